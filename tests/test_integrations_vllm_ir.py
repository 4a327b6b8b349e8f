"""kernel_variants as vLLM IR's provider ``kernel_variants`` of rms_norm and fused_add_rms_norm
(``integrations/_vllm_ir.py``): what its ``supports_args`` accepts (from the registry), the
eager implementation (in place for the add form), the traced one (the library's custom ops,
for vLLM's lowering pass), and, where vLLM IR is installed (tools/vllm_cpu_e2e.sh's
virtualenv), the registration through the plugin and vLLM's own dispatch and compile."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import kernel_variants as kv
from kernel_variants.integrations import _vllm_ir as ir
from kernel_variants.ops.rms_norm import _spec

HAS_VLLM_IR = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("vllm.ir") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM_IR, reason="vLLM IR not installed (tools/vllm_cpu_e2e.sh runs these)")


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(6, 64, generator=gen).to(dtype) for _ in range(2))
    return x, r, (1 + torch.randn(64, generator=gen) * 0.1).to(dtype)


@pytest.fixture(autouse=True)
def coverage(monkeypatch):
    """The coverage table as register_provider() makes it (vLLM need not be installed)."""
    monkeypatch.setattr(ir, "COVERED", ir._coverage())


def test_supports_args_accepts_what_a_variant_covers_and_refuses_the_rest():
    x, r, w = _inputs(torch.bfloat16)
    assert ir.supports_rms_norm(x, w, 1e-6)
    assert ir.supports_rms_norm(x, w.float(), 1e-6, 32)  # GemmaRMSNorm's fp32 weight, a variance_size
    assert ir.supports_fused_add_rms_norm(x, r, None, 1e-6)
    assert not ir.supports_rms_norm(x.double(), w.double(), 1e-6)  # no float64 variant: vLLM's next provider
    assert not ir.supports_rms_norm(x, w.half(), 1e-6)  # a weight dtype the op refuses
    assert not ir.supports_rms_norm(x, w, 1e-6, 65)
    assert not ir.supports_fused_add_rms_norm(x, r[:1], w, 1e-6)


def test_supports_args_needs_a_variant_beyond_the_reference(monkeypatch):
    x, _r, w = _inputs()
    with monkeypatch.context() as m:
        m.setenv("KV_DISABLE_PLUGINS", "rms_aten,cpu_rms_norm,vllm_ir,triton_rms_norm,npu_rms_norm")
        kv.reload()
        m.setattr(ir, "COVERED", ir._coverage())
        assert not ir.supports_rms_norm(x, w, 1e-6)  # the reference alone: vLLM's own native is as good
    kv.reload()
    assert ir.supports_rms_norm(x, w, 1e-6)


def test_supports_args_traces_to_a_constant_under_dynamo():
    """vLLM asks while its torch.compile traces the model: the answer must trace, graph-free."""
    x, _r, w = _inputs()
    compiled = torch.compile(lambda x, w: x * 2 if ir.supports_rms_norm(x, w, 1e-6) else x, fullgraph=True,
                             backend="eager")
    assert torch.equal(compiled(x, w), x * 2)
    assert torch.equal(compiled(x.double(), w.double()), x.double())


def test_eager_calls_dispatch_and_the_add_form_writes_in_place():
    x, r, w = _inputs()
    torch.testing.assert_close(ir.rms_norm(x, w, 1e-6, 48), _spec.reference_fn(x, w, 1e-6, 48))
    expected = _spec.reference_add(x, r, w, 1e-6)
    xi, ri = x.clone(), r.clone()
    normed, residual = ir.fused_add_rms_norm(xi, ri, w, 1e-6)
    assert normed is xi and residual is ri
    torch.testing.assert_close(xi, expected[0])
    assert torch.equal(ri, expected[1])


def test_traced_with_fake_tensors_the_graph_holds_the_custom_ops():
    """vLLM's lowering pass traces the provider with its nodes' fake values: the result is this
    library's ops in the graph, dispatched when the graph runs, and nothing written."""
    x, r, w = _inputs()

    def both(x, r, w):
        normed, residual = ir.fused_add_rms_norm(x, r, w, 1e-6)
        return ir.rms_norm(normed, None, 1e-6, 16), residual

    graph = make_fx(both, tracing_mode="fake")(x, r, w)
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert {"kernel_variants.fused_add_rms_norm.default", "kernel_variants.rms_norm.default"} <= targets
    out = graph(x.clone(), r.clone(), w)
    expected = both(x.clone(), r.clone(), w)
    for a, b in zip(out, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_without_vllm_ir_nothing_is_registered():
    if HAS_VLLM_IR:
        pytest.skip("vLLM IR is installed here")
    assert ir.register_provider() == ()


@needs_vllm
def test_the_plugin_registers_the_provider_without_the_conv_patch(monkeypatch):
    import vllm.ir.ops as ops

    from kernel_variants.integrations import vllm as kv_vllm

    monkeypatch.delenv("KV_VLLM_PATCH", raising=False)
    assert kv_vllm.plugin() is None  # no conv patch
    assert kv_vllm.plugin() is None  # idempotent
    for name in ir.OPS:
        impl = getattr(ops, name).impls[ir.PROVIDER]
        assert impl.supported and impl.inplace == (name == "fused_add_rms_norm")


@needs_vllm
def test_vllm_dispatches_to_the_provider_and_falls_back_for_what_it_does_not_cover():
    import vllm.ir.ops as ops

    ir.register_provider()
    x, r, w = _inputs()
    native = ops.rms_norm.impls["native"].impl_fn
    with ops.rms_norm.set_priority([ir.PROVIDER, "native"]), \
            ops.fused_add_rms_norm.set_priority([ir.PROVIDER, "native"]):
        assert ops.rms_norm.dispatch(x, w, 1e-6).provider == ir.PROVIDER
        assert ops.rms_norm.dispatch(x.double(), None, 1e-6).provider == "native"
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), native(x, w, 1e-6))
        xi, ri = x.clone(), r.clone()
        normed, residual = ops.fused_add_rms_norm.maybe_inplace(xi, ri, w, 1e-6)
        assert normed is xi and residual is ri
        functional = ops.fused_add_rms_norm(x, r, w, 1e-6)  # the default overload writes nothing
        for got in ((normed, residual), functional):
            for a, b in zip(got, ops.fused_add_rms_norm.impls["native"].impl_fn(x, r, w, 1e-6), strict=True):
                torch.testing.assert_close(a, b)
        assert torch.equal(x, _inputs()[0])

        def block(x, r, w):
            a, b = ops.fused_add_rms_norm(x, r, w, 1e-6)
            return ops.rms_norm(a, None, 1e-6, 32), b

        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(x, r, w)
        for a, b in zip(compiled, block(x, r, w), strict=True):
            torch.testing.assert_close(a, b)
