"""Named sweeps of (B, D, L) shapes that ship with the package, and CSV sweeps from users.

``seed69`` is the 69 shapes of the Ascend 910B2 regression report; ``seed69-cpu`` the same with
B divided by 64 (B from 1 to 128) so a CPU measures them in minutes; ``decode`` and
``decode-spec`` the decode sweep of causal_conv1d_update; ``smoke`` a few tiny shapes.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from kernel_variants.registry._models import OpName

Shape = tuple[int, int, int]


@dataclass(frozen=True)
class Sweep:
    name: str
    op: OpName
    shapes: tuple[Shape, ...]
    spec: bool = False  # num_accepted_tokens (update op, L > 1)
    description: str = field(default="", compare=False)


def read_shapes_csv(path: str | Path) -> tuple[Shape, ...]:
    """(B, D, L) triples from a CSV with columns ``B``, ``dim`` (or ``D``) and ``seq`` (or ``L``)."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise ValueError(f"sweep file {path}: cannot be read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"sweep file {path}: not a CSV file ({exc})") from None
    shapes = []
    for i, row in enumerate(rows, start=2):
        try:
            b = row.get("B") or row.get("batch")
            d = row.get("dim") or row.get("D")
            s = row.get("seq") or row.get("L") or row.get("seqlen")
            shape = (int(b), int(d), int(s))
        except (TypeError, ValueError):
            raise ValueError(
                f"sweep file {path}, line {i}: expected integer columns B, dim, seq; got {dict(row)}"
            ) from None
        if min(shape) < 1:
            raise ValueError(f"sweep file {path}, line {i}: expected positive sizes, got {shape}")
        shapes.append(shape)
    if not shapes:
        raise ValueError(f"sweep file {path}: no rows (expected a header B,dim,seq and shapes)")
    return tuple(shapes)


def _seed69() -> tuple[Shape, ...]:
    return read_shapes_csv(Path(str(files(__package__) / "seed69.csv")))


def _named() -> dict[str, Sweep]:
    seed = _seed69()
    decode = tuple((b, d, 1) for b in (1, 8, 64, 256) for d in (1024, 4096, 8192))
    return {
        "seed69": Sweep("seed69", "causal_conv1d_fn", seed, description="the 69 shapes of the 910B2 regression report"),
        "seed69-cpu": Sweep("seed69-cpu", "causal_conv1d_fn", tuple((max(b // 64, 1), d, s) for b, d, s in seed),
                            description="seed69 with B divided by 64, for CPUs"),
        "decode": Sweep("decode", "causal_conv1d_update", decode, description="decode: B x D, one token"),
        "decode-spec": Sweep("decode-spec", "causal_conv1d_update", tuple((b, d, 4) for b, d, _ in decode), spec=True,
                             description="speculative verify: B x D, L=4 with num_accepted_tokens"),
        "smoke": Sweep("smoke", "causal_conv1d_fn", ((1, 64, 16), (2, 256, 64), (4, 512, 128), (8, 1024, 256)),
                       description="a few small shapes, seconds to calibrate"),
    }


NAMES = ("seed69", "seed69-cpu", "decode", "decode-spec", "smoke")


def get_sweep(name_or_path: str, op: OpName | None = None) -> Sweep:
    """A named sweep, or a CSV file of shapes (for ``op``, default causal_conv1d_fn)."""
    named = _named()
    if name_or_path in named:
        return named[name_or_path]
    if name_or_path.endswith(".csv") or Path(name_or_path).exists():
        return Sweep(Path(name_or_path).stem, op or "causal_conv1d_fn", read_shapes_csv(name_or_path))
    raise ValueError(f"sweep: expected one of {', '.join(NAMES)} or a .csv file, got {name_or_path!r}")
