"""The compiled call core and the Python call path: the same keys, decisions, results and errors.

Every call is made twice per path (the first one decides and teaches the core its entry, the
second is served by the core, where it is on), with ``KV_CALL_CORE`` on and off. The core is
built here when it is not (as ``kv build`` does); a machine without a C++ toolchain skips this
file, and every other test file passes there on the Python path.
"""

from __future__ import annotations

import pytest
import torch

import kernel_variants as kv
from kernel_variants._runtime import callcore as _callcore
from kernel_variants._runtime.dispatcher import Dispatcher, dispatcher
from kernel_variants._runtime.errors import VariantFailed, result_error
from kernel_variants._runtime.pins import pins_in_context
from kernel_variants.kernels.cpu_native import _build
from kernel_variants.ops.causal_conv1d import FN_SPEC, ConvCapabilities, _reference
from kernel_variants.plugin import Variant

pytestmark = pytest.mark.skipif(_build.toolchain_missing() is not None,
                                reason=f"the call core cannot be built here: {_build.toolchain_missing()}")

B, L, D, W, N, S = 3, 4, 8, 4, 6, 3
FN, UP = "causal_conv1d_fn", "causal_conv1d_update"


@pytest.fixture(scope="module", autouse=True)
def _built():
    _build.build(_build.CORE)


@pytest.fixture
def path(monkeypatch):
    """``path(on)``: put the ops on the core (or the Python path), in a fresh dispatcher."""

    def use(on: bool) -> None:
        monkeypatch.setenv(_callcore.ENV, "1" if on else "0")
        kv.reload()

    return use


def _fn_call(seed: int = 0, **changes):
    g = torch.Generator().manual_seed(seed)
    call = dict(x=torch.randn(B, L, D, generator=g), weight=torch.randn(D, W, generator=g),
                bias=torch.randn(D, generator=g), conv_states=torch.randn(N, S, D, generator=g),
                cache_indices=torch.tensor([4, 0, 2], dtype=torch.int32),
                has_initial_state=torch.tensor([True, False, True]), activation="silu")
    call.update(changes)
    return call


def _varlen_call(seed: int = 0, **changes):
    call = _fn_call(seed)
    call["x"] = torch.randn(10, D, generator=torch.Generator().manual_seed(seed + 1))
    call["query_start_loc"] = torch.tensor([0, 3, 3, 10], dtype=torch.int64)
    call.update(changes)
    return call


def _update_call(seed: int = 0, **changes):
    g = torch.Generator().manual_seed(seed)
    call = dict(x=torch.randn(B, 2, D, generator=g), conv_state=torch.randn(N, S + 1, D, generator=g),
                weight=torch.randn(D, W, generator=g), bias=torch.randn(D, generator=g),
                conv_state_indices=torch.tensor([1, -1, 3], dtype=torch.int64),
                num_accepted_tokens=torch.tensor([1, 2, 2], dtype=torch.int32), activation="swish")
    call.update(changes)
    return call


def _decode_call(seed: int = 0, **changes):
    g = torch.Generator().manual_seed(seed)
    call = dict(x=torch.randn(1, D, generator=g), conv_state=torch.randn(N, W - 1, D, generator=g),
                weight=torch.randn(D, W, generator=g), conv_state_indices=torch.tensor([5], dtype=torch.int32))
    call.update(changes)
    return call


def _rms_call(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(4, D, generator=g), weight=torch.randn(D, generator=g))


CALLS = {
    "fn, states and slots": (FN, _fn_call),
    "fn, no states": (FN, lambda seed=0: _fn_call(seed, conv_states=None, cache_indices=None, has_initial_state=None)),
    "fn, varlen": (FN, _varlen_call),
    "fn, strided pool": (FN, lambda seed=0: _fn_call(seed, conv_states=torch.randn(
        S, N, D, generator=torch.Generator().manual_seed(seed)).transpose(0, 1))),
    "fn, pad slot": (FN, lambda seed=0: _fn_call(seed, cache_indices=torch.tensor([4, 7, 2], dtype=torch.int64),
                                                  pad_slot_id=7)),
    "update, speculative": (UP, _update_call),
    "update, decode step": (UP, _decode_call),
    "gemma_rms_norm": ("gemma_rms_norm", _rms_call),
}


def _run(op: str, call: dict) -> tuple[object, dict]:
    """(the result, the tensors after the call: states are written in place)."""
    res = getattr(kv, op)(**call)
    return res, {k: v.clone() for k, v in call.items() if isinstance(v, torch.Tensor)}


def _decisions() -> dict:
    return {sig: hit.vid for sig, hit in dispatcher().memo.items()}


def _calls_twice(calls, grad: bool = False):
    out = []
    with torch.enable_grad() if grad else torch.no_grad():
        for op, make in calls.values():
            out.append([_run(op, make(seed)) for seed in (0, 1)])
    return out


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, tuple | list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


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


def _error(op: str, call: dict) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        getattr(kv, op)(**call)
    return type(info.value), str(info.value)


def _bad_calls():
    """(op, a good call, the same signature with a problem only the values or memory show)."""
    good = _fn_call()
    pool = torch.randn(N, S, D)
    yield "slot out of range", FN, good, _fn_call(cache_indices=torch.tensor([4, 6, 2], dtype=torch.int32))
    yield "negative slot", FN, good, _fn_call(cache_indices=torch.tensor([4, -3, 2], dtype=torch.int32))
    yield "duplicate slot", FN, good, _fn_call(cache_indices=torch.tensor([2, 0, 2], dtype=torch.int32))
    yield "starts not from 0", FN, _varlen_call(), _varlen_call(query_start_loc=torch.tensor([1, 3, 3, 10]))
    yield "starts decreasing", FN, _varlen_call(), _varlen_call(query_start_loc=torch.tensor([0, 4, 3, 10]))
    yield "starts short of T", FN, _varlen_call(), _varlen_call(query_start_loc=torch.tensor([0, 3, 3, 9]))
    yield "accepted above L", UP, _update_call(), _update_call(
        num_accepted_tokens=torch.tensor([1, 3, 2], dtype=torch.int32))
    yield "decode slot out of range", UP, _decode_call(), _decode_call(
        conv_state_indices=torch.tensor([6], dtype=torch.int32))
    # x a view of the pool's own memory (same dtype and shapes: the signature of the good call)
    yield "x inside the pool", FN, _fn_call(conv_states=pool), _fn_call(
        conv_states=pool, x=pool.view(-1)[: B * L * D].view(B, L, D))
    # bias starting before the pool, in the same allocation, and reaching into it
    below, other = torch.randn(D + N * S * D), torch.randn(D + N * S * D)
    yield "bias reaching into the pool", FN, _fn_call(conv_states=other[D:].view(N, S, D)), _fn_call(
        conv_states=below[D:].view(N, S, D), bias=below[D // 2: D // 2 + D])


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_both_paths_raise_the_same_errors(reference_only, path, grad):
    outcomes = {}
    for on in (True, False):
        path(on)
        seen = []
        with torch.enable_grad() if grad else torch.no_grad():
            for what, op, good, bad in _bad_calls():
                getattr(kv, op)(**good)  # the signature is memoised: the core serves the next call
                if on:  # the core has the bad call's entry: it detected the problem and handed it over
                    spec = dispatcher().registry.spec(op)
                    assert _callcore.core_for(spec).lookup(spec.bind(**bad), None) == "reference", what
                seen.append((what, _error(op, bad)))
        outcomes[on] = seen
    assert outcomes[True] == outcomes[False]
    assert all(t is ValueError for _, (t, _) in outcomes[True])


def test_an_inference_state_is_refused_outside_inference_mode_on_both_paths(reference_only, path):
    errors = []
    for on in (True, False):
        path(on)
        with torch.inference_mode():
            pool = torch.randn(N, S, D)
            kv.causal_conv1d_fn(**_fn_call(conv_states=pool))  # learned inside inference mode
        call = _fn_call(conv_states=pool)
        if on:
            assert _callcore.core_for(FN_SPEC).lookup(FN_SPEC.bind(**call), None) == "reference"
        errors.append(_error(FN, call))
    assert errors[0] == errors[1] and "inference tensor" in errors[0][1]


def test_wrong_non_tensor_values_raise_the_same_errors(reference_only, path):
    errors = {}
    for on in (True, False):
        path(on)
        kv.causal_conv1d_fn(**_fn_call())
        errors[on] = [_error(FN, _fn_call(activation="relu")), _error(FN, _fn_call(pad_slot_id=1.5)),
                      _error(FN, _fn_call(pad_slot_id=[1]))]
    assert errors[True] == errors[False]
    assert [t for t, _ in errors[True]] == [ValueError, TypeError, TypeError]


def _recording(op: str, seen: list, fail: bool = False):
    ref = _reference.causal_conv1d_fn if op == FN else _reference.causal_conv1d_update

    def fn(*args, **kwargs):
        seen.append((len(args), dict(kwargs)))
        if fail:
            raise RuntimeError("kernel exploded")
        return ref(*args, **kwargs)

    return Variant(id="rec", op=op, version="1", fn=fn, capabilities=ConvCapabilities(
        devices={"cpu"}, dtypes={"float32"}, noncontiguous_states=True, num_accepted_tokens=True, varlen=True))


def test_a_forced_variant_gets_the_same_arguments_on_both_paths(with_variants, path):
    seen: dict[bool, list] = {True: [], False: []}
    for on in (True, False):
        path(on)
        with_variants(_recording(FN, seen[on]), _recording(UP, seen[on]))
        with kv.force(causal_conv1d_fn="rec", causal_conv1d_update="rec"):
            for _ in range(2):
                kv.causal_conv1d_fn(**_fn_call(activation="swish"))
                kv.causal_conv1d_update(**_update_call())
    assert len(seen[True]) == 4
    assert [(n, {k: (type(v), v.shape if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
            for n, kw in seen[True]] == [(n, {k: (type(v), v.shape if isinstance(v, torch.Tensor) else v)
                                              for k, v in kw.items()}) for n, kw in seen[False]]
    assert seen[True][1][1]["activation"] == "silu", "normalised once per signature, on the core too"


def test_a_variant_that_raises_is_reported_the_same_on_both_paths(with_variants, path):
    errors = []
    for on in (True, False):
        path(on)
        with_variants(_recording(FN, [], fail=True))
        with kv.force(causal_conv1d_fn="rec"):
            for _ in range(2):  # the second call is the core's
                with pytest.raises(VariantFailed) as info:
                    kv.causal_conv1d_fn(**_fn_call())
                errors.append((str(info.value), type(info.value.__cause__), str(info.value.__cause__)))
    assert len(set(errors)) == 1
    assert errors[0] == ("variant 'rec' of causal_conv1d_fn failed: RuntimeError: kernel exploded", RuntimeError,
                         "kernel exploded")


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


@pytest.mark.parametrize("n", [0, 3, len(FN_SPEC.params) + 2])
def test_an_entry_called_without_the_op_s_arguments_raises_the_same_on_both_paths(reference_only, path, n):
    """The core hands a call of the wrong arity to the Python path, which says what is wrong."""
    raised = {}
    for on in (True, False):
        path(on)
        entry = _callcore.slot_of(FN_SPEC).entry
        kv.causal_conv1d_fn(**_fn_call())  # the core found and serving
        with pytest.raises((TypeError, IndexError)) as err:
            entry(*([None] * n))
        raised[on] = (type(err.value), str(err.value))
    assert raised[True] == raised[False]
    if n:
        assert raised[True][0] is TypeError and "its entry (what make_op returns)" in raised[True][1]


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


def test_a_device_rule_count_on_the_cpu_is_reported_first_on_both_paths(reference_only, path, monkeypatch):
    from kernel_variants._runtime import device_errors as _device_errors

    errors = []
    for on in (True, False):
        path(on)
        kv.causal_conv1d_fn(**_fn_call())
        counter = torch.zeros(len(_device_errors.KINDS), dtype=torch.int64)
        counter[_device_errors.SLOT] = 2
        monkeypatch.setitem(_device_errors._counters, torch.device("cpu"), counter)
        errors.append(_error(FN, _fn_call()))
    assert errors[0] == errors[1] and "2 x slot index" in errors[0][1]


def _bound_outcomes(bound, calls):
    """Per call: ("ok", result) or (the error's type, its message)."""
    out = []
    for args, kwargs in calls:
        try:
            out.append(("ok", bound(*args, **kwargs)))
        except Exception as exc:
            out.append((type(exc), str(exc)))
    return out


def _bind_calls():
    """(the example, calls of the bound op): fresh tensors each time (the pool is written)."""
    example = _fn_call()
    x, w, b = example.pop("x"), example.pop("weight"), example.pop("bias")
    pool = example["conv_states"]
    calls = [
        ((x, w, b), example),
        ((x, w), {**example, "bias": b}),
        ((x, w, b), {**example, "cache_indices": torch.tensor([1, 0, 3], dtype=torch.int64)}),  # not int32: refused
        ((x, w, b), {**example, "activation": "swish"}),  # another value: refused
        ((x, w, b), {**example, "pad_slot_id": 0}),
        ((x, w, b), {**example, "cache_indices": torch.tensor([1, 6, 3], dtype=torch.int32)}),
        ((x, w, b), {**example, "cache_indices": torch.tensor([1, 1, 3], dtype=torch.int32)}),
        ((x, w, b), {**example, "cache_indices": None}),  # not what the example had: refused
        ((x, w, b), {**example, "out": torch.zeros(B, L, D)}),
        ((x, w, b), {**example, "out": pool}),  # overlaps the written pool
        ((x, w, b, pool), {}),  # too many positional arguments
        ((x,), example),  # weight missing
        ((x, w, b), {**example, "nonsense": 1}),
    ]
    return ((x, w, b), example), calls


def test_kv_bind_is_c_level_on_the_core_and_behaves_as_the_python_bound_function(reference_only, path):
    import inspect

    outcomes = {}
    for on in (True, False):
        path(on)
        (args, kwargs), calls = _bind_calls()
        bound = kv.bind(kv.causal_conv1d_fn, *args, **kwargs)
        assert (type(bound).__name__ == "BoundCore") is on
        assert (bound.op, bound.variant, bound.__name__) == (FN, "reference", "causal_conv1d_fn_bound")
        assert inspect.signature(bound) == FN_SPEC.py_signature
        outcomes[on] = [*_bound_outcomes(bound, calls), ("pool after", calls[0][1]["conv_states"].clone())]
    _same(outcomes[True], outcomes[False])
    assert [o[0] for o in outcomes[True][:-1]] == ["ok", "ok", TypeError, ValueError, ValueError, ValueError, ValueError,
                                                   TypeError, "ok", ValueError, TypeError, TypeError, TypeError]


def test_a_bound_variant_that_raises_is_reported_the_same_on_both_paths(with_variants, path):
    errors = []
    for on in (True, False):
        path(on)
        with_variants(_recording(UP, [], fail=True))
        with kv.force(causal_conv1d_update="rec"):
            call = _decode_call()
            bound = kv.bind(UP, **call)
        with pytest.raises(VariantFailed) as info:
            bound(**call)
        errors.append((str(info.value), type(info.value.__cause__)))
    assert errors == [("variant 'rec' of causal_conv1d_update failed: RuntimeError: kernel exploded",
                       RuntimeError)] * 2


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


def test_a_compiled_graph_takes_the_core_as_an_eager_call_does(reference_only, path, python_calls):
    """The custom op's kernel enters the core directly: the Python path serves a signature once."""
    def step(x, conv_state, weight, conv_state_indices):
        return kv.causal_conv1d_update(x, conv_state, weight, conv_state_indices=conv_state_indices) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    call = _decode_call()
    with torch.no_grad():
        expected = step(**{k: v.clone() for k, v in call.items()})
        for on, python in ((True, 1), (False, 3)):
            path(on)
            python_calls[0] = 0
            for _ in range(3):
                got = compiled(**{k: v.clone() for k, v in call.items()})
            torch.testing.assert_close(got, expected)
            assert python_calls[0] == python, f"core {'on' if on else 'off'}"


def _overload_args(op: str, call: dict) -> tuple:
    """The op's arguments in signature order, as a compiled graph passes them to its overload."""
    return tuple(dispatcher().registry.spec(op).bind(**call))


# The subprocess scripts' variant: the reference's decode, chosen by priority under
# KV_QUALIFY=off, returning `returns[0]` instead where a script sets it; and its call's tensors.
_ODD_VARIANT = """
returns = [None]
def odd(*args, **kwargs):
    res = _reference.causal_conv1d_update(*args, **kwargs)
    return res if returns[0] is None else returns[0]

class Plugin:
    @hookimpl
    def kv_register_variants(self, register):
        register(Variant(id="odd", op="causal_conv1d_update", version="1", fn=odd, priority=10_000,
                         capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"})))

reset(Registry(make_plugin_manager(extra_plugins=[("odd", Plugin())])))
g = torch.Generator().manual_seed(0)
x, w, idx = torch.randn(2, 8, generator=g), torch.randn(8, 4, generator=g), torch.tensor([3, 1], dtype=torch.int32)
pool = torch.randn(4, 3, 8, generator=g)
"""


_GRAPH_KERNEL = """
import os, sys, torch
import kernel_variants as kv
from kernel_variants._registry.registry import Registry, make_plugin_manager
from kernel_variants._runtime.dispatcher import reset
from kernel_variants.ops.causal_conv1d import ConvCapabilities, _reference
from kernel_variants.plugin import Capabilities, Variant, hookimpl
import kernel_variants._runtime.custom_ops  # what a process's first trace imports

c_level = os.environ.get("KV_CALL_CORE") != "0"
for name in ("causal_conv1d_fn", "causal_conv1d_update", "gemma_rms_norm", "add_gemma_rms_norm"):
    getattr(kv, name)  # makes (and registers) the op
    kernel = torch._C._dispatch_dump("kernel_variants::" + name).split("CompositeExplicitAutograd")[1]
    assert ("call_core.cpp" in kernel) == c_level and ("custom_ops.py" in kernel) != c_level, kernel

""" + _ODD_VARIANT + """args = lambda p: (x, p, w, None, "silu", idx, None, -1)
op = torch.ops.kernel_variants.causal_conv1d_update.default
with torch.no_grad():
    mine, theirs = pool.clone(), pool.clone()
    expected = kv.causal_conv1d_update(x, theirs, w, activation="silu", conv_state_indices=idx)
    entered = set()
    def profile(frame, event, arg):
        if event == "call":
            entered.add(frame.f_code.co_name)
    sys.setprofile(profile)
    got = op(*args(mine))
    sys.setprofile(None)
    assert torch.equal(got, expected) and torch.equal(mine, theirs)
    assert "odd" in entered, entered
    kernels = entered & {"kernel", "kernel_miss"}  # the Python kernel's code names
    assert bool(kernels) != c_level, entered  # the served call enters no Python kernel where it is C++
    returns[0] = "not a tensor"
    try:
        op(*args(pool.clone()))
    except (TypeError, RuntimeError) as exc:
        print(type(exc).__name__ + ": " + str(exc).splitlines()[0])

# A two-output op's variant returning one tensor.
class One:
    @hookimpl
    def kv_register_variants(self, register):
        register(Variant(id="one", op="add_gemma_rms_norm", version="1", fn=lambda x, weight, residual, eps=1e-6: x,
                         priority=10_000, capabilities=Capabilities(devices={"cpu"}, dtypes={"float32"})))

reset(Registry(make_plugin_manager(extra_plugins=[("one", One())])))
with torch.no_grad():
    try:
        torch.ops.kernel_variants.add_gemma_rms_norm.default(x, torch.randn(8), x.clone(), 1e-6)
    except (TypeError, RuntimeError) as exc:
        print(type(exc).__name__ + ": " + str(exc).splitlines()[0])
print("ok")
"""


@pytest.mark.parametrize("on", [True, False])
def test_a_process_s_graph_kernel_is_the_core_s_c_kernel_where_the_core_is_built(on, tmp_path):
    """In a process whose first trace finds the core built, each op's graph kernel is the core's
    C++ one: a served call enters no Python kernel, only the variant, with the eager call's result
    and state write. With KV_CALL_CORE=0 the Python kernel is registered, with the same results.
    A variant returning no tensor: the same TypeError from either kernel, written once
    (``errors.result_error``)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, _callcore.ENV: "1" if on else "0", "KV_QUALIFY": "off"}
    env.pop("KV_FORCE", None)
    script = tmp_path / "graph_kernel.py"  # a file: the plugin's version is read from its source
    script.write_text(_GRAPH_KERNEL)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[-1] == "ok", run.stdout
    assert lines[0] == "TypeError: " + str(result_error("causal_conv1d_update", 1, "not a tensor")), lines
    assert lines[1] == "TypeError: " + str(result_error("add_gemma_rms_norm", 2, torch.empty(0))), lines


_C_ENTRY = """
import importlib.util, os, sys, torch
import kernel_variants as kv
import kernel_variants.ops.causal_conv1d as conv
from kernel_variants._registry.registry import Registry, make_plugin_manager
from kernel_variants._runtime.dispatcher import reset
from kernel_variants.ops.causal_conv1d import ConvCapabilities, _reference
from kernel_variants.plugin import Variant, hookimpl

core, order = os.environ.get("KV_CALL_CORE") != "0", os.environ["ORDER"]

""" + _ODD_VARIANT + """step = lambda p: kv.causal_conv1d_update(x, p, w, activation="silu", conv_state_indices=idx)
graphs = []
def compiled(p):  # torch.compile imports Dynamo: made at the first compiled call
    graphs or graphs.append(torch.compile(lambda p: step(p) * 2, fullgraph=True, backend="aot_eager"))
    return graphs[0](p)
python_entry = conv._UPDATE
with torch.no_grad():
    theirs = pool.clone()
    expected = _reference.causal_conv1d_update(x, theirs, w, activation="silu", conv_state_indices=idx)
    if order == "dynamo imported first":
        import torch._dynamo
    if order == "dynamo's spec asked first":  # an availability check: nothing imported
        import importlib.util
        assert importlib.util.find_spec("torch._dynamo") is not None
    if order == "compiled first":
        mine = pool.clone()
        assert torch.equal(compiled(mine), expected * 2) and torch.equal(mine, theirs)
    step(pool.clone())  # the first eager call finds the core
    swapped = conv._UPDATE is not python_entry
    assert swapped == (core and order != "compiled first"), conv._UPDATE
    assert ("torch._dynamo" in sys.modules) == (order in ("dynamo imported first", "compiled first"))  # the swap imported nothing
    if order == "eager first":
        assert importlib.util.find_spec("torch._dynamo") is not None  # leaves the hook waiting
    from kernel_variants.integrations import vllm  # after the swap: its fast path finds the op's core
    mine = pool.clone()
    got = vllm.causal_conv1d_update(x, mine.transpose(1, 2), w, None, "silu", conv_state_indices=idx, null_block_id=None)
    assert torch.equal(got, expected) and torch.equal(mine, theirs)
    entered = []
    def profile(frame, event, arg):
        if event == "call":
            entered.append(frame.f_code.co_name)
    mine = pool.clone()
    sys.setprofile(profile)
    got = step(mine)
    sys.setprofile(None)
    assert torch.equal(got, expected) and torch.equal(mine, theirs)
    assert entered[1:3] == (["causal_conv1d_update", "odd"] if swapped else
                            ["causal_conv1d_update", "entry"]), entered
    mine = pool.clone()
    assert torch.equal(compiled(mine), expected * 2) and torch.equal(mine, theirs)  # fullgraph: traced through
    mine = pool.clone()
    assert torch.equal(step(mine), expected) and torch.equal(mine, theirs)
print("ok")
"""


@pytest.mark.parametrize("on, order", [(True, "eager first"), (True, "dynamo imported first"),
                                       (True, "dynamo's spec asked first"), (True, "compiled first"),
                                       (False, "eager first")])
def test_the_public_function_calls_the_core_s_c_entry_once_the_core_is_found(on, order, tmp_path):
    """With the core built, an op's first eager call swaps its public function's entry for the
    core's C one: a served call enters no Python frame between the public function and the
    variant. The swap imports nothing (not Dynamo), and a compiled graph (fullgraph) still
    traces the op, whether Dynamo was imported before the swap or after (its spec asked for
    meanwhile); the engine adapters imported after it serve through the core; a process whose first
    trace came first, or with the core off, keeps the Python entry. Results and state writes
    are the reference's throughout."""
    import os
    import subprocess
    import sys

    env = {**os.environ, _callcore.ENV: "1" if on else "0", "KV_QUALIFY": "off", "ORDER": order}
    env.pop("KV_FORCE", None)
    script = tmp_path / "c_entry.py"  # a file: the plugin's version is read from its source
    script.write_text(_C_ENTRY)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-1] == "ok", run.stdout


def test_the_graph_kernel_serves_as_the_eager_call_does(reference_only, path, python_calls):
    """The op's overloads called through the dispatcher (what a compiled graph calls) give the
    eager call's results and state writes, the call core serving them once the eager call taught
    it the signature (the Python path every time with the core off)."""
    from kernel_variants._runtime import custom_ops  # noqa: F401 - registers the ops (a first trace imports it)

    calls = {**CALLS, "add_gemma_rms_norm": ("add_gemma_rms_norm", lambda seed=0: {
        **_rms_call(seed), "residual": torch.randn(4, D, generator=torch.Generator().manual_seed(seed + 7))})}
    with torch.no_grad():
        for on in (True, False):
            path(on)
            for label, (op, make) in calls.items():
                expected = _run(op, make(0))
                args = _overload_args(op, make(0))
                overload = getattr(torch.ops.kernel_variants, op)
                # A call without a state pool: the overload that declares no write, as a graph calls it.
                overload = overload.no_conv_states if op == FN and args[3] is None else overload.default
                python_calls[0] = 0
                for _ in range(2):
                    call = make(0)
                    got = overload(*_overload_args(op, call))
                    _same((got, {k: v for k, v in call.items() if isinstance(v, torch.Tensor)}), expected)
                assert python_calls[0] == (0 if on else 2), (label, on)


def test_the_graph_kernel_raises_the_eager_call_s_errors(with_variants, path):
    """Through the op's graph kernel: bad input raises the eager call's error (its type and
    message), a variant's failure is a VariantFailed, on the core's path and on the Python one."""
    returns = [None]

    def fn(*args, **kwargs):
        res = _reference.causal_conv1d_fn(*args, **kwargs)
        if isinstance(returns[0], Exception):
            raise returns[0]
        return res if returns[0] is None else returns[0]

    overload = torch.ops.kernel_variants.causal_conv1d_fn.default
    bad = _fn_call(cache_indices=torch.tensor([4, 9, 2], dtype=torch.int32))
    for on in (True, False):
        path(on)
        with_variants(Variant(id="odd", op=FN, version="1", fn=fn, capabilities=ConvCapabilities(
            devices={"cpu"}, dtypes={"float32"}, noncontiguous_states=True, varlen=True)))
        with torch.no_grad(), kv.force(causal_conv1d_fn="odd"):
            kv.causal_conv1d_fn(**_fn_call())  # qualifies the variant and teaches the core the entry
            with pytest.raises(ValueError) as eager:
                kv.causal_conv1d_fn(**bad)
            for _ in range(2):
                with pytest.raises(ValueError) as graph:
                    overload(*_overload_args(FN, bad))
                assert str(graph.value) == str(eager.value)
            returns[0] = RuntimeError("kernel exploded")
            with pytest.raises(VariantFailed, match="variant 'odd' of causal_conv1d_fn failed: RuntimeError"):
                overload(*_overload_args(FN, _fn_call()))
            returns[0] = None


UNLIKE = {  # a bound call's change to its example -> the error
    "another dtype": ({"x": lambda c: c["x"].bfloat16(), "weight": lambda c: c["weight"].bfloat16(),
                       "bias": lambda c: c["bias"].bfloat16(), "conv_states": lambda c: c["conv_states"].bfloat16()},
                      TypeError, r"x: .* expected a \[3, 4, 8\] float32 tensor on cpu, got a \[3, 4, 8\] bfloat16"),
    "another length": ({"x": lambda c: c["x"][:, :2]}, ValueError, r"x: .* got a \[3, 2, 8\] float32"),
    "None for a tensor": ({"bias": lambda c: None}, TypeError, r"bias: .* got None"),
    "a smaller pool": ({"conv_states": lambda c: c["conv_states"][:5]}, ValueError,
                       r"conv_states: .* with strides \[24, 8, 1\], got a \[5, 3, 8\]"),
    "a transposed pool": ({"conv_states": lambda c: c["conv_states"].transpose(1, 2).contiguous().transpose(1, 2)},
                          ValueError, r"conv_states: .* got a \[6, 3, 8\] float32 tensor on cpu with strides \[24, 1, 3\]"),
    "a gradient": ({"weight": lambda c: c["weight"].clone().requires_grad_()}, ValueError,
                   r"weight: .* expected no tensor that requires grad in grad mode"),
}


@pytest.mark.parametrize("change", list(UNLIKE))
def test_a_bound_call_unlike_its_example_is_refused_and_runs_nothing(with_variants, path, change):
    """The bound variant qualified and was chosen for the example's class and shapes (here one
    that supports fp32 only): a call with other tensors is refused with the same error on both
    paths, before the variant runs or the pool is written."""
    changes, error, message = UNLIKE[change]
    calls = [0]

    def fp32_only(*args, **kwargs):
        calls[0] += 1
        return _reference.causal_conv1d_fn(*args, **kwargs)

    errors = []
    for on in (True, False):
        path(on)
        with_variants(Variant(id="fp32_only", op=FN, version="1", fn=fp32_only, capabilities=ConvCapabilities(
            devices={"cpu"}, dtypes={"float32"}, noncontiguous_states=True, autograd=False)))
        example = _fn_call()
        with torch.no_grad(), kv.force(causal_conv1d_fn="fp32_only"):
            bound = kv.bind(FN, **example)
        assert bound.variant == "fp32_only" and (type(bound).__name__ == "BoundCore") is on
        call = {**example, **{k: f(example) for k, f in changes.items()}}
        before, ran = call["conv_states"].clone() if call["conv_states"] is not None else None, calls[0]
        with pytest.raises(error, match=message) as info:
            bound(**call)
        errors.append(str(info.value))
        assert calls[0] == ran, "the variant ran"
        assert torch.equal(call["conv_states"], before), "the pool was written"
        with torch.no_grad():
            bound(**_fn_call())  # a call like the example runs
        assert calls[0] == ran + 1
    assert errors[0] == errors[1]


def test_a_bound_call_with_inference_tensors_is_served_in_c(reference_only, path, monkeypatch):
    """A serving loop runs under inference_mode, its tensors inference tensors (no autograd
    dispatch keys) where the example was made outside it: the C object still serves the call,
    never its Python fallback. Outside inference_mode the same pool cannot be written."""
    path(True)
    fallbacks = [0]
    made = _callcore.bound

    def counting(spec, python, *rest):
        def counted(*args, **kwargs):
            fallbacks[0] += 1
            return python(*args, **kwargs)
        return made(spec, counted, *rest)

    monkeypatch.setattr(_callcore, "bound", counting)
    bound = kv.bind(FN, **_fn_call())
    assert type(bound).__name__ == "BoundCore"
    expected = _fn_call(seed=1)
    want = _reference.causal_conv1d_fn(**expected)
    with torch.inference_mode():
        call = _fn_call(seed=1)
        got = bound(**call)
    assert call["x"].is_inference() and fallbacks[0] == 0
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(call["conv_states"], expected["conv_states"])
    with pytest.raises(ValueError, match="conv_states: an inference tensor"):
        bound(**call)
    assert fallbacks[0] == 1


def test_a_bind_with_a_parameter_in_its_example_is_c_level_and_keeps_no_tensor_of_it(reference_only, path):
    """Module weights are Parameters: the C object serves such a bind; the bound op keeps the
    example's metadata, not its tensors (a throw-away example's pool is freed)."""
    import gc
    import weakref

    path(True)
    example = _fn_call(weight=torch.nn.Parameter(torch.randn(D, W), requires_grad=False))
    bound = kv.bind(FN, **example)
    assert type(bound).__name__ == "BoundCore"
    pool = weakref.ref(example["conv_states"])
    call = _fn_call(seed=1, weight=example["weight"])
    del example
    gc.collect()
    assert pool() is None, "the bound op keeps the example's pool"
    torch.testing.assert_close(bound(**call), _reference.causal_conv1d_fn(**_fn_call(seed=1, weight=call["weight"])))


def test_a_bound_call_with_a_value_of_another_type_is_refused_on_both_paths(reference_only, path):
    """The memo key holds each value's type: -1.0 is not -1, and a bound op says so before its
    variant sees a float where it was chosen for an int."""
    errors = []
    for on in (True, False):
        path(on)
        bound = kv.bind(FN, **_fn_call(pad_slot_id=-1))
        assert (type(bound).__name__ == "BoundCore") is on
        with pytest.raises(ValueError, match=r"pad_slot_id: a bound op runs with the example's values; "
                                             r"expected \{'pad_slot_id': -1\}, got \{'pad_slot_id': -1\.0\}") as info:
            bound(**_fn_call(pad_slot_id=-1.0))
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def test_a_bound_variant_not_graph_safe_refuses_a_call_in_a_capture(with_variants, path, monkeypatch):
    """Captured into a CUDA/NPU graph the op chooses among graph_safe variants only: a bound
    variant that is not one refuses a call made while a graph is captured, and the bound op is
    then the Python function (the C object does not read the capture state). Simulated on the
    CPU: its calls counted as capturable."""
    import gc
    import weakref

    from kernel_variants._runtime import bind as _bind

    path(True)
    monkeypatch.setattr(_bind, "_capturable", lambda device: True)
    capture = [False]
    monkeypatch.setattr(_bind, "capturing", lambda device: capture[0])
    for vid, graph_safe in (("unsafe", False), ("safe", True)):
        with_variants(Variant(id=vid, op=FN, version="1", fn=_reference.causal_conv1d_fn, capabilities=ConvCapabilities(
            devices={"cpu"}, dtypes={"float32"}, noncontiguous_states=True, graph_safe=graph_safe)))
        with kv.force(causal_conv1d_fn=vid):
            bound = kv.bind(FN, **_fn_call())
        assert (type(bound).__name__ == "BoundCore") is graph_safe
        capture[0] = True
        if graph_safe:
            bound(**_fn_call())
        else:
            refused = _fn_call()
            with pytest.raises(ValueError, match="the bound variant 'unsafe' is not declared graph_safe, and a cpu graph "
                                                 "is being captured"):
                bound(**refused)
            x = weakref.ref(refused.pop("x"))
            gc.collect()
            assert x() is None, "the error keeps a refused call's tensors"
        capture[0] = False
        bound(**_fn_call())


def test_a_graph_call_to_the_core_copies_an_output_that_aliases_an_input(with_variants, path):
    """A compiled graph's kernel calls the core with ``GRAPH`` for ``out``: the core clones an
    output sharing an input's storage in the same call; an ordinary call hands it back as is."""
    path(True)
    alias = [False]

    def fn(*args, **kwargs):
        return args[0] if alias[0] else _reference.causal_conv1d_fn(*args, **kwargs)

    with_variants(Variant(id="aliasing", op=FN, version="1", fn=fn, capabilities=ConvCapabilities(
        devices={"cpu"}, dtypes={"float32"}, noncontiguous_states=True, varlen=True)))
    call = _fn_call()
    with kv.force(causal_conv1d_fn="aliasing"):
        kv.causal_conv1d_fn(**call)  # qualifies the variant and teaches the core the entry
        args = FN_SPEC.bind(**call)
        core = _callcore.core_for(FN_SPEC)
        alias[0] = True
        graph = core(*args, _callcore.GRAPH)
        plain = core(*args, None)
    x = call["x"]
    assert plain is x, "an ordinary call returns what the variant returned"
    assert graph is not x and torch.equal(graph, x)
    assert graph.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("on", [True, False])
def test_a_compiled_graph_copies_an_aliasing_output_and_runs_the_variant_once(with_variants, path, on):
    """End to end: a forced variant returning its input, in a fullgraph compile (the kernel passes
    GRAPH to the core, or takes the Python path): one variant call per graph call, a copy out."""
    path(on)
    calls, fail = [0], [False]

    def fn(x, conv_state, weight, *args, **kwargs):
        calls[0] += 1
        if fail[0]:
            raise RuntimeError("boom")
        _reference.causal_conv1d_update(x, conv_state, weight, *args, **kwargs)
        return x

    with_variants(Variant(id="aliasing", op=UP, version="1", fn=fn, capabilities=ConvCapabilities(
        devices={"cpu"}, dtypes={"float32"}, noncontiguous_states=True, num_accepted_tokens=True, varlen=True)))

    def step(x, conv_state, weight, conv_state_indices):
        return kv.causal_conv1d_update(x, conv_state, weight, conv_state_indices=conv_state_indices)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    call = _decode_call()
    with torch.no_grad(), kv.force(causal_conv1d_update="aliasing"):
        step(**call)  # qualifies the variant and teaches the core the entry
        for _ in range(2):
            calls[0] = 0
            got = compiled(**call)
            assert calls[0] == 1
            assert torch.equal(got, call["x"])
            assert got.untyped_storage().data_ptr() != call["x"].untyped_storage().data_ptr()
        fail[0], calls[0] = True, 0
        with pytest.raises(VariantFailed, match="boom"):
            compiled(**call)
        assert calls[0] == 1, "a failed variant is reported, never run again"


@pytest.mark.parametrize("on", [True, False])
def test_an_output_sharing_an_inputs_storage_is_copied_on_both_paths(path, on):
    """A torch.library op's output may not alias an input: the compiled graph's kernel copies it."""
    path(on)
    x, other = torch.randn(4, 3), torch.randn(2)
    from kernel_variants._runtime.core_functions import FUNCTIONS as fresh
    view = x[1:]
    got = fresh.unaliased(view, x, other, None)
    assert torch.equal(got, view) and got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    mine = torch.randn(3)
    assert fresh.unaliased(mine, x, None) is mine
    pair = fresh.unaliased((mine, other), x, other)
    assert pair[0] is mine and torch.equal(pair[1], other) and pair[1] is not other
    assert (fresh.unaliased.__module__ or "").startswith("kernel_variants") != on, "the C function serves where the core does"


def test_the_engine_adapters_fast_steps_call_the_core_below_the_entry(reference_only, path, python_calls,
                                                                      monkeypatch):
    """vLLM's and sglang's everyday calls in their layouts (slot lists and vLLM's slot table, a
    prefill with and without a pool): once each signature has been seen, the op's core serves
    them from C (neither the entry nor the Python path runs); both paths give the same outputs
    and states."""
    from kernel_variants.integrations import _fast
    from kernel_variants.integrations import sglang as kv_sglang
    from kernel_variants.integrations import vllm as kv_vllm

    entered = []
    for name in ("_FN", "_UPDATE"):
        real = getattr(_fast, name)
        monkeypatch.setattr(_fast, name, lambda *a, _real=real: entered.append(1) or _real(*a))

    def calls(seed: int):
        g = torch.Generator().manual_seed(seed)
        pool = torch.randn(N, W - 1, D, generator=g)
        weight, bias = torch.randn(D, W, generator=g), torch.randn(D, generator=g)
        slots = torch.tensor([4, 1, 2], dtype=torch.int32)
        table = torch.tensor([[5, 0], [1, 0], [3, 0]], dtype=torch.int32)  # vLLM reads column 0
        qsl, init = torch.tensor([0, 3, 4, 10], dtype=torch.int32), torch.tensor([True, False, True])
        x = torch.randn(10, D, generator=g)
        tokens = torch.randn(3, D, generator=g)
        return [
            kv_vllm.causal_conv1d_fn(x.t(), weight, bias, pool.transpose(1, 2), qsl, slots, init, "silu").clone(),
            kv_vllm.causal_conv1d_fn(x.t(), weight, bias, None, qsl, None, None, "silu").clone(),
            kv_vllm.causal_conv1d_update(tokens, pool.transpose(1, 2), weight, bias, "silu", slots),
            kv_vllm.causal_conv1d_update(tokens, pool.transpose(1, 2), weight, bias, "silu", table),
            kv_sglang.causal_conv1d_fn(x.t(), weight, bias, pool.transpose(1, 2), qsl, [3, 1, 6], slots, init,
                                       "silu").clone(),
            kv_sglang.causal_conv1d_update(tokens, pool.transpose(1, 2), weight, bias, "silu",
                                           conv_state_indices=slots),
            pool,
        ]

    results = {}
    for on in (True, False):
        path(on)
        with torch.no_grad():
            first = calls(0)  # each signature decides once (the entry, the Python path)
            entered.clear()
            python_calls[0] = 0
            results[on] = [first, calls(1)]
        assert (len(entered), python_calls[0]) == ((0, 0) if on else (6, 6))
    _same(results[True], results[False])


def test_sglang_prefill_s_host_lengths_are_checked_in_the_core_as_in_python(reference_only, path, monkeypatch):
    """sglang hands its host lengths: the core serves the call where they hold no zero and sum
    to T, as a list or a tuple, with a plain int pad id; anything else (an empty sequence,
    padding tokens past the lengths, an int subclass) takes the general path. Both paths agree
    on which, and on the results."""
    from kernel_variants.integrations import _sglang_adapters
    from kernel_variants.integrations import sglang as kv_sglang

    class Slot(int):
        pass

    general = []
    real = _sglang_adapters.prefill
    monkeypatch.setattr(_sglang_adapters, "prefill", lambda *a, **k: general.append(1) or real(*a, **k))
    forms = {  # name: (query_start_loc, host lengths, pad id, served by the step)
        "list": ([0, 3, 4, 10], [3, 1, 6], -1, True),
        "tuple": ([0, 3, 4, 10], (3, 1, 6), -1, True),
        "an empty sequence": ([0, 3, 3, 10], [3, 0, 7], -1, False),
        "padding tokens": ([0, 3, 4, 9], [3, 1, 5], -1, False),
        "an int subclass": ([0, 3, 4, 10], [3, 1, 6], Slot(-1), False),
        "a non-int length": ([0, 3, 4, 10], [3, 1.0, 6], -1, False),
    }

    def run(qsl, lengths, pad):
        g = torch.Generator().manual_seed(0)
        pool = torch.randn(N, W - 1, D, generator=g)
        weight, bias = torch.randn(D, W, generator=g), torch.randn(D, generator=g)
        x = torch.randn(10, D, generator=g)
        y = kv_sglang.causal_conv1d_fn(x.t(), weight, bias, pool.transpose(1, 2), torch.tensor(qsl, dtype=torch.int32),
                                       lengths, torch.tensor([4, 1, 2], dtype=torch.int32),
                                       torch.tensor([True, False, True]), "silu", pad)
        return [y.clone(), pool]

    results = {}
    for on in (True, False):
        path(on)
        with torch.no_grad():
            for name, (qsl, lengths, pad, _) in forms.items():
                run(qsl, lengths, pad)  # the signature decides once
                general.clear()
                results[on, name] = run(qsl, lengths, pad)
                assert (not general) == forms[name][3], (name, on)
    for name in forms:
        _same(results[True, name], results[False, name])


def test_a_step_s_views_are_reused_only_where_nothing_holds_them(path):
    """The views a fast step hands the op (the pool, a prefill's x, a slot table's column) are
    kept after the call and re-pointed at the next step's tensors, unless something holds one:
    a tensor the variant kept, weak-referenced, tagged or gave another class is never changed
    afterwards; a kept view holds none of the engine's storage and is out of the GC's reach; each step's view has its own tensor's sizes, strides,
    data, dtype, version counter and inference state."""
    import gc
    import weakref

    import kernel_variants.integrations._fast  # noqa: F401  (provides the steps)
    from kernel_variants._runtime.core_functions import FUNCTIONS

    path(True)
    seen, held, refs, seen_types = [], [], [], []

    class Sub(torch.Tensor):
        pass

    def entry(*args):  # the op's entry, as a step calls it where no core serves
        state = args[1]
        seen.append((id(state), getattr(state, "tag", None)))
        state[0, 0, 0] += 1  # the variant writes the pool through its view
        what = behaviour[0]
        if what == "keep":
            held.append((state, state.shape, state.clone()))
        elif what == "weak":
            refs.append((weakref.ref(state), state.shape))
        elif what == "tag":
            state.tag = "mine"
        elif what == "subclass":
            state.__class__ = Sub
        seen_types.append(type(state))
        return args[0]

    def step(pool: torch.Tensor) -> None:
        x, weight = torch.zeros(2, pool.shape[1], dtype=pool.dtype), torch.zeros(pool.shape[1], W, dtype=pool.dtype)
        uses = torch._C._storage_Use_Count(pool.untyped_storage()._cdata)
        version = None if pool.is_inference() else pool._version
        assert FUNCTIONS.decode_step(None, entry, x, pool, weight, None, "silu", None, -1, True) is x
        if behaviour[0] != "keep":
            assert torch._C._storage_Use_Count(pool.untyped_storage()._cdata) == uses, "nothing keeps the pool"
        if version is not None:
            assert pool._version > version, "a write through the view counts on the pool"

    behaviour = ["plain"]
    with torch.no_grad():
        pools = [torch.zeros(N, D + k, W - 1) for k in range(3)]
        for pool in pools:
            step(pool)
        assert all(p[0, 0, 0] == 1 for p in pools)
        assert len({i for i, _ in seen}) == 1, "a view nothing holds is reused"
        step(torch.zeros(N, D, W - 1, dtype=torch.bfloat16))
        assert seen[-1][0] == seen[0][0], "for another dtype too"

        assert seen[-1][0] not in {id(o) for o in gc.get_objects()}, "a kept view is out of the GC's reach"
        for what in ("keep", "weak", "tag", "subclass"):
            behaviour[0] = what
            for k in range(3):
                step(torch.full((N, D + k, W - 1), float(k)))
            behaviour[0] = "plain"
            step(torch.zeros(N, D, W - 1))
            assert seen[-1][1] is None, "a reused view carries no attribute of an earlier call"
            assert seen_types[-1] is torch.Tensor, "nor the class an earlier call gave it"
        for k, (state, shape, values) in enumerate(held):
            assert state.shape == shape and torch.equal(state, values) and state[1, 1, 1] == k
        for ref, shape in refs:
            assert ref() is None or ref().shape == shape, "a weak reference never sees another tensor"

    with torch.inference_mode():
        frozen = torch.zeros(N, D, W - 1)
        step(frozen)
    inference = seen[-1][0]
    with torch.inference_mode():
        step(torch.zeros(N, D, W - 1))
        assert seen[-1][0] == inference, "an inference tensor's view is reused for the next one"
    with torch.no_grad():
        step(torch.zeros(N, D, W - 1))  # a normal pool: a normal view, never the inference one
        assert seen[-1][0] != inference

    def fn_entry(x, weight, bias, pool, slots, init, qsl, act, pad, out):
        got.append((x.shape, x.stride(), x.data_ptr(), pool.shape, pool.data_ptr(), slots.tolist()))
        return x

    got = []
    table = torch.tensor([[4, 0], [1, 0]], dtype=torch.int32)
    qsl, init = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([True, False])
    with torch.no_grad():
        for k in range(3):
            x, pool = torch.randn(7, D + k), torch.randn(N, W - 1, D + k)
            y = FUNCTIONS.prefill_step(None, fn_entry, x.t(), torch.zeros(D + k, W), None, pool.transpose(1, 2), qsl,
                                       table, init, "silu", 0, True, None)
            assert got[-1] == (x.shape, x.stride(), x.data_ptr(), pool.shape, pool.data_ptr(), [4, 1])
            assert y.shape == (D + k, 7) and y.data_ptr() == x.data_ptr()

    # The op's result as the engine's (dim, T): a fresh output is restrided in place, one the
    # variant also holds (or weak-references) is left as it is and aliased.
    cache, values = torch.zeros(7, D), torch.randn(7, D)

    made = []

    def fresh(*args):
        y = torch.empty(7, D)
        made.append(id(y))
        return y.copy_(values)

    watched = []

    def watched_fresh(*args):  # a fresh output the variant keeps a weak reference to
        y = torch.empty(7, D).copy_(values)
        watched.append(weakref.ref(y))
        return y

    for entry_, holder in ((fresh, None), (lambda *a: cache, cache), (watched_fresh, watched)):
        with torch.no_grad():
            y = FUNCTIONS.prefill_step(None, entry_, torch.randn(7, D).t(), torch.zeros(D, W), None, None, qsl, None,
                                       None, "silu", 0, True, None)
        assert y.shape == (D, 7) and y.stride() == (1, D)
        if holder is None:
            assert torch.equal(y, values.t()) and id(y) == made[-1], "the variant's own output, no alias"
        elif holder is watched:
            # Not restrided: the watched object died with the step, y is an alias of its data.
            assert watched[-1]() is None and torch.equal(y, values.t())
        else:
            assert holder.shape == (7, D) and y.data_ptr() == holder.data_ptr()


def test_the_engine_adapters_under_a_non_strict_export_record_the_ops(reference_only, path):
    """torch.export without Dynamo runs the adapters on fake tensors: their fast steps make
    ordinary views, read no host data, and the ops record their custom ops; the exported
    program computes what the eager calls do, pools included."""
    from kernel_variants.integrations import sglang as kv_sglang
    from kernel_variants.integrations import vllm as kv_vllm

    path(True)

    class Step(torch.nn.Module):
        def forward(self, x, weight, pool, qsl, slots, init, tokens):
            return (kv_vllm.causal_conv1d_fn(x.t(), weight, None, pool.transpose(1, 2), qsl, slots, init, "silu"),
                    kv_vllm.causal_conv1d_update(tokens, pool.transpose(1, 2), weight, None, "silu", slots),
                    kv_sglang.causal_conv1d_fn(x.t(), weight, None, pool.transpose(1, 2), qsl, [3, 4], slots, init,
                                               "silu"),
                    kv_sglang.causal_conv1d_update(tokens, pool.transpose(1, 2), weight, None, "silu",
                                                   conv_state_indices=slots))

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(7, D, generator=g), torch.randn(D, W, generator=g), torch.randn(N, W - 1, D, generator=g),
            torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([1, 4], dtype=torch.int32),
            torch.tensor([True, False]), torch.randn(2, D, generator=g))
    program = torch.export.export(Step(), tuple(a.clone() for a in args), strict=False)
    assert "causal_conv1d" in str(program.graph)
    exported, eager = [a.clone() for a in args], [a.clone() for a in args]
    _same([*program.module()(*exported), exported[2]], [*Step()(*eager), eager[2]])


def test_kept_views_survive_dispatch_keys_that_come_and_go(path):
    """Views of tensors with several dispatch key sets (inference or not, a conjugate bit) in
    turn, three at once from a prefill step: every place is taken, the oldest view is let go
    for a new key set, and each step's writes land in its own pool."""
    import kernel_variants.integrations._fast  # noqa: F401  (provides the steps)
    from kernel_variants._runtime.core_functions import FUNCTIONS

    path(True)

    def decode_entry(*args):
        args[1][0, 0, 0] += 1
        return args[0]

    def prefill_entry(x, weight, bias, pool, slots, init, qsl, act, pad, out):
        pool[int(slots[0]), 0, 0] += 1
        return x

    def pool(inference: bool, conj: bool) -> torch.Tensor:
        with torch.inference_mode(inference):
            p = torch.zeros(N, D, W - 1, dtype=torch.complex64 if conj else torch.float32)
            return p.conj() if conj else p

    qsl, table = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([[2, 0]], dtype=torch.int32)
    for _ in range(5):
        for inference in (True, False):
            for conj in (False, True):
                with torch.inference_mode(inference):
                    p = pool(inference, conj)
                    x, w = torch.zeros(3, D, dtype=p.dtype), torch.zeros(D, W, dtype=p.dtype)
                    FUNCTIONS.decode_step(None, decode_entry, x[:1], p, w, None, "silu", None, -1, True)
                    FUNCTIONS.prefill_step(None, prefill_entry, x.t(), w, None, p, qsl, table, None, "silu", -1,
                                           True, None)
                assert p[0, 0, 0] == 1 and p[2, 0, 0] == 1 and int((p != 0).sum()) == 2


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
    assert not _callcore.serves(object(), tensor("cuda"), host_checks=False)  # not a core: a resolver
    try:
        assert _callcore.serves(core, tensor("cuda"), host_checks=False) and served == {"cpu", "cuda"}
        installed = module.capture_check("cuda", None)  # what the first CUDA call installed, taken out
        assert installed in (getattr(torch._C, "_cuda_isCurrentStreamCapturing", None),
                             torch.cuda.is_current_stream_capturing)
    finally:
        module.capture_check("cuda", None)
