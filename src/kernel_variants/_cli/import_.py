"""Merge a table document from ``kv export`` into this machine's table.

The whole document is validated before anything is written; a document measured on another
fingerprint is refused unless ``--force`` (which files its entries under this machine's
fingerprint), and one measured on another kind of CPU (vendor, family, model, stepping or ISA
level) is refused even then. Per entry, the newer of the local and the imported one is kept.
"""

from __future__ import annotations

import argparse
import sys

import kernel_variants as kv
from kernel_variants._cli import _options as opt
from kernel_variants._cli._output import print_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="a document written by kv export")
    p.add_argument("--force", action="store_true", help="import a document from another fingerprint (another thread count or driver, say; "
                   "never another kind of CPU)")
    opt.add_device(p)


def run(args: argparse.Namespace) -> int:
    rep = kv.import_table(args.file, force=args.force, device=opt.device(args.device))
    if args.json:
        print_json({"file": args.file, "fingerprint_id": rep.fingerprint_id, "forced": rep.forced,
                    "added": rep.added, "updated": rep.updated, "kept": rep.kept,
                    "stale": {v: list(vs) for v, vs in rep.stale.items()}, "unknown": rep.unknown,
                    "verdicts": rep.verdicts, "verdicts_left": rep.verdicts_left,
                    "verdicts_empty": rep.verdicts_empty})
        return 0
    forced = " (fingerprint differed; imported under this machine's with --force)" if rep.forced else ""
    print(f"imported {args.file}: {rep.added} added, {rep.updated} updated, {rep.kept} kept as newer here, "
          f"{rep.verdicts} qualification verdicts{forced}")
    if rep.verdicts_left:
        print(f"kv import: {rep.verdicts_left} qualification verdicts left out: they were taken on another "
              "fingerprint (each variant qualifies here before it is chosen)", file=sys.stderr)
    if rep.verdicts_empty:
        print(f"kv import: {rep.verdicts_empty} qualification verdicts refused: they say passed but ran no "
              "case (each such variant qualifies here before it is chosen)", file=sys.stderr)
    for v, (theirs, ours) in sorted(rep.stale.items()):
        print(f"kv import: warning: {v} was measured at version {theirs}, this machine has {ours}; "
              "its imported timings are ignored until recalibrated", file=sys.stderr)
    if rep.unknown:
        print(f"kv import: warning: not registered here, kept for when they are: {', '.join(rep.unknown)}",
              file=sys.stderr)
    return 0
