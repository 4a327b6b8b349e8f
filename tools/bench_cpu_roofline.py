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

Beside 1., the kernel's own compute floor, timed in the same interleaved rounds: the same
loads, conversions to fp32, W=4 FMAs, SiLU, conversion and stores, on the same ISA build,
streamed once over x with no convolution logic (no halo, window, tiles or taps from memory).
It is a bench-only extension (tools/cpu_floor/, which includes the kernel's header for those
primitives), built on first use into the kernels' build cache (about a minute). The kernel /
floor ratio is what the convolution's logic costs; floor / copy what its arithmetic costs.
``--paths`` measures 1. with its floor once per ISA path, each in a child process with
ATEN_CPU_CAPABILITY set (which also caps ATen's own kernels, the copy's included).

    python tools/bench_cpu_roofline.py            # everything (~2 minutes)
    python tools/bench_cpu_roofline.py --repeats 3 --no-alloc
    python tools/bench_cpu_roofline.py --paths avx2,avx512,native --repeats 15   # floor table
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


FLOOR_DIR = Path(__file__).resolve().parent / "cpu_floor"
FLOOR_SOURCES = ("floor.cpp", "floor_avx2.cpp", "floor_avx512.cpp", "floor_avx512bf16.cpp")  # binding first


def floor_extension():
    """The floor's bench-only extension, built once per content of its sources and the kernel's
    headers (and torch version) under the kernels' build cache; the package never loads it."""
    from torch.utils import cpp_extension

    from kernel_variants._native.build import build_root
    from kernel_variants.kernels.cpu_native._build import CONV

    csrc = CONV.csrc
    h = hashlib.sha256(torch.__version__.encode())
    for f in [*(FLOOR_DIR / s for s in FLOOR_SOURCES), FLOOR_DIR / "floor_kernel.h", *sorted(csrc.glob("*.h"))]:
        h.update(f.name.encode() + f.read_bytes())
    tag = h.hexdigest()[:12]
    where = build_root() / "bench" / f"cpu_floor-{tag}"
    where.mkdir(parents=True, exist_ok=True)
    # The kernel's flags (kernel_variants._native.build) less OpenMP: the floor runs one thread.
    return cpp_extension.load(name=f"kv_cpu_floor_{tag}", sources=[str(FLOOR_DIR / s) for s in FLOOR_SOURCES],
                              extra_cflags=["-O3", "-fno-trapping-math", "-fno-math-errno", "-Wno-psabi"],
                              extra_include_paths=[str(FLOOR_DIR), str(csrc)], build_directory=str(where),
                              verbose=False)


def _floor_call(ext, x, act):
    """The floor over x into its own output, with W=4 taps and a bias (fp32, as the kernel
    holds them), on the ISA build the kernel runs here."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(128, generator=g) / 4, torch.randn(32, generator=g)
    out, isa, silu = torch.empty_like(x), cpu_native.isa_path(), act == "silu"
    return lambda: ext.run(x, out, w, b, silu, isa)


def small_targets(repeats: int, floor=None) -> dict:
    """1. and 2.; with ``floor`` (the floor's extension) the floor is timed beside the
    one-thread calls."""
    res = {}
    for dtype, act, label in ((torch.float32, None, "fp32"), (torch.bfloat16, "silu", "bf16+silu")):
        x, w, b = _inputs(SMALL, dtype)
        out = torch.empty_like(x)
        per_thr = {}
        for thr in (1, 2):
            torch.set_num_threads(thr)
            fns = {"copy": lambda: out.copy_(x), "fresh": _call(x, w, b, act), "out=": _call(x, w, b, act, out)}
            if floor is not None and thr == 1:
                fns["floor"] = _floor_call(floor, x, act)
            t = interleaved(fns, repeats, 0.05)
            per_thr[thr] = {k: min(v) for k, v in t.items()}
        one, two = per_thr[1], per_thr[2]
        res[label] = {
            "copy_us_1t": one["copy"] * 1e6,
            "fresh/copy_1t": one["fresh"] / one["copy"], "out/copy_1t": one["out="] / one["copy"],
            **({"floor/copy_1t": one["floor"] / one["copy"], "out/floor_1t": one["out="] / one["floor"]}
               if "floor" in one else {}),
            "fresh/copy_2t": two["fresh"] / two["copy"], "out/copy_2t": two["out="] / two["copy"],
            # target 2: kernel speedup from 1 to 2 threads, as a share of the copy's speedup
            "scaling_fresh": (one["fresh"] / two["fresh"]) / (one["copy"] / two["copy"]),
            "scaling_out": (one["out="] / two["out="]) / (one["copy"] / two["copy"]),
        }
    torch.set_num_threads(os.cpu_count() or 1)
    return res


FLOOR_CASES = ((torch.float32, None, "fp32"), (torch.bfloat16, "silu", "bf16+silu"), (torch.bfloat16, None, "bf16"))


def floor_targets(repeats: int) -> dict:
    """1. on one thread with the floor: copy, floor and the kernel's ``out=`` call interleaved."""
    floor = floor_extension()
    torch.set_num_threads(1)
    res = {}
    for dtype, act, label in FLOOR_CASES:
        x, w, b = _inputs(SMALL, dtype)
        out = torch.empty_like(x)
        t = interleaved({"copy": lambda: out.copy_(x), "floor": _floor_call(floor, x, act),
                         "out=": _call(x, w, b, act, out)}, repeats, 0.05)
        m = {k: min(v) for k, v in t.items()}
        res[label] = {"copy_us": m["copy"] * 1e6, "floor_us": m["floor"] * 1e6, "out_us": m["out="] * 1e6,
                      "out/floor": m["out="] / m["floor"], "out/copy": m["out="] / m["copy"],
                      "floor/copy": m["floor"] / m["copy"]}
    return {"isa": cpu_native.isa_path(), "cases": res}


def per_path(paths: list[str], repeats: int) -> dict:
    """floor_targets in a child process per ISA cap (``native``: ATEN_CPU_CAPABILITY unset)."""
    floor_extension()  # built once here, not raced by the children
    res = {}
    for cap in paths:
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if cap != "native":
            env["ATEN_CPU_CAPABILITY"] = cap
        p = subprocess.run([sys.executable, __file__, "--floor-child", "--repeats", str(repeats)], env=env,
                           capture_output=True, text=True, check=True)
        res[cap] = json.loads(p.stdout.strip().splitlines()[-1])
    return res


def print_paths(res: dict) -> None:
    print(f"1. {'x'.join(map(str, SMALL))}, one thread, by ISA path: the kernel's out= call / its floor / a copy")
    print(f"   {'cap':8s} {'path':12s} {'case':10s} {'out/floor':>9s} {'out/copy':>9s} {'floor/copy':>10s}   "
          "(out, floor, copy us)")
    for cap, r in res.items():
        for label, c in r["cases"].items():
            print(f"   {cap:8s} {r['isa']:12s} {label:10s} {c['out/floor']:9.2f} {c['out/copy']:9.2f} "
                  f"{c['floor/copy']:10.2f}   ({c['out_us']:.0f}, {c['floor_us']:.0f}, {c['copy_us']:.0f})")


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
    p.add_argument("--no-floor", action="store_true", help="skip the compute floor (and its build)")
    p.add_argument("--paths", default=None,
                   help="only 1. with its floor, once per ATEN_CPU_CAPABILITY in this comma-separated list "
                        "(avx2, avx512, default; native: unset), each in a child process")
    p.add_argument("--floor-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.repeats)
        return 0
    if args.floor_child:
        print(json.dumps(floor_targets(args.repeats)))
        return 0
    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs); cpu_native ISA path: {cpu_native.isa_path()}; "
          f"torch {torch.__version__}")
    print(f"ratios are time / time of out.copy_(x) in the same run, min over {args.repeats} interleaved repeats\n")
    data: dict = {"cpu": cpu_model(), "isa": cpu_native.isa_path()}
    if args.paths:
        data["paths"] = res = per_path(args.paths.split(","), args.repeats)
        print_paths(res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f, indent=2)
        return 0
    floor = None if args.no_floor else floor_extension()
    data["small"] = small = small_targets(args.repeats, floor)
    print(f"1. {'x'.join(map(str, SMALL))}, one thread (target fp32 <= 1.5, bf16+silu <= 2.5)")
    for label, r in small.items():
        vs_floor = (f"   floor {r['floor/copy_1t']:.2f}x, out= / floor {r['out/floor_1t']:.2f}"
                    if "floor/copy_1t" in r else "")
        print(f"   {label:10s} fresh {r['fresh/copy_1t']:.2f}x   out= {r['out/copy_1t']:.2f}x{vs_floor}   "
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
