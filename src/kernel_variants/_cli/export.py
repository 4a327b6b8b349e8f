"""Write this device's calibration table as a versioned JSON document (``-`` for stdout), for
``kv import`` on every identical machine of a fleet."""

from __future__ import annotations

import argparse
import sys

import kernel_variants as kv
from kernel_variants._cli import _options as opt
from kernel_variants._cli._output import print_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="where to write the document (- for stdout)")
    opt.add_device(p)


def run(args: argparse.Namespace) -> int:
    to_stdout = args.file == "-"
    doc = kv.export_table(sys.stdout if to_stdout else args.file, device=opt.device(args.device))
    if to_stdout:
        pass  # stdout holds the document itself, with or without --json
    elif args.json:
        print_json({"file": args.file, "fingerprint_id": doc.fingerprint_id,
                    "measurements": len(doc.measurements), "winners": len(doc.winners)})
    else:
        print(f"wrote {len(doc.measurements)} measurements and {len(doc.winners)} winners "
              f"(fingerprint {doc.fingerprint_id}) to {args.file}")
    if not doc.measurements:
        print("kv export: warning: the table has no measurements for this device (run kv calibrate)", file=sys.stderr)
    return 0
