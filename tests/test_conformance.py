"""Every registered, available variant against the reference. A new variant is tested here by
registering it: cases are drawn from what it declares, and a claimed case must run and match."""

from __future__ import annotations

import pytest
import torch
from helpers.conformance import DTYPES, assert_conforms, spec_of

import kernel_variants
from kernel_variants._tolerances import mismatch
from kernel_variants._tuning.verify import verify
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.ops.causal_conv1d._cases import make_case


def pytest_generate_tests(metafunc):
    if "entry" not in metafunc.fixturenames:
        return
    params = []
    for rv in kernel_variants.variants():
        marks = []
        why = rv.unavailable_reason()
        if why is not None:
            marks.append(pytest.mark.skip(reason=f"{rv.id} unavailable here: {why}"))
        params.append(pytest.param((rv.op, rv.id), id=f"{rv.op}:{rv.id}", marks=marks))
    metafunc.parametrize("entry", params)


@pytest.fixture
def variant(entry):
    op, vid = entry
    return kernel_variants._runtime.dispatcher.dispatcher().registry.get(op, vid)


def test_matches_reference_on_every_claimed_case(variant, device):
    if device not in variant.variant.capabilities.devices:
        pytest.skip(f"{variant.id} does not claim {device}")
    assert_conforms(variant, device)


def test_dispatched_call_writes_into_the_callers_view(variant, device):
    """Through the public op, pinned to this variant: the state lands in the caller's view (the
    op's first conformance case whose pool is a view with gaps and whose call writes it)."""
    caps = variant.variant.capabilities
    if device not in caps.devices or not getattr(caps, "noncontiguous_states", False):
        pytest.skip(f"{variant.id} does not claim non-contiguous states on {device}")
    spec = spec_of(variant)
    dtype = "float32" if "float32" in caps.dtypes else sorted(caps.dtypes & DTYPES.keys())[0]
    cases = (spec.make_case(**{**options, "shape": shape, "poison": False}, device=device,
                            dtype=DTYPES[dtype])
             for _, options in spec.conformance(caps) if options.get("noncontig")
             for shape in [caps.fit(spec.axes, options["shape"])] if shape is not None)
    for case in (c.fresh() for c in cases if caps.uncovered(spec.key_of_case(c)) is None):
        before = case.pool_base.clone()
        _, bases = case.run(spec.reference.fn)  # the reference, on a fresh copy
        expected_pool = next(iter(bases.values()))
        if not torch.equal(before, expected_pool):  # a case whose call writes the pool (W > 1)
            break
    op = getattr(kernel_variants, variant.op)
    with kernel_variants.force(**{variant.op: variant.id}):
        op(*case.args, **case.kwargs)
    assert not torch.equal(before, case.pool_base), "the state update did not reach the caller's pool"
    if spec.written_within_tolerance:  # a computed state: within the dtype's tolerance
        assert mismatch(case.pool_base, expected_pool, "the caller's pool") is None
    else:
        assert torch.equal(case.pool_base, expected_pool), "the caller's pool differs from the reference's"


def test_the_suite_catches_a_variant_that_writes_into_a_copy():
    """The failure the SGLang adoption of causal_conv1d_update_v2 had: state written to a copy."""
    def into_copy(x, conv_state, *args, **kwargs):
        return reference.causal_conv1d_update(x, conv_state.contiguous(), *args, **kwargs)

    case = make_case("causal_conv1d_update", batch=2, dim=8, seqlen=1, noncontig=True)
    assert "conv_state:" in (verify(into_copy, case) or "")


def test_the_suite_catches_a_variant_that_reads_a_history_it_must_not():
    def always_initial(x, weight, bias=None, *, has_initial_state=None, **kwargs):
        return reference.causal_conv1d_fn(x, weight, bias, has_initial_state=torch.ones_like(has_initial_state), **kwargs)

    case = make_case("causal_conv1d_fn", batch=3, dim=8, seqlen=4, poison=True)
    assert "NaN" in (verify(always_initial, case) or "")


def _outs_like(spec, full, make):
    """One out tensor per output, each ``make(like)`` (like: the parameter the results are shaped after)."""
    like = full[spec.out_like_index]
    outs = tuple(make(like) for _ in spec.outputs)
    return outs, (outs[0] if len(outs) == 1 else outs)


def _strided(like):
    """A non-contiguous tensor of ``like``'s shape: every other element of a wider buffer."""
    wide = torch.full((*like.shape[:-1], 2 * like.shape[-1]) if like.ndim else (2,), float("nan"),
                      dtype=like.dtype, device=like.device)
    return wide[..., ::2]


def _returned(got, outs):
    got = got if isinstance(got, tuple) else (got,)
    return len(got) == len(outs) and all(g is o for g, o in zip(got, outs, strict=True))


def _in_place_args(spec, full):
    """The call with each aliasable input replaced by a dense copy, and out = those copies; None
    when the op lets no output alias an input."""
    if not spec.out_aliases:
        return None
    args = list(full)
    outs = []
    for i in spec.out_alias_indices:
        if i is None:
            return None
        args[i] = args[i].clone(memory_format=torch.contiguous_format)
        outs.append(args[i])
    return tuple(args), tuple(outs)


def _variant_with_out(rv, in_place):
    """``rv``'s fn called as the dispatcher calls a variant that takes ``out``: a dense out, or
    (in place) out being exactly the inputs the op lets it alias. Fails unless ``out`` comes back."""
    spec = spec_of(rv)

    def run(*args, **kwargs):
        full = spec.bind(*args, **kwargs)
        if in_place:
            full, outs = _in_place_args(spec, full)
        else:
            outs, _ = _outs_like(spec, full, lambda t: torch.full_like(t, float("nan"),
                                                                       memory_format=torch.contiguous_format))
        versions = [o._version for o in outs]
        got = spec.invoke_out(rv.variant.fn, full, outs[0] if len(outs) == 1 else outs)
        assert _returned(got, outs), f"{rv.id} did not return the out tensors it was given"
        # As torch's in-place ops do: a graph that saved out must fail at backward, not use new values.
        assert all(o._version > v for o, v in zip(outs, versions, strict=True)), \
            f"{rv.id} wrote out without bumping its version counter (mark it written for autograd)"
        return got

    return run


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "out=input"])
def test_variant_writes_into_out_as_it_claims(variant, device, in_place):
    """A variant that declares ``takes_out`` (and ``in_place``) is handed ``out`` by the
    dispatcher: on every case it claims, writing there must match the reference."""
    caps, spec = variant.variant.capabilities, spec_of(variant)
    if device not in caps.devices or not (caps.in_place if in_place else caps.takes_out):
        pytest.skip(f"{variant.id} does not claim {'in_place' if in_place else 'takes_out'} on {device}")
    if in_place and not spec.out_aliases:
        pytest.skip(f"{spec.name} lets no output alias an input")
    assert_conforms(variant, device, fn=_variant_with_out(variant, in_place))


@pytest.mark.parametrize("form", ["dense", "strided", "in_place"])
def test_dispatched_call_with_out_matches_reference(variant, device, form):
    """Through the public op, pinned to this variant, every variant honours ``out=`` (written
    directly by one that takes it, copied for the rest): a dense out, a strided one, and out being
    exactly the input the op lets it alias."""
    caps, spec = variant.variant.capabilities, spec_of(variant)
    if device not in caps.devices:
        pytest.skip(f"{variant.id} does not claim {device}")
    if form == "in_place" and not spec.out_aliases:
        pytest.skip(f"{spec.name} lets no output alias an input")
    op = getattr(kernel_variants, variant.op)

    def run(*args, **kwargs):
        full = spec.bind(*args, **kwargs)
        if form == "in_place":
            full, outs = _in_place_args(spec, full)
        else:
            make = _strided if form == "strided" else (lambda t: torch.full_like(t, float("nan")))
            outs, _ = _outs_like(spec, full, make)
        kw = {n: full[i] for i, n in enumerate(spec.params) if n not in spec.positional}
        with kernel_variants.force(**{variant.op: variant.id}):
            got = op(*full[:len(spec.positional)], **kw, out=outs[0] if len(outs) == 1 else outs)
        assert _returned(got, outs), "the op did not return out"
        return got

    assert_conforms(variant, device, fn=run, layout=False)  # the result is the caller's out, strided or not
