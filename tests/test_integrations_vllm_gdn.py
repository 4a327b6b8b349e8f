"""vLLM-CPU's gated delta rule (Qwen3-Next's GDN layers) through kernel_variants, without vLLM:
what ``patch()`` replaces in ``vllm._custom_ops``, how each call is mapped (views of the
engine's tensors, the pool written in place), which calls run vLLM's own function, and the
shadow judging them.

The stand-ins compute what vLLM-CPU 0.32's ops compute (the contract's recurrence), in the
shapes it returns: decode ``[T, 1, Hv, V]``, gating ``([1, T, Hv] fp32, [1, T, Hv] a's dtype)``,
prefill ``([1, T, Hv, V], the pool)``."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

import kernel_variants as kv
from kernel_variants.integrations import vllm as kv_vllm
from kernel_variants.ops.gdn import _reference

UPDATE, CHUNK = "gated_delta_rule_update", "chunk_gated_delta_rule"
HK, HV, K, V, N = 2, 4, 8, 16, 6


def _engine(calls: list[str]) -> dict:
    def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                                   initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
                                                   softplus_beta=1.0, softplus_threshold=20.0):
        calls.append("decode")
        o = _reference.gated_delta_rule_update(
            q[0], k[0], v[0], a, b, A_log, dt_bias.float(), initial_state_source, initial_state_indices, cu_seqlens,
            use_qk_l2norm=use_qk_l2norm_in_kernel, scale=None, softplus_beta=1.0,
            softplus_threshold=softplus_threshold, pad_slot_id=-1)
        return o.unsqueeze(1)

    def fused_gdn_gating_cpu(A_log, a, b, dt_bias):
        calls.append("gating")
        g, beta = _reference.gdn_gating(A_log, a, b, dt_bias)
        return g.unsqueeze(0), beta.to(a.dtype).unsqueeze(0)

    def chunk_gated_delta_rule_cpu(query, key, value, g, beta, initial_state, output_final_state, cu_seqlens,
                                   head_first, use_qk_l2norm_in_kernel, initial_state_indices, eps=1e-5):
        calls.append("prefill")
        if head_first:
            return None, initial_state  # only that it ran is checked
        batch = cu_seqlens.shape[0] - 1
        o = _reference.chunk_gated_delta_rule(
            query[0], key[0], value[0], g[0], beta[0], cu_seqlens, ssm_states=initial_state,
            state_indices=initial_state_indices, has_initial_state=torch.ones(batch, dtype=torch.bool),
            use_qk_l2norm=use_qk_l2norm_in_kernel, scale=None, pad_slot_id=-1)
        return o.unsqueeze(0), initial_state

    fns = dict(fused_sigmoid_gating_delta_rule_update_cpu=fused_sigmoid_gating_delta_rule_update_cpu,
               fused_gdn_gating_cpu=fused_gdn_gating_cpu, chunk_gated_delta_rule_cpu=chunk_gated_delta_rule_cpu)
    for fn in fns.values():
        fn.__module__ = "vllm._custom_ops"
    return fns


@pytest.fixture
def engine(monkeypatch, reference_only):
    calls: list[str] = []
    module = types.ModuleType("vllm._custom_ops")
    vars(module).update(_engine(calls))
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", module)
    utils = types.ModuleType(kv_vllm.UTILS_MODULE)
    utils.PAD_SLOT_ID, utils.NULL_BLOCK_ID = -1, 0
    monkeypatch.setitem(sys.modules, kv_vllm.UTILS_MODULE, utils)
    return module, calls


def _qkv(total: int, g: torch.Generator, dtype=torch.bfloat16):
    """q, k, v ``[1, T, H, D]`` as views of one projection (``rearrange_mixed_qkv``'s)."""
    mixed = torch.randn(total, 2 * HK * K + HV * V, generator=g).to(dtype)
    q, k, v = mixed.split([HK * K, HK * K, HV * V], -1)
    return q.view(1, total, HK, K), k.view(1, total, HK, K), v.view(1, total, HV, V)


def decode_call(batch: int = 3, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(batch, g)
    pool = torch.randn(N, 2 * HV * K * V, generator=g)[:, : HV * K * V].view(N, HV, K, V).to(torch.bfloat16)
    return dict(A_log=torch.randn(HV, generator=g), dt_bias=torch.randn(HV, generator=g).to(torch.bfloat16), q=q, k=k,
                v=v, a=torch.randn(batch, HV, generator=g).to(torch.bfloat16),
                b=torch.randn(batch, HV, generator=g).to(torch.bfloat16), initial_state_source=pool,
                initial_state_indices=torch.tensor([4, 1, 2][:batch], dtype=torch.int32),
                cu_seqlens=torch.arange(batch + 1, dtype=torch.int32), use_qk_l2norm_in_kernel=True)


def prefill_call(lengths=(5, 0, 7), seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = _qkv(total, gen)
    a, b = torch.randn(total, HV, generator=gen).to(torch.bfloat16), torch.randn(total, HV, generator=gen).to(torch.bfloat16)
    g, beta = _reference.gdn_gating(torch.randn(HV, generator=gen), a, b, torch.randn(HV, generator=gen))
    pool = torch.randn(N, HV, K, V, generator=gen).to(torch.bfloat16)
    pool[3] = 0  # vLLM zeroes the slot of a sequence without an initial state before it calls
    return dict(query=q, key=k, value=v, g=g.unsqueeze(0), beta=beta.to(torch.bfloat16).unsqueeze(0),
                initial_state=pool, output_final_state=True,
                cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
                head_first=False, use_qk_l2norm_in_kernel=True,
                initial_state_indices=torch.tensor([5, 0, 3][: len(lengths)], dtype=torch.int32))


def _copies(call: dict) -> dict:
    from kernel_variants._tuning.verify import clone_views

    return clone_views(call)[0]


def _close(got, want, what):
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2, msg=what)


def test_patch_replaces_the_three_in_custom_ops(engine):
    module, _ = engine
    own = {n: getattr(module, n) for n in ("fused_sigmoid_gating_delta_rule_update_cpu", "fused_gdn_gating_cpu",
                                            "chunk_gated_delta_rule_cpu")}
    with kv_vllm.patch() as handle:
        for name in own:
            assert getattr(module, name) is getattr(kv_vllm, name)
            assert f"vllm._custom_ops.{name}" in handle.replaced
    assert all(getattr(module, n) is fn for n, fn in own.items())


def test_decode_matches_vllm_with_views_and_pool_in_place(engine, monkeypatch):
    module, calls = engine
    seen = []
    real = kv.gated_delta_rule_update

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(kv, UPDATE, spy)
    call, want = decode_call(), None
    want = _copies(call)
    expected = module.fused_sigmoid_gating_delta_rule_update_cpu(**want)
    with kv_vllm.patch():
        got = module.fused_sigmoid_gating_delta_rule_update_cpu(**call)
    assert calls == ["decode"] and len(seen) == 1
    args, kwargs = seen[0]
    assert args[0].data_ptr() == call["q"].data_ptr() and args[0].shape == (3, HK, K)  # a view
    assert args[7] is call["initial_state_source"] and kwargs["pad_slot_id"] == -1
    assert got.shape == expected.shape == (3, 1, HV, V)
    _close(got, expected, "output")
    _close(call["initial_state_source"], want["initial_state_source"], "pool")
    untouched = [0, 3, 5]
    assert torch.equal(call["initial_state_source"][untouched], want["initial_state_source"][untouched])


def test_gating_as_vllm_returns_it(engine):
    module, calls = engine
    call = decode_call()
    args = dict(A_log=call["A_log"], a=call["a"], b=call["b"], dt_bias=call["dt_bias"])
    g0, b0 = module.fused_gdn_gating_cpu(**args)
    with kv_vllm.patch():
        g1, b1 = module.fused_gdn_gating_cpu(**args)
    assert calls == ["gating"]  # the engine's own ran once: ours above
    assert g1.shape == g0.shape == (1, 3, HV) and g1.dtype == torch.float32 and b1.dtype == torch.bfloat16
    torch.testing.assert_close(g1, g0)
    torch.testing.assert_close(b1, b0)


def test_prefill_matches_vllm_in_place(engine):
    module, calls = engine
    call = prefill_call()
    want = _copies(call)
    o0, _ = module.chunk_gated_delta_rule_cpu(**want)
    with kv_vllm.patch():
        o1, pool1 = module.chunk_gated_delta_rule_cpu(**call)
    assert calls == ["prefill"]
    assert pool1 is call["initial_state"] and o1.shape == o0.shape == (1, 12, HV, V)
    _close(o1, o0, "output")
    _close(call["initial_state"], want["initial_state"], "pool")
    assert torch.equal(call["initial_state"][[1, 2, 4]], want["initial_state"][[1, 2, 4]])


def test_head_first_runs_vllms_own(engine):
    module, calls = engine
    call = prefill_call()
    call["head_first"] = True
    with kv_vllm.patch():
        module.chunk_gated_delta_rule_cpu(**call)
    assert calls == ["prefill"]


def _mirror(fn):
    def mirror(*args, **kwargs):  # the reference's results under another function (not "the reference")
        return fn(*args, **kwargs)

    return mirror


def test_shadow_judges_decode_and_prefill_against_vllm(engine, with_variants, monkeypatch):
    from kernel_variants.ops.gdn import GdnCapabilities
    from kernel_variants.plugin import Variant

    module, calls = engine
    caps = GdnCapabilities(devices={"cpu"}, dtypes={"bfloat16"})
    with_variants(*(Variant(id="mirror", op=op, version="1", priority=100, isolate=False, capabilities=caps,
                            fn=_mirror(getattr(_reference, op))) for op in (UPDATE, CHUNK)))
    monkeypatch.setenv("KV_QUALIFY", "off")
    with kv.force(gated_delta_rule_update="mirror", chunk_gated_delta_rule="mirror"), kv_vllm.patch(shadow=1.0), \
            warnings.catch_warnings():
        warnings.simplefilter("error")
        module.chunk_gated_delta_rule_cpu(**prefill_call())
        module.fused_sigmoid_gating_delta_rule_update_cpu(**decode_call())
    assert calls == ["prefill", "decode"]  # each ran once, as the oracle
    counts = {c.op: c for c in kv.shadow_report().counts if c.variant == "mirror"}
    assert counts[UPDATE].shadowed == 1 and counts[CHUNK].shadowed == 1
    assert counts[UPDATE].mismatches == counts[CHUNK].mismatches == 0


def test_shadow_catches_a_wrong_pool_and_returns_vllms(engine, with_variants, monkeypatch):
    from kernel_variants.ops.gdn import GdnCapabilities
    from kernel_variants.plugin import Variant

    def drifting(q, k, v, a, b, A_log, dt_bias, state, *args, **kwargs):
        o = _reference.gated_delta_rule_update(q, k, v, a, b, A_log, dt_bias, state, *args, **kwargs)
        state[4] *= 1.1
        return o

    module, _ = engine
    with_variants(Variant(id="drifting", op=UPDATE, version="1", priority=100, isolate=False, fn=drifting,
                          capabilities=GdnCapabilities(devices={"cpu"}, dtypes={"bfloat16"})))
    monkeypatch.setenv("KV_QUALIFY", "off")
    call = decode_call()
    want = _copies(call)
    module.fused_sigmoid_gating_delta_rule_update_cpu(**want)
    with kv.force(gated_delta_rule_update="drifting"), kv_vllm.patch(shadow=1.0), \
            pytest.warns(kv.ShadowMismatch, match="differ beyond"):
        module.fused_sigmoid_gating_delta_rule_update_cpu(**call)
    assert torch.equal(call["initial_state_source"], want["initial_state_source"])  # vLLM's outcome


def test_shadow_judges_an_fp32_pool_at_the_activations_tolerance(engine, with_variants, monkeypatch):
    """vLLM-CPU's kernels round their intermediates to bf16: a variant within bf16's tolerance of
    the engine on an fp32 pool agrees; the prefill's returned pool is judged as that state."""
    from kernel_variants.ops.gdn import GdnCapabilities
    from kernel_variants.plugin import Variant

    def close(fn, decode):
        def variant(*args, **kwargs):
            o = fn(*args, **kwargs)
            pool, slots = (args[7], args[8].long()) if decode else (kwargs["ssm_states"], torch.tensor([5, 3]))
            pool[slots] *= 1 + 1e-3  # the slots it wrote (not the empty sequence's): beyond fp32's tolerance
            return o

        return variant

    module, _ = engine
    caps = GdnCapabilities(devices={"cpu"}, dtypes={"bfloat16"})
    with_variants(Variant(id="close", op=UPDATE, version="1", priority=100, isolate=False, capabilities=caps,
                          fn=close(_reference.gated_delta_rule_update, True)),
                  Variant(id="close", op=CHUNK, version="1", priority=100, isolate=False, capabilities=caps,
                          fn=close(_reference.chunk_gated_delta_rule, False)))
    monkeypatch.setenv("KV_QUALIFY", "off")
    decode, prefill = decode_call(), prefill_call()
    decode["initial_state_source"] = decode["initial_state_source"].float()
    prefill["initial_state"] = prefill["initial_state"].float()
    with kv.force(gated_delta_rule_update="close", chunk_gated_delta_rule="close"), kv_vllm.patch(shadow=1.0), \
            warnings.catch_warnings():
        warnings.simplefilter("error")
        module.chunk_gated_delta_rule_cpu(**prefill)
        module.fused_sigmoid_gating_delta_rule_update_cpu(**decode)
    counts = {c.op: c for c in kv.shadow_report().counts if c.variant == "close"}
    assert counts[UPDATE].shadowed == 1 and counts[CHUNK].shadowed == 1
    assert counts[UPDATE].mismatches == counts[CHUNK].mismatches == 0
