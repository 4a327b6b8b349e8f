"""Why the CPU variant of gemma_rms_norm is a C++ kernel and not torch.compile: both (and aten)
on the same inputs, checked against the reference first, timed in alternating rounds in one run.

    python tools/bench_rms_compile.py [--dtypes bf16,fp32] [--out reports]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _report import markdown_table, write_report  # a sibling module: tools/ is sys.path[0]

import kernel_variants as kv
from kernel_variants._dtypes import as_dtype
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._tolerances import mismatch
from kernel_variants._tuning.timing import TimingConfig, measure
from kernel_variants.ops.gemma_rms_norm._spec import reference_fn

SHAPES = [(1, 4096), (16, 4096), (256, 2048), (1024, 4096), (4096, 1024), (4096, 8192)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="reports")
    args = p.parse_args(argv)
    registry = dispatcher().registry
    native = registry.get("gemma_rms_norm", "cpu_native")
    if native.ensure_built() is not None:
        raise SystemExit(f"cpu_native unavailable: {native.unavailable_reason()}")
    candidates = {"cpu_native": native.variant.fn, "aten": registry.get("gemma_rms_norm", "aten").variant.fn}
    timing = TimingConfig(warmup=2, windows=3, iters=20, window_budget_s=0.05)
    rows, data = [], []
    for name in args.dtypes.split(","):
        dtype = as_dtype(name)
        for t, d in SHAPES:
            x = torch.randn(t, d).mul(3).to(dtype)
            w = torch.randn(d).mul(0.5).to(dtype)
            expected = reference_fn(x, w)
            torch._dynamo.reset()  # one static compile per shape, as a serving process would hold
            candidates["compile"] = torch.compile(reference_fn, dynamic=False)
            for label, fn in candidates.items():  # correctness before speed
                why = mismatch(fn(x, w), expected, label)
                if why is not None:
                    raise SystemExit(f"{label} differs from the reference at {(t, d)} {name}: {why}")
            best = {label: float("inf") for label in candidates}
            for _ in range(args.rounds):  # alternating rounds: load lands on every candidate alike
                for label, fn in candidates.items():
                    best[label] = min(best[label], measure([lambda fn=fn: fn(x, w)], "cpu", timing).best_us)
            rows.append([name, t, d, *(best[k] for k in candidates),
                         best["compile"] / best["cpu_native"], best["aten"] / best["cpu_native"]])
            data.append({"dtype": name, "shape": [t, d], "us": best})
    head = ["dtype", "T", "D", "cpu_native µs", "aten µs", "compile µs", "compile/cpu_native", "aten/cpu_native"]
    table = markdown_table(head, rows)
    ratios = [r[-2] for r in rows]
    summary = (f"compile/cpu_native: median {statistics.median(ratios):.2f}x, min {min(ratios):.2f}x over "
               f"{len(rows)} shapes; cpu_native faster on {sum(r > 1 for r in ratios)} of them")
    print(table + "\n\n" + summary)
    md, js = write_report(args.out, "bench_rms_compile", "# gemma_rms_norm on the CPU: C++ vs torch.compile vs aten\n\n"
                          + table + "\n\n" + summary + "\n", {"rows": data})
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    kv.reload()
    raise SystemExit(main())
