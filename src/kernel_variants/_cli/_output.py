"""Output shared by every command: aligned tables (text, Markdown, CSV), JSON, a progress bar."""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, TextIO

if TYPE_CHECKING:
    from kernel_variants import types

Format = Literal["text", "md", "csv"]


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, fmt: Format = "text",
                 right: Sequence[bool] | None = None, header: bool = True, width: int | None = None) -> str:
    """``rows`` (each as long as ``headers``) as one string without a trailing newline.

    ``right[i]`` right-aligns column i (numbers); by default a column is right-aligned when every
    cell in it is a number or a number-like string. ``None`` cells print as ``-``. Without
    ``header`` (text only) the rows are aligned as a list of facts. With ``width`` (text only),
    the last column wraps onto continuation lines so that every line fits.
    """
    cells = [["-" if c is None else str(c) for c in row] for row in rows]
    if width is not None and fmt == "text" and cells:
        cells = _wrap_last(headers, cells, width)
    if fmt == "md":  # a pipe inside a cell would end the cell
        headers = [h.replace("|", "\\|") for h in headers]
        cells = [[c.replace("|", "\\|") for c in row] for row in cells]
    if fmt == "csv":
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(headers)
        w.writerows(cells)
        return out.getvalue().rstrip("\n")
    if right is None:
        right = [bool(cells) and all(_numeric(r[i]) for r in cells) for i in range(len(headers))]
    least = 3 if fmt == "md" else 1  # a Markdown rule cell needs three characters
    widths = [max([least, len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> list[str]:
        return [v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right, strict=True)]

    if fmt == "md":
        rule = [("-" * (w - 1) + ":") if r else "-" * w for w, r in zip(widths, right, strict=True)]
        lines = [line(headers), rule, *(line(r) for r in cells)]
        return "\n".join("| " + " | ".join(v) + " |" for v in lines)
    lines = [line(headers), ["-" * w for w in widths]] if header else []
    lines += [line(r) for r in cells]
    return "\n".join("  ".join(v).rstrip() for v in lines)


def _wrap_last(headers: Sequence[str], cells: list[list[str]], width: int) -> list[list[str]]:
    lead = sum(max([len(h)] + [len(r[i]) for r in cells]) + 2 for i, h in enumerate(headers[:-1]))
    room = max(width - lead, 12)  # a narrower floor would stack a reason a word a line
    out = []
    for row in cells:
        pieces = textwrap.wrap(row[-1], room, break_long_words=True, break_on_hyphens=False) or [""]
        out.append([*row[:-1], pieces[0]])
        out += [[""] * (len(row) - 1) + [p] for p in pieces[1:]]
    return out


def terminal_width() -> int:
    """Columns to fit output in: the terminal's (or $COLUMNS), 120 when not a terminal."""
    return max(shutil.get_terminal_size((120, 24)).columns, 60)


def _numeric(s: str) -> bool:
    t = s.rstrip("x%").lstrip("+")
    if t == "-":
        return True
    try:
        float(t)
    except ValueError:
        return False
    return True


def us(value: float | None) -> str | None:
    """Microseconds with the precision a reader compares at (four significant digits)."""
    if value is None:
        return None
    return f"{value:.1f}" if value >= 100 else f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def ratio(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def percent(value: float | None) -> str | None:
    return None if value is None else f"{value * 100:+.1f}%"


def print_json(obj: Any, stream: TextIO | None = None) -> None:
    json.dump(obj, stream or sys.stdout, indent=2, allow_nan=False, default=str)
    (stream or sys.stdout).write("\n")


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--:--"
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class ProgressBar:
    """A ``progress`` callback for calibration that draws on ``stream`` (stderr).

    On a terminal the bar redraws in place; elsewhere (CI logs, pipes) it prints one line per
    step so that a log shows how far a killed run got.
    """

    def __init__(self, label: str = "", stream: TextIO | None = None, width: int = 24,
                 axes: Sequence[str] = ("B", "D", "L")) -> None:
        self.stream = stream or sys.stderr
        self.label = label
        self.axes = tuple(axes)
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._drawn = False

    def __call__(self, p: types.Progress) -> None:
        filled = int(self.width * p.done / p.total) if p.total else self.width
        bar = "#" * filled + "." * (self.width - filled)
        at = " ".join(f"{a}={v}" for a, v in zip(self.axes, p.shape, strict=False))
        text = (f"{self.label}[{bar}] {p.done}/{p.total}  {at}  {p.variant}  "
                f"{_clock(p.elapsed_s)} elapsed, ~{_clock(p.eta_s)} left")
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False
