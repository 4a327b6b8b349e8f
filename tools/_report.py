"""Shared by the benchmark scripts: where reports go, how tables are printed, which CPU ran them."""

from __future__ import annotations

import json
import platform
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


def cpu_model() -> str:
    """The CPU's model name (figures say which CPU they came from: this project's machines vary)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
