"""What calibration times a variant on: the input copies a shape's calls cycle over, and one call
made as the dispatcher makes it (into a preallocated ``out=``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernel_variants._registry.case import Case
from kernel_variants._registry.keys import Features
from kernel_variants._registry.spec import OpSpec, Shape
from kernel_variants._tuning.timing import TimingConfig, cold_copies


def with_out(spec: OpSpec, takes_out: bool, fn: Callable[..., Any], case: Case) -> Callable[[], Any]:
    """One timed call of ``case`` into a preallocated dense ``out``, as the dispatcher runs it."""
    like = spec.bind(*case.args, **case.kwargs)[spec.out_like_index]
    outs = tuple(torch.empty_like(like, memory_format=torch.contiguous_format) for _ in spec.outputs)
    args, kwargs = case.args, case.kwargs
    if takes_out:
        out = outs[0] if len(outs) == 1 else outs
        return lambda: fn(*args, **kwargs, out=out)
    if len(outs) == 1:
        return lambda: outs[0].copy_(fn(*args, **kwargs))

    def copied() -> None:
        for o, r in zip(outs, fn(*args, **kwargs), strict=True):
            o.copy_(r)

    return copied


def input_copies(spec: OpSpec, case: Case, shape: Shape, features: Features, *, dtype: torch.dtype, device: str,
                 rotate: int, timing: TimingConfig) -> tuple[list[Case], str]:
    """The input copies a variant's calls cycle over, and what the method says of them: the
    case, plus ``rotate`` more, or with ``cold_l2`` as many as make twice the device's L2."""
    n = rotate
    if timing.cold_l2:
        n = max(n, cold_copies(device, case_bytes(case)) - 1)
    copies = [case] + [spec.sweep_case(shape, features, dtype=dtype, device=device, seed=i + 1) for i in range(n)]
    if timing.cold_l2:
        return copies, f", cold L2 ({len(copies)} input sets)"
    return copies, f", {len(copies)} input sets" if n else ""


def case_bytes(case: Case) -> int:
    """Bytes of the tensors a call reads and writes."""
    tensors = [a for a in (*case.args, *case.kwargs.values()) if isinstance(a, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def seed_of(shape: Shape) -> int:
    seed = 0
    for size in shape:
        seed = (seed * 1009 + size) % (1 << 31)
    return seed
