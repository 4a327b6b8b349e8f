"""The CPU sweep: every available variant on every shape, against a copy of the same bytes.

causal_conv1d is memory-bound: per call it must read x once and write the output once, so the
floor on any device is the time to stream those bytes, which a plain ``out.copy_(x)`` measures.
For each shape this script calibrates every variant through the library (each is checked against
the reference first, then timed with the project's harness, and the table's winner decided), and
in the same run times that copy. It writes a markdown table (each variant's microseconds, the
winner, winner/copy), a JSON file, and a PNG of each variant's time relative to the copy.
Two more columns time cpu_native directly: writing into a preallocated ``out=`` tensor (what a
caller that reuses its output pays) and on one thread (against a one-thread copy); the header
names the ISA build of the C++ kernel that ran.

    python tools/sweep_cpu.py                    # seed69-cpu prefill in bf16 and fp32, decode sweeps
    python tools/sweep_cpu.py --quick            # a subset, for trying things out
    python tools/sweep_cpu.py --dtypes bf16 --sweeps seed69-cpu
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from _report import markdown_table, write_report  # a sibling module: tools/ is sys.path[0]

import kernel_variants as kv
from kernel_variants._dtypes import as_dtype
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._tuning.timing import TimingConfig, measure
from kernel_variants.plugin import Sweep


def get_sweep(name: str) -> Sweep:
    """The named sweep of whichever registered op has it."""
    for spec in dispatcher().registry.ops():
        if name in spec.sweeps:
            return spec.sweeps[name]
    known = [n for spec in dispatcher().registry.ops() for n in spec.sweeps]
    raise SystemExit(f"--sweeps: expected names among {', '.join(known)}, got {name!r}")


def _copy_us(sweep: Sweep, shape, dtype: torch.dtype, timing: TimingConfig) -> tuple[float, float]:
    """A copy of x's bytes into an output-sized buffer (the floor for this shape), and the same
    copy into a freshly allocated one (``clone``), which an op returning a new tensor also pays."""
    spec = dispatcher().registry.spec(sweep.op)
    case = spec.sweep_case(shape, spec.features(**sweep.features), dtype=dtype, device="cpu")
    x = case.args[0]  # every op's first argument is its input x
    out = torch.empty_like(x)
    return (measure([lambda: out.copy_(x)], "cpu", timing).best_us,
            measure([lambda: x.clone()], "cpu", timing).best_us)


def _native_us(sweep: Sweep, shape, dtype: torch.dtype, timing: TimingConfig) -> dict[str, float]:
    """cpu_native writing into a preallocated output, and on one thread against a one-thread
    copy; empty where cpu_native does not take this call."""
    from kernel_variants.kernels import cpu_native

    fn = {"causal_conv1d_fn": cpu_native.causal_conv1d_fn,
          "causal_conv1d_update": cpu_native.causal_conv1d_update}.get(sweep.op)
    if fn is None:
        return {}
    spec = dispatcher().registry.spec(sweep.op)
    case = spec.sweep_case(shape, spec.features(**sweep.features), dtype=dtype, device="cpu")
    x = case.args[0]
    out, dst = torch.empty_like(x), torch.empty_like(x)
    res = {"out_us": measure([lambda: fn(*case.args, **case.kwargs, out=out)], "cpu", timing).best_us}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res["t1_us"] = measure([lambda: fn(*case.args, **case.kwargs)], "cpu", timing).best_us
        res["t1_copy_us"] = measure([lambda: dst.copy_(x)], "cpu", timing).best_us
    finally:
        torch.set_num_threads(threads)
    return res


def isa_path() -> str:
    try:
        from kernel_variants.kernels import cpu_native

        return cpu_native.isa_path()
    except (ImportError, RuntimeError) as exc:
        return f"unavailable ({str(exc).splitlines()[0]})"


def run_sweep(name: str, dtype_name: str, timing: TimingConfig, quick: bool, skip: set[str]) -> dict:
    sweep = get_sweep(name)
    shapes = list(sweep.shapes)
    if quick:
        shapes = shapes[:: max(1, len(shapes) // 8)]
    dtype = as_dtype(dtype_name)
    variants = [rv.id for rv in kv.variants(sweep.op) if rv.id not in skip and rv.unavailable_reason() is None]
    rows = []
    t0 = time.perf_counter()
    for i, shape in enumerate(shapes):
        res = kv.calibrate(sweep.op, [shape], dtype=dtype, variants=variants,
                           **sweep.features, timing=timing)
        copy, clone = _copy_us(sweep, shape, dtype, timing)
        times = {m.variant: m.best_us for m in res.measurements if m.status == "ok"}
        native = _native_us(sweep, shape, dtype, timing) if "cpu_native" in times else {}
        rejected = {m.variant: m.reason for m in res.rejected()}
        winner = res.winners.get(tuple(shape))
        rows.append(dict(shape=list(shape), copy_us=copy, clone_us=clone, times_us=times, rejected=rejected, **native,
                         winner=winner.variant if winner else None,
                         fastest=min(times, key=times.__getitem__) if times else None))
        extra = (f"; cpu_native out= {native['out_us'] / copy:.2f}x, 1 thread {native['t1_us'] / native['t1_copy_us']:.2f}x"
                 if native else "")
        print(f"  [{name} {dtype_name}] {i + 1}/{len(shapes)} {shape}: "
              + ", ".join(f"{v} {t / copy:.2f}x" for v, t in sorted(times.items())) + extra, flush=True)
    return dict(sweep=name, op=sweep.op, dtype=dtype_name, variants=variants, rows=rows,
                seconds=time.perf_counter() - t0)


def summarize(result: dict) -> dict:
    rows = result["rows"]
    best = [min(r["times_us"].values()) / r["copy_us"] for r in rows if r["times_us"]]
    over_clone = [min(r["times_us"].values()) / r["clone_us"] for r in rows if r["times_us"]]
    out = {"best_over_copy_median": statistics.median(best), "best_over_copy_worst": max(best),
           "best_over_clone_median": statistics.median(over_clone),
           "winners": sorted({r["winner"] for r in rows if r["winner"]})}
    if native := [r for r in rows if "out_us" in r]:
        out["cpu_native_out_over_copy_median"] = statistics.median(r["out_us"] / r["copy_us"] for r in native)
        out["cpu_native_1thread_over_copy_median"] = statistics.median(r["t1_us"] / r["t1_copy_us"] for r in native)
    if all("cpu_native" in r["times_us"] and "aten" in r["times_us"] for r in rows):
        speedup = [r["times_us"]["aten"] / r["times_us"]["cpu_native"] for r in rows]
        out["aten_over_cpu_native_median"] = statistics.median(speedup)
        out["cpu_native_slower_than_aten_by_10pct"] = [
            r["shape"] for r in rows if r["times_us"]["cpu_native"] > 1.1 * r["times_us"]["aten"]]
    out["variant_over_copy_median"] = {
        v: statistics.median(ts) for v in result["variants"]
        if (ts := [r["times_us"][v] / r["copy_us"] for r in rows if v in r["times_us"]])}
    out["wins"] = {v: sum(r["fastest"] == v for r in rows) for v in result["variants"]}
    b1 = [r for r in rows if r["shape"][0] == 1]
    if result["op"] == "causal_conv1d_update" and b1:  # decode latency at B=1 is a figure of its own
        out["b1_best_us"] = {str(r["shape"]): min(r["times_us"].values()) for r in b1 if r["times_us"]}
    return out


def to_markdown(result: dict, summary: dict) -> str:
    variants = result["variants"]
    rows = []
    for r in result["rows"]:
        best = min(r["times_us"].values()) if r["times_us"] else float("nan")
        nan = float("nan")
        rows.append([*r["shape"], r["copy_us"], *[r["times_us"].get(v, nan) for v in variants],
                     r["winner"] or "-", best / r["copy_us"], r.get("out_us", nan) / r["copy_us"],
                     r.get("t1_us", nan) / r.get("t1_copy_us", nan)])
    head = f"## {result['sweep']} ({result['op']}, {result['dtype']}): microseconds per call"
    axes = list(dispatcher().registry.spec(result["op"]).axes)
    table = markdown_table([*axes, "copy", *variants, "winner", "winner/copy", "native out=/copy",
                            "native 1-thread/copy"], rows)
    lines = [head, "", table, ""]
    lines.append("variant/copy median: " + ", ".join(
        f"{v} {m:.2f}" for v, m in summary["variant_over_copy_median"].items()))
    lines.append("fastest on: " + ", ".join(f"{v} {n}/{len(result['rows'])}" for v, n in summary["wins"].items()))
    lines.append(f"best/copy: median {summary['best_over_copy_median']:.2f}, worst {summary['best_over_copy_worst']:.2f}; "
                 f"best/clone: median {summary['best_over_clone_median']:.2f}; winners: {', '.join(summary['winners'])}")
    if "cpu_native_out_over_copy_median" in summary:
        lines.append(f"cpu_native out=/copy median {summary['cpu_native_out_over_copy_median']:.2f}; "
                     f"one thread (vs a one-thread copy) median {summary['cpu_native_1thread_over_copy_median']:.2f}")
    if "aten_over_cpu_native_median" in summary:
        slow = summary["cpu_native_slower_than_aten_by_10pct"]
        lines.append(f"aten/cpu_native: median {summary['aten_over_cpu_native_median']:.2f}x; "
                     f"cpu_native >10% slower than aten on {len(slow)} shapes {slow if slow else ''}")
    if "b1_best_us" in summary:
        lines.append("B=1 best us: " + ", ".join(f"{k} {v:.1f}" for k, v in summary["b1_best_us"].items()))
    rejected = {(v, why) for r in result["rows"] for v, why in r["rejected"].items()}
    for v, why in sorted(rejected):
        lines.append(f"rejected: {v}: {why}")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install -e '.[plot]'): no PNG written"
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 3.2 * len(results)), squeeze=False)
    for ax, res in zip(axes[:, 0], results, strict=True):
        for v in res["variants"]:
            ys = [r["times_us"].get(v, float("nan")) / r["copy_us"] for r in res["rows"]]
            ax.plot(range(len(ys)), ys, marker=".", label=v)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("time / copy")
        ax.set_title(f"{res['sweep']} {res['op']} {res['dtype']}")
        ax.set_xlabel("shape index (sweep order)")
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweeps", default="seed69-cpu,decode,decode-spec")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip", default="reference", help="variants not to time (the oracle is still run)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--window-budget", type=float, default=0.05)
    p.add_argument("--cache-dir", default=None, help="table location (default: a temporary directory)")
    p.add_argument("--out", default="reports")
    args = p.parse_args(argv)
    os.environ["KV_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="kv-sweep-")
    kv.reload()
    timing = TimingConfig(warmup=args.warmup, windows=args.windows, iters=args.iters,
                          window_budget_s=args.window_budget)
    results, sections, data = [], [], {"isa_path": isa_path()}
    print(f"cpu_native ISA path: {data['isa_path']}", flush=True)
    for name in args.sweeps.split(","):
        dtypes = args.dtypes.split(",")
        for dt in dtypes:
            res = run_sweep(name, dt, timing, args.quick, set(filter(None, args.skip.split(","))))
            summary = summarize(res)
            results.append(res)
            sections.append(to_markdown(res, summary))
            data[f"{name}/{dt}"] = {"summary": summary, **res}
            print(sections[-1].split("\n\n", 1)[-1].split("\n\n", 1)[-1], flush=True)
    text = (f"# CPU sweep: each variant against a copy of the same bytes\n\ncpu_native ISA path: {data['isa_path']}\n\n"
            + "\n\n".join(sections))
    md, js = write_report(args.out, "sweep_cpu", text, data)
    png = os.path.join(args.out, "sweep_cpu.png")
    why = plot(results, png)
    print(f"\nwrote {md}, {js}" + (f" and {png}" if why is None else f" ({why})"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
