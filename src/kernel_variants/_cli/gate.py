"""Keep a new kernel from replacing a faster one: exit 0 when the candidate is within the
tolerance of the incumbent, or faster, on every shape; exit 1 otherwise, listing the shapes where
it loses and by how much. A candidate that fails the correctness check on any shape, or cannot
run one, fails the gate too. With ``--from-csv``, --incumbent and --candidate name µs columns
(as for kv compare).
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from kernel_variants._cli import _headtohead as h2h
from kernel_variants._cli._output import percent, print_json, ratio, render_table, us

if TYPE_CHECKING:
    from kernel_variants import types


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="how much slower the candidate may be, as a fraction (default 0.02)")
    h2h.add_arguments(p)


def failures(result: types.HeadToHead, tolerance: float) -> list[dict]:
    """Each shape where the candidate is not shown to be within ``tolerance`` of the incumbent:
    slower, rejected, unable to run it, or with no incumbent time to compare against."""
    out = []
    for p in result.pairs:
        reason = None
        if p.candidate_us is None:
            reason = p.candidate_note or "not timed"
        elif p.incumbent_us is None:  # nothing to compare with: the gate cannot vouch for this shape
            reason = f"not compared: incumbent {p.incumbent_note or 'not timed'}"
        elif p.candidate_us > p.incumbent_us * (1 + tolerance):
            reason = f"slower by {percent(p.ratio - 1)}"
        if reason is not None:
            out.append({"shape": list(p.shape), "incumbent_us": p.incumbent_us, "candidate_us": p.candidate_us,
                        "ratio": p.ratio, "slower_by": None if p.ratio is None else p.ratio - 1, "reason": reason})
    return out


def run(args: argparse.Namespace) -> int:
    tol = args.tolerance
    if not (math.isfinite(tol) and tol > -1):
        raise ValueError(f"--tolerance: expected a fraction such as 0.02, got {tol}")
    result = h2h.collect(args)
    failed = failures(result, tol)
    a, b, n = result.incumbent, result.candidate, len(result.pairs)
    if failed:
        verdict = f"gate failed: {b} loses to {a} (beyond {tol:.1%}) on {len(failed)} of {n} shapes"
    else:
        verdict = f"gate passed: {b} within {tol:.1%} of {a} or faster on all {n} shapes"
    if args.json:
        print_json({"passed": not failed, "incumbent": a, "candidate": b, "tolerance": tol, "shapes": n,
                    "source": result.source, "verdict": verdict, "summary": result.summary(), "failures": failed})
        return 1 if failed else 0
    print(verdict)
    if failed:
        rows = [[*f["shape"], us(f["incumbent_us"]), us(f["candidate_us"]), ratio(f["ratio"]), f["reason"]]
                for f in failed]
        print(render_table([*result.axes, f"{a} µs", f"{b} µs", f"{b}/{a}", "why"], rows))
    print(result.summary())
    return 1 if failed else 0
