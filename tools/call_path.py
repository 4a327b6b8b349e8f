"""The path of one ``kv.causal_conv1d_fn`` call through the package: the functions of
kernel_variants a call enters, in order, for the first call of a shape in a process (a miss: the
decision is made, from verdicts a previous process left) and for the next one (a hit). A call of
another shape runs first, so that imports, plugin loading and the table's opening are not counted.

    python tools/call_path.py            # both paths' counts and their spine
    python tools/call_path.py --all      # every function entered
    python tools/call_path.py --time 300 # and what a first call of a new shape costs, and a hit

Run it twice on a fresh table: the first run also qualifies the chosen variant (child processes),
which is not the call path; the figures are those of the second. Functions of the variants
themselves and of the table's storage (diskcache, sqlite) are counted as one hop each: what is
followed is the dispatch, not the kernel or the database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import kernel_variants as kv

PACKAGE = Path(kv.__file__).resolve().parent
# The modules a call's dispatch passes through (validation, verdict and table reads are below them).
SPINE = ("ops/causal_conv1d/__init__.py", "_runtime/entry.py", "_runtime/call.py", "_runtime/dispatcher.py",
         "_decide.py", "_runtime/callcore.py", "kernels/cpu_native/__init__.py", "(C++ call core)")


def _trace(fn) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(PACKAGE) or frame.f_code.co_filename.startswith("<kv "):
                seen.append((str(path.relative_to(PACKAGE)) if path.is_relative_to(PACKAGE) else path.name,
                             frame.f_code.co_name))
        elif event == "c_call" and type(arg).__name__ in ("CallCore",):
            seen.append(("(C++ call core)", "CallCore"))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every function entered, not only the spine")
    parser.add_argument("--time", type=int, default=0, metavar="N",
                        help="also time N first calls of new shapes (misses) and N hits, in rounds")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 16, 64, generator=g), torch.randn(64, 4, generator=g)
    pool, idx = torch.zeros(4, 3, 64), torch.tensor([2, 0], dtype=torch.int32)

    def call() -> None:
        kv.causal_conv1d_fn(x, w, None, conv_states=pool, cache_indices=idx, activation="silu")

    kv.causal_conv1d_fn(x[:, :8], w, None, conv_states=pool, cache_indices=idx, activation="silu")

    for label in ("miss (first call of this shape in the process)", "hit (the next call)"):
        path = _trace(call)
        files = sorted({f for f, _ in path})
        print(f"## {label}: {len(path)} function entries, {len({p for p in path})} distinct functions, "
              f"{len(files)} files")
        last = None
        for f, name in path:
            if (f, name) != last and (args.all or f in SPINE) and not name.startswith("<"):
                print(f"  {f}: {name}")
                last = (f, name)


    if args.time:
        _time(w, args.time)


def _time(w: torch.Tensor, n: int) -> None:
    """Median us per call over 3 rounds: n calls each of a shape not seen before (L grows, so
    each is a miss that decides), then n calls of one shape (hits)."""
    misses, hits = [], []
    x = torch.randn(1, 7, w.shape[0])
    for r in range(3):
        xs = [torch.randn(1, 17 + r * n + i, w.shape[0]) for i in range(n)]
        t = time.perf_counter()
        for xi in xs:
            kv.causal_conv1d_fn(xi, w, None, activation="silu")
        misses.append((time.perf_counter() - t) / n * 1e6)
        t = time.perf_counter()
        for _ in range(n):
            kv.causal_conv1d_fn(x, w, None, activation="silu")
        hits.append((time.perf_counter() - t) / n * 1e6)
    print(f"## time: a first call of a new shape {statistics.median(misses):.0f} us "
          f"(rounds {', '.join(f'{m:.0f}' for m in misses)}), a hit {statistics.median(hits):.1f} us "
          f"(B=1, D={w.shape[0]}, fp32, L=17.., the kernel included)")


if __name__ == "__main__":
    main()
