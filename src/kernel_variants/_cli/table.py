"""The calibrated winners of this device, per shape: every variant's time, the winner's lead and
how sure it is ("clear": the lead exceeds the margin and the measured noise; "within noise":
either could be faster). A variant timed for one round only shows "pruned >=Nx", one not timed
at a shape because it lost by far at the neighbouring shapes "pruned by neighbours >=Nx".

With --stale, the rows that no longer match their variant and why (a dependency, its source or
an earlier release): `kv calibrate --stale` re-measures them. With --recorded, the call keys
serving processes met without a measurement (KV_RECORD=1): `kv calibrate --recorded` measures them.
"""

from __future__ import annotations

import argparse
import sys
import time

import kernel_variants as kv
from kernel_variants._cli import _options as opt
from kernel_variants._cli._output import percent, print_json, render_table, us


def add_arguments(p: argparse.ArgumentParser) -> None:
    opt.add_op(p)
    opt.add_device(p)
    p.add_argument("--format", choices=("text", "md", "csv", "json"), default="text",
                   help="aligned text (default), Markdown, CSV or JSON")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--stale", action="store_true",
                      help="the rows that no longer match their variant, and why (kv calibrate --stale re-measures them)")
    what.add_argument("--recorded", action="store_true",
                      help="the call keys recorded by serving processes (KV_RECORD=1), waiting or calibrated")


def run(args: argparse.Namespace) -> int:
    op = opt.op_spec(args.op).name if args.op else None
    device = opt.device(args.device)
    fmt = "json" if args.json else args.format
    if args.stale:
        return _stale(op, device, fmt)
    if args.recorded:
        return _recorded(op, fmt, full=True)
    rows = kv.table(op, device=device)
    if fmt == "json":
        print_json([{"op": r.group.op, "group": r.group.model_dump(mode="json"), "features": r.group.slug(),
                     "shape": list(r.shape), "winner": r.winner, "margin": r.margin, "times_us": r.times_us,
                     "rejected": r.rejected, "missing": list(r.missing), "pruned": r.pruned,
                     "pruned_by_neighbours": sorted(r.by_neighbours), "noise": r.noise,
                     "confidence": r.confidence, "methods": list(r.methods)} for r in rows])
        return 0
    if not rows:
        print("kv table: no calibrated shapes on this device yet (run kv calibrate)", file=sys.stderr)
    by_op: dict[str, list] = {}
    for r in rows:
        by_op.setdefault(r.group.op, []).append(r)
    for i, (name, group_rows) in enumerate(by_op.items()):  # each op has its own axes
        axes = opt.spec_of(name).axes
        variants = sorted({v for r in group_rows for v in (*r.times_us, *r.rejected, *r.pruned)})
        body = []
        for r in group_rows:
            cells = [f"pruned{' by neighbours' if v in r.by_neighbours else ''} >={r.pruned[v]:.1f}x"
                     if v in r.pruned else us(r.times_us[v]) if v in r.times_us
                     else "rejected" if v in r.rejected else None for v in variants]
            noise = r.noise.get(r.winner) if r.winner else None
            body.append([r.group.slug(), *r.shape, r.winner, *cells, percent(r.margin), percent(noise),
                         r.confidence or None, ",".join(r.missing) or None])
        if i:
            print()
        print(render_table(["features", *axes, "winner", *(f"{v} µs" for v in variants), "margin", "noise", "sure",
                            "not measured"], body, fmt=fmt,
                           right=[False, *[True] * len(axes), False, *[True] * len(variants), True, True, False, False]))
    if fmt == "text":  # what else the table holds, below it (csv and md stay one table)
        stale = kv_stale(op, device)
        if stale:
            print(f"\n{len(stale)} stale row{'' if len(stale) == 1 else 's'} ignored (kv table --stale lists them, "
                  "kv calibrate --stale re-measures them)")
        _recorded(op, fmt, full=False)
    return 0


def kv_stale(op: str | None, device: str):
    return kv.stale_rows(op, device=device)


def _stale(op: str | None, device: str, fmt: str) -> int:
    rows = kv_stale(op, device)
    if fmt == "json":
        print_json([{"op": r.group.op, "group": r.group.model_dump(mode="json"), "features": r.group.slug(),
                     "shape": list(r.shape), "variant": r.variant, "measured_version": r.measured,
                     "current_version": r.current, "why": r.why, "legacy": r.legacy, "measured_at": r.measured_at}
                    for r in rows])
        return 0
    if not rows:
        print("kv table: no stale rows on this device", file=sys.stderr)
        return 0
    body = [[r.group.slug(), ",".join(map(str, r.shape)), r.variant, r.measured, r.current, r.why] for r in rows]
    print(render_table(["features", "shape", "variant", "measured version", "version now", "why"], body, fmt=fmt))
    return 0


def _recorded(op: str | None, fmt: str, *, full: bool) -> int:
    entries = [e for e in kv.recorded(pending_only=not full) if op is None or e.get("op") == op]
    if fmt == "json":
        print_json(entries)
        return 0
    if not entries:
        if full:
            print("kv table: no recorded keys (serving processes record with KV_RECORD=1)", file=sys.stderr)
        return 0
    waiting = sum(1 for e in entries if e.get("done_at") is None)
    if not full:
        print(f"\nrecorded by serving processes, not calibrated yet ({waiting}; kv calibrate --recorded measures them):")
    body = [[e.get("op"), e.get("dtype"), e.get("device"),
             " ".join(f"{k}={v}" for k, v in sorted((e.get("features") or {}).items())) or "-",
             ",".join(map(str, e.get("shape") or [])), e.get("seen"),
             "waiting" if e.get("done_at") is None else "calibrated " + time.strftime(
                 "%Y-%m-%d %H:%M", time.localtime(e["done_at"]))] for e in entries]
    print(render_table(["op", "dtype", "device", "features", "shape", "processes", "status"], body,
                       fmt=fmt if fmt in ("md", "csv") else "text"))
    return 0
