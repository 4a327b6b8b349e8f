"""Regret of the calibrated dispatcher: dispatched time / best variant's time, same run.

Half of a shape grid is calibrated, the other half is held out (reached by the nearest-shape
rule). Then every shape is timed again in one pass, the dispatched op and each variant called
directly side by side, so the ratio is free of drift between runs. Targets: median regret
<= 1.03 on calibrated shapes, <= 1.10 on held-out shapes.

    python tools/bench_regret.py [--dtype bf16] [--quick] [--out reports]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from _report import markdown_table, write_report  # a sibling module: tools/ is sys.path[0]

import kernel_variants as kv
from kernel_variants._dtypes import as_dtype
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._tuning.timing import TimingConfig, measure
from kernel_variants.ops.causal_conv1d._cases import make_case


def _grids(quick: bool) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """A coarse grid to calibrate and the geometric midpoints between its points, held out."""
    if quick:
        coarse, mids = ((1, 16), (256, 2048), (64, 1024)), ((4,), (768,), (256,))
    else:
        coarse = ((1, 8, 64), (256, 1024, 4096), (32, 256, 2048))
        mids = ((3, 24), (512, 2048), (96, 768))

    def product(axes):
        return [(b, d, s) for b in axes[0] for d in axes[1] for s in axes[2] if b * d * s <= 2**25]

    return product(coarse), product(mids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", default="causal_conv1d_fn")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--quick", action="store_true", help="a small grid, for trying things out")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--cache-dir", default=None, help="table location (default: a temporary directory)")
    p.add_argument("--out", default="reports")
    args = p.parse_args(argv)
    os.environ["KV_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="kv-regret-")
    kv.reload()
    dtype = as_dtype(args.dtype)
    calibrated, held_out = _grids(args.quick)
    grid = calibrated + held_out
    timing = TimingConfig(warmup=3, windows=5, iters=args.iters, window_budget_s=0.1)
    kv.calibrate(args.op, calibrated, dtype=dtype, timing=timing)

    op = getattr(kv, args.op)
    rows, data = [], []
    for shape in grid:
        case = make_case(args.op, *shape, dtype=dtype)
        key = dispatcher().registry.spec(args.op).key_of_case(case)
        decision = dispatcher().decide(key)
        times = {}
        for rv in dispatcher().registry.variants(args.op):
            if rv.why_not(key):
                continue
            c = case.fresh()
            times[rv.id] = measure([lambda c=c, fn=rv.variant.fn: fn(*c.args, **c.kwargs)], "cpu", timing).best_us
        best = min(times, key=times.__getitem__)
        # The best variant direct and the dispatched op, alternated so drift and cache state hit
        # both alike; each keeps its fastest round.
        fn = dispatcher().registry.get(args.op, best).variant.fn
        direct_c, op_c = case.fresh(), case.fresh()
        rounds = [(measure([lambda: fn(*direct_c.args, **direct_c.kwargs)], "cpu", timing).best_us,
                   measure([lambda: op(*op_c.args, **op_c.kwargs)], "cpu", timing).best_us) for _ in range(3)]
        times[best] = min(r[0] for r in rounds)
        dispatched = min(r[1] for r in rounds)
        kind = "calibrated" if shape in calibrated else "held-out"
        regret = dispatched / times[best]
        rows.append([kind, *shape, decision.chosen.id, best, dispatched, times[best], regret])
        data.append(dict(kind=kind, shape=shape, chosen=decision.chosen.id, best=best, dispatched_us=dispatched,
                         variants_us=times, regret=regret, source=decision.source))
    summary = {}
    for kind, target in (("calibrated", 1.03), ("held-out", 1.10)):
        r = [d["regret"] for d in data if d["kind"] == kind]
        summary[kind] = {"median": statistics.median(r), "max": max(r), "target_median": target, "n": len(r)}
    table = markdown_table(["set", "B", "D", "L", "chosen", "best", "dispatched us", "best us", "regret"], rows)
    lines = [f"# Regret of the dispatcher ({args.op}, {args.dtype}, CPU)", "", table, ""]
    for kind, s in summary.items():
        lines.append(f"{kind}: median regret {s['median']:.3f} (target <= {s['target_median']}), "
                     f"worst {s['max']:.3f}, {s['n']} shapes")
    text = "\n".join(lines)
    print(text)
    md, js = write_report(args.out, "regret", text, {"summary": summary, "shapes": data})
    print(f"\nwrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
