"""Moving a table between machines (export, import) and between ranks (distributed
calibration, the agreement check)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import IO

import torch

from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table import exchange
from kernel_variants._table.exchange import ImportReport, TableDocument
from kernel_variants._table.rows import DEFAULT_MARGIN
from kernel_variants._tuning import distributed
from kernel_variants._tuning.calibrate import Progress
from kernel_variants._tuning.distributed import Disagreement, DistributedResult
from kernel_variants._tuning.timing import TimingConfig


def export_table(path_or_file: str | os.PathLike[str] | IO[str], device: str = "cpu") -> TableDocument:
    """Write this device's measurements, winners and verdicts to ``path_or_file`` (a path,
    replaced atomically, or a text file) as one versioned JSON document."""
    return exchange.export_table(dispatcher().table, path_or_file, device)


def import_table(path: str | os.PathLike[str], *, force: bool = False, device: str = "cpu") -> ImportReport:
    """Validate the document at ``path`` whole, then merge it into this machine's table in one
    transaction (the newer row wins). A document from another device or software stack is
    refused unless ``force``."""
    d = dispatcher()
    try:
        return exchange.import_table(d.table, d.versions(), path, force=force, device=device)
    finally:
        d.invalidate()


def check_agreement() -> list[Disagreement]:
    """The call keys on which the ranks of the default process group decide differently.

    A collective: every rank calls it. Each rank contributes the keys it has dispatched (with
    the variant it ran); every rank then decides every key any rank met (without running or
    measuring anything), and the keys whose variants differ are returned, the same list on every
    rank. Without torch.distributed, or with one rank, [].
    """
    return distributed.check_agreement(dispatcher())


def calibrate_distributed(
    op: str,
    shapes: Sequence[Sequence[int]],
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str = "cpu",
    variants: Sequence[str] | None = None,
    timing: TimingConfig | None = None,
    rotate: int = 0,
    margin: float = DEFAULT_MARGIN,
    progress: Callable[[Progress], None] | None = None,
    **features: object,
) -> DistributedResult:
    """:func:`calibrate` across the ranks of this ``torchrun`` job, leaving every rank with the
    same table. A collective: every rank calls it with the same arguments; ``device`` is a device
    type (each rank measures on ``TYPE:LOCAL_RANK``). Each rank measures a share of the (shape,
    variant) pairs; rank 0 records them all and decides the winners, every other rank imports
    rank 0's table (its result's ``imported`` says what that changed). Nothing is pruned. Ranks
    must have one device fingerprint and one set of variant versions (a ``ValueError`` names the
    ranks that differ). Joins the default process group, or creates it from the torchrun
    environment for the call."""
    from kernel_variants._api.calibration import check_shapes

    d = dispatcher()
    spec = d.registry.spec(op)
    if timing is not None and not isinstance(timing, TimingConfig):
        raise TypeError(f"timing: expected a kernel_variants.TimingConfig, got {type(timing).__name__}")
    try:
        return distributed.calibrate_distributed(
            d, spec.name, check_shapes(shapes, spec.axes), dtype=dtype, device=device,
            features=spec.features(**features), timing=timing if timing is not None else TimingConfig(),
            variants=variants, rotate=rotate, margin=margin, progress=progress)
    finally:
        d.invalidate()
