"""Every registered variant with its plugin, version, capabilities and availability; with
``--shape``, the decision the dispatcher makes for a realistic call of that shape, and why
(exit status 1 when no variant can run that call)."""

from __future__ import annotations

import argparse

import torch

import kernel_variants as kv
from kernel_variants._cli import _options as opt
from kernel_variants._cli._output import print_json, render_table, terminal_width, us


def add_arguments(p: argparse.ArgumentParser) -> None:
    opt.add_op(p)
    p.add_argument("--shape", help="a shape of the op (B,D,L for the conv ops): which variant this call gets and why")
    opt.add_dtype(p)
    opt.add_device(p)
    opt.add_features(p)
    p.add_argument("--wide", action="store_true", help="every column (plugin, version, width, features)")


def _catalogue(args: argparse.Namespace) -> int:
    op = opt.op_spec(args.op).name if args.op else None
    order = {spec.name: i for i, spec in enumerate(opt.ops())}
    # A variant's tactics are listed with it, not as rows of their own.
    entries = sorted((rv for rv in kv.variants(op) if rv.tactic is None),
                     key=lambda rv: (order[rv.op], -rv.variant.priority, rv.id))
    verdicts: dict[tuple[str, str], list] = {}
    for v in kv.verdicts(opt.device(args.device)):
        verdicts.setdefault((v.group.op, v.variant), []).append(v)
    records = []
    for rv in entries:
        c = rv.variant.capabilities
        why = rv.unavailable_reason()
        records.append({
            "op": rv.op, "id": rv.id, "tactics": list(rv.tactics), "plugin": rv.plugin, "version": rv.version, "depends": rv.deps,
            "priority": rv.variant.priority, "devices": sorted(c.devices), "dtypes": sorted(c.dtypes),
            "features": c.summary(), "available": why is None, "reason": why,
            "needs_build": rv.needs_build(), "code_path": rv.code_path(),
            "qualification": [{"dtype": v.group.dtype, "features": dict(v.group.features), "passed": v.passed,
                               "cases": v.cases, "failed_case": v.failed_case, "reason": v.reason}
                              for v in verdicts.get((rv.op, rv.id), [])],
            "capabilities": c.model_dump(mode="json"),
        })
    if args.json:
        print_json(records)
        return 0
    status = ["yes, not built yet (kv build)" if r["needs_build"] else "yes" if r["available"]
              else f"no: {r['reason']}" for r in records]
    qualified = [_qualified(r, rv.variant.fn is opt.spec_of(rv.op).reference.fn, args.wide)
                 for r, rv in zip(records, entries, strict=True)]
    if args.wide:
        rows = [[r["op"], _named(r, True), r["plugin"], r["version"], r["priority"], ",".join(r["devices"]),
                 ",".join(_short(d) for d in r["dtypes"]), r["features"], r["code_path"] or "-", q, st]
                for r, st, q in zip(records, status, qualified, strict=True)]
        print(render_table(["op", "variant", "plugin", "version", "prio", "devices", "dtypes", "capabilities",
                            "code path", "qualified", "available"], rows, right=[False] * 4 + [True] + [False] * 6))
    else:
        # "available" last: its reasons are the long cells, wrapped to the terminal's width.
        rows = [[r["op"], _named(r, False), r["priority"], ",".join(r["devices"]),
                 ",".join(_short(d) for d in r["dtypes"]), q, st]
                for r, st, q in zip(records, status, qualified, strict=True)]
        print(render_table(["op", "variant", "prio", "devices", "dtypes", "qualified", "available"], rows,
                           right=[False, False, True, False, False, False, False], width=terminal_width()))
    for name, why in kv.info(opt.device(args.device)).broken_plugins.items():
        print(f"broken plugin {name!r}: {why}")
    return 0


def _named(record: dict, wide: bool) -> str:
    """The variant's id with its tactics: named with ``--wide`` (``triton [d32,d64]``), else
    counted (``triton +2 tactics``), so the table fits the terminal."""
    tactics = record["tactics"]
    if not tactics:
        return record["id"]
    return f"{record['id']} [{','.join(tactics)}]" if wide else f"{record['id']} +{len(tactics)} tactics"


def _qualified(record: dict, oracle: bool, wide: bool) -> str:
    """A variant's verdicts on this device in a word or two (wide: the first failing case too)."""
    if oracle:
        return "oracle"
    found = record["qualification"]
    failed = [q for q in found if not q["passed"]]
    if failed:
        q = failed[0]
        more = f" (+{len(failed) - 1} classes)" if len(failed) > 1 else ""
        return f"FAILED {_short(q['dtype'])}: {q['failed_case'] or q['reason']}{more}" if wide else "FAILED"
    if found:
        return f"{len(found)} passed"
    return "not yet" if record["available"] else "-"


def _decision(args: argparse.Namespace) -> int:
    spec = opt.op_spec(args.op) if args.op else opt.ops()[0]
    shape = opt.shape(args.shape, spec)
    f = opt.features(args, spec)
    case = spec.sweep_case(shape, f, dtype=getattr(torch, opt.dtype(args.dtype)), device=opt.device(args.device))
    decision = kv.explain(spec.name, *case.args, **case.kwargs)
    chosen = decision.chosen.id if decision.chosen is not None else None
    k = decision.key
    if args.json:
        print_json({
            "key": {"op": k.op, "device": k.device, "dtype": k.dtype, **dict(zip(spec.axes, k.shape, strict=True)),
                    **k.features.model_dump(), "extra": sorted(k.extra)},
            "chosen": chosen, "source": decision.source, "note": decision.note,
            "measured_shape": decision.measured_key, "needs_build": bool(chosen and decision.chosen.needs_build()),
            "trace": [{"variant": r.variant, "accepted": r.accepted, "reason": r.reason, "time_us": r.time_us}
                      for r in decision.trace],
        })
        return 0
    print(k.describe())
    how = decision.source
    if decision.measured_key is not None and decision.source == "nearest":
        how += " calibrated shape " + ",".join(map(str, decision.measured_key))
    notes = [n for n in (decision.note, "not built yet: the first call compiles it, or run `kv build`"
                         if chosen and decision.chosen.needs_build() else "") if n]
    print(f"-> {chosen or 'nothing can run it'} (by {how}{'; ' + '; '.join(notes) if notes else ''})")
    rows = [["+" if r.accepted else "-", r.variant, us(r.time_us), r.reason] for r in decision.trace]
    print(render_table(["", "variant", "µs", "reason"], rows))
    return 0 if chosen is not None else 1


def run(args: argparse.Namespace) -> int:
    return _decision(args) if args.shape else _catalogue(args)


def _short(dtype: str) -> str:
    """``bfloat16`` -> ``bf16``, ``float32`` -> ``fp32`` (as users type them)."""
    if dtype in ("bfloat16", "float16", "float32", "float64"):
        return dtype.replace("bfloat", "bf").replace("float", "fp")
    return dtype
