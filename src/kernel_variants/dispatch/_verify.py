"""Correctness before speed: a variant's result on a case, compared with the reference's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernel_variants._cases import Case
from kernel_variants._tolerances import mismatch
from kernel_variants.variants import reference

Result = tuple[torch.Tensor, torch.Tensor | None]


def reference_result(case: Case) -> Result:
    return case.run(getattr(reference, case.op))


def verify(fn: Callable[..., Any], case: Case, expected: Result | None = None) -> str | None:
    """None when ``fn`` matches the reference on ``case`` (output within tolerance, the whole state
    pool bit for bit), else a one-line reason. A raising variant is a mismatch, not a crash."""
    ref_out, ref_pool = expected if expected is not None else reference_result(case)
    try:
        out, pool = case.run(fn)
    except Exception as exc:  # any failure of the candidate is a verdict on it
        return f"raised {type(exc).__name__}: {exc}"
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, expected a tensor"
    why = mismatch(out, ref_out, "output")
    if why is None and ref_pool is not None:
        why = mismatch(pool, ref_pool, "state pool", exact=True)
    return why
