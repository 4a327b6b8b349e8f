"""Moving a table between machines (export, import) and between ranks (distributed
calibration, the agreement check)."""

from __future__ import annotations

import os
from typing import IO

from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table import exchange
from kernel_variants._table.exchange import ImportReport, TableDocument
from kernel_variants._tuning import distributed
from kernel_variants._tuning.distributed import Disagreement


def export_table(path_or_file: str | os.PathLike[str] | IO[str], device: str = "cpu") -> TableDocument:
    """Write this device's measurements, winners and verdicts to ``path_or_file`` (a path,
    replaced atomically, or a text file) as one versioned JSON document."""
    return exchange.export_table(dispatcher().table, path_or_file, device)


def import_table(path: str | os.PathLike[str], *, force: bool = False, device: str = "cpu") -> ImportReport:
    """Validate the document at ``path`` whole, then merge it into this machine's table in one
    transaction (the newer row wins). A document from another device or software stack is
    refused unless ``force``; one from another kind of CPU (or an earlier release's, which did not
    record it), and one whose fingerprint_id is not its fingerprint's, even then."""
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
