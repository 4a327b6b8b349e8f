"""What writing into ``out=`` saves the C++ Gemma RMSNorm: SGLang's in-place fused add,
``add_gemma_rms_norm(x, w, residual, out=(x, residual))``, with ``cpu_native`` writing there
directly against computing fresh tensors and copying them back (what the dispatcher does for a
variant that does not take ``out``), beside a copy of the same bytes, in one run, one thread.
Both forms are checked against the reference first.

    python tools/bench_rms_in_place.py [--dtypes bf16,fp32] [--windows 5]
"""

from __future__ import annotations

import argparse

import torch
from _report import cpu_model  # a sibling module: tools/ is sys.path[0]

from kernel_variants._dtypes import as_dtype
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._tolerances import mismatch
from kernel_variants._tuning.timing import Timing, TimingConfig, measure_interleaved
from kernel_variants.ops.gemma_rms_norm._spec import reference_add

SHAPES = [(1, 4096), (32, 4096), (512, 4096), (4096, 4096)]  # (T, D)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--windows", type=int, default=5)
    args = p.parse_args(argv)
    native = dispatcher().registry.get("add_gemma_rms_norm", "cpu_native")
    if native.ensure_built() is not None:
        raise SystemExit(f"cpu_native unavailable: {native.unavailable_reason()}")
    fn = native.variant.fn
    torch.set_num_threads(1)
    timing = TimingConfig(warmup=2, windows=args.windows, iters=50, window_budget_s=0.1)
    print(f"{cpu_model()}, torch {torch.__version__}, 1 thread; best window, the three timed in alternating rounds")
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

            timed = measure_interleaved({"in_place": [in_place], "fresh": [fresh_copy], "copy": [copy]}, "cpu", timing)
            times = {}
            for k, v in timed.items():
                if not isinstance(v, Timing):
                    raise SystemExit(f"{name} T={t} D={d}: {k} failed: {v}")
                times[k] = v.best_us
            print(f"{name:6} {t:5d} {d:5d} {times['in_place']:15.1f} us {times['fresh']:10.1f} us "
                  f"{times['fresh'] / times['in_place']:6.2f} {times['copy']:7.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
