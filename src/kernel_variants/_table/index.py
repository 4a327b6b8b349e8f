"""What a dispatch decision reads from the table, kept fast at fleet scale.

The table's full load validates every row (pydantic, per JSON document): about 0.8 s for 5000
calibrated shapes. A decision needs far less: per group and shape, each variant's best time,
the variants rejected there, the winner, and the nearest calibrated shape for an unseen one.
A variant pruned at a shape (timed for one round, far slower than the best) has its
first-round figure among the times, as measured-slower, and its bound in ``pruned``. That is
kept here:

- in memory, per group, as a dict for exact shapes and a tensor of log-sizes with one presence
  mask per variant, so the nearest shape is one vectorised argmin (tens of microseconds);
- on disk, as one snapshot row per device fingerprint (``i|<fingerprint>``), columnar (per
  group: the shapes once, per variant its version and one time per shape), tagged with the
  table's write token (``t|token``, renewed by every write of a measurement or winner). A
  process whose token matches loads the snapshot instead of every row; one that finds it out of
  date rebuilds it from the rows and stores it for the next. Its content is checked as it is
  read: a damaged or planted snapshot is rebuilt, never trusted.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kernel_variants._registry.spec import Shape
from kernel_variants._table.store import TOKEN_KEY

if TYPE_CHECKING:
    from kernel_variants._table.rows import Measurement, Winner

__all__ = ["SNAPSHOT_PREFIX", "TOKEN_KEY", "FastIndex", "GroupIndex", "document", "index_from"]

SNAPSHOT_PREFIX = "i|"
FORMAT = 3
REJECTED = -1.0  # a time slot's value for "rejected here"; real times are positive


@dataclass
class GroupIndex:
    """One group's current figures: shape -> variant -> best µs, the variants rejected at each
    shape (they differed from the reference there), those pruned there (variant -> how many
    times slower than the best, at least), and each shape's winner."""

    shapes: list[Shape]
    times: dict[Shape, dict[str, float]] = field(default_factory=dict)
    rejected: dict[Shape, set[str]] = field(default_factory=dict)
    pruned: dict[Shape, dict[str, float]] = field(default_factory=dict)
    winners: dict[Shape, str] = field(default_factory=dict)
    _logs: torch.Tensor | None = None
    _present: dict[str, torch.Tensor] = field(default_factory=dict)

    def nearest(self, want: Shape, allowed: Iterable[str]) -> Shape | None:
        """The calibrated shape closest to ``want`` in log space where an allowed variant has a
        time (ties: the first calibrated)."""
        if self._logs is None:
            self._logs = torch.tensor(self.shapes, dtype=torch.float64).clamp_(min=1).log_()
        masks = [self._present[v] for v in allowed if v in self._present]
        if not masks:
            return None
        mask = torch.stack(masks).any(dim=0)
        if not bool(mask.any()):
            return None
        target = torch.tensor(want, dtype=torch.float64).clamp_(min=1).log_()
        dist = ((self._logs - target) ** 2).sum(dim=1)
        dist[~mask] = float("inf")
        return self.shapes[int(torch.argmin(dist))]


@dataclass
class FastIndex:
    groups: dict[str, GroupIndex]  # by group slug
    stale: dict[str, tuple[str, str]]  # variant -> (measured version, current version)
    counts: dict[str, int]  # rows of other fingerprints ("other_fp") and unreadable ones ("bad")


def document(ms: Iterable[Measurement], ws: Iterable[Winner], counts: dict[str, int]) -> dict[str, Any]:
    """The snapshot of one fingerprint's rows (every version: filtering is the reader's)."""
    groups: dict[str, dict[str, Any]] = {}
    where: dict[str, dict[Shape, int]] = {}
    for m in ms:
        if m.status != "rejected" and m.best_us is None:
            continue
        slug = m.group.slug()
        g = groups.setdefault(slug, {"shapes": [], "variants": {}, "winners": [], "pruned": {}})
        at = where.setdefault(slug, {})
        if m.shape not in at:
            at[m.shape] = len(g["shapes"])
            g["shapes"].append(list(m.shape))
            g["winners"].append(None)
        tag = f"{m.variant}\n{m.version}"
        per = g["variants"].setdefault(tag, {})
        per[str(at[m.shape])] = m.best_us if m.status != "rejected" else REJECTED
        if m.status == "pruned":
            g["pruned"].setdefault(tag, {})[str(at[m.shape])] = m.pruned_at or 0.0
    for w in ws:
        slug = w.group.slug()
        if slug in groups and w.shape in where[slug]:
            groups[slug]["winners"][where[slug][w.shape]] = w.variant
    return {"format": FORMAT, "groups": groups, "counts": counts}


def encode(token: str, doc: dict[str, Any]) -> str:
    return json.dumps({**doc, "token": token}, separators=(",", ":"))


def decode(raw: str | None, token: str | None) -> dict[str, Any] | None:
    """The snapshot's content when it is current (same token, same format), else None."""
    if raw is None or token is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("token") != token:
        return None
    return doc


def index_from(doc: dict[str, Any], versions: dict[tuple[str, str], str]) -> FastIndex | None:
    """The index of a snapshot document for the variants registered now (``versions``): other
    versions are stale, unregistered variants kept out. None when the document is malformed."""
    try:
        groups: dict[str, GroupIndex] = {}
        stale: dict[str, tuple[str, str]] = {}
        for slug, g in doc["groups"].items():
            shapes = [tuple(int(v) for v in s) for s in g["shapes"]]
            op = slug.split("|", 1)[0]
            index = GroupIndex(shapes, {s: {} for s in shapes})
            for tag, per in g["variants"].items():
                variant, version = tag.split("\n", 1)
                current = versions.get((op, variant))
                if current is None:
                    continue
                if current != version:
                    stale[variant] = (version, current)
                    continue
                present = [False] * len(shapes)
                for pos, bound in g["pruned"].get(tag, {}).items():
                    index.pruned.setdefault(shapes[int(pos)], {})[variant] = float(bound)
                for pos, t in per.items():
                    i, t = int(pos), float(t)
                    if t == REJECTED:
                        index.rejected.setdefault(shapes[i], set()).add(variant)
                    elif t > 0:
                        index.times[shapes[i]][variant] = t
                        present[i] = True
                index._present[variant] = torch.tensor(present)
            index.winners = {s: w for s, w in zip(shapes, g["winners"], strict=True) if isinstance(w, str)}
            groups[str(slug)] = index
        counts = {str(k): int(v) for k, v in doc["counts"].items()}
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return None
    return FastIndex(groups, stale, counts)
