"""Correctness before speed: a variant's result on a case, compared with the reference's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernel_variants._tolerances import mismatch
from kernel_variants.registry import Case

Result = tuple[Any, dict[str, torch.Tensor]]


def reference_result(case: Case) -> Result:
    return case.run(case.spec.reference.fn)


def verify(fn: Callable[..., Any], case: Case, expected: Result | None = None) -> str | None:
    """None when ``fn`` matches the reference on ``case`` (every output within tolerance, every
    mutated tensor bit for bit), else a one-line reason. A raising variant is a mismatch, not a
    crash."""
    ref_out, ref_bases = expected if expected is not None else reference_result(case)
    try:
        out, bases = case.run(fn)
    except Exception as exc:  # any failure of the candidate is a verdict on it
        return f"raised {type(exc).__name__}: {exc}"
    names = case.spec.outputs
    if len(names) == 1:
        got, want = (out,), (ref_out,)
    elif not isinstance(out, tuple | list) or len(out) != len(names):
        return f"returned {type(out).__name__}, expected a tuple of {len(names)} tensors ({', '.join(names)})"
    else:
        got, want = tuple(out), tuple(ref_out)
    for name, a, e in zip(names, got, want, strict=True):
        if not isinstance(a, torch.Tensor):
            return f"returned {type(a).__name__} for {name}, expected a tensor"
        why = mismatch(a, e, "output" if len(names) == 1 else name)
        if why is not None:
            return why
    for name, base in ref_bases.items():
        why = mismatch(bases[name], base, "state pool" if len(ref_bases) == 1 else name, exact=True)
        if why is not None:
            return why
    return None
