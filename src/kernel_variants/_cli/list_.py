"""Every registered variant with its plugin, version, capabilities and availability; with
``--shape``, the decision the dispatcher makes for a realistic call of that shape, and why
(exit status 1 when no variant can run that call)."""

from __future__ import annotations

import argparse

import kernel_variants as kv
from kernel_variants.dispatch import dispatcher
from kernel_variants._cases import make_case
from kernel_variants.dispatch._calibrate import as_dtype
from kernel_variants.registry import Capabilities

from . import _options as opt
from ._output import print_json, render_table, terminal_width, us


_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    opt.add_op(p)
    p.add_argument("--shape", help="B,D,L: show which variant this call gets and why")
    opt.add_dtype(p)
    opt.add_device(p)
    opt.add_features(p)
    p.add_argument("--wide", action="store_true", help="every column (plugin, version, width, features)")


def _bounds(b: tuple[int, int | None]) -> str:
    lo, hi = b
    return f"{lo}.." if hi is None else (str(lo) if lo == hi else f"{lo}..{hi}")


def _features(c: Capabilities) -> str:
    flags = [name for name, on in (("varlen", c.varlen), ("states", c.conv_states),
                                   ("noncontig", c.noncontiguous_states), ("bias", c.bias)) if on]
    if c.num_accepted_tokens:
        flags.append("spec" + (f"(W={_bounds(c.num_accepted_tokens_width)})" if c.num_accepted_tokens_width else ""))
    flags.append("act=" + "+".join(sorted(c.activations)))
    limits = [f"{n}={_bounds(v)}" for n, v in (("B", c.batch), ("D", c.dim), ("L", c.seqlen)) if v != (1, None)]
    return ",".join(flags + limits)


def _catalogue(args: argparse.Namespace) -> int:
    op = opt.op_name(args.op) if args.op else None
    entries = sorted(kv.variants(op), key=lambda rv: (rv.op, -rv.variant.priority, rv.id))
    records = []
    for rv in entries:
        c = rv.variant.capabilities
        why = rv.unavailable_reason()
        records.append({
            "op": rv.op, "id": rv.id, "plugin": rv.plugin, "version": rv.version,
            "priority": rv.variant.priority, "devices": sorted(c.devices), "dtypes": sorted(c.dtypes),
            "width": _bounds(c.width), "features": _features(c), "available": why is None, "reason": why,
            "needs_build": rv.needs_build(),
            "capabilities": c.model_dump(mode="json"),
        })
    if args.json:
        print_json(records)
        return 0
    status = ["yes, not built yet (kv build)" if r["needs_build"] else "yes" if r["available"]
              else f"no: {r['reason']}" for r in records]
    if args.wide:
        rows = [[r["op"], r["id"], r["plugin"], r["version"], r["priority"], ",".join(r["devices"]),
                 ",".join(_SHORT.get(d, d) for d in r["dtypes"]), r["width"], r["features"], st]
                for r, st in zip(records, status, strict=True)]
        print(render_table(["op", "variant", "plugin", "version", "prio", "devices", "dtypes", "W", "features",
                            "available"], rows, right=[False] * 4 + [True] + [False] * 5))
    else:
        rows = [[r["op"], r["id"], r["priority"], ",".join(r["devices"]),
                 ",".join(_SHORT.get(d, d) for d in r["dtypes"]), st]
                for r, st in zip(records, status, strict=True)]
        print(render_table(["op", "variant", "prio", "devices", "dtypes", "available"], rows,
                           right=[False, False, True, False, False, False], width=terminal_width()))
    for name, why in dispatcher().registry.broken.items():
        print(f"broken plugin {name!r}: {why}")
    return 0


def _decision(args: argparse.Namespace) -> int:
    op = opt.op_name(args.op) if args.op else "causal_conv1d_fn"
    b, d, seq = opt.shape(args.shape)
    f = opt.features(args, op)
    case = make_case(op, b, d, seq, width=f.width, dtype=as_dtype(opt.dtype(args.dtype)),
                     device=opt.device(args.device), bias=f.bias, activation=f.activation, states=f.states,
                     varlen=f.varlen, spec=f.spec)
    decision = kv.explain(op, *case.args, **case.kwargs)
    chosen = decision.chosen.id if decision.chosen is not None else None
    if args.json:
        print_json({
            "key": decision.key._asdict(), "chosen": chosen, "source": decision.source, "note": decision.note,
            "measured_shape": decision.measured_key,
            "trace": [{"variant": r.variant, "accepted": r.accepted, "reason": r.reason, "time_us": r.time_us}
                      for r in decision.trace],
        })
        return 0
    k = decision.key
    print(f"{k.op} on {k.device} {k.dtype}, B={k.batch} D={k.dim} L={k.seqlen} W={k.width} "
          f"bias={k.bias} act={k.activation} states={k.states} varlen={k.varlen} spec={k.spec}")
    how = decision.source
    if decision.measured_key is not None and decision.source == "nearest":
        how += " calibrated shape " + ",".join(map(str, decision.measured_key))
    print(f"-> {chosen or 'nothing can run it'} (by {how}{'; ' + decision.note if decision.note else ''})")
    rows = [["+" if r.accepted else "-", r.variant, us(r.time_us), r.reason] for r in decision.trace]
    print(render_table(["", "variant", "µs", "reason"], rows))
    return 0 if chosen is not None else 1


def run(args: argparse.Namespace) -> int:
    return _decision(args) if args.shape else _catalogue(args)
