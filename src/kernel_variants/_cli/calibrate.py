"""Measure every variant on a sweep of shapes and store the winners in this device's table.

Each variant is checked against the reference on each shape first; one that differs is listed
as rejected with the reason and never chosen. A progress bar on stderr shows the current shape
and the time left. Under torchrun, ``--distributed`` shares the work among the ranks and leaves
every rank with the same table:

    torchrun --nproc-per-node 8 -m kernel_variants calibrate --distributed --device cuda --sweep seed69
"""

from __future__ import annotations

import argparse
import sys

import kernel_variants as kv
from kernel_variants.dispatch._calibrate import CalibrationResult
from kernel_variants.dispatch._table import DEFAULT_MARGIN, Group, check_margin

from . import _options as opt
from ._output import ProgressBar, percent, print_json, render_table, us


def add_arguments(p: argparse.ArgumentParser) -> None:
    opt.add_op(p)
    opt.add_sweep(p)
    opt.add_dtype(p)
    opt.add_device(p)
    p.add_argument("--variants", help="comma-separated ids to measure (default: every available one)")
    p.add_argument("--missing", action="store_true",
                   help="per shape, measure only the variants the table has no current figure for")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                   help=f"a challenger must be this much faster to take a shape (default {DEFAULT_MARGIN})")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.add_argument("--distributed", action="store_true", help="share the work among torchrun ranks")
    opt.add_timing(p)
    opt.add_features(p)


def summary(result: CalibrationResult, shapes, device: str) -> list[dict]:
    """Per shape: the winner, its time, the runner-up and the winner's lead, from the table."""
    groups = {m.shape: m.group for m in result.measurements}
    rows = {(r.group, r.shape): r for r in kv.table(result.op, device=device)}
    out = []
    for shape in shapes:
        row = rows.get((groups.get(shape), shape))
        times = dict(row.times_us) if row is not None else {}
        w = result.winners.get(shape)
        winner = w.variant if w is not None else None
        others = sorted((t, v) for v, t in times.items() if v != winner)
        out.append({
            "shape": list(shape), "winner": winner, "winner_us": times.get(winner) if winner else None,
            "runner_up": others[0][1] if others else None, "runner_up_us": others[0][0] if others else None,
            "margin": row.margin if row is not None else None, "times_us": times,
        })
    return out


def _missing(work: opt.Work, dtype: str, device: str, variants: list[str]) -> dict[tuple, list[str]]:
    """(shape,) -> the variants without a current figure there (all of them for a new shape)."""
    group = Group(op=work.op, dtype=dtype, features=work.features.model_dump())
    rows = {r.shape: r for r in kv.table(work.op, device=device) if r.group == group}
    out = {}
    for shape in work.shapes:
        row = rows.get(tuple(shape))
        have = set(row.times_us) | set(row.rejected) if row is not None else set()
        out[(tuple(shape),)] = [v for v in variants if v not in have]
    return out


def run(args: argparse.Namespace) -> int:
    work = opt.work(args)
    features = work.features
    timing = opt.timing(args)
    dtype = opt.dtype(args.dtype)
    device = opt.device(args.device)
    if args.variants:
        variants = opt.variant_list(args.variants)
    else:
        # Named explicitly, so that the progress total counts only variants that can run here.
        variants = [rv.id for rv in kv.variants(work.op) if rv.unavailable_reason() is None]
    check_margin(args.margin)
    common = dict(dtype=dtype, timing=timing, variants=variants, rotate=args.rotate, margin=args.margin)
    if args.distributed and args.missing:
        raise ValueError("--missing: not with --distributed (each rank would see another part of the table)")
    if args.distributed:
        from kernel_variants.dispatch._distributed import calibrate_distributed, torchrun_env

        rank = torchrun_env()[0]
        bar = None if args.quiet or rank != 0 else ProgressBar("rank 0 share ", axes=work.spec.axes)
        try:
            dres = calibrate_distributed(work.op, work.shapes, device=device, features=features, progress=bar,
                                         **common)
        finally:
            if bar is not None:
                bar.close()
        if rank != 0:
            rep = dres.imported
            print(f"kv calibrate: rank {rank}: imported rank 0's table ({rep.added} added, {rep.updated} updated)",
                  file=sys.stderr)
            return 0
        result, device = dres.result, dres.result.device
    else:
        bar = None if args.quiet else ProgressBar(axes=work.spec.axes)
        todo = _missing(work, dtype, device, variants) if args.missing else {tuple(work.shapes): variants}
        result = CalibrationResult(work.op, device, dtype)
        try:
            for shapes, ids in todo.items():
                if not ids:
                    continue
                part = kv.calibrate(work.op, shapes, device=device, warmup=timing.warmup, windows=timing.windows,
                                    iters=timing.iters, rotate=args.rotate, margin=args.margin, dtype=dtype,
                                    variants=ids, progress=bar, **features.model_dump())
                result.measurements += part.measurements
                result.winners.update(part.winners)
        finally:
            if bar is not None:
                bar.close()
    rows = summary(result, work.shapes, device)
    rejected = [{"shape": list(m.shape), "variant": m.variant, "reason": m.reason} for m in result.rejected()]
    if args.json:
        print_json({"op": result.op, "device": result.device, "dtype": result.dtype, "sweep": work.source,
                    "shapes": rows, "rejected": rejected,
                    "measurements": [m.model_dump(mode="json") for m in result.measurements]})
        return 0
    print(f"{result.op} on {result.device} {result.dtype}, sweep {work.source}: {len(rows)} shape{'' if len(rows) == 1 else 's'}")
    axes = list(work.spec.axes)
    table = [[*r["shape"], r["winner"] or "(none can run it)", us(r["winner_us"]), r["runner_up"],
              us(r["runner_up_us"]), percent(r["margin"])] for r in rows]
    print(render_table([*axes, "winner", "winner µs", "runner-up", "runner-up µs", "margin"], table))
    if rejected:
        print(f"\nrejected ({len(rejected)}):")
        print(render_table([*axes, "variant", "reason"], [[*r["shape"], r["variant"], r["reason"]] for r in rejected]))
    return 0
