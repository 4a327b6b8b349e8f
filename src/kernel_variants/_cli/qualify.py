"""Qualify variants on this device: each available variant runs the op's edge cases (pad slots in
and outside the pool, poisoned rows, packed and strided inputs, each out= form it declares, an
empty call) against the reference, for each class of calls (dtype and features); one that fails
is never chosen for that class here. Verdicts are stored with the table, so no call pays for
them later. Exit status 1 when a variant failed (each failure is listed with its case)."""

from __future__ import annotations

import argparse

import kernel_variants as kv
from kernel_variants._cli import _options as opt
from kernel_variants._cli._output import print_json, render_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", help="an op name or alias; default: every registered op")
    p.add_argument("--dtype", default=None, help=f"{opt.DTYPES} (default: fp32, bf16 and fp16)")
    opt.add_device(p)
    p.add_argument("--variants", help="comma-separated variant ids (default: every available one)")
    p.add_argument("--redo", action="store_true", help="qualify again even where a current verdict is stored")
    p.add_argument("--clear", action="store_true", help="forget the stored verdicts (of --op, of --variants) instead")
    opt.add_features(p)


def run(args: argparse.Namespace) -> int:
    op = opt.op_spec(args.op).name if args.op else None
    variants = opt.variant_list(args.variants) if args.variants else None
    if args.clear:
        n = sum(kv.clear_verdicts(op, v) for v in variants) if variants else kv.clear_verdicts(op)
        print(f"kv qualify: {n} verdicts forgotten")
        return 0
    features = opt.features(args, opt.op_spec(op)).model_dump() if op else {}
    if not op and any(k.startswith(opt._FEATURE_PREFIX) and v is not None for k, v in vars(args).items()):
        raise ValueError("features: pass --op to say which op they are of")
    verdicts = kv.qualify(op, device=opt.device(args.device), dtype=opt.dtype(args.dtype) if args.dtype else None,
                          variants=variants, redo=args.redo, **features)
    if args.json:
        print_json([v.model_dump(mode="json") for v in verdicts])
    elif not verdicts:
        print("kv qualify: no available variant claims this device")
    else:
        rows = [[v.group.op, v.variant, v.group.dtype, ",".join(f"{k}={x}" for k, x in v.group.features) or "-",
                 "passed" if v.passed else "FAILED", v.cases, f"{v.seconds:.2f}", v.where,
                 "" if v.passed else f"{v.failed_case}: {v.reason}" if v.failed_case else v.reason]
                for v in verdicts]
        print(render_table(["op", "variant", "dtype", "features", "verdict", "cases", "s", "in", "why"], rows,
                           right=[False] * 5 + [True, True, False, False]))
    return 0 if all(v.passed for v in verdicts) else 1
