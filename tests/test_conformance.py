"""Every registered, available variant against the reference. A new variant is tested here by
registering it: cases are drawn from what it declares, and a claimed case must run and match."""

from __future__ import annotations

import pytest
import torch

import kernel_variants
from kernel_variants._cases import make_case
from kernel_variants.variants import reference
from kernel_variants.dispatch import uncovered
from kernel_variants.dispatch._verify import verify
from kernel_variants.ops import call_key

FN_CASES = {
    "L=1": dict(batch=3, dim=64, seqlen=1),
    "L<W-1": dict(batch=3, dim=33, seqlen=2, poison=True),
    "odd-D": dict(batch=2, dim=37, seqlen=9, poison=True),
    "B=1-long": dict(batch=1, dim=130, seqlen=67),
    "no-states": dict(batch=2, dim=40, seqlen=7, states=False),
    "no-bias-no-act": dict(batch=2, dim=24, seqlen=6, bias=False, activation=None),
    "pad": dict(batch=4, dim=48, seqlen=5, pad=True, poison=True),
    "noncontig": dict(batch=3, dim=32, seqlen=6, noncontig=True, poison=True),
    "extra-rows": dict(batch=2, dim=16, seqlen=3, extra_rows=3, poison=True),
    "varlen": dict(batch=5, dim=40, seqlen=4, varlen=True, poison=True),
    "varlen-pad-noncontig": dict(batch=4, dim=24, seqlen=3, varlen=True, pad=True, noncontig=True, poison=True),
    "slot-b": dict(batch=3, dim=40, seqlen=5, slot_indices=False, poison=True),
    "no-initial-flags": dict(batch=3, dim=40, seqlen=5, initial_flags=False, poison=True),
    "strided-inputs": dict(batch=2, dim=48, seqlen=6, strided=True, noncontig=True, poison=True),
    "varlen-strided": dict(batch=3, dim=24, seqlen=4, varlen=True, strided=True, poison=True),
}
UPDATE_CASES = {
    "2d": dict(batch=3, dim=64, seqlen=1),
    "L=4": dict(batch=2, dim=37, seqlen=4),
    "B=1": dict(batch=1, dim=130, seqlen=1),
    "extra-rows": dict(batch=2, dim=24, seqlen=2, extra_rows=2),
    "pad": dict(batch=4, dim=32, seqlen=1, pad=True, poison=True),
    "noncontig": dict(batch=3, dim=40, seqlen=2, noncontig=True),
    "no-bias-no-act": dict(batch=2, dim=24, seqlen=1, bias=False, activation=None),
    "spec": dict(batch=3, dim=40, seqlen=4, spec=True, poison=True),
    "spec-pad-noncontig": dict(batch=4, dim=24, seqlen=3, spec=True, pad=True, noncontig=True, extra_rows=1, poison=True),
    "slot-b": dict(batch=3, dim=40, seqlen=2, slot_indices=False),
    "strided-inputs": dict(batch=3, dim=48, seqlen=2, strided=True, noncontig=True),
    "spec-strided": dict(batch=2, dim=32, seqlen=3, spec=True, strided=True, poison=True),
}
CASES = {"causal_conv1d_fn": FN_CASES, "causal_conv1d_update": UPDATE_CASES}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _widths(caps) -> list[int]:
    lo, hi = caps.width
    return list(range(max(lo, 1), min(hi if hi is not None else 5, 5) + 1))


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


def _claimed_cases(rv, device):
    caps = rv.variant.capabilities
    for name, spec in CASES[rv.op].items():
        for width in _widths(caps):
            for dname in sorted(caps.dtypes & DTYPES.keys()):
                case = make_case(rv.op, width=width, dtype=DTYPES[dname], device=device, **spec)
                if uncovered(caps, call_key(rv.op, *case.args, **case.kwargs)) is None:
                    yield f"{name} W={width} {dname}", case


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
    if device not in caps.devices or not caps.noncontiguous_states:
        pytest.skip(f"{variant.id} does not claim non-contiguous states on {device}")
    spec = dict(batch=2, dim=32, seqlen=3, noncontig=True)
    case = make_case(variant.op, width=_widths(caps)[-1], device=device, dtype=torch.float32, **spec).fresh()
    before = case.pool_base.clone()
    _, expected_pool = case.run(getattr(reference, variant.op))  # the reference, on a fresh copy
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
