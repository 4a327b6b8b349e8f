"""Autograd: a call whose inputs require grad goes only to variants that declare ``autograd``
(their gradients checked when they qualify), never to one that would hand back a detached output (the
caller's backward would silently miss a gradient); state pools never join the graph; an inference-mode pool is refused
outside inference mode whichever variant would run."""

from __future__ import annotations

import pytest
import torch

import kernel_variants as kv
from kernel_variants._runtime.dispatcher import dispatcher

OPS = ("causal_conv1d_fn", "causal_conv1d_update", "gemma_rms_norm", "add_gemma_rms_norm", "gated_rms_norm")


def _case(op: str, dtype: torch.dtype):
    spec = dispatcher().registry.spec(op)
    shape = (2, 6) if len(spec.axes) == 2 else (2, 3, 4)
    options = {} if len(spec.axes) == 2 else {"width": 3}
    return spec, spec.make_case(shape, dtype=dtype, device="cpu", **options)


def _differentiable(spec, case):
    """The call's floating tensors the op does not write: what gradients flow to."""
    args = [case.get(n) for n in spec.params]
    return [n for n, a in zip(spec.params, args, strict=True)
            if isinstance(a, torch.Tensor) and a.is_floating_point() and n not in spec.mutates]


def _call(fn, spec, case, names, values):
    """fn on a fresh copy of the case, with ``values`` in place of the arguments ``names``."""
    c = case.fresh()
    args = [c.get(n) for n in spec.params]
    for n, v in zip(names, values, strict=True):
        args[spec.params.index(n)] = v
    out = spec.invoke(fn, args)
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("op", OPS)
def test_the_references_gradients_pass_gradcheck_in_fp64(op):
    spec, case = _case(op, torch.float64)
    names = _differentiable(spec, case)
    inputs = [case.get(n).detach().clone().requires_grad_() for n in names]
    fn = spec.reference.fn
    assert torch.autograd.gradcheck(lambda *v: _call(fn, spec, case, names, v), inputs)


def _claiming():
    for op in OPS:
        for rv in kv.variants(op):
            if rv.variant.capabilities.autograd and rv.id != "reference" and rv.unavailable_reason() is None:
                yield pytest.param(op, rv.id, id=f"{op}:{rv.id}")


@pytest.mark.parametrize(("op", "vid"), list(_claiming()))
def test_every_variant_claiming_autograd_has_the_references_gradients(op, vid):
    """The qualification's gradient check (which runs on every edge case of a class), here on a
    call with every input requiring grad, and on a wrong backward: it must see the difference."""
    from kernel_variants._tuning.cases import gradient_problem

    _, case = _case(op, torch.float32)
    fn = dispatcher().registry.get(op, vid).variant.fn
    assert gradient_problem(fn, case) is None

    def doubled(*args, **kwargs):
        out = fn(*args, **kwargs)
        return tuple(o * 2 - o.detach() for o in out) if isinstance(out, tuple) else out * 2 - out.detach()

    assert "d/d" in (gradient_problem(doubled, case) or "")


def test_a_call_that_needs_grad_never_gets_a_detached_output():
    x = torch.randn(2, 5, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)
    pool = torch.zeros(3, 3, 16)
    decision = kv.explain("causal_conv1d_fn", x, w, conv_states=pool)
    assert decision.chosen.variant.capabilities.autograd
    assert "no autograd support" in {r.variant: r.reason for r in decision.trace}["cpu_native"]
    y = kv.causal_conv1d_fn(x, w, conv_states=pool)
    assert y.grad_fn is not None and not pool.requires_grad, "the pool joined the graph"
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    with torch.no_grad():
        assert kv.explain("causal_conv1d_fn", x, w, conv_states=pool).chosen.id == "cpu_native"
    h = torch.randn(4, 64, requires_grad=True)
    out = kv.gemma_rms_norm(h, torch.zeros(64))
    assert out.grad_fn is not None


def test_an_inference_pool_is_refused_outside_inference_mode_by_every_variant():
    with torch.inference_mode():
        pool = torch.zeros(4, 3, 16)
    x, w = torch.randn(2, 16), torch.randn(16, 4)
    runnable = [rv for rv in kv.variants("causal_conv1d_update")
                if rv.unavailable_reason() is None and "cpu" in rv.variant.capabilities.devices]
    assert len(runnable) >= 2, [rv.id for rv in runnable]  # the reference and at least one other
    for rv in runnable:
        with kv.force(causal_conv1d_update=rv.id), pytest.raises(ValueError, match="conv_state: an inference tensor"):
            kv.causal_conv1d_update(x, pool, w)
    with torch.inference_mode():
        kv.causal_conv1d_update(x, pool, w)  # inside inference mode it is fine


def test_aliased_memory_is_refused_before_anything_is_written():
    """x a view of the pool the call writes: the write must not corrupt what autograd saved."""
    pool = torch.randn(4, 3, 16)
    before = pool.clone()
    w = torch.randn(16, 4)
    runnable = [rv for rv in kv.variants("causal_conv1d_fn")
                if rv.unavailable_reason() is None and "cpu" in rv.variant.capabilities.devices]
    assert len(runnable) >= 2, [rv.id for rv in runnable]  # the reference and at least one other
    for rv in runnable:
        with kv.force(causal_conv1d_fn=rv.id):
            with pytest.raises(ValueError, match="x: expected memory apart from conv_states"):
                kv.causal_conv1d_fn(pool[0:2], w, conv_states=pool,
                                    cache_indices=torch.tensor([3, 0], dtype=torch.int32))
            with pytest.raises(ValueError, match="x: expected memory apart from conv_state"):
                kv.causal_conv1d_update(pool[1], pool, w, conv_state_indices=torch.tensor([1, 2, 3], dtype=torch.int32))
    assert torch.equal(pool, before)
    other = torch.randn(8, 3, 16)
    kv.causal_conv1d_fn(other[4:6], w, conv_states=other[:4])  # same allocation, apart: fine


@pytest.mark.parametrize("op", ["causal_conv1d_fn", "causal_conv1d_update"])
def test_a_call_of_pads_only_that_needs_grad_still_gets_an_attached_output(op):
    """Every sequence a pad: nothing is computed from the inputs, yet the output must be in the
    graph (a detached one makes the caller's backward raise), with zero gradients, NaN in a
    pad's tokens notwithstanding."""
    x = torch.randn(2, 3, 16) if op == "causal_conv1d_fn" else torch.randn(2, 16)
    x[0, 0] = float("nan")
    x.requires_grad_()
    w = torch.randn(16, 4, requires_grad=True)
    pool = torch.zeros(4, 3, 16)
    pads = torch.tensor([-1, -1], dtype=torch.int32)
    claiming = [rv.id for rv in kv.variants(op) if rv.variant.capabilities.autograd and rv.unavailable_reason() is None]
    assert "reference" in claiming and len(claiming) >= 2, claiming
    for vid in claiming:
        x.grad = w.grad = None
        with kv.force(**{op: vid}):
            if op == "causal_conv1d_fn":
                y = kv.causal_conv1d_fn(x, w, conv_states=pool, cache_indices=pads, activation="silu")
            else:
                y = kv.causal_conv1d_update(x, pool, w, activation="silu", conv_state_indices=pads)
        assert y.grad_fn is not None and torch.equal(y, torch.zeros_like(y)), vid
        y.sum().backward()
        assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(x.grad, torch.zeros_like(x)), vid
