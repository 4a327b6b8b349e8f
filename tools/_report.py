"""Shared by the benchmark scripts: where reports go and how tables are printed."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kernel_variants._cli._output import render_table


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The CLI's own table renderer, with floats shortened to what a noisy timing supports."""
    return render_table(headers, [[_fmt(c) for c in r] for r in rows], fmt="md")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def write_report(out_dir: str | Path, name: str, markdown: str, data: dict[str, Any]) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / f"{name}.md", out / f"{name}.json"
    md.write_text(markdown + "\n")
    js.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return md, js
