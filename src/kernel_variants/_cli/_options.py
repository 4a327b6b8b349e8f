"""Options several commands share, and turning them into library arguments.

The parsers raise ``ValueError`` with a message naming the option, so a typo reads as one line.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from kernel_variants._sweeps import NAMES, Sweep, get_sweep
from kernel_variants.dispatch._calibrate import Features, as_dtype
from kernel_variants.dispatch._timing import TimingConfig
from kernel_variants.registry._models import OPS, OpName

Shape = tuple[int, int, int]

_OP_ALIASES = {"fn": "causal_conv1d_fn", "prefill": "causal_conv1d_fn",
               "update": "causal_conv1d_update", "decode": "causal_conv1d_update"}
DTYPE_CHOICES = ("bf16", "fp16", "fp32", "bfloat16", "float16", "float32")


def op_name(raw: str) -> OpName:
    op = _OP_ALIASES.get(raw, raw)
    if op not in OPS:
        raise ValueError(f"--op: expected one of {', '.join(OPS)} (or fn, update), got {raw!r}")
    return op  # type: ignore[return-value]


def shape(raw: str) -> Shape:
    """``"B,D,L"`` (also ``BxDxL``) -> (B, D, L) of positive ints."""
    parts = raw.replace("x", ",").split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise ValueError(f"shape: expected B,D,L as three positive integers (e.g. 2,256,64), got {raw!r}")
    return values  # type: ignore[return-value]


def dtype(raw: str) -> str:
    if raw not in DTYPE_CHOICES:
        raise ValueError(f"--dtype: expected one of {', '.join(DTYPE_CHOICES)}, got {raw!r}")
    return str(as_dtype(raw)).removeprefix("torch.")


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


def add_op(p: argparse.ArgumentParser, *, default: str | None = None) -> None:
    p.add_argument("--op", help=f"{' or '.join(OPS)} (or fn, update)" + (f"; default {default}" if default else ""))


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")


def add_dtype(p: argparse.ArgumentParser, default: str = "bf16") -> None:
    p.add_argument("--dtype", default=default, help=f"{', '.join(DTYPE_CHOICES)} (default {default})")


def add_features(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("call features (what the measured call looks like)")
    g.add_argument("--width", type=int, default=4, help="convolution width W (default 4)")
    g.add_argument("--no-bias", action="store_true", help="no bias")
    g.add_argument("--activation", default="silu", help="silu or none (default silu)")
    g.add_argument("--no-states", action="store_true", help="no conv_states (prefill only)")
    g.add_argument("--varlen", action="store_true", help="packed sequences with query_start_loc (prefill)")
    g.add_argument("--spec", action="store_true", help="num_accepted_tokens (update, L > 1)")


def add_sweep(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shapes")
    g.add_argument("--sweep", help=f"{', '.join(NAMES)} or a CSV file with B,dim,seq columns "
                                   "(default smoke; decode with --op update)")
    g.add_argument("--shapes", nargs="+", metavar="B,D,L", help="explicit shapes instead of a sweep")


def add_timing(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("timing")
    g.add_argument("--warmup", type=int, default=5, help="warm-up calls (default 5)")
    g.add_argument("--windows", type=int, default=5, help="timed windows; the minimum counts (default 5)")
    g.add_argument("--iters", type=int, default=100, help="calls per window (default 100)")
    g.add_argument("--rotate", type=int, default=0, help="extra input copies cycled for a cold cache (default 0)")


def features(args: argparse.Namespace, op: OpName, *, spec: bool = False) -> Features:
    act = args.activation.lower()
    if act == "swish":
        act = "silu"
    if act not in ("silu", "none"):
        raise ValueError(f"--activation: expected silu or none, got {args.activation!r}")
    spec = spec or args.spec
    if spec and op != "causal_conv1d_update":
        raise ValueError("--spec: num_accepted_tokens exists only for causal_conv1d_update (use --op update)")
    if args.varlen and op != "causal_conv1d_fn":
        raise ValueError("--varlen: packed sequences exist only for causal_conv1d_fn")
    if args.no_states and op != "causal_conv1d_fn":
        raise ValueError("--no-states: causal_conv1d_update always has a conv_state")
    if args.width < 1:
        raise ValueError(f"--width: expected a convolution width W >= 1, got {args.width}")
    return Features(width=args.width, bias=not args.no_bias, activation=None if act == "none" else "silu",
                    states=not args.no_states, varlen=args.varlen, spec=spec)


def timing(args: argparse.Namespace) -> TimingConfig:
    if args.rotate < 0:
        raise ValueError(f"--rotate: expected a count >= 0, got {args.rotate}")
    try:
        return TimingConfig(warmup=args.warmup, windows=args.windows, iters=args.iters)
    except ValueError as exc:
        raise ValueError(f"--{exc}") from None


@dataclass(frozen=True)
class Work:
    """What to measure: the op, its shapes and whether the sweep asks for speculative decoding."""

    op: OpName
    shapes: tuple[Shape, ...]
    spec: bool
    source: str  # the sweep name, file, or "--shapes"


def work(args: argparse.Namespace) -> Work:
    """The op and shapes from ``--op``, ``--sweep`` and ``--shapes``; without either, the smoke
    sweep (prefill) or the decode sweep (``--op update``)."""
    op = op_name(args.op) if args.op else None
    if args.shapes and args.sweep:
        raise ValueError("give --sweep or --shapes, not both")
    if args.shapes:
        return Work(op or "causal_conv1d_fn", tuple(shape(s) for s in args.shapes), False, "--shapes")
    default = "decode" if op == "causal_conv1d_update" else "smoke"
    sweep: Sweep = get_sweep(args.sweep or default, op)
    if op is not None and sweep.op != op:
        raise ValueError(f"--sweep {sweep.name} is a sweep of {sweep.op}, but --op is {op}")
    return Work(sweep.op, sweep.shapes, sweep.spec, sweep.name)
