"""The calibrated winners of this device, per shape: every variant's time and the winner's lead."""

from __future__ import annotations

import argparse
import sys

import kernel_variants as kv

from . import _options as opt
from ._output import percent, print_json, render_table, us


def add_arguments(p: argparse.ArgumentParser) -> None:
    opt.add_op(p)
    opt.add_device(p)
    p.add_argument("--format", choices=("text", "md", "csv", "json"), default="text",
                   help="aligned text (default), Markdown, CSV or JSON")


def run(args: argparse.Namespace) -> int:
    op = opt.op_spec(args.op).name if args.op else None
    rows = kv.table(op, device=opt.device(args.device))
    fmt = "json" if args.json else args.format
    if fmt == "json":
        print_json([{"op": r.group.op, "group": r.group.model_dump(mode="json"), "features": r.group.slug(),
                     "shape": list(r.shape), "winner": r.winner, "margin": r.margin, "times_us": r.times_us,
                     "rejected": r.rejected, "missing": list(r.missing)} for r in rows])
        return 0
    if not rows:
        print("kv table: no calibrated shapes on this device yet (run kv calibrate)", file=sys.stderr)
        return 0
    by_op: dict[str, list] = {}
    for r in rows:
        by_op.setdefault(r.group.op, []).append(r)
    for i, (name, group_rows) in enumerate(by_op.items()):  # each op has its own axes
        axes = opt.registry().spec(name).axes
        variants = sorted({v for r in group_rows for v in (*r.times_us, *r.rejected)})
        body = []
        for r in group_rows:
            cells = [us(r.times_us[v]) if v in r.times_us else "rejected" if v in r.rejected else None
                     for v in variants]
            body.append([r.group.slug(), *r.shape, r.winner, *cells, percent(r.margin), ",".join(r.missing) or None])
        if i:
            print()
        print(render_table(["features", *axes, "winner", *(f"{v} µs" for v in variants), "margin", "not measured"],
                           body, fmt=fmt, right=[False, *[True] * len(axes), False, *[True] * len(variants), True, False]))
    return 0
