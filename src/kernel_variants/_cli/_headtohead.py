"""What ``kv compare`` and ``kv gate`` share: the two sides, the incumbent and the candidate
(variant ids, or with ``--from-csv`` columns of microseconds measured elsewhere), and the shape
and measurement options; the head-to-head itself is :func:`kernel_variants.compare` or
:meth:`kernel_variants.HeadToHead.from_csv`.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import kernel_variants as kv

if TYPE_CHECKING:
    from kernel_variants import types
from kernel_variants._cli import _options as opt
from kernel_variants._cli._output import ProgressBar

# Spellings of the sides before compare and gate named them alike, and what replaced each.
RENAMED = {"--a-col": "--incumbent", "--b-col": "--candidate"}


class _Renamed(argparse.Action):
    """An option that is gone: using it is a usage error naming its replacement."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        new = RENAMED[option_string or ""]
        parser.error(f"{option_string} is now {new} (compare and gate name the two sides alike, with "
                     "--from-csv too: --incumbent COL --candidate COL)")


class _Positional(argparse.Action):
    """``kv compare A B``, the old spelling of the two sides: a usage error naming the new one."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values:
            given = " ".join(values)
            parser.error(f"the two sides are options now: --incumbent A --candidate B "
                         f"(got {given!r} as positional arguments)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The two sides, and the shape, measurement and CSV options shared by compare and gate."""
    p.add_argument("--incumbent", required=True, metavar="ID",
                   help="variant id of the incumbent (with --from-csv: the column of its µs)")
    p.add_argument("--candidate", required=True, metavar="ID",
                   help="variant id of the candidate (with --from-csv: the column of its µs)")
    p.add_argument("old_sides", nargs="*", action=_Positional, help=argparse.SUPPRESS)
    opt.add_op(p)
    opt.add_sweep(p)
    opt.add_dtype(p)
    opt.add_device(p)
    g = p.add_argument_group("measurements taken elsewhere")
    g.add_argument("--from-csv", metavar="FILE", help="a CSV with a column per axis of the op (B, dim, seq for the "
                                                      "conv ops) and the µs columns --incumbent and --candidate name")
    for old in RENAMED:
        g.add_argument(old, action=_Renamed, help=argparse.SUPPRESS)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    opt.add_timing(p)
    opt.add_features(p)


def collect(args: argparse.Namespace) -> types.HeadToHead:
    """Read the CSV given with ``--from-csv``, or measure the two variants on the shapes asked."""
    if args.from_csv:
        if args.sweep or args.shapes:
            raise ValueError("--from-csv brings its own shapes: drop --sweep/--shapes")
        from kernel_variants.types import HeadToHead  # (imports torch: not at kv --help)

        return HeadToHead.from_csv(args.from_csv, args.incumbent, args.candidate,
                                      opt.op_spec(args.op).name if args.op else None)
    if args.incumbent == args.candidate:
        raise ValueError(f"expected two different variants, got {args.incumbent!r} twice")
    work = opt.work(args)
    bar = None if args.quiet else ProgressBar(axes=work.spec.axes)
    try:
        return kv.compare(work.op, args.incumbent, args.candidate, work.shapes, dtype=opt.dtype(args.dtype),
                          device=opt.device(args.device), timing=opt.timing(args), rotate=args.rotate,
                          progress=bar, **work.features.model_dump())
    finally:
        if bar is not None:
            bar.close()
