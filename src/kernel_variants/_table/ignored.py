"""Rows of the table that one device's reads leave out, told apart so that one warning can say
why: another device or stack, this CPU at another thread count, another kind of CPU (named,
with this one's), or an earlier release's rows of this device."""

from __future__ import annotations

import contextlib
import sqlite3

import torch

from kernel_variants._table.fingerprint import (
    cpu_kind,
    describe_cpu,
    device_part,
    fingerprint,
    is_legacy,
    lacks_cpu_kind,
)
from kernel_variants._table.fingerprint import fingerprint_id as identify
from kernel_variants._table.rows import parse_verdict, verdict_fingerprint
from kernel_variants._table.store import Store

MINE = "mine"
OTHER_CPU = "other_cpu|"  # a count's key: this prefix, then the CPU's kind in words
# Not a count of the snapshot: verdicts are dropped as they are met, and said once.
DROPPED_VERDICTS = "dropped_verdicts"


def _other_threads(fp: dict[str, str], fingerprint_id: str) -> bool:
    """Whether ``fp`` is the fingerprint ``fingerprint_id`` of this CPU but for its thread count."""
    now = str(torch.get_num_threads())
    return fp.get("device") == "cpu" and fp.get("threads") not in (None, now) and identify(
        {**fp, "threads": now}) == fingerprint_id


class Sorter:
    """Says, per row fingerprint, whether the rows of ``fingerprint_id`` may use it, and if not
    which count of ignored rows it goes to (asked once per fingerprint id)."""

    def __init__(self, fingerprint_id: str) -> None:
        self.fingerprint_id = fingerprint_id
        self._seen: dict[str, str] = {}
        self._here: dict[str, str] | None = None  # this CPU's fingerprint, when it is the one read
        here = fingerprint("cpu")
        if identify(here) == fingerprint_id:
            self._here = here

    def sort(self, fp: dict[str, str], fpid: str) -> str:
        """``MINE``, or the count it goes to: "legacy" (an earlier release's, of this device),
        "legacy_cpu" (an earlier release's, of a CPU of this one's name, kind not recorded),
        "threads", ``OTHER_CPU`` + the CPU's kind, or "other_fp"."""
        found = self._seen.get(fpid)
        if found is None:
            found = self._seen[fpid] = self._sort(fp, fpid)
        return found

    def _sort(self, fp: dict[str, str], fpid: str) -> str:
        if fpid == self.fingerprint_id:  # (a legacy fingerprint's id is never a current one)
            return MINE
        if is_legacy(fp) and identify(device_part(fp)) == self.fingerprint_id:
            return "legacy_cpu" if lacks_cpu_kind(fp) else "legacy"
        if _other_threads(fp, self.fingerprint_id):
            return "threads"
        if self._here is not None and fp.get("device") == "cpu" and not lacks_cpu_kind(fp) \
                and cpu_kind(fp) != cpu_kind(self._here):
            return OTHER_CPU + describe_cpu(fp)
        return "other_fp"

    def drop_old_verdict(self, store: Store, key: str, raw: str | None) -> bool:
        """Delete a verdict of this CPU written before the CPU's kind was kept; whether it was
        one. It is never read again (verdicts are found by fingerprint id): the variant qualifies
        here again before it is chosen. A table that cannot be written keeps it."""
        if self._here is None or raw is None or '"isa"' in raw:
            return False
        v = parse_verdict(raw)
        if v is None or not lacks_cpu_kind(v.fingerprint) or \
                identify(device_part(v.fingerprint)) != identify(verdict_fingerprint(self._here)):
            return False
        with contextlib.suppress(OSError, sqlite3.Error):
            store.delete(key)
        return True


def reasons(counts: dict[str, int], stale: dict[str, tuple[str, str]]) -> tuple[list[str], bool]:
    """The warning's parts for ``counts`` of ignored rows and ``stale`` variants, and whether
    ``kv calibrate --stale`` re-measures any of them."""
    out = []
    if counts.get("legacy"):
        out.append(f"{counts['legacy']} measured on this device by an earlier kernel_variants release "
                   "(before staleness was kept per variant; they cannot be told current)")
    if counts.get("legacy_cpu"):
        out.append(f"{counts['legacy_cpu']} measured on a CPU of this one's name by an earlier kernel_variants "
                   "release, which did not record its model and ISA level (they cannot be told this CPU's)")
    if counts.get(DROPPED_VERDICTS):
        out.append(f"{counts[DROPPED_VERDICTS]} qualification verdicts of that release, dropped (each variant "
                   "qualifies here again before it is chosen)")
    if counts.get("threads"):
        out.append(f"{counts['threads']} measured on this CPU with another intra-op thread count (this "
                   f"process runs {torch.get_num_threads()}; a forked child runs one)")
    others = {k.removeprefix(OTHER_CPU): n for k, n in counts.items() if k.startswith(OTHER_CPU) and n}
    if others:
        kinds = ", ".join(f"{n} on {kind}" for kind, n in sorted(others.items()))
        out.append(f"rows measured on another CPU ({kinds}) ignored here: this CPU is "
                   f"{describe_cpu(fingerprint('cpu'))}")
    if counts.get("other_fp"):
        out.append(f"{counts['other_fp']} measured on another device or software stack (fingerprint differs)")
    for vid, (old, new) in sorted(stale.items()):
        out.append(f"variant {vid!r} changed since it was measured (version {old} -> {new})")
    if counts.get("bad"):
        out.append(f"{counts['bad']} entries unreadable or malformed")
    return out, bool(stale or counts.get("legacy") or counts.get("legacy_cpu"))
