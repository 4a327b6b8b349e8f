"""Measure every variant on a sweep of shapes and store the winners in this device's table.

Each variant is checked against the reference on each shape first; one that differs is listed
as rejected with the reason and never chosen. The candidates of a shape are timed in
alternating rounds; after the first, one slower than the best by more than --prune times is
recorded as pruned (with the ratio) and timed no further. A progress bar on stderr shows the
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
import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

import kernel_variants as kv
from kernel_variants._cli import _options as opt
from kernel_variants._cli._output import ProgressBar, percent, print_json, render_table, us
from kernel_variants._registry import Features, OpSpec
from kernel_variants._registry.spec import Shape
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
from kernel_variants._table.rows import DEFAULT_PRUNE, check_margin, check_prune
from kernel_variants._table.table import DEFAULT_MARGIN, Group
from kernel_variants._tuning.calibrate import CalibrationResult


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
    p.add_argument("--distributed", action="store_true", help="share the work among torchrun ranks")
    opt.add_timing(p)
    opt.add_features(p)


@dataclass
class Job:
    """Shapes of one group to measure, and with which variants (per shape)."""

    spec: OpSpec
    features: Features
    dtype: str
    device: str
    todo: dict[Shape, list[str]]
    source: str
    threads: int | None = None  # a recorded key's CPU thread count, when it differs from ours
    ids: dict[Shape, str] = field(default_factory=dict)  # the recorded key of each shape

    @property
    def op(self) -> str:
        return self.spec.name


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
            "pruned": dict(row.pruned) if row is not None else {},
            "noise": (w.noise if w is not None else None), "confidence": (w.confidence if w is not None else ""),
            "skipped": tuple(shape) in result.skipped,
        })
    return out


def _available(spec: OpSpec) -> list[str]:
    return [rv.id for rv in kv.variants(spec.name) if rv.unavailable_reason() is None]


def _missing(job: Job) -> Job:
    """The variants without a current figure at each of ``job``'s shapes (all for a new shape)."""
    group = Group(op=job.op, dtype=job.dtype, features=job.features.model_dump())
    rows = {r.shape: r for r in kv.table(job.op, device=job.device) if r.group == group}
    todo = {}
    for shape, variants in job.todo.items():
        row = rows.get(tuple(shape))
        have = set(row.times_us) | set(row.rejected) | set(row.pruned) if row is not None else set()
        todo[shape] = [v for v in variants if v not in have]
    job.todo = todo
    return job


def _stale_jobs(op: str | None, device: str, variants: list[str] | None) -> tuple[list[Job], dict[tuple, list[str]]]:
    """One job per group of the stale rows, each shape with the variants stale there; and the
    storage keys of the legacy rows they replace, by (group, shape, variant): dropped once
    re-measured."""
    from kernel_variants._api import stale_rows

    jobs: dict[Group, Job] = {}
    legacy: dict[tuple, list[str]] = {}
    for r in stale_rows(op, device=device):
        if variants is not None and r.variant not in variants:
            continue
        spec = opt.registry().spec(r.group.op)
        try:
            features = spec.features(**r.group.flags())
        except ValueError:
            continue  # features this release does not know
        job = jobs.setdefault(r.group, Job(spec, features, r.group.dtype, device, {}, "stale rows"))
        job.todo.setdefault(r.shape, []).append(r.variant)
        if r.legacy:
            legacy[(r.group, r.shape, r.variant)] = [r.key, r.winner_key]
    return list(jobs.values()), legacy


def _recorded_jobs(device: str, variants: list[str] | None) -> tuple[list[Job], list[dict]]:
    """One job per group of the recorded keys waiting for calibration on this device type, and
    the keys that cannot be measured here (with why)."""
    ours = fingerprint(device)
    skipped = []
    jobs: dict[tuple, Job] = {}
    for entry in kv_recorded(pending_only=True):
        why, threads = _recorded_fit(entry, ours, device)
        if why is None:
            try:
                spec = opt.registry().spec(str(entry["op"]))
                features = spec.features(**dict(entry["features"]))
                shape = tuple(int(v) for v in entry["shape"])
                if len(shape) != len(spec.axes):
                    raise ValueError(f"shape {shape} is not {spec.name}'s")
            except (ValueError, TypeError, KeyError) as exc:
                why = f"not a call this release can make ({exc})"
        if why is not None:
            skipped.append({**entry, "why": why})
            continue
        ids = [v for v in _available(spec) if variants is None or v in variants]
        slot = (spec.name, entry["dtype"], Group(op=spec.name, dtype=entry["dtype"], features=features.model_dump()),
                threads)
        job = jobs.setdefault(slot, Job(spec, features, str(entry["dtype"]), device, {}, "recorded keys",
                                        threads=threads))
        job.todo[shape] = ids
        job.ids[shape] = str(entry["id"])
    return list(jobs.values()), skipped


def kv_recorded(pending_only: bool = False) -> list[dict]:
    from kernel_variants._api import recorded

    return recorded(pending_only)


def _recorded_fit(entry: dict, ours: dict[str, str], device: str) -> tuple[str | None, int | None]:
    """(why a recorded key cannot be measured here or None, the thread count to measure it with)."""
    if entry.get("device") != torch.device(device).type:
        return f"recorded on {entry.get('device')}, not {torch.device(device).type} (pass --device)", None
    theirs = entry.get("fingerprint")
    if not isinstance(theirs, dict) or entry.get("fingerprint_id") == fingerprint_id(ours):
        return None, None
    differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    if differ == ["threads"] and str(theirs.get("threads", "")).isdigit():
        return None, int(theirs["threads"])  # the serving process's thread count: measured with it
    diff = ", ".join(f"{k} {theirs.get(k, '(none)')!r} vs {ours.get(k, '(none)')!r} here" for k in differ)
    return f"recorded on another device or stack ({diff})", None


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(args: argparse.Namespace) -> int:
    timing = opt.timing(args)
    dtype = opt.dtype(args.dtype)
    device = opt.device(args.device)
    check_margin(args.margin)
    prune = check_prune(args.prune)
    budget = opt.budget(args.budget)
    chosen = opt.variant_list(args.variants) if args.variants else None
    if args.distributed:
        return _distributed(args, timing, dtype, device, chosen)
    legacy: dict[tuple, list[str]] = {}
    skipped_keys: list[dict] = []
    if args.stale or args.recorded:
        if args.sweep or args.shapes:
            raise ValueError(f"--{'stale' if args.stale else 'recorded'} brings its own shapes: drop --sweep/--shapes")
        if args.stale:
            jobs, legacy = _stale_jobs(opt.op_spec(args.op).name if args.op else None, device, chosen)
        else:
            jobs, skipped_keys = _recorded_jobs(device, chosen)
        source = "stale rows" if args.stale else "recorded keys"
    else:
        work = opt.work(args)
        # Named explicitly, so that the progress total counts only variants that can run here.
        variants = chosen or _available(work.spec)
        jobs = [Job(work.spec, work.features, dtype, device, {tuple(s): list(variants) for s in work.shapes},
                    work.source)]
        if args.missing:
            jobs = [_missing(jobs[0])]
        source = work.source
    results = []
    left = budget
    bar = None if args.quiet else ProgressBar(axes=jobs[0].spec.axes if jobs else ("",))
    _table().quiet_stale = args.stale
    try:
        for job in jobs:
            result, left = _run_job(job, args, timing, prune, left, bar)
            results.append((job, result))
    finally:
        _table().quiet_stale = False
        if bar is not None:
            bar.close()
    if legacy:  # the rows of an earlier release that were measured again: superseded
        measured = {(m.group, m.shape, m.variant) for _, r in results for m in r.measurements}
        _table().drop([k for triple, keys in legacy.items() if triple in measured for k in keys])
    if args.recorded:
        _mark_done([job.ids[s] for job, r in results for s in {m.shape for m in r.measurements} if s in job.ids])
    return _report(args, results, source, budget, skipped_keys)


def _table():
    from kernel_variants._runtime.dispatcher import dispatcher

    return dispatcher().table


def _mark_done(ids: list[str]) -> None:
    from kernel_variants._api import recorder

    r = recorder()
    try:
        r.mark_done(ids)
    finally:
        r.close()


def _run_job(job: Job, args, timing, prune, left: float | None, bar) -> tuple[CalibrationResult, float | None]:
    """Measure one job, per set of variants; returns its result and the budget left."""
    result = CalibrationResult(job.op, job.device, job.dtype)
    by_ids: dict[tuple[str, ...], list[Shape]] = {}
    for shape, ids in job.todo.items():
        by_ids.setdefault(tuple(ids), []).append(shape)
    for ids, shapes in by_ids.items():
        if not ids:
            continue
        if left is not None and left <= 0:
            result.skipped += shapes
            continue
        with _threads(job.threads):
            part = kv.calibrate(job.op, shapes, device=job.device, rotate=args.rotate, margin=args.margin, dtype=job.dtype,
                                variants=list(ids), progress=bar, prune=prune, budget_s=left,
                                **job.features.model_dump(), timing=timing)
        result.measurements += part.measurements
        result.winners.update(part.winners)
        result.skipped += part.skipped
        result.elapsed_s += part.elapsed_s
        if left is not None:
            left -= part.elapsed_s
    return result, left


def _distributed(args, timing, dtype: str, device: str, chosen: list[str] | None) -> int:
    if args.missing or args.stale or args.recorded:
        raise ValueError("--missing/--stale/--recorded: not with --distributed (each rank would see another part "
                         "of the table)")
    if args.budget:
        raise ValueError("--budget: not with --distributed (the ranks would stop at different shapes)")
    from kernel_variants._tuning.distributed import calibrate_distributed, torchrun_env

    work = opt.work(args)
    variants = chosen or _available(work.spec)
    rank = torchrun_env()[0]
    bar = None if args.quiet or rank != 0 else ProgressBar("rank 0 share ", axes=work.spec.axes)
    try:
        dres = calibrate_distributed(work.op, work.shapes, device=device, features=work.features, progress=bar,
                                     dtype=dtype, timing=timing, variants=variants, rotate=args.rotate,
                                     margin=args.margin)
    finally:
        if bar is not None:
            bar.close()
    if rank != 0:
        rep = dres.imported
        print(f"kv calibrate: rank {rank}: imported rank 0's table ({rep.added} added, {rep.updated} updated)",
              file=sys.stderr)
        return 0
    job = Job(work.spec, work.features, dtype, dres.result.device, {tuple(s): variants for s in work.shapes},
              work.source)
    return _report(args, [(job, dres.result)], work.source, None, [])


def _summary(job: Job, result: CalibrationResult) -> list[dict]:
    with _threads(job.threads):  # the table as the measurements were filed (a recorded thread count)
        return summary(result, list(job.todo), job.device)


def _group_dict(job: Job, result: CalibrationResult) -> dict:
    rows = _summary(job, result)
    return {"op": result.op, "device": result.device, "dtype": result.dtype, "features": job.features.model_dump(),
            "shapes": rows,
            "rejected": [{"shape": list(m.shape), "variant": m.variant, "reason": m.reason} for m in result.rejected()],
            "pruned": [{"shape": list(m.shape), "variant": m.variant, "at_least": m.pruned_at}
                       for m in result.pruned()],
            "skipped": [list(s) for s in result.skipped],
            "measurements": [m.model_dump(mode="json") for m in result.measurements]}


def _report(args, results, source: str, budget: float | None, skipped_keys: list[dict]) -> int:
    elapsed = sum(r.elapsed_s for _, r in results)
    skipped = [(job, s) for job, r in results for s in r.skipped]
    if args.json:
        groups = [_group_dict(job, r) for job, r in results]
        if len(groups) == 1 and not (args.stale or args.recorded):
            doc = {**groups[0], "sweep": source}
        else:
            doc = {"source": source, "groups": groups}
        doc.update(elapsed_s=elapsed, budget_s=budget,
                   not_measured=[{k: e.get(k) for k in ("op", "dtype", "features", "shape", "why")}
                                 for e in skipped_keys])
        print_json(doc)
        return 0
    if not results:
        print(f"kv calibrate: nothing to measure ({source}: none)")
    for i, (job, result) in enumerate(results):
        rows = _summary(job, result)
        if i:
            print()
        n = len(rows)
        if args.stale or args.recorded:
            group = Group(op=job.op, dtype=job.dtype, features=job.features.model_dump())
            what = f" ({group.slug()}), {source}"
        else:
            what = f", sweep {source}"
        print(f"{result.op} on {result.device} {result.dtype}{what}: {n} shape{'' if n == 1 else 's'}"
              + (f", {job.threads} threads as recorded" if job.threads else ""))
        axes = list(job.spec.axes)
        table = [[*r["shape"], "(skipped: budget)" if r["skipped"] else r["winner"] or "(none can run it)",
                  us(r["winner_us"]), r["runner_up"], us(r["runner_up_us"]), percent(r["margin"]),
                  percent(r["noise"]), r["confidence"] or None,
                  ", ".join(f"{v} >={b:.1f}x" for v, b in sorted(r["pruned"].items())) or None] for r in rows]
        print(render_table([*axes, "winner", "winner µs", "runner-up", "runner-up µs", "margin", "noise", "sure",
                            "pruned"], table))
        rejected = result.rejected()
        if rejected:
            print(f"\nrejected ({len(rejected)}):")
            print(render_table([*axes, "variant", "reason"], [[*m.shape, m.variant, m.reason] for m in rejected]))
    if budget is not None:
        took = _duration(elapsed)
        if skipped:
            listed = "; ".join(",".join(map(str, s)) for _, s in skipped[:20]) + (" ..." if len(skipped) > 20 else "")
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


def _duration(s: float) -> str:
    m, sec = divmod(round(s), 60)
    return f"{m}m{sec:02d}s" if m else f"{s:.1f}s"
