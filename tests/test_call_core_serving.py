"""The compiled call core and the Python call path: the same results and decisions, the core's key,
what it serves and what it leaves to the Python path, and when it is cleared or taught.

Shared calls and helpers: ``tests/helpers/call_core.py``; the ``path`` fixture: ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.call_core import (
    CALLS,
    CORE_MARKS,
    FN,
    B,
    D,
    L,
    N,
    S,
    W,
    _calls_twice,
    _decisions,
    _fn_call,
    _recording,
    _rms_call,
    _run,
    _same,
)

import kernel_variants as kv
from kernel_variants._runtime import callcore as _callcore
from kernel_variants._runtime.dispatcher import Dispatcher, dispatcher
from kernel_variants._runtime.pins import pins_in_context
from kernel_variants.ops.causal_conv1d import FN_SPEC

pytestmark = CORE_MARKS


def test_both_paths_give_the_same_results_and_decisions(reference_only, path, python_calls):
    path(True)
    on = _calls_twice(CALLS)
    assert python_calls[0] == len(CALLS), "the second call of each signature is the core's"
    core_decisions = _decisions()
    for op, make in CALLS.values():
        args = dispatcher().registry.spec(op).bind(**make())
        assert _callcore.core_for(dispatcher().registry.spec(op)).lookup(args, None) == "reference"
    path(False)
    python_calls[0] = 0
    off = _calls_twice(CALLS)
    assert python_calls[0] == 2 * len(CALLS)
    _same(on, off)
    assert _decisions() == core_decisions


def test_the_core_serves_grad_mode_and_inference_mode_alike(reference_only, path, python_calls):
    calls = {k: CALLS[k] for k in ("fn, states and slots", "update, decode step")}
    path(True)
    on = _calls_twice(calls, grad=True)
    with torch.inference_mode():
        inf = [[_run(op, make(seed)) for seed in (0, 1)] for op, make in calls.values()]
    assert python_calls[0] == len(calls), "grad mode is not part of a signature unless a tensor requires grad"
    path(False)
    _same(on, _calls_twice(calls, grad=True))
    _same(inf, on)


def _pairs():
    """(description, call a, call b) of one op; a and b share a memo signature or do not."""
    base = _fn_call()
    yield "same metadata, other values", base, _fn_call(seed=3)
    yield "x strided, not written", base, {**base, "x": torch.randn(B, D, L).transpose(1, 2)}
    yield "pool strided: written", base, {**base, "conv_states": torch.randn(S, N, D).transpose(0, 1)}
    yield "another pool size", base, {**base, "conv_states": torch.randn(N + 1, S, D)}
    yield "another dtype", base, {**base, "x": base["x"].double()}
    yield "int64 indices", base, {**base, "cache_indices": base["cache_indices"].long()}
    yield "no bias", base, {**base, "bias": None}
    yield "swish, not silu", base, {**base, "activation": "swish"}
    yield "pad id True, not 1", {**base, "pad_slot_id": 1}, {**base, "pad_slot_id": True}
    yield "pad id 1.0, not 1", {**base, "pad_slot_id": 1}, {**base, "pad_slot_id": 1.0}
    yield "an equal, other string", base, {**base, "activation": "".join(["si", "lu"])}
    yield "requires grad", base, {**base, "weight": base["weight"].clone().requires_grad_()}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_the_core_key_and_the_memo_key_make_the_same_classes(path, grad):
    path(True)
    spec = FN_SPEC
    core = _callcore.core_for(spec)
    pins = pins_in_context()
    with torch.enable_grad() if grad else torch.no_grad():
        for what, a, b in _pairs():
            a, b = spec.bind(**a), spec.bind(**b)
            ka, kb = core.key(a, None), core.key(b, None)
            assert ka is not None and kb is not None, what
            assert (ka == kb) == (spec.memo_key(a, pins) == spec.memo_key(b, pins)), what
        with kv.force(causal_conv1d_fn="reference"):
            forced = core.key(spec.bind(**_fn_call()), None)
    assert forced != core.key(spec.bind(**_fn_call()), None), "the pins are part of the key"


def test_calls_the_core_does_not_serve_go_to_the_python_path(reference_only, path, python_calls):
    path(True)
    core = _callcore.core_for(FN_SPEC)

    class Sub(torch.Tensor):
        pass

    class Str(str):  # its == and hash could be Python code: the core leaves it to the Python memo
        pass

    call = _fn_call()
    kv.causal_conv1d_fn(**call)
    n = python_calls[0]
    for what, changes in {"out=": dict(out=torch.empty(B, L, D)), "a subclass": dict(x=call["x"].as_subclass(Sub)),
                          "not a tensor": dict(weight=[[1.0]]), "a str subclass": dict(activation=Str("silu"))}.items():
        args = FN_SPEC.bind(**{**call, **{k: v for k, v in changes.items() if k != "out"}})
        assert core.key(args, changes.get("out")) is None, what
    kv.causal_conv1d_fn(**call, out=torch.empty(B, L, D))
    kv.causal_conv1d_fn(**{**call, "x": call["x"].as_subclass(Sub)})
    for _ in range(2):
        kv.causal_conv1d_fn(**{**call, "activation": Str("silu")})
    assert python_calls[0] == n + 4


def test_invalidation_clears_the_core(reference_only, path, python_calls):
    path(True)
    core = _callcore.core_for(FN_SPEC)
    for clear in (lambda: dispatcher().invalidate(), lambda: dispatcher().memo.clear(), kv.reload,
                  lambda: kv.clear_table()):
        kv.causal_conv1d_fn(**_fn_call())
        kv.causal_conv1d_fn(**_fn_call())
        assert len(core) == 1
        n = python_calls[0]
        clear()
        assert len(core) == 0
        kv.causal_conv1d_fn(**_fn_call())
        assert python_calls[0] == n + 1, "after invalidation the Python path decides again"


def test_a_reload_while_a_call_decides_leaves_the_core_no_stale_entry(with_variants, path, monkeypatch):
    """Another thread's ``kv.reload()`` landing while a call decides (here: from inside the
    decision): that call runs its decision but teaches the cores nothing, or they would serve the
    old dispatcher's decision to every later call; the new dispatcher (here: a new pin) decides
    from the next call on, as on the Python path."""
    seen: list = []
    reloaded: list = []
    path(True)
    with_variants(_recording(FN, seen))
    decide = Dispatcher.decide

    def reloading(self, *args, **kwargs):
        chosen = decide(self, *args, **kwargs)
        if not reloaded:
            reloaded.append(True)
            monkeypatch.setenv("KV_FORCE", f"{FN}=rec")
            with_variants(_recording(FN, seen))
        return chosen

    monkeypatch.setattr(Dispatcher, "decide", reloading)
    kv.causal_conv1d_fn(**_fn_call())
    assert reloaded and seen == [], "the straddling call ran the old dispatcher's choice"
    assert len(_callcore.core_for(FN_SPEC)) == 0, "and taught the core nothing"
    kv.causal_conv1d_fn(**_fn_call())
    kv.causal_conv1d_fn(**_fn_call())
    assert len(seen) == 2, "the new dispatcher's pin serves the later calls"


def test_a_force_block_is_its_own_key_and_unforced_calls_are_not_served_its_entry(with_variants, path, python_calls):
    path(True)
    seen: list = []
    with_variants(_recording(FN, seen))
    kv.causal_conv1d_fn(**_fn_call())
    kv.causal_conv1d_fn(**_fn_call())
    with kv.force(causal_conv1d_fn="rec"):
        kv.causal_conv1d_fn(**_fn_call())
        kv.causal_conv1d_fn(**_fn_call())
    kv.causal_conv1d_fn(**_fn_call())
    assert len(seen) == 2, "only the forced calls ran the forced variant"
    assert python_calls[0] == 2


def test_kv_call_core_0_takes_the_python_path(reference_only, path, python_calls, capfd):
    path(False)
    for _ in range(3):
        kv.causal_conv1d_fn(**_fn_call())
    assert python_calls[0] == 3
    assert _callcore.status() == (False, "Python (KV_CALL_CORE=0)")
    assert "call path" not in capfd.readouterr().err, "turned off on purpose: nothing to announce"
    from kernel_variants._cli import main

    assert main(["info"]) == 0
    assert "Python (KV_CALL_CORE=0)" in capfd.readouterr().out


def test_without_a_build_the_python_path_serves_and_says_so_once(reference_only, monkeypatch, tmp_path, python_calls,
                                                                   capfd):
    monkeypatch.setenv("KV_BUILD_DIR", str(tmp_path / "no-build"))
    monkeypatch.delenv(_callcore.ENV, raising=False)
    monkeypatch.setattr(_callcore, "_announced", False)
    kv.reload()
    for _ in range(2):
        kv.causal_conv1d_fn(**_fn_call())
        kv.gemma_rms_norm(**_rms_call())
    assert python_calls[0] == 4
    err = capfd.readouterr().err
    assert err.count("ops take the Python call path") == 1 and "not built: run kv build" in err
    assert _callcore.status() == (False, "Python (not built: run kv build)")


def test_kv_info_names_the_compiled_core(path, capfd):
    from kernel_variants._cli import main

    path(True)
    assert main(["info", "--json"]) == 0
    assert '"call_path": "compiled core"' in capfd.readouterr().out


def _python_frames(fn) -> set[str]:
    """The Python functions a call enters (their code names)."""
    import sys

    names: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            names.add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names


def test_a_served_call_runs_no_python_of_the_call_path(reference_only, path):
    path(True)
    call = _fn_call()
    kv.causal_conv1d_fn(**call)
    bound = kv.bind(FN, **call)
    entered = _python_frames(lambda: kv.causal_conv1d_fn(**call)) | _python_frames(lambda: bound(**call))
    assert entered, "the variant itself is Python"
    assert not entered & {"call", "memo_key", "bound", "run_one", "plan", "check_one", "_resolve"}, entered
    path(False)
    kv.causal_conv1d_fn(**call)
    assert {"call", "memo_key", "run_one"} <= _python_frames(lambda: kv.causal_conv1d_fn(**call))


def test_an_accelerator_s_call_is_served_by_the_core_with_the_device_rule(reference_only, path, python_calls,
                                                                         monkeypatch):
    """A call whose index values are not read on the host (an accelerator's; simulated on CPU
    tensors) is taught to the core once and then served there, running the op's device rule per
    call as the Python path does: the same results, pool and device-rule counts on both paths.
    While its device captures a graph the core serves nothing and learns nothing."""
    from kernel_variants._runtime import call as _op
    from kernel_variants._runtime import device_errors as _device_errors

    monkeypatch.setattr(_op, "host_values", lambda t: False)  # as on an accelerator
    x, pool, w = torch.randn(3, D), torch.randn(N, W - 1, D), torch.randn(D, W)
    idx = torch.tensor([1, N + 2, 4], dtype=torch.int32)  # one slot outside the pool: a pad, counted
    outcomes = {}
    for on in (True, False):
        path(on)
        monkeypatch.setattr(_device_errors, "_counters", {})
        python_calls[0] = 0
        mine, results = pool.clone(), []
        for _ in range(3):
            results.append(kv.causal_conv1d_update(x, mine, w, activation="silu", conv_state_indices=idx))
        counts = _device_errors._counters[torch.device("cpu")].tolist()
        outcomes[on] = (results, mine, counts, python_calls[0])
        with pytest.raises(ValueError, match="bad index values"):
            kv.check_errors()
    (got, got_pool, got_counts, served_in_python), (want, want_pool, want_counts, _) = outcomes[True], outcomes[False]
    for g, w_ in zip(got, want, strict=True):
        assert torch.equal(g, w_) and not g[1].any()  # the bad slot's row is a pad's: zeros
    assert torch.equal(got_pool, want_pool)
    assert got_counts == want_counts == [3, 0, 0, 0]  # every call's rule ran and counted
    assert served_in_python == 1  # the first call decided; the core served the others

    path(True)
    module = _callcore.core_module()
    capturing = [True]
    before = module.capture_check("cpu", lambda: capturing[0])
    try:
        python_calls[0] = 0
        for _ in range(2):
            kv.causal_conv1d_update(x, pool.clone(), w, activation="silu", conv_state_indices=idx)
        assert python_calls[0] == 2  # in a capture: the Python path's, and nothing taught
        capturing[0] = False
        for _ in range(3):
            kv.causal_conv1d_update(x, pool.clone(), w, activation="silu", conv_state_indices=idx)
        assert python_calls[0] == 3  # taught at the first call outside it, served from then on
    finally:
        module.capture_check("cpu", before)
    with pytest.raises(ValueError, match="bad index values"):
        kv.check_errors()


def test_a_call_is_taught_only_where_the_core_serves_its_device(path, monkeypatch):
    """CPU tensors always; a CUDA call only without host checks of its index values, and from the
    first one the Python path sees on, the core asks torch whether a graph is being captured (so
    nothing asks CUDA anything before such a call); another device's never."""
    from types import SimpleNamespace

    def tensor(device_type):
        return SimpleNamespace(is_cpu=device_type == "cpu", device=SimpleNamespace(type=device_type))

    path(True)
    core = _callcore.core_for(dispatcher().registry.spec("causal_conv1d_update"))
    module, _ = _callcore._SERVED[type(core)]
    served = {"cpu"}
    monkeypatch.setitem(_callcore._SERVED, type(core), (module, served))
    assert _callcore.serves(core, tensor("cpu"), host_checks=True)
    assert _callcore.serves(core, tensor("cpu"), host_checks=False)
    assert not _callcore.serves(core, tensor("npu"), host_checks=False)
    assert not _callcore.serves(core, tensor("cuda"), host_checks=True) and served == {"cpu"}
    assert not _callcore.serves(object(), tensor("cuda"), host_checks=False)  # not a core
    try:
        assert _callcore.serves(core, tensor("cuda"), host_checks=False) and served == {"cpu", "cuda"}
        installed = module.capture_check("cuda", None)  # what the first CUDA call installed, taken out
        assert installed in (getattr(torch._C, "_cuda_isCurrentStreamCapturing", None),
                             torch.cuda.is_current_stream_capturing)
    finally:
        module.capture_check("cuda", None)
