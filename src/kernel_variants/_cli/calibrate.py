"""Measure every variant on a sweep of shapes and store the winners in this device's table.

Each variant is checked against the reference on each shape first; one that differs is listed
as rejected with the reason and never chosen. The candidates of a shape are timed in
alternating rounds; after the first, one slower than the best by more than --prune times is
recorded as pruned (with the ratio) and timed no further, and one that lost by more than twice
that at the neighbouring shapes of the run is recorded as pruned by its neighbours without being
checked or timed there (--no-prune: everything checked and timed fully). The summary ends with
where the time went (--breakdown: seconds per kind of work and per variant). A progress bar on stderr shows the
current shape and the time left; --budget bounds the run and lists the shapes it skipped.

What to measure: a sweep or --shapes; --missing (the variants a shape has no figure for);
--stale (rows that no longer match their variant: kv table --stale lists them); --recorded (the
keys serving processes met without a measurement, with KV_RECORD=1).

Under torchrun, ``--distributed`` shares the work among the ranks and leaves every rank with
the same table:

    torchrun --nproc-per-node 8 -m kernel_variants calibrate --distributed --device cuda --sweep seed69
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import TYPE_CHECKING

import kernel_variants as kv

if TYPE_CHECKING:
    from kernel_variants import types
from kernel_variants._cli import _options as opt
from kernel_variants._cli._output import ProgressBar, percent, print_json, render_table, us

# The defaults of kv.calibrate, shown in the options' help.
_DEFAULTS = kv.calibrate.__kwdefaults__
DEFAULT_MARGIN: float = _DEFAULTS["margin"]
DEFAULT_PRUNE: float = _DEFAULTS["prune"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    opt.add_op(p)
    opt.add_sweep(p)
    opt.add_dtype(p)
    opt.add_device(p)
    p.add_argument("--variants", help="comma-separated ids to measure (default: every available one)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--missing", action="store_true",
                      help="per shape, measure only the variants the table has no current figure for")
    what.add_argument("--stale", action="store_true",
                      help="re-measure only the rows that no longer match their variant (kv table --stale)")
    what.add_argument("--recorded", action="store_true",
                      help="measure the keys recorded by serving processes (KV_RECORD=1), each with its own "
                           "features, then mark them done")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                   help=f"a challenger must be this much faster to take a shape, and more than the measured "
                        f"noise (default {DEFAULT_MARGIN})")
    p.add_argument("--prune", type=float, default=DEFAULT_PRUNE, metavar="FACTOR",
                   help=f"after the first round, stop timing a variant slower than the best by more than FACTOR "
                        f"(recorded as pruned, with the ratio; default {DEFAULT_PRUNE:g})")
    p.add_argument("--no-prune", dest="prune", action="store_const", const=None,
                   help="time every variant fully")
    p.add_argument("--budget", metavar="TIME",
                   help="bound the run (5m, 90s, 1h): shapes that no longer fit are skipped and listed")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.add_argument("--breakdown", action="store_true",
                   help="where the time went, in seconds, per kind of work and per variant (the summary's last "
                        "line has the shares; --json always has both)")
    p.add_argument("--distributed", action="store_true", help="share the work among torchrun ranks")
    opt.add_timing(p)
    opt.add_features(p)


def summary(done: types.JobResult) -> list[dict]:
    """Per shape: the winner, its time, the runner-up and the winner's lead, from the table."""
    result = done.result
    out = []
    for shape in done.job.shapes:
        row = done.rows.get(shape)
        times = dict(row.times_us) if row is not None else {}
        w = result.winners.get(shape)
        winner = w.variant if w is not None else None
        others = sorted((t, v) for v, t in times.items() if v != winner)
        out.append({
            "shape": list(shape), "winner": winner, "winner_us": times.get(winner) if winner else None,
            "runner_up": others[0][1] if others else None, "runner_up_us": others[0][0] if others else None,
            "margin": row.margin if row is not None else None, "times_us": times,
            "pruned": dict(row.pruned) if row is not None else {},
            "pruned_by_neighbours": sorted(row.by_neighbours) if row is not None else [],
            "noise": (w.noise if w is not None else None), "confidence": (w.confidence if w is not None else ""),
            "skipped": tuple(shape) in result.skipped,
        })
    return out


def run(args: argparse.Namespace) -> int:
    timing = opt.timing(args)
    dtype = opt.dtype(args.dtype)
    device = opt.device(args.device)
    budget = opt.budget(args.budget)
    chosen = opt.variant_list(args.variants) if args.variants else None
    if args.distributed:
        return _distributed(args, timing, dtype, device, chosen)
    if args.stale or args.recorded:
        select = "stale" if args.stale else "recorded"
        if args.sweep or args.shapes:
            raise ValueError(f"--{select} brings its own shapes: drop --sweep/--shapes")
        op = opt.op_spec(args.op).name if args.op and args.stale else None
        plan = kv.plan_calibration(select, op, device=device, variants=chosen)
        source = "stale rows" if args.stale else "recorded keys"
        axes = opt.spec_of(plan.jobs[0].op).axes if plan.jobs else ("",)
    else:
        work = opt.work(args)
        plan = kv.plan_calibration("missing" if args.missing else "all", work.op, work.shapes, dtype=dtype,
                                   device=device, variants=chosen, **work.features.model_dump())
        source, axes = work.source, work.spec.axes
    bar = None if args.quiet else ProgressBar(axes=axes)
    try:
        done = plan.run(timing=timing, rotate=args.rotate, margin=args.margin, prune=args.prune, budget_s=budget,
                        progress=bar)
    finally:
        if bar is not None:
            bar.close()
    return _report(args, done, source, budget, plan.not_measured)


def _distributed(args, timing, dtype: str, device: str, chosen: list[str] | None) -> int:
    if args.missing or args.stale or args.recorded:
        raise ValueError("--missing/--stale/--recorded: not with --distributed (each rank would see another part "
                         "of the table)")
    if args.budget:
        raise ValueError("--budget: not with --distributed (the ranks would stop at different shapes)")
    work = opt.work(args)
    plan = kv.plan_calibration("all", work.op, work.shapes, dtype=dtype, device=device, variants=chosen,
                               **work.features.model_dump())
    (job,) = plan.jobs
    rank = os.environ.get("RANK", "0")
    bar = None if args.quiet or rank != "0" else ProgressBar("rank 0 share ", axes=work.spec.axes)
    try:
        dres = kv.calibrate(work.op, work.shapes, device=device, progress=bar, dtype=dtype, timing=timing,
                            variants=list(job.variants[job.shapes[0]]), rotate=args.rotate, margin=args.margin,
                            prune=None, distributed=True, **job.features)
    finally:
        if bar is not None:
            bar.close()
    if dres.rank != 0:
        rep = dres.imported
        print(f"kv calibrate: rank {dres.rank}: imported rank 0's table ({rep.added} added, {rep.updated} updated)",
              file=sys.stderr)
        return 0
    job.device = dres.device
    groups = {m.shape: m.group for m in dres.measurements}
    rows = {r.shape: r for r in kv.table(job.op, device=job.device) if groups.get(r.shape) == r.group}
    from kernel_variants.types import JobResult

    return _report(args, [JobResult(job, dres, rows)], work.source, None, [])


def _group_dict(done: types.JobResult) -> dict:
    result = done.result
    return {"op": result.op, "device": result.device, "dtype": result.dtype, "features": done.job.features,
            "shapes": summary(done),
            "rejected": [{"shape": list(m.shape), "variant": m.variant, "reason": m.reason} for m in result.rejected()],
            "pruned": [{"shape": list(m.shape), "variant": m.variant, "at_least": m.pruned_at}
                       for m in result.pruned()],
            "skipped": [list(s) for s in result.skipped],
            "pruned_by_neighbours": len(result.pruned_by_neighbours()),
            "breakdown": result.breakdown.as_dict(result.elapsed_s),
            "measurements": [m.model_dump(mode="json") for m in result.measurements]}


def _report(args, results: list[types.JobResult], source: str, budget: float | None, skipped_keys: list[dict]) -> int:
    elapsed = sum(d.result.elapsed_s for d in results)
    skipped = [s for d in results for s in d.result.skipped]
    if args.json:
        groups = [_group_dict(d) for d in results]
        if len(groups) == 1 and not (args.stale or args.recorded):
            doc = {**groups[0], "sweep": source}
        else:
            doc = {"source": source, "groups": groups}
        doc.update(elapsed_s=elapsed, budget_s=budget, breakdown=_costs(results),
                   not_measured=[{k: e.get(k) for k in ("op", "dtype", "features", "shape", "why")}
                                 for e in skipped_keys])
        print_json(doc)
        return 0
    if not results:
        print(f"kv calibrate: nothing to measure ({source}: none)")
    for i, done in enumerate(results):
        job, result = done.job, done.result
        rows = summary(done)
        if i:
            print()
        n = len(rows)
        what = f" ({job.slug()}), {source}" if args.stale or args.recorded else f", sweep {source}"
        print(f"{result.op} on {result.device} {result.dtype}{what}: {n} shape{'' if n == 1 else 's'}"
              + (f", {job.threads} threads as recorded" if job.threads else ""))
        axes = list(opt.spec_of(job.op).axes)
        table = [[*r["shape"], "(skipped: budget)" if r["skipped"] else r["winner"] or "(none can run it)",
                  us(r["winner_us"]), r["runner_up"], us(r["runner_up_us"]), percent(r["margin"]),
                  percent(r["noise"]), r["confidence"] or None,
                  ", ".join(f"{v} >={b:.1f}x" + (" by neighbours" if v in r["pruned_by_neighbours"] else "")
                            for v, b in sorted(r["pruned"].items())) or None] for r in rows]
        print(render_table([*axes, "winner", "winner µs", "runner-up", "runner-up µs", "margin", "noise", "sure",
                            "pruned"], table))
        rejected = result.rejected()
        if rejected:
            print(f"\nrejected ({len(rejected)}):")
            print(render_table([*axes, "variant", "reason"], [[*m.shape, m.variant, m.reason] for m in rejected]))
    if results:
        _print_costs(results, elapsed, args.breakdown)
    if budget is not None:
        took = _duration(elapsed)
        if skipped:
            listed = "; ".join(",".join(map(str, s)) for s in skipped[:20]) + (" ..." if len(skipped) > 20 else "")
            print(f"\nbudget {_duration(budget)}: measured for {took}; skipped {len(skipped)} shape"
                  f"{'' if len(skipped) == 1 else 's'} that no longer fit: {listed}\n"
                  "(run the same command with --missing to measure them)")
        else:
            print(f"\nbudget {_duration(budget)}: everything measured in {took}")
    if skipped_keys:
        print(f"\nnot measured here ({len(skipped_keys)} recorded key{'' if len(skipped_keys) == 1 else 's'}):")
        for e in skipped_keys:
            print(f"  {e.get('op')} {e.get('dtype')} {','.join(map(str, e.get('shape') or []))}: {e['why']}")
    return 0


def _costs(results: list[types.JobResult]) -> dict:
    """The jobs' breakdowns (``CalibrationResult.breakdown``) added up by their own ``merge``,
    as plain data."""
    if not results:
        return {"seconds": {}, "other_s": 0.0, "by_variant": {}}
    total = copy.deepcopy(results[0].result.breakdown)
    for d in results[1:]:
        total.merge(d.result.breakdown)
    return total.as_dict(sum(d.result.elapsed_s for d in results))


# Each kind of work, as the summary line names it and as --breakdown says it.
_KINDS = {"build": ("build", "building compiled variants"),
          "qualification": ("qualification", "qualifying each class (its edge cases)"),
          "inputs": ("inputs", "making each shape's inputs"),
          "reference": ("reference", "the reference's output at each shape"),
          "checks": ("checks", "checking each variant at each shape"),
          "timing": ("timing", "timing the variants kept"),
          "timing_pruned": ("timing before pruning", "timing variants before they were pruned"),
          "table": ("table", "writing rows, deciding winners"),
          "other": ("other", "the rest: progress, bookkeeping")}


def _print_costs(results: list[types.JobResult], elapsed: float, full: bool) -> None:
    """The summary's last line: the shares of the run's time, largest first, and what pruning
    left out; ``full`` (--breakdown): the seconds, per kind and per variant."""
    costs = _costs(results)
    kinds = {**costs["seconds"], "other": costs["other_s"]}
    pruned = [m for d in results for m in d.result.pruned()]
    near = sum(len(d.result.pruned_by_neighbours()) for d in results)
    shares = ", ".join(f"{_KINDS[k][0]} {s / elapsed:.0%}" for k, s in sorted(kinds.items(), key=lambda kv: -kv[1])
                       if elapsed > 0 and s >= 0.005 * elapsed)
    print(f"\ntook {_duration(elapsed)}: {shares}; pruned: {len(pruned) - near} once timed, {near} by their "
          f"neighbours (neither checked nor timed)" + ("" if full else "; --breakdown: seconds per variant"))
    if not full:
        return
    print(render_table(["work", "s", "share"], [[_KINDS[k][1], f"{s:.1f}", f"{s / elapsed:.0%}" if elapsed else None]
                                                for k, s in kinds.items()]))
    per = costs["by_variant"]
    cols = [k for k in _KINDS if any(k in v for v in per.values())]
    print()
    print(render_table(["variant", *(f"{_KINDS[k][0]} s" for k in cols), "total s"],
                       [[v, *(f"{mine.get(k, 0.0):.1f}" for k in cols), f"{sum(mine.values()):.1f}"]
                        for v, mine in per.items()]))


def _duration(s: float) -> str:
    m, sec = divmod(round(s), 60)
    return f"{m}m{sec:02d}s" if m else f"{s:.1f}s"
