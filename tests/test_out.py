"""``out=`` on every op, and ``kv.bind``: the result lands in ``out`` and ``out`` comes back;
a wrong ``out`` or a partial overlap is an error naming ``out`` before anything is written;
exactly the input the spec allows is in place; a variant that does not take ``out`` gets the
copy; the write guard's per-signature plan agrees with the full check; torch.compile honours
``out``; a bound op runs the chosen variant and stays fixed."""

from __future__ import annotations

import pytest
import torch
from helpers.calibration import quick

import kernel_variants as kv
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._runtime.guards import guard_writes
from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.ops.causal_conv1d import _reference as conv_reference
from kernel_variants.plugin import Capabilities, Variant

B, D, W, N = 3, 16, 4, 6


def _update_call():
    g = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(B, D, generator=g), conv_state=torch.randn(N, W - 1, D, generator=g),
                weight=torch.randn(D, W, generator=g), bias=torch.randn(D, generator=g), activation="silu",
                conv_state_indices=torch.tensor([4, 0, 2], dtype=torch.int32))


def _fn_call():
    g = torch.Generator().manual_seed(1)
    return dict(x=torch.randn(B, 5, D, generator=g), weight=torch.randn(D, W, generator=g),
                conv_states=torch.randn(N, W - 1, D, generator=g), cache_indices=torch.tensor([1, 5, 3], dtype=torch.int32),
                has_initial_state=torch.tensor([True, False, True]), activation="silu")


def _expected(op, call):
    fresh = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    with kv.force(**{op.__name__: "reference"}):
        return op(**fresh), fresh


@pytest.mark.parametrize("vid", ["reference", "aten", "torch_shift"])
def test_update_in_place_over_x_matches_a_fresh_output(vid):
    call = _update_call()
    want, want_call = _expected(kv.causal_conv1d_update, call)
    x = call["x"]
    with kv.force(causal_conv1d_update=vid):
        got = kv.causal_conv1d_update(**call, out=x)
    assert got is x
    torch.testing.assert_close(x, want)
    assert torch.equal(call["conv_state"], want_call["conv_state"])


@pytest.mark.parametrize("bad, exc, match", [
    (lambda x: torch.empty(B + 1, D), ValueError, r"out: expected shape \[3, 16\] \(the result's\), got \[4, 16\]"),
    (lambda x: torch.empty(B, D, dtype=torch.float64), TypeError, "out: expected dtype float32 .* got float64"),
    (lambda x: "a tensor", TypeError, "out: expected a tensor, got str"),
    (lambda x: torch.empty(1, D).expand(B, D), ValueError, "out: expected a tensor whose elements are apart"),
    (lambda x: torch.empty(B, D, requires_grad=True), ValueError,
     "out: expected a tensor that does not require grad"),
])
def test_a_wrong_out_is_refused_before_the_state_is_written(bad, exc, match):
    call = _update_call()
    pool = call["conv_state"].clone()
    with pytest.raises(exc, match=match):
        kv.causal_conv1d_update(**call, out=bad(call["x"]))
    assert torch.equal(call["conv_state"], pool), "the state was written before the error"


def test_out_overlapping_an_input_or_the_state_is_refused():
    call = _fn_call()
    pool = call["conv_states"].clone()
    buf = torch.empty(2 * call["x"].numel() + D)
    overlap_x = call["x"].view(-1)
    with pytest.raises(ValueError, match="out: expected memory apart from x"):  # fn allows no alias at all
        kv.causal_conv1d_fn(**call, out=call["x"])
    partial = buf[D:D + call["x"].numel()].view(call["x"].shape)
    call2 = {**call, "x": buf[:call["x"].numel()].view(call["x"].shape).copy_(overlap_x.view(call["x"].shape))}
    with pytest.raises(ValueError, match="out: expected memory apart from x"):
        kv.causal_conv1d_fn(**call2, out=partial)
    states = torch.empty(N * (W - 1) * D + B * 5 * D)
    call3 = {**call, "conv_states": states[:N * (W - 1) * D].view(N, W - 1, D).copy_(pool)}
    with pytest.raises(ValueError, match="out: expected memory apart from conv_states"):
        kv.causal_conv1d_fn(**call3, out=states[-B * 5 * D - 1:-1].view(B, 5, D))
    assert torch.equal(call["conv_states"], pool) and torch.equal(call3["conv_states"], pool)


def test_a_partial_overlap_with_the_aliasable_input_is_refused():
    call = _update_call()
    buf = torch.randn(B * D + 1)
    call["x"] = buf[:B * D].view(B, D)
    with pytest.raises(ValueError, match=r"out: expected exactly \(in place\) or memory apart from x"):
        kv.causal_conv1d_update(**call, out=buf[1:].view(B, D))


def test_add_rms_norm_out_pair_in_place_as_sglang_runs_it():
    g = torch.Generator().manual_seed(2)
    x, res, w = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g), torch.randn(32, generator=g) * 0.1
    want_norm, want_sum = kv.add_gemma_rms_norm(x, w, res)
    got = kv.add_gemma_rms_norm(x, w, res, out=(x, res))
    assert got[0] is x and got[1] is res
    torch.testing.assert_close(x, want_norm)
    assert torch.equal(res, want_sum)
    with pytest.raises(TypeError, match=r"out: expected a tuple of 2 tensors \(out, residual_sum\), got Tensor"):
        kv.add_gemma_rms_norm(x, w, res, out=x)
    o = torch.empty(5, 32)
    with pytest.raises(ValueError, match=r"out\[1\]: expected memory apart from out\[0\]"):
        kv.add_gemma_rms_norm(x, w, res, out=(o, o))
    with pytest.raises(ValueError, match=r"out\[0\]: expected memory apart from residual"):
        kv.add_gemma_rms_norm(x, w, res, out=(res, x))


def _counting(op, caps, calls):
    def fn(*args, out=None, **kwargs):
        calls.append(out)
        result = conv_reference.causal_conv1d_update(*args, **kwargs)
        if out is None:
            return result
        return out.copy_(result)

    return Variant(id="probe", op=op, version="1", fn=fn, capabilities=caps, priority=1000)


@pytest.mark.parametrize("takes_out, in_place", [(False, False), (True, False), (True, True)])
def test_out_reaches_a_variant_only_as_it_declares(with_variants, takes_out, in_place):
    """takes_out: handed a dense out (not a strided one); in_place: also out being x. Otherwise
    the variant runs without out and the dispatcher copies. The result is the same each way."""
    calls: list = []
    caps = ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, takes_out=takes_out, in_place=in_place)
    with_variants(_counting("causal_conv1d_update", caps, calls))
    call = _update_call()
    want, _ = _expected(kv.causal_conv1d_update, call)
    dense, strided = torch.empty(B, D), torch.empty(B, 2 * D)[:, ::2]
    for out in (dense, strided, call["x"]):
        calls.clear()
        assert kv.causal_conv1d_update(**{**call, "conv_state": call["conv_state"].clone()}, out=out) is out
        torch.testing.assert_close(out, want)
        handed = takes_out and out is not strided and (in_place or out is not call["x"])
        assert calls == [out if handed else None], f"out={'x' if out is call['x'] else 'other'}"
    assert dispatcher().memo, "out= calls are memoised too"


def test_out_and_plain_calls_share_no_memo_entry():
    call = _update_call()
    plain = kv.causal_conv1d_update(**{**call, "conv_state": call["conv_state"].clone()})
    out = torch.empty(B, D)
    assert kv.causal_conv1d_update(**{**call, "conv_state": call["conv_state"].clone()}, out=out) is out
    again = kv.causal_conv1d_update(**{**call, "conv_state": call["conv_state"].clone()})
    assert again is not out and torch.equal(again, plain) and torch.equal(out, plain)


def test_the_planned_write_guard_catches_what_the_full_one_does():
    """The memoised call checks overlap from data pointers and spans worked out once per
    signature: a repeat call whose x now overlaps the pool (same metadata) is still refused."""
    call = _update_call()
    kv.causal_conv1d_update(**call)  # memoised
    buf = torch.randn(N * (W - 1) * D)
    pool = buf.view(N, W - 1, D)
    for x in (buf[:B * D].view(B, D), buf[-B * D:].view(B, D), buf[5:5 + B * D].view(B, D)):
        with pytest.raises(ValueError, match="x: expected memory apart from conv_state"):
            kv.causal_conv1d_update(**{**call, "x": x, "conv_state": pool})
        with pytest.raises(ValueError, match="x: expected memory apart from conv_state"):
            guard_writes(dispatcher().registry.spec("causal_conv1d_update"),
                         (x, pool, call["weight"], call["bias"], "silu", call["conv_state_indices"], None, -1))
    buf = torch.randn(B * D + N * (W - 1) * D)  # x starting before the pool, in its allocation
    for start, overlaps in ((B * D - 1, True), (B * D, False)):
        pool = buf[start:start + N * (W - 1) * D].view(N, W - 1, D)
        x = buf[:B * D].view(B, D)
        if overlaps:
            with pytest.raises(ValueError, match="x: expected memory apart from conv_state"):
                kv.causal_conv1d_update(**{**call, "x": x, "conv_state": pool})
        else:
            kv.causal_conv1d_update(**{**call, "x": x, "conv_state": pool})
    before = torch.randn(2 * B * D)  # x lying just before and just after the pool: no overlap
    kv.causal_conv1d_update(**{**call, "x": before[:B * D].view(B, D)})


def test_an_inference_out_is_refused_outside_inference_mode():
    with torch.inference_mode():
        out = torch.empty(4, 8)
    with pytest.raises(ValueError, match="out: an inference tensor"):
        kv.gemma_rms_norm(torch.randn(4, 8), torch.zeros(8), out=out)


def test_explain_checks_out_without_writing():
    x, w = torch.randn(4, 8), torch.zeros(8)
    out = torch.full((4, 8), 7.0)
    assert kv.explain("gemma_rms_norm", x, w, out=out).chosen is not None
    assert torch.equal(out, torch.full((4, 8), 7.0))
    with pytest.raises(ValueError, match="out: expected shape"):
        kv.explain("gemma_rms_norm", x, w, out=torch.empty(2, 8))


def test_compiled_calls_honour_out():
    torch._dynamo.reset()
    call = _update_call()
    want, want_call = _expected(kv.causal_conv1d_update, call)
    g = torch.Generator().manual_seed(3)
    x, res, w = torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g), torch.randn(32, generator=g) * 0.1
    want_norm, want_sum = kv.add_gemma_rms_norm(x, w, res)

    @torch.compile(fullgraph=True)
    def step(c, x, res, out):
        y = kv.causal_conv1d_update(c["x"], c["conv_state"], c["weight"], c["bias"], activation="silu",
                                    conv_state_indices=c["conv_state_indices"], out=c["x"])
        n = kv.add_gemma_rms_norm(x, w, res, out=(x, res))
        r = kv.gemma_rms_norm(x, w, out=out)
        return y, n, r

    out = torch.empty(4, 32)
    with torch.no_grad():
        y, n, r = step(call, x, res, out)
    torch._dynamo.reset()
    assert y is call["x"] and n[0] is x and n[1] is res and r is out
    torch.testing.assert_close(call["x"], want)
    assert torch.equal(call["conv_state"], want_call["conv_state"])
    torch.testing.assert_close(res, want_sum)
    torch.testing.assert_close(out, kv.gemma_rms_norm(want_norm, w))


def test_bind_runs_the_chosen_variant_and_stays_fixed(with_variants):
    calls: list = []
    caps = ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, takes_out=True)
    with_variants(_counting("causal_conv1d_update", caps, calls))
    call = _update_call()
    pristine = call["conv_state"].clone()
    run = kv.bind(kv.causal_conv1d_update, **call)
    assert run.variant == "probe" and run.op == "causal_conv1d_update"
    want, _ = _expected(kv.causal_conv1d_update, call)

    def fresh():
        return {**call, "conv_state": pristine.clone()}

    torch.testing.assert_close(run(**fresh()), want)
    with kv.force(causal_conv1d_update="reference"):  # fixed: a pin after bind changes nothing
        run(**fresh())
    assert len(calls) == 2
    out = torch.empty(B, D)
    assert run(**fresh(), out=out) is out and calls[-1] is out
    torch.testing.assert_close(out, want)
    with pytest.raises(ValueError, match=r"activation: a bound op runs with the example's values"):
        run(**{**call, "activation": None})
    bad = {**call, "conv_state_indices": torch.tensor([4, 0, 9], dtype=torch.int32)}  # values checked each call
    pool = call["conv_state"].clone()
    with pytest.raises(ValueError, match="conv_state_indices"):
        run(**bad)
    assert torch.equal(call["conv_state"], pool)
    with pytest.raises(ValueError, match="out: expected shape"):
        run(**call, out=torch.empty(B + 1, D))


def test_bind_validates_the_example_like_the_op():
    with pytest.raises(ValueError, match="weight"):
        kv.bind("gemma_rms_norm", torch.randn(4, 8), torch.zeros(9))
    with pytest.raises(ValueError, match="op"):
        kv.bind("no_such_op", torch.randn(4, 8))
    with pytest.raises(TypeError, match="op: expected an op name or an op function, got int"):
        kv.bind(3, torch.randn(4, 8))
    x, w = torch.randn(4, 8), torch.randn(8) * 0.1
    run = kv.bind(kv.gemma_rms_norm, x, w)
    assert torch.equal(run(x, w), kv.gemma_rms_norm(x, w))


def test_capabilities_in_place_needs_takes_out():
    with pytest.raises(ValueError, match="in_place is set but takes_out is False"):
        Capabilities(devices={"cpu"}, dtypes={"float32"}, in_place=True)


def test_calibration_can_time_the_out_path(with_variants):
    """with_out: a variant that takes out is timed writing there, the others with the copy."""
    calls: list = []
    caps = ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, takes_out=True)
    with_variants(_counting("causal_conv1d_update", caps, calls))
    result = kv.calibrate("causal_conv1d_update", [(2, 32, 1)], variants=["probe", "reference"],
                          prune=None, **quick(with_out=True))
    timed = {m.variant: m for m in result.measurements if m.status == "ok"}
    assert set(timed) == {"probe", "reference"}
    assert all("out=" in m.method for m in timed.values())
    handed = [o for o in calls if o is not None]
    assert handed and all(o.shape == (2, 32) and o.is_contiguous() for o in handed), "probe was not timed with out"


def test_an_out_that_requires_grad_is_refused_on_a_memoised_signature_too():
    call = _update_call()
    kv.causal_conv1d_update(**call, out=torch.empty(B, D))  # memoises the signature with this out
    with pytest.raises(ValueError, match="out: expected a tensor that does not require grad"):
        kv.causal_conv1d_update(**call, out=torch.empty(B, D, requires_grad=True))
    with torch.no_grad():  # nothing is recorded under no_grad: allowed
        out = torch.empty(B, D, requires_grad=True)
        assert kv.causal_conv1d_update(**call, out=out) is out
    # ... and memoised there: the same out under grad mode again is still refused.
    with pytest.raises(ValueError, match="out: expected a tensor that does not require grad"):
        kv.causal_conv1d_update(**call, out=out)
    run = kv.bind(kv.causal_conv1d_update, **call)
    with pytest.raises(ValueError, match="out: expected a tensor that does not require grad"):
        run(**call, out=torch.empty(B, D, requires_grad=True))


def test_a_bound_call_of_another_batch_size_is_refused_before_anything_runs():
    """The bound variant was chosen (and its index checks set up) for the example's sizes: a call
    with more sequences is a ValueError naming the tensor, and nothing is written."""
    g = torch.Generator().manual_seed(2)
    one = dict(x=torch.randn(1, D, generator=g), conv_state=torch.randn(N, W - 1, D, generator=g),
               weight=torch.randn(D, W, generator=g), conv_state_indices=torch.tensor([2], dtype=torch.int32))
    run = kv.bind(kv.causal_conv1d_update, **one)
    two = {**one, "x": torch.randn(2, D, generator=g), "conv_state_indices": torch.tensor([0, 1], dtype=torch.int32)}
    before = one["conv_state"].clone()
    with pytest.raises(ValueError, match=r"x: a bound op runs on tensors like its example's.*expected a \[1, 16\] "
                                         r"float32 tensor on cpu, got a \[2, 16\]"):
        run(**two)
    assert torch.equal(one["conv_state"], before)
    with pytest.raises(ValueError, match=r"conv_state_indices: expected slot indices in \[0, 6\).* got 6 at position 0"):
        run(**{**one, "conv_state_indices": torch.tensor([6], dtype=torch.int32)})
