"""cpu_native causal_conv1d against a copy of the same bytes: the hot-path targets in one run.

Each figure is a time divided by the time of ``out.copy_(x)`` into an existing tensor of x's
shape, measured in the same process and interleaved with it (every repeat times each
candidate once, in turn; the minimum over repeats is kept, the median too for large shapes),
so machine noise that drifts absolute times largely cancels in the ratios.

1. cache-resident 1x256x4096 ([B, L, D]), one thread: fp32 without activation, bf16 with SiLU.
2. the same, 1 -> 2 threads: the kernel's speedup over the copy's speedup; and so at widths
   that are not a multiple of the 2048-channel tile (1x1024xD bf16 with SiLU, ``out=``), where
   the tiles are made equal so that each thread gets its share of the channels.
3. large bf16 SiLU shapes, all threads: writing into a preallocated ``out=`` and into a fresh
   output, and the fresh-output call in a subprocess with glibc's malloc tunables set so freed
   outputs are reused instead of returned to the kernel (the allocator advice).

    python tools/bench_cpu_roofline.py            # everything (~2 minutes)
    python tools/bench_cpu_roofline.py --repeats 3 --no-alloc
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from _report import ALLOC_ENV, cpu_model  # a sibling module: tools/ is sys.path[0]

from kernel_variants.kernels import cpu_native

SMALL = (1, 256, 4096)
WIDTHS = (2048, 3072, 4160, 5376)  # one tile; 2 of 1536; 3 of 1408/1408/1344; 3 of 1792
LARGE = ((2, 1024, 4096), (8, 1024, 2048), (4, 1024, 6144))


def _call(x, w, b, act, out=None):
    return lambda: cpu_native.causal_conv1d_fn(x, w, b, activation=act, out=out)


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    x = torch.randn(*shape, generator=g).to(dtype)
    w = (torch.randn(d, 4, generator=g) / 4).to(dtype)
    b = torch.randn(d, generator=g).to(dtype)
    return x, w, b


def interleaved(fns: dict, repeats: int, min_s: float) -> dict[str, list[float]]:
    """Seconds per call of each fn, one window per fn per repeat, windows of >= min_s."""
    iters = {}
    for name, fn in fns.items():
        fn()
        n, t = 1, 0.0
        while True:  # calibrate the window
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t = time.perf_counter() - t0
            if t >= min_s / 4 or n >= 1 << 16:
                break
            n *= 2
        iters[name] = max(1, int(n * min_s / max(t, 1e-9)))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            n = iters[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - t0) / n)
    return times


def small_targets(repeats: int) -> dict:
    res = {}
    for dtype, act, label in ((torch.float32, None, "fp32"), (torch.bfloat16, "silu", "bf16+silu")):
        x, w, b = _inputs(SMALL, dtype)
        out = torch.empty_like(x)
        per_thr = {}
        for thr in (1, 2):
            torch.set_num_threads(thr)
            t = interleaved({"copy": lambda: out.copy_(x), "fresh": _call(x, w, b, act),
                             "out=": _call(x, w, b, act, out)}, repeats, 0.05)
            per_thr[thr] = {k: min(v) for k, v in t.items()}
        one, two = per_thr[1], per_thr[2]
        res[label] = {
            "copy_us_1t": one["copy"] * 1e6,
            "fresh/copy_1t": one["fresh"] / one["copy"], "out/copy_1t": one["out="] / one["copy"],
            "fresh/copy_2t": two["fresh"] / two["copy"], "out/copy_2t": two["out="] / two["copy"],
            # target 2: kernel speedup from 1 to 2 threads, as a share of the copy's speedup
            "scaling_fresh": (one["fresh"] / two["fresh"]) / (one["copy"] / two["copy"]),
            "scaling_out": (one["out="] / two["out="]) / (one["copy"] / two["copy"]),
        }
    torch.set_num_threads(os.cpu_count() or 1)
    return res


def width_scaling(repeats: int) -> dict:
    """1 -> 2 threads, the kernel's speedup over the copy's, at each of WIDTHS: the median and
    range over four placements of ``out`` against x ((out - x) mod 4 KiB in 0, 1, 2, 3 KiB),
    since which cache sets the two threads' rows share moves a single placement's figure by
    up to 2x on a shared VM (AMD EPYC: 0.45 to 1.0 at D=3072)."""
    res = {}
    for d in WIDTHS:
        x, w, b = _inputs((1, 1024, d), torch.bfloat16)
        buf = torch.empty(x.numel() + 4096, dtype=x.dtype)
        got = []
        for off in (0, 1024, 2048, 3072):
            first = (off - (buf.data_ptr() - x.data_ptr())) % 4096 // x.element_size()
            out = buf[first:first + x.numel()].view_as(x)
            per_thr = {}
            for thr in (1, 2):
                torch.set_num_threads(thr)
                t = interleaved({"copy": lambda: out.copy_(x), "out=": _call(x, w, b, "silu", out)}, repeats,
                                0.03)
                per_thr[thr] = {k: min(v) for k, v in t.items()}
            one, two = per_thr[1], per_thr[2]
            got.append((one["out="] / two["out="]) / (one["copy"] / two["copy"]))
        res[d] = {"median": statistics.median(got), "min": min(got), "max": max(got)}
    torch.set_num_threads(os.cpu_count() or 1)
    return res


def large_targets(repeats: int) -> dict:
    res = {}
    for shape in LARGE:
        x, w, b = _inputs(shape, torch.bfloat16)
        out = torch.empty_like(x)
        t = interleaved({"copy": lambda: out.copy_(x), "fresh": _call(x, w, b, "silu"),
                         "out=": _call(x, w, b, "silu", out)}, repeats, 0.1)
        res["x".join(map(str, shape))] = {
            "copy_us": min(t["copy"]) * 1e6,
            "out/copy_min": min(t["out="]) / min(t["copy"]),
            "out/copy_median": statistics.median(t["out="]) / statistics.median(t["copy"]),
            "fresh/copy_min": min(t["fresh"]) / min(t["copy"]),
            "fresh/copy_median": statistics.median(t["fresh"]) / statistics.median(t["copy"]),
        }
    return res


def child(repeats: int) -> None:
    """Fresh-output calls on the large shapes, in a process whose allocator env the parent set."""
    torch.set_num_threads(os.cpu_count() or 1)
    res = {}
    for shape in LARGE:
        x, w, b = _inputs(shape, torch.bfloat16)
        out = torch.empty_like(x)
        t = interleaved({"copy": lambda: out.copy_(x), "fresh": _call(x, w, b, "silu")}, repeats, 0.1)
        res["x".join(map(str, shape))] = statistics.median(t["fresh"]) / statistics.median(t["copy"])
    print(json.dumps(res))


def allocator(repeats: int) -> dict:
    def run(extra: dict) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        env.update(extra)
        p = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(repeats)], env=env,
                           capture_output=True, text=True, check=True)
        return json.loads(p.stdout.strip().splitlines()[-1])

    # Alternate the two settings so drift hits both alike.
    plain, tuned = run({}), run(ALLOC_ENV)
    plain2, tuned2 = run({}), run(ALLOC_ENV)
    return {k: {"default": min(plain[k], plain2[k]), "tuned": min(tuned[k], tuned2[k])} for k in plain}


def other_allocators() -> str:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "ldconfig unavailable"
    found = sorted({ln.split()[0] for ln in out.splitlines() if "jemalloc" in ln or "tcmalloc" in ln})
    return ", ".join(found) if found else "none installed"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-alloc", action="store_true", help="skip the allocator subprocesses")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.child:
        child(args.repeats)
        return 0
    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs); cpu_native ISA path: {cpu_native.isa_path()}; "
          f"torch {torch.__version__}")
    print(f"ratios are time / time of out.copy_(x) in the same run, min over {args.repeats} interleaved repeats\n")
    data: dict = {"cpu": cpu_model(), "isa": cpu_native.isa_path()}
    data["small"] = small = small_targets(args.repeats)
    print(f"1. {'x'.join(map(str, SMALL))}, one thread (target fp32 <= 1.5, bf16+silu <= 2.5)")
    for label, r in small.items():
        print(f"   {label:10s} fresh {r['fresh/copy_1t']:.2f}x   out= {r['out/copy_1t']:.2f}x   "
              f"(copy {r['copy_us_1t']:.0f} us)")
    print("2. 1 -> 2 threads: kernel speedup / copy speedup (target >= 0.85)")
    for label, r in small.items():
        print(f"   {label:10s} fresh {r['scaling_fresh']:.2f}   out= {r['scaling_out']:.2f}   "
              f"(2 threads: fresh {r['fresh/copy_2t']:.2f}x, out= {r['out/copy_2t']:.2f}x)")
    data["widths"] = widths = width_scaling(args.repeats)
    print("   1x1024xD bf16+silu out=, by D, median (range) over 4 placements of out: "
          + "   ".join(f"{d}: {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})" for d, r in widths.items()))
    data["large"] = large = large_targets(max(3, args.repeats // 2))
    print(f"3. large bf16+silu, {torch.get_num_threads()} threads (target out= median <= 1.5)")
    for shape, r in large.items():
        print(f"   {shape:12s} out= median {r['out/copy_median']:.2f}x (min {r['out/copy_min']:.2f}x)   "
              f"fresh median {r['fresh/copy_median']:.2f}x   (copy {r['copy_us']:.0f} us)")
    if not args.no_alloc:
        print(f"allocator: fresh-output call, median/copy, glibc default vs {' '.join(f'{k}={v}' for k, v in ALLOC_ENV.items())}"
              f" (jemalloc/tcmalloc: {other_allocators()})")
        data["allocator"] = alloc = allocator(max(3, args.repeats // 2))
        for shape, r in alloc.items():
            print(f"   {shape:12s} default {r['default']:.2f}x   tuned {r['tuned']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
