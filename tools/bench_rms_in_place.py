"""What writing into ``out=`` saves the C++ Gemma RMSNorm: SGLang's in-place fused add,
``add_gemma_rms_norm(x, w, residual, out=(x, residual))``, with ``cpu_native`` writing there
directly against computing fresh tensors and copying them back (what the dispatcher does for a
variant that does not take ``out``), beside a copy of the same bytes, in one run, one thread.
Both forms are checked against the reference first.

    python tools/bench_rms_in_place.py [--dtypes bf16,fp32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch
from _report import cpu_model  # a sibling module: tools/ is sys.path[0]

from kernel_variants._dtypes import as_dtype
from kernel_variants._tolerances import mismatch
from kernel_variants.dispatch import dispatcher
from kernel_variants.ops.gemma_rms_norm._spec import reference_add

SHAPES = [(1, 4096), (32, 4096), (512, 4096), (4096, 4096)]  # (T, D)


def _best_us(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    native = dispatcher().registry.get("add_gemma_rms_norm", "cpu_native")
    if native.ensure_built() is not None:
        raise SystemExit(f"cpu_native unavailable: {native.unavailable_reason()}")
    fn = native.variant.fn
    torch.set_num_threads(1)
    print(f"{cpu_model()}, torch {torch.__version__}, 1 thread; min over rounds")
    print(f"{'dtype':6} {'T':>5} {'D':>5} {'out=(x, residual)':>18} {'fresh + copy':>13} {'ratio':>6} {'copy x, r':>10}")
    for name in args.dtypes.split(","):
        dtype = as_dtype(name)
        for t, d in SHAPES:
            g = torch.Generator().manual_seed(t * d)
            x, r, w = (torch.randn(*s, generator=g).to(dtype) for s in ((t, d), (t, d), (d,)))
            want = reference_add(x, w, r)
            xi, ri = x.clone(), r.clone()
            fn(xi, w, ri, out=(xi, ri))
            fo, fs = fn(x, w, r)
            for got in ((xi, ri), (fo, fs)):
                for g_, w_ in zip(got, want, strict=True):
                    why = mismatch(g_, w_, "out")
                    if why is not None:
                        raise SystemExit(f"{name} T={t} D={d}: cpu_native does not match the reference: {why}")

            def in_place(xi=xi, ri=ri):
                fn(xi, w, ri, out=(xi, ri))

            def fresh_copy(xi=xi, ri=ri):
                o, s = fn(xi, w, ri)
                xi.copy_(o)
                ri.copy_(s)

            bx, br = torch.empty_like(x), torch.empty_like(r)

            def copy(bx=bx, br=br, x=x, r=r):
                bx.copy_(x)
                br.copy_(r)

            times = {k: float("inf") for k in ("in_place", "fresh", "copy")}
            reps = max(3, min(200, int(2e5 // (t * d / 64 + 1))))
            for _ in range(args.rounds):  # interleaved rounds: drift hits all three alike
                times["in_place"] = min(times["in_place"], _best_us(in_place, reps))
                times["fresh"] = min(times["fresh"], _best_us(fresh_copy, reps))
                times["copy"] = min(times["copy"], _best_us(copy, reps))
            print(f"{name:6} {t:5d} {d:5d} {times['in_place']:15.1f} us {times['fresh']:10.1f} us "
                  f"{times['fresh'] / times['in_place']:6.2f} {times['copy']:7.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
