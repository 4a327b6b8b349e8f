"""What qualifying one class of calls costs, per built-in CPU variant, on this machine's CPU.

For each op, each built-in variant available on the CPU, at the op's default features (what a
calibration measures) in fp32 and bf16:

- ``first``: the first in-process run of the class's cases in this process, extension already
  loaded (oneDNN primitives, caches and the reference's first calls are made here);
- ``warm``: the median of ``--repeat`` more in-process runs (the target: <= 200 ms a class);
- ``child``: the run as the dispatcher makes it for a variant declared ``isolate`` (cpu_native):
  in a forked child, whose result comes back over a pipe.

Every run is checked to pass: a figure of a failing run would time an early exit.

    python tools/bench_qualify.py [--repeat 5] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from _report import cpu_model  # a sibling module: tools/ is sys.path[0]

import kernel_variants as kv
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._tuning import cases as _cases
from kernel_variants._tuning import isolate as _isolate

TARGET_MS = 200.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    os.environ["KV_CACHE_DIR"] = tempfile.mkdtemp(prefix="kv-qualify-")  # never the user's table
    kv.reload()
    registry = dispatcher().registry
    rows = []
    for spec in registry.ops():
        features = spec.features()
        for rv in registry.variants(spec.name):
            caps = rv.variant.capabilities
            if rv.variant.fn is spec.reference.fn or rv.why_not(_key(spec, features, "float32")) is not None:
                continue
            if rv.ensure_built() is not None:
                continue
            for dtype in (torch.float32, torch.bfloat16):
                if str(dtype)[6:] not in caps.dtypes:
                    continue
                runs = []
                for _ in range(args.repeat + 1):
                    t0 = time.perf_counter()
                    got = _cases.run_cases(spec, rv, features, dtype, "cpu")
                    runs.append(1e3 * (time.perf_counter() - t0))
                    if got.get("reason"):
                        raise SystemExit(f"{spec.name} {rv.id} {dtype}: failed: {got}")
                t0 = time.perf_counter()
                got = _isolate._forked(lambda spec=spec, rv=rv, dtype=dtype: _cases.run_cases(
                    spec, rv, features, dtype, "cpu"), 300.0)
                child = 1e3 * (time.perf_counter() - t0)
                if got.get("reason"):
                    raise SystemExit(f"{spec.name} {rv.id} {dtype} in a child: failed: {got}")
                warm = statistics.median(runs[1:])
                rows.append((spec.name, rv.id, str(dtype)[6:], got["cases"], runs[0], warm, child,
                             "met" if warm <= TARGET_MS else "missed"))
    print(f"qualification cost per class, {cpu_model()}, {torch.get_num_threads()} threads, "
          f"median of {args.repeat} warm runs")
    print(f"{'op':<20} {'variant':<11} {'dtype':<9} {'cases':>5} {'first ms':>9} {'warm ms':>8} "
          f"{'child ms':>9}  <= {TARGET_MS:.0f} ms")
    for op, vid, dt, n, first, warm, child, verdict in rows:
        print(f"{op:<20} {vid:<11} {dt:<9} {n:>5} {first:>9.1f} {warm:>8.1f} {child:>9.1f}  {verdict}")
    worst = max(r[5] for r in rows)
    print(f"worst warm class: {worst:.1f} ms ({'met' if worst <= TARGET_MS else 'missed'})")
    return 0


def _key(spec, features, dtype):
    from kernel_variants.plugin import CallKey

    return CallKey(spec, "cpu", dtype, features, (1,) * len(spec.axes))


if __name__ == "__main__":
    raise SystemExit(main())
