"""What this machine's table is keyed by and where it lives: the device fingerprint, the cache
directory (or that it is in memory), the table size, the call path the ops take (the compiled
call core, or Python and why) and the plugins loaded."""

from __future__ import annotations

import argparse

from kernel_variants._cli import _options as opt
from kernel_variants._cli._output import print_json, render_table
from kernel_variants._runtime import callcore as _callcore
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
from kernel_variants._version import __version__


def add_arguments(p: argparse.ArgumentParser) -> None:
    opt.add_device(p)


def run(args: argparse.Namespace) -> int:
    d = dispatcher()
    fp = fingerprint(opt.device(args.device))
    table = d.table
    facts = {
        "kernel_variants": __version__,
        "fingerprint_id": fingerprint_id(fp),
        "fingerprint": fp,
        "cache_dir": str(table.directory),
        "in_memory": table.in_memory,
        "read_only": table.store.read_only,
        "table_entries": len(table),
        "call_path": _callcore.status()[1],
        "plugins": d.registry.plugins(),
        "broken_plugins": d.registry.broken,
        "variants": {spec.name: [rv.id for rv in d.registry.variants(spec.name)] for spec in d.registry.ops()},
        "ops": {spec.name: {"axes": list(spec.axes), "aliases": list(spec.aliases), "sweeps": list(spec.sweeps),
                            "features": list(spec.features.model_fields), "plugin": d.registry.op_plugin(spec.name)}
                for spec in d.registry.ops()},
    }
    if args.json:
        print_json(facts)
        return 0
    rows = [["kernel_variants", __version__], ["fingerprint id", facts["fingerprint_id"]]]
    rows += [[f"  {k}", v] for k, v in fp.items()]
    where = facts["cache_dir"] + (" (read-only: its entries are used, new ones stay in memory)"
                                  if facts["read_only"] else
                                  " (unusable: in memory for this process)" if table.in_memory else "")
    rows += [["cache", where], ["table entries", len(table)], ["call path", facts["call_path"]],
             ["plugins", ", ".join(facts["plugins"])]]
    rows += [[f"broken plugin {name}", why] for name, why in d.registry.broken.items()]
    for op, ids in facts["variants"].items():
        o = facts["ops"][op]
        rows.append([op, f"axes {','.join(o['axes'])}; aliases {', '.join(o['aliases']) or '-'}; "
                         f"sweeps {', '.join(o['sweeps']) or '-'}"])
        rows.append(["  variants", ", ".join(ids)])
    print(render_table(["", ""], rows, right=[False, False], header=False))
    return 0
