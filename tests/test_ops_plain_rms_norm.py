"""The plain RMSNorm family, rms_norm and fused_add_rms_norm (vLLM IR's semantics): the contract
written out independently of the reference, the features that route calls (no weight, an fp32
weight, variance_size), vLLM's in-place form, bad input, torch.compile, and the one C++ kernel
that serves both families. (Conformance of every variant is tests/test_conformance.py.)"""

from __future__ import annotations

import pytest
import torch

import kernel_variants as kv
from kernel_variants.ops.rms_norm import _spec

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


def _inputs(shape=(3, 5, 64), dtype=torch.bfloat16, wdtype=None):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(wdtype or dtype)
    r = torch.randn(*shape, generator=gen).to(dtype)
    return x, w, r


def _contract(s32, w, eps, size, dtype):
    """vLLM IR's rms_norm, written from its documented steps: fp32 row, the mean of squares over
    the first ``size`` channels, the norm rounded to the weight's dtype, times the weight."""
    rows = s32.reshape(-1, s32.shape[-1])
    out = torch.empty_like(rows)
    for i, row in enumerate(rows):
        part = row if size is None else row[:size]
        n = row / torch.sqrt((part * part).sum() / part.numel() + eps)
        out[i] = n if w is None else (n.to(w.dtype) * w).float()
    return out.reshape(s32.shape).to(dtype)


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize(("weight", "size"), [("x", None), ("none", None), ("float32", 40), ("x", 1)])
def test_the_ops_follow_vllm_irs_contract_and_write_nothing(dtype, weight, size):
    x, w, r = _inputs(dtype=dtype, wdtype=torch.float32 if weight == "float32" else None)
    w = None if weight == "none" else w
    before = [t.clone() for t in (x, r)]
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(kv.rms_norm(x, w, 1e-5, size), _contract(x.float(), w, 1e-5, size, dtype),
                               atol=atol, rtol=rtol)
    normed, residual = kv.fused_add_rms_norm(x, r, w, 1e-5, size)
    s32 = x.float() + r.float()
    assert torch.equal(residual, s32.to(dtype)), "residual is the fp32 sum rounded to x's dtype, exactly"
    torch.testing.assert_close(normed, _contract(s32, w, 1e-5, size, dtype), atol=atol, rtol=rtol)
    assert all(torch.equal(a, b) for a, b in zip(before, (x, r), strict=True)), "an input was written"


def test_vllms_in_place_form_writes_the_norm_over_x_and_the_sum_over_the_residual():
    x, w, r = _inputs(dtype=torch.float32)
    expected = _spec.reference_add(x, r, w, 1e-6)
    for variant in ("reference", "cpu_native", "aten"):
        xi, ri = x.clone(), r.clone()
        with kv.force(fused_add_rms_norm=variant):
            normed, residual = kv.fused_add_rms_norm(xi, ri, w, 1e-6, out=(xi, ri))
        assert normed is xi and residual is ri, variant
        torch.testing.assert_close(xi, expected[0])
        torch.testing.assert_close(ri, expected[1], atol=0, rtol=0)


def test_features_route_calls_to_the_variants_that_take_them():
    x, w, _ = _inputs(dtype=torch.float32)
    decision = kv.explain("rms_norm", x, None, 1e-6, 32)
    assert decision.key.features == _spec.NormFeatures(weight="none", variance_size=True)
    assert decision.key.shape == (15, 64)
    refused = {row.variant: row.reason for row in decision.trace if not row.accepted}
    assert "aten" in refused and "variance_size not supported" in refused["aten"]
    half = kv.explain("rms_norm", x.bfloat16(), w, 1e-6)
    assert half.key.features.weight == "float32"  # an fp32 weight under bf16: vLLM's GemmaRMSNorm


def test_gemma_and_plain_rmsnorm_are_one_cpu_kernel():
    """Gemma's op is this op with the scale 1 + weight: the shared cpu_native kernel gives the
    same bits either way (offset 1 on w, or offset 0 on 1 + w in fp32)."""
    x, w, r = _inputs(dtype=torch.float32)
    with kv.force(gemma_rms_norm="cpu_native", rms_norm="cpu_native", add_gemma_rms_norm="cpu_native",
                  fused_add_rms_norm="cpu_native"):
        torch.testing.assert_close(kv.gemma_rms_norm(x, w, 1e-6), kv.rms_norm(x, 1 + w, 1e-6), atol=0, rtol=0)
        gemma = kv.add_gemma_rms_norm(x, w, r, 1e-6)
        plain = kv.fused_add_rms_norm(x, r, 1 + w, 1e-6)
    for a, b in zip(gemma, plain, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_compiled_model_calls_the_custom_ops_and_matches_eager():
    x, w, r = _inputs(dtype=torch.float32)

    def block(x, w, r):
        normed, residual = kv.fused_add_rms_norm(x, r, w, 1e-6)
        return kv.rms_norm(normed * 2, None, 1e-6, 16), residual

    eager = block(x, w, r)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x, w, r)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b)
