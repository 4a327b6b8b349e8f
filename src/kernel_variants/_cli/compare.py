"""Head-to-head of two variants, --incumbent and --candidate, on a sweep, or of two columns of a
CSV measured elsewhere (--from-csv FILE --incumbent COL --candidate COL).

Both variants are checked against the reference on every shape before they are timed; a wrong
one is reported, not timed. Nothing is written to the table. The last line reads
``I faster on X of N shapes, median C/I r (range lo-hi)`` (I the incumbent, C the candidate,
with an en dash), over the shapes where both ran.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kernel_variants._cli import _headtohead as h2h
from kernel_variants._cli._output import print_json, ratio, render_table, us

if TYPE_CHECKING:
    from kernel_variants import types


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plot", metavar="FILE.png", help="draw candidate/incumbent per shape (needs matplotlib)")
    h2h.add_arguments(p)


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kernel-variants[plot]'") from None


def plot(result: types.HeadToHead, path: str | Path) -> None:
    """Candidate/incumbent per shape as bars (above 1: the incumbent is faster), with the summary
    line as the title."""
    # The object API with an Agg canvas leaves pyplot's global state (and backend) alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    timed = result.timed()
    ratios = [p.ratio for p in timed]
    fig = Figure(figsize=(max(6.0, 0.16 * len(timed) + 2), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.bar(range(len(timed)), ratios, color=["tab:green" if r > 1 else "tab:red" for r in ratios])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(timed)), ["x".join(map(str, p.shape)) for p in timed],
                  rotation=90, fontsize=6)
    ax.set_xlim(-0.6, len(timed) - 0.4)
    ax.set_ylabel(f"{result.candidate} / {result.incumbent} time")
    ax.set_xlabel(f"shape ({'x'.join(result.axes)})")
    ax.set_title(result.summary(), fontsize=9)
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    if args.plot:
        require_matplotlib()
    result = h2h.collect(args)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print_json({"incumbent": result.incumbent, "candidate": result.candidate, "source": result.source,
                    **result.stats(), "summary": result.summary(), "plot": args.plot,
                    "pairs": [{"shape": list(p.shape), "elements": p.elements, "incumbent_us": p.incumbent_us,
                               "candidate_us": p.candidate_us, "ratio": p.ratio, "incumbent_note": p.incumbent_note,
                               "candidate_note": p.candidate_note} for p in result.pairs]})
        return 0
    a, b = result.incumbent, result.candidate
    rows = [[*p.shape, p.elements, us(p.incumbent_us) or _short(p.incumbent_note),
             us(p.candidate_us) or _short(p.candidate_note), ratio(p.ratio)] for p in result.pairs]
    print(f"{b} vs {a}, {result.source}")
    print(render_table([*result.axes, "elements", f"{a} µs", f"{b} µs", f"{b}/{a}"], rows,
                       right=[True] * (len(result.axes) + 4)))
    notes = [(p, v, n) for p in result.pairs for v, n in ((a, p.incumbent_note), (b, p.candidate_note)) if n]
    if notes:
        print()
        print(render_table([*result.axes, "variant", "not timed because"], [[*p.shape, v, n] for p, v, n in notes]))
    print()
    print(result.summary())
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def _short(note: str) -> str:
    return note.split(":", 1)[0] if note else "-"
