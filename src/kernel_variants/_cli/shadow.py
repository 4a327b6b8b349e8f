"""What shadow verification found: per op and variant, the calls served, shadowed and the
mismatches, summed over every process that wrote its counters to this table's directory, and
each saved mismatch; ``--replay FILE`` judges a saved mismatch again (exit 1 while it still
disagrees), ``--clear`` removes the counters and saved calls. Shadowing is turned on in the
serving process: ``KV_SHADOW=0.01`` (or ``kv.shadow(0.01)``; ``patch(shadow=...)`` for engines).
"""

from __future__ import annotations

import argparse

import kernel_variants as kv
from kernel_variants._cli._output import print_json, render_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--replay", metavar="FILE", help="judge a saved mismatch again")
    group.add_argument("--clear", action="store_true", help="remove the counters and the saved calls")


def run(args: argparse.Namespace) -> int:
    if args.replay:
        why, ran = kv.replay_mismatch(args.replay)
        if args.json:
            print_json({"file": args.replay, "ran": ran, "mismatch": why})
        else:
            print(f"{ran}: {'still disagrees: ' + why if why else 'agrees now'}")
        return 1 if why else 0
    if args.clear:
        print(f"cleared {kv.clear_shadow()}")
        return 0
    rep = kv.shadow_report(all_processes=True)
    if args.json:
        print_json({"processes": rep.processes, "mismatches": rep.mismatches,
                    "counts": [vars(c) for c in rep.counts]})
        return 0
    if not rep.counts and not rep.mismatches:
        print("no shadow counters here: set KV_SHADOW=<rate> in the serving process (0.01: one call in a hundred)")
        return 0
    print(render_table(["op", "variant", "served", "shadowed", "mismatches"],
                       [(c.op, c.variant, c.served, c.shadowed, c.mismatches) for c in rep.counts]))
    print(f"({rep.processes} process{'es' if rep.processes != 1 else ''})")
    for m in rep.mismatches:
        print(f"mismatch: {m['op']} {m['variant']} against {m['oracle']}: {m['reason']}\n"
              f"  kv shadow --replay {m['file']}")
    return 0
