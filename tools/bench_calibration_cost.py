"""What pruning saves: one sweep calibrated twice on this machine, with pruning (the default:
a variant more than 3x slower than the best after the first round is timed no further) and
without (every variant fully timed), each into a fresh table. Prints both wall times and the
winners side by side; the target is seed69-cpu (bf16, every CPU variant) in <= 3 minutes with
the same winners as the full measurement.

    python3 tools/bench_calibration_cost.py [--sweep seed69-cpu] [--dtype bf16] [--prune 3]
        [--only pruned|full] [--out reports]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from _report import markdown_table, write_report  # a sibling module: tools/ is sys.path[0]

import kernel_variants as kv
from kernel_variants._cli._options import find_sweep
from kernel_variants._dtypes import canonical
from kernel_variants._table.fingerprint import fingerprint


def _calibrate(sweep, dtype: str, prune: float | None, quiet: bool) -> dict:
    os.environ["KV_CACHE_DIR"] = tempfile.mkdtemp(prefix="kv-cost-")
    kv.reload()
    shapes_done: set = set()

    def progress(p) -> None:  # one line per ten shapes
        if not quiet and p.shape not in shapes_done:
            shapes_done.add(p.shape)
            if len(shapes_done) % 10 == 0:
                print(f"  {'pruned' if prune else 'full'}: {len(shapes_done)} shapes in {p.elapsed_s:.0f} s",
                      file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    result = kv.calibrate(sweep.op, list(sweep.shapes), dtype=dtype, prune=prune, progress=progress,
                          **dict(sweep.features))
    wall = time.perf_counter() - t0
    rows = {r.shape: r for r in kv.table(sweep.op)}
    return {
        "wall_s": wall,
        "winners": {s: (w.variant if w else None) for s, w in result.winners.items()},
        "winner_us": {s: rows[s].times_us.get(rows[s].winner) if s in rows and rows[s].winner else None
                      for s in result.winners},
        "times": {s: dict(rows[s].times_us) for s in rows},
        "pruned": sum(1 for m in result.measurements if m.status == "pruned"),
        "timed": sum(1 for m in result.measurements if m.status == "ok"),
        "rejected": sum(1 for m in result.measurements if m.status == "rejected"),
        "variants": sorted({m.variant for m in result.measurements}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", default="seed69-cpu")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--prune", type=float, default=3.0)
    p.add_argument("--only", choices=("pruned", "full"), help="run one of the two (for trying things out)")
    p.add_argument("--quiet", "-q", action="store_true")
    p.add_argument("--out", default="reports")
    args = p.parse_args(argv)
    sweep = find_sweep(args.sweep, None)
    dtype = canonical(args.dtype)
    runs = {}
    for name, prune in (("pruned", args.prune), ("full", None)):
        if args.only in (None, name):
            print(f"{name}: {sweep.name}, {len(sweep.shapes)} shapes, {dtype}", file=sys.stderr)
            runs[name] = _calibrate(sweep, dtype, prune, args.quiet)
    shapes = list(sweep.shapes)
    pr, fu = runs.get("pruned"), runs.get("full")
    table, same, differ = [], 0, []
    for s in shapes:
        a = pr["winners"].get(s) if pr else None
        b = fu["winners"].get(s) if fu else None
        if pr and fu:
            same += a == b
            if a != b:
                # how far apart the two winners are in the full run's own figures
                t = fu["times"].get(s, {})
                ratio = t[a] / t[b] if a in t and b in t else None
                differ.append({"shape": list(s), "pruned": a, "full": b, "full_ratio": ratio})
        table.append([",".join(map(str, s)), a or "-", b or "-", "" if not (pr and fu) else "yes" if a == b else "NO"])
    fp = fingerprint("cpu")
    head = [f"# Calibration cost: `{sweep.name}` ({len(shapes)} shapes, {dtype}), pruning at {args.prune:g}x vs none",
            "", f"{fp['name']}, {fp['threads']} threads; variants: {', '.join((pr or fu)['variants'])}", ""]
    summary = [["run", "wall", "fully timed", "pruned", "rejected"]]
    lines = []
    for name, r in runs.items():
        lines.append([name, f"{r['wall_s']:.0f} s ({r['wall_s'] / 60:.1f} min)", r["timed"], r["pruned"], r["rejected"]])
    md = "\n".join(head) + markdown_table(summary[0], lines) + "\n\n"
    if pr and fu:
        md += (f"pruned / full wall time: {pr['wall_s'] / fu['wall_s']:.2f}; winners equal on {same} of "
               f"{len(shapes)} shapes\n\n")
        if differ:
            md += markdown_table(["shape", "pruned run", "full run", "full run: pruned winner / full winner"],
                                 [[",".join(map(str, d["shape"])), d["pruned"], d["full"], d["full_ratio"]]
                                  for d in differ]) + "\n\n"
    md += markdown_table(["shape", "winner (pruned)", "winner (full)", "same"], table)
    print(md)
    data = {"sweep": sweep.name, "dtype": dtype, "prune": args.prune, "fingerprint": fp,
            "runs": {n: {"wall_s": r["wall_s"], "timed": r["timed"], "pruned": r["pruned"], "rejected": r["rejected"],
                         "winners": {",".join(map(str, s)): w for s, w in r["winners"].items()}}
                     for n, r in runs.items()},
            "winners_equal": same if pr and fu else None, "differ": differ}
    if args.only is None:
        md_path, _ = write_report(args.out, "calibration_cost", md, data)
        print(f"\nwrote {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
