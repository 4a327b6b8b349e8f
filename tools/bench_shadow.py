"""What shadow verification (KV_SHADOW) costs a call: per call form, the time with shadowing off,
on at a rate whose streams sample none of the timed calls (the counting wrapper alone), and at
rate 1 (every call also runs the reference on copies and is judged), measured side by side in
alternating rounds. Two calls of the decode step and one prefill, bf16, on the variant the
dispatcher chooses (cpu_native where it is built), one thread.

The rate-0 row is the everyday cost (none: the decision holds the variant itself; the overhead
benchmark, tools/bench_dispatch_overhead.py, checks it against its targets). The expected cost
of shadowing at rate r is about r times the rate-1 row's added time plus the wrapper's.

    python tools/bench_shadow.py [--rounds 7] [--number 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import warnings

import torch
from _report import cpu_model, markdown_table, per_call_us  # tools/ is sys.path[0]

import kernel_variants as kv
from kernel_variants._runtime import shadow as _shadow

# The rates timed: off, on but sampling no timed call (the wrapper: the tiny rate makes each
# stream's first draws all misses at seed 0), every call.
RATES = {"off": 0.0, "wrapper only": 1e-9, "every call": 1.0}


def _calls() -> dict[str, tuple[object, ...]]:
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(bf)

    pool = r(64, 3, 2048)
    slots = torch.arange(8, dtype=torch.int32)
    return {
        "decode 1x2048": (kv.causal_conv1d_update, (r(1, 2048), pool, r(2048, 4), r(2048)),
                          dict(activation="silu", conv_state_indices=slots[:1])),
        "decode 8x2048": (kv.causal_conv1d_update, (r(8, 2048), pool, r(2048, 4), r(2048)),
                          dict(activation="silu", conv_state_indices=slots)),
        "prefill 1x2048x256": (kv.causal_conv1d_fn, (r(1, 256, 2048), r(2048, 4), r(2048)),
                               dict(conv_states=pool, cache_indices=slots[:1],
                                    has_initial_state=torch.zeros(1, dtype=torch.bool), activation="silu")),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--number", type=int, default=200, help="calls per form per round")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ["KV_CACHE_DIR"] = tempfile.mkdtemp(prefix="kv-bench-shadow-")
    kv.reload()
    calls = _calls()
    times: dict[tuple[str, str], list[float]] = {}
    chosen = {}
    for name, (op, a, kw) in calls.items():
        op(*a, **kw)  # qualified and decided before anything is timed
        chosen[name] = kv.explain(op.__name__, *a, **kw).chosen.id
    with warnings.catch_warnings():
        warnings.simplefilter("error", kv.ShadowMismatch)  # a mismatch here is a defect, not a figure
        for _ in range(args.rounds):
            for label, rate in RATES.items():
                kv.shadow(rate, seed=0)
                for name, (op, a, kw) in calls.items():
                    op(*a, **kw)  # the memo refilled (with or without the wrapper) before timing
                    times.setdefault((name, label), []).append(per_call_us(lambda: op(*a, **kw), args.number))
    kv.shadow(0)
    shadowed = {c.op: c.shadowed for c in _shadow.counts()}
    rows = []
    for name in calls:
        off = statistics.median(times[(name, "off")])
        wrap = statistics.median(times[(name, "wrapper only")])
        every = statistics.median(times[(name, "every call")])
        rows.append([name, chosen[name], off, wrap - off, every - off, every / off])
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; 1 thread; {args.rounds} rounds of {args.number} calls")
    print(markdown_table(["call (bf16, SiLU)", "variant", "off us", "wrapper +us", "shadowed +us", "shadowed / off"],
                         rows))
    print(f"calls shadowed while timing (per op): {shadowed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
