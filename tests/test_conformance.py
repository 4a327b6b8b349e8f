"""Every registered, available variant against the reference. A new variant is tested here by
registering it: cases are drawn from what it declares, and a claimed case must run and match."""

from __future__ import annotations

import pytest
import torch

import kernel_variants
from kernel_variants.dispatch._verify import verify
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.ops.causal_conv1d._cases import make_case

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    return kernel_variants.dispatch.dispatcher().registry.get(op, vid)


def _spec(rv):
    return kernel_variants.dispatch.dispatcher().registry.spec(rv.op)


def _claimed_cases(rv, device):
    """Every case of the op's conformance list, in every dtype, that ``rv`` claims on ``device``."""
    spec, caps = _spec(rv), rv.variant.capabilities
    for label, options in spec.conformance(caps):
        for dname in sorted(caps.dtypes & DTYPES.keys()):
            case = spec.make_case(dtype=DTYPES[dname], device=device, **options)
            if caps.uncovered(spec.key_of_case(case)) is None:
                yield f"{label} {dname}", case


def assert_conforms(rv, device, keep=lambda label: True) -> int:
    """Run ``rv`` on every case it claims on ``device`` (those ``keep`` selects); returns how many."""
    failures, ran = [], 0
    for label, case in _claimed_cases(rv, device):
        if not keep(label):
            continue
        ran += 1
        why = verify(rv.variant.fn, case)
        if why is not None:
            failures.append(f"{label}: {why}")
    assert ran > 0, f"{rv.id} claims no case of the suite"
    assert not failures, f"{rv.id} failed {len(failures)} of {ran} cases on {device}:\n" + "\n".join(failures)
    return ran


def test_matches_reference_on_every_claimed_case(variant, device):
    if device not in variant.variant.capabilities.devices:
        pytest.skip(f"{variant.id} does not claim {device}")
    assert_conforms(variant, device)


def test_dispatched_call_writes_into_the_callers_view(variant, device):
    """Through the public op, pinned to this variant: the state lands in the caller's view."""
    caps = variant.variant.capabilities
    if device not in caps.devices or not getattr(caps, "noncontiguous_states", False):
        pytest.skip(f"{variant.id} does not claim non-contiguous states on {device}")
    width = min(caps.width[1] or 4, 4)
    case = make_case(variant.op, 2, 32, 3, width=width, noncontig=True, device=device, dtype=torch.float32).fresh()
    before = case.pool_base.clone()
    _, bases = case.run(_spec(variant).reference.fn)  # the reference, on a fresh copy
    expected_pool = next(iter(bases.values()))
    op = getattr(kernel_variants, variant.op)
    with kernel_variants.force(**{variant.op: variant.id}):
        op(*case.args, **case.kwargs)
    assert not torch.equal(before, case.pool_base), "the state update did not reach the caller's pool"
    assert torch.equal(case.pool_base, expected_pool), "the caller's pool differs from the reference's"


def test_the_suite_catches_a_variant_that_writes_into_a_copy():
    """The failure the SGLang adoption of causal_conv1d_update_v2 had: state written to a copy."""
    def into_copy(x, conv_state, *args, **kwargs):
        return reference.causal_conv1d_update(x, conv_state.contiguous(), *args, **kwargs)

    case = make_case("causal_conv1d_update", batch=2, dim=8, seqlen=1, noncontig=True)
    assert "state pool" in (verify(into_copy, case) or "")


def test_the_suite_catches_a_variant_that_reads_a_history_it_must_not():
    def always_initial(x, weight, bias=None, *, has_initial_state=None, **kwargs):
        return reference.causal_conv1d_fn(x, weight, bias, has_initial_state=torch.ones_like(has_initial_state), **kwargs)

    case = make_case("causal_conv1d_fn", batch=3, dim=8, seqlen=4, poison=True)
    assert "NaN" in (verify(always_initial, case) or "")
