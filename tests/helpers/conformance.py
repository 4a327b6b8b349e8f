"""The conformance check: every case of an op's conformance list that a variant claims, run
against the reference."""

from __future__ import annotations

import torch

import kernel_variants
from kernel_variants._tuning.verify import verify

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def spec_of(rv):
    """The op spec of a registered variant."""
    return kernel_variants._runtime.dispatcher.dispatcher().registry.spec(rv.op)


def claimed_cases(rv, device):
    """Every case of the op's conformance list, in every dtype, that ``rv`` claims on ``device``."""
    spec, caps = spec_of(rv), rv.variant.capabilities
    for label, options in spec.conformance(caps):
        # Each case at the nearest sizes the variant takes (a kernel that needs D % 32 == 0 is
        # tested at D=64 where the case says 37), so every case is tried on every variant.
        shape = caps.fit(spec.axes, tuple(options["shape"]))
        if shape is None:
            continue
        options = {**options, "shape": shape}
        for dname in sorted(caps.dtypes & DTYPES.keys()):
            case = spec.make_case(dtype=DTYPES[dname], device=device, **options)
            if caps.uncovered(spec.key_of_case(case)) is None:
                yield f"{label} {dname}", case


def assert_conforms(rv, device, keep=lambda label: True, fn=None, **verify_kw) -> int:
    """Run ``rv`` (or ``fn`` standing for it) on every case it claims on ``device`` (those ``keep``
    selects); fails unless at least one ran and all matched. Returns how many ran."""
    fn = rv.variant.fn if fn is None else fn
    failures, ran = [], 0
    for label, case in claimed_cases(rv, device):
        if not keep(label):
            continue
        ran += 1
        why = verify(fn, case, **verify_kw)
        if why is not None:
            failures.append(f"{label}: {why}")
    assert ran > 0, f"{rv.id} claims no case of the suite"
    assert not failures, f"{rv.id} failed {len(failures)} of {ran} cases on {device}:\n" + "\n".join(failures)
    return ran
