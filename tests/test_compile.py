"""torch.compile: both ops trace to the kernel_variants custom ops, compile with fullgraph=True and
match eager, the in-place state update included, for a contiguous pool and a strided view."""

from __future__ import annotations

import pytest
import torch

import kernel_variants
from kernel_variants.dispatch import _custom_ops
from kernel_variants.dispatch._dispatcher import Dispatcher
from kernel_variants.ops.causal_conv1d._cases import make_case


def step(x, weight, bias, pool, idx, init, x_next):
    """A prefill then a decode step on the same pool, with ordinary torch around them."""
    y = kernel_variants.causal_conv1d_fn(x, weight, bias, conv_states=pool, cache_indices=idx,
                                         has_initial_state=init, activation="silu")
    z = kernel_variants.causal_conv1d_update(x_next * 2, pool, weight, bias, activation="silu",
                                             conv_state_indices=idx)
    return y.sum(dim=1), torch.tanh(z)


def _inputs(case):
    x, weight, bias = case.args
    kw = case.kwargs
    x_next = torch.randn(x.shape[0], x.shape[-1], generator=torch.Generator().manual_seed(1))
    return x, weight, bias, kw["conv_states"], kw["cache_indices"], kw["has_initial_state"], x_next


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_model_using_both_ops_compiles_fullgraph_and_matches_eager():
    compiled = torch.compile(step, fullgraph=True)
    for noncontig in (False, True):
        case = make_case("causal_conv1d_fn", batch=3, dim=16, seqlen=5, noncontig=noncontig, pad=True)
        eager, traced = case.fresh(), case.fresh()
        expected = step(*_inputs(eager))
        got = compiled(*_inputs(traced))
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e)  # inductor may sum in another order
        assert torch.equal(traced.pool_base, eager.pool_base), f"state differs (noncontig={noncontig})"
        assert not torch.equal(traced.pool_base, case.pool_base), "the state update was dropped"


def test_the_graph_holds_the_custom_ops_and_tracing_decides_nothing(monkeypatch):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    decisions = []
    real = Dispatcher.decide

    def counting(self, key, forced=None):
        decisions.append(key.op)
        return real(self, key, forced)

    monkeypatch.setattr(Dispatcher, "decide", counting)
    case = make_case("causal_conv1d_fn", batch=2, dim=8, seqlen=4)
    torch.compile(step, fullgraph=True, backend=backend)(*_inputs(case.fresh()))
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {"kernel_variants.causal_conv1d_fn.default", "kernel_variants.causal_conv1d_update.default"} <= targets
    # Once per op when the graph ran, none while tracing (fake tensors never reach a decision).
    assert sorted(decisions) == ["causal_conv1d_fn", "causal_conv1d_update"]


def test_eager_calls_never_go_through_the_custom_op(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("eager call routed through the custom op")

    monkeypatch.setattr(_custom_ops, "OPS", {"causal_conv1d_fn": refuse, "causal_conv1d_update": refuse})
    case = make_case("causal_conv1d_fn", batch=2, dim=8, seqlen=4)
    step(*_inputs(case.fresh()))


def test_the_custom_ops_are_well_formed():
    case = make_case("causal_conv1d_fn", batch=2, dim=8, seqlen=3).fresh()
    x, weight, bias, pool, idx, init, x_next = _inputs(case)
    torch.library.opcheck(torch.ops.kernel_variants.causal_conv1d_fn.default,
                          (x, weight, bias, pool, idx, init, None, "silu", -1),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.kernel_variants.causal_conv1d_update.default,
                          (x_next, pool, weight, bias, None, idx, None, -1),
                          test_utils=("test_schema", "test_faketensor"))
