"""Realistic calls of an op (``Case``), replayable on fresh copies of what they mutate, and named
shape lists (``Sweep``), from code or from CSV files."""

from __future__ import annotations

import csv
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernel_variants._registry.keys import Shape

if TYPE_CHECKING:
    import torch

    from kernel_variants._registry.spec import OpSpec


@dataclass(frozen=True)
class Sweep:
    """Named shapes of one op, measured with ``features`` (overrides of the feature defaults)."""

    name: str
    op: str
    shapes: tuple[Shape, ...]
    features: Mapping[str, Any] = field(default_factory=dict)
    description: str = field(default="", compare=False)


@dataclass
class Case:
    """One realistic call of an op, replayable on fresh copies of the tensors it mutates.

    ``args``/``kwargs`` are the call as written; ``bases`` maps each mutated parameter to the
    allocation its tensor is a view of, so a fresh copy keeps the view's strides and offset.
    """

    spec: OpSpec
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    bases: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def op(self) -> str:
        return self.spec.name

    def _where(self, name: str) -> int | None:
        pos = self.spec.positional
        return pos.index(name) if name in pos and pos.index(name) < len(self.args) else None

    def get(self, name: str) -> Any:
        """The argument ``name`` as the call passes it (``None`` when left to its default)."""
        i = self._where(name)
        return self.args[i] if i is not None else self.kwargs.get(name)

    def fresh(self) -> Case:
        """The same call with fresh copies of the mutated tensors, with the same strides and offset."""
        if not self.bases:
            return self
        args, kwargs, bases = list(self.args), dict(self.kwargs), {}
        for name, base in self.bases.items():
            view = self.get(name)
            bases[name] = copy = base.clone(memory_format=_contiguous())
            new = copy.as_strided(view.size(), view.stride(), view.storage_offset())
            i = self._where(name)
            if i is not None:
                args[i] = new
            else:
                kwargs[name] = new
        return Case(self.spec, tuple(args), kwargs, bases)

    def state(self) -> torch.Tensor | None:
        """The (first) mutated tensor, as the call sees it."""
        return next((self.get(n) for n in self.bases), None)

    @property
    def pool_base(self) -> torch.Tensor | None:
        return next(iter(self.bases.values()), None)

    def run(self, fn: Callable[..., Any]) -> tuple[Any, dict[str, torch.Tensor]]:
        """Call ``fn`` on a fresh copy; return (its result, each mutated allocation after the call)."""
        case = self.fresh()
        return fn(*case.args, **case.kwargs), case.bases


def _contiguous():
    import torch  # the registry itself imports no torch: plugins declare before anything runs

    return torch.contiguous_format


def read_shapes(header: Sequence[str], rows: Sequence[Mapping[str, str | None]], axes: Sequence[str],
                aliases: Mapping[str, tuple[str, ...]], where: str) -> tuple[list[str], list[Shape]]:
    """(the columns used, the shapes) from CSV rows with a column per axis (named by one of its
    ``aliases``, else by the axis); the first row that does not parse is the error."""
    columns = []
    for axis in axes:
        names = aliases.get(axis, (axis,))
        found = next((n for n in names if n in header), None)
        if found is None:
            raise ValueError(f"{where}: no column {' or '.join(names)} (columns: {', '.join(header)})")
        columns.append(found)
    shapes = []
    for line, row in enumerate(rows, start=2):
        try:
            shape = tuple(int(row[c] or "") for c in columns)
        except (TypeError, ValueError):
            raise ValueError(f"{where}, line {line}: expected integer {', '.join(columns)}, "
                             f"got {[row.get(c) for c in columns]}") from None
        if min(shape) < 1:
            raise ValueError(f"{where}, line {line}: expected positive sizes, got {shape}")
        shapes.append(shape)
    if not shapes:
        raise ValueError(f"{where}: no rows below the header")
    return columns, shapes


def read_csv_rows(path: str | Path) -> tuple[list[str], list[dict[str, str | None]]]:
    """(the header, every row as a dict) of a CSV file; one that is not readable UTF-8 CSV is one
    ValueError."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            return list(reader.fieldnames or []), rows
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path}: not a CSV file ({exc})") from None


def load_sweep_csv(path: str | Path, spec: OpSpec) -> Sweep:
    header, rows = read_csv_rows(path)
    _, shapes = read_shapes(header, rows, spec.axes, spec.axis_aliases, str(path))
    return Sweep(Path(path).stem, spec.name, tuple(shapes))
