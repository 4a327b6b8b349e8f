"""Options several commands share, and turning them into library arguments.

Nothing here names an op: ``--op`` takes any registered op (or an alias), shapes have as many
sizes as the op has axes, sweeps come from the op specs, and the feature options (``--width``,
``--no-bias``...) are generated from the registered ops' feature models. The parsers raise
``ValueError`` with a message naming the option, so a typo reads as one line.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

import kernel_variants as kv
from kernel_variants.plugin import Features, OpSpec, Sweep

Shape = tuple[int, ...]
DTYPES = "bf16, fp16, fp32, fp64 (or bfloat16, float16...)"
MODES = typing.get_args(typing.get_type_hints(kv.TimingConfig)["mode"])  # eager, graph
_FEATURE_PREFIX = "feature_"


def ops() -> list[OpSpec]:
    return kv.op_specs()


def spec_of(name: str) -> OpSpec:
    """The registered op called ``name`` (or one of its aliases); KeyError otherwise."""
    found = next((s for s in ops() if s.name == name), None) or next((s for s in ops() if name in s.aliases), None)
    if found is None:
        raise KeyError(f"op must be one of {', '.join(s.name for s in ops())}, got {name!r}")
    return found


def op_spec(raw: str) -> OpSpec:
    try:
        return spec_of(raw)
    except KeyError:
        names = ", ".join(f"{s.name}" + (f" ({', '.join(s.aliases)})" if s.aliases else "") for s in ops())
        raise ValueError(f"--op: expected one of {names}, got {raw!r}") from None


def shape(raw: str, spec: OpSpec) -> Shape:
    """``"B,D,L"`` (also ``BxDxL``) -> a tuple of positive ints, one per axis of ``spec``."""
    parts = raw.replace("x", ",").split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != len(spec.axes) or min(values) < 1:
        axes = ",".join(spec.axes)
        raise ValueError(f"shape: expected {axes} as {len(spec.axes)} positive integers for {spec.name}, got {raw!r}")
    return values


def dtype(raw: str) -> str:
    try:
        return kv.dtype_name(raw)
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None


def device(raw: str) -> str:
    try:
        dev = torch.device(raw)
    except RuntimeError:
        raise ValueError(f"--device: expected a torch device such as cpu, cuda, cuda:1 or npu, got {raw!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {raw!r} asked for, but this machine has no CUDA device torch can use")
    if dev.type == "npu" and not hasattr(torch, "npu"):
        raise ValueError(f"--device: {raw!r} asked for, but torch_npu is not installed (pip install torch_npu)")
    if dev.type not in ("cpu", "cuda", "npu"):
        raise ValueError(f"--device: expected cpu, cuda[:N] or npu[:N], got {raw!r}")
    return str(dev)


def variant_list(raw: str) -> list[str]:
    ids = [v.strip() for v in raw.split(",") if v.strip()]
    if not ids:
        raise ValueError(f"--variants: expected comma-separated variant ids, got {raw!r}")
    return ids


def add_op(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", help="an op name or alias (kv info lists them); default: the first registered op")


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")


def add_dtype(p: argparse.ArgumentParser, default: str = "bf16") -> None:
    p.add_argument("--dtype", default=default, help=f"{DTYPES} (default {default})")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def add_features(p: argparse.ArgumentParser) -> None:
    """One option per feature field of every registered op: ``--no-X`` for a flag on by default,
    ``--X`` for one off by default, ``--X VALUE`` otherwise. Unset options leave the op's default."""
    g = p.add_argument_group("call features (what the measured call looks like; each op has its own)")
    seen: set[str] = set()
    for spec in ops():
        hints = typing.get_type_hints(spec.features)
        for name, field in spec.features.model_fields.items():
            if name in seen:
                continue
            seen.add(name)
            dest = _FEATURE_PREFIX + name
            having = [s.name for s in ops() if name in s.features.model_fields]
            doc = f"{field.description + '; ' if field.description else ''}{', '.join(having)}"
            if hints[name] is bool:
                if field.default:
                    g.add_argument(f"--no-{_flag(name)}", dest=dest, action="store_false", default=None,
                                   help=f"{doc} (default on)")
                else:
                    g.add_argument(f"--{_flag(name)}", dest=dest, action="store_true", default=None,
                                   help=f"{doc} (default off)")
            else:
                g.add_argument(f"--{_flag(name)}", dest=dest, default=None, metavar="VALUE",
                               help=f"{doc} (default {field.default})")


def features(args: argparse.Namespace, spec: OpSpec, base: dict[str, Any] | None = None) -> Features:
    """The feature model of ``spec`` from the options given (on top of ``base``, a sweep's)."""
    given = {k.removeprefix(_FEATURE_PREFIX): v for k, v in vars(args).items()
             if k.startswith(_FEATURE_PREFIX) and v is not None}
    foreign = [n for n in given if n not in spec.features.model_fields]
    if foreign:
        raise ValueError(f"--{_flag(foreign[0])}: not a feature of {spec.name} "
                         f"(its features: {', '.join(spec.features.model_fields) or 'none'})")
    try:
        return spec.features(**{**(base or {}), **given})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = f"--{_flag(str(err['loc'][0]))}: " if err["loc"] else ""
        raise ValueError(f"{where}{err['msg'].removeprefix('Value error, ')}") from None


def add_sweep(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shapes")
    g.add_argument("--sweep", help="a named sweep of an op (kv info lists them) or a CSV file with a column per "
                                   "axis of the op (default: the op's own default sweep)")
    g.add_argument("--shapes", nargs="+", metavar="SHAPE", help="explicit shapes (B,D,L for the conv ops) instead")


def add_timing(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("timing")
    g.add_argument("--warmup", type=int, default=5, help="warm-up calls (default 5)")
    g.add_argument("--windows", type=int, default=5, help="timed windows; the minimum counts (default 5)")
    g.add_argument("--iters", type=int, default=100, help="calls per window (default 100)")
    g.add_argument("--rotate", type=int, default=0, help="extra input copies cycled for a cold cache (default 0)")
    g.add_argument("--timing-mode", choices=MODES, default="eager",
                   help="eager launches (default), or graph: the replay of a captured CUDA graph of each window "
                        "(CUDA only; what a model served from CUDA graphs sees)")
    g.add_argument("--cold-l2", action="store_true",
                   help="rotate as many input copies as make twice the device's L2, so no window reads its inputs "
                        "from L2 (CUDA only)")
    g.add_argument("--with-out", action="store_true",
                   help="time each call writing into a preallocated out= as the dispatcher runs it (passed to a "
                        "variant that takes out, else its result copied there), for callers that pass out=")


def timing(args: argparse.Namespace) -> kv.TimingConfig:
    """The timing options as a TimingConfig (whether the device can take them, graph mode and
    cold L2 on CUDA only, the library checks before measuring anything)."""
    if args.rotate < 0:
        raise ValueError(f"--rotate: expected a count >= 0, got {args.rotate}")
    try:
        return kv.TimingConfig(warmup=args.warmup, windows=args.windows, iters=args.iters,
                               mode=args.timing_mode, cold_l2=args.cold_l2, with_out=args.with_out)
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def budget(raw: str | None) -> float | None:
    """``"5m"``, ``"90s"``, ``"1h"``, ``"1m30s"`` or a number of seconds -> seconds (None for None)."""
    if raw is None:
        return None
    text = raw.strip().lower()
    total, number = 0.0, ""
    try:
        for ch in text:
            if ch.isdigit() or ch == ".":
                number += ch
            elif ch in _UNITS and number:
                total += float(number) * _UNITS[ch]
                number = ""
            else:
                raise ValueError
        total += float(number) if number else 0.0
    except ValueError:
        total = -1.0
    if not text or total <= 0:
        raise ValueError(f"--budget: expected a duration such as 5m, 90s, 1h30m or seconds, got {raw!r}")
    return total


def find_sweep(name: str, spec: OpSpec | None) -> Sweep:
    """A named sweep (of ``spec``, or of whichever op has one by that name), or a CSV file."""
    specs = [spec] if spec is not None else ops()
    named = [s.sweeps[name] for s in specs if name in s.sweeps]
    if len(named) == 1:
        return named[0]
    if len(named) > 1:
        raise ValueError(f"--sweep {name}: several ops have a sweep of that name; say which with --op")
    if name.endswith(".csv") or Path(name).exists():
        return kv.read_sweep(name, spec.name if spec is not None else None)
    known = list(dict.fromkeys(n for s in ops() for n in s.sweeps))
    if spec is not None:
        others = [s.name for s in ops() if name in s.sweeps]
        if others:
            raise ValueError(f"--sweep {name} is a sweep of {others[0]}, but --op is {spec.name}")
    raise ValueError(f"sweep: expected one of {', '.join(known)} or a .csv file, got {name!r}")


@dataclass(frozen=True)
class Work:
    """What to measure: the op, its shapes, the features of the call and where they came from."""

    spec: OpSpec
    shapes: tuple[Shape, ...]
    features: Features
    source: str  # the sweep name, file, or "--shapes"

    @property
    def op(self) -> str:
        return self.spec.name


def work(args: argparse.Namespace) -> Work:
    """The op, shapes and features from ``--op``, ``--sweep``, ``--shapes`` and the feature
    options; without a sweep or shapes, the op's default sweep."""
    spec = op_spec(args.op) if args.op else None
    if args.shapes and args.sweep:
        raise ValueError("give --sweep or --shapes, not both")
    if args.shapes:
        spec = spec or ops()[0]
        return Work(spec, tuple(shape(s, spec) for s in args.shapes), features(args, spec), "--shapes")
    if args.sweep:
        sweep = find_sweep(args.sweep, spec)
    else:
        spec = spec or ops()[0]
        if spec.default_sweep is None:
            raise ValueError(f"{spec.name} has no default sweep: give --sweep or --shapes")
        sweep = spec.sweeps[spec.default_sweep]
    spec = spec_of(sweep.op)
    return Work(spec, sweep.shapes, features(args, spec, dict(sweep.features)), sweep.name)
