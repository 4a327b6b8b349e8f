"""What this machine's table is keyed by and where it lives: the device fingerprint (on the CPU:
its name, thread count, architecture, vendor, family, model, stepping and the ISA level its code
paths run at), the cache directory (or that it is in memory), the table size, the call path the
ops take (the compiled call core, or Python and why), the plugins loaded, and the code path of
each variant that picks one at run time (cpu_native's ISA build; "not built" before a build)."""

from __future__ import annotations

import argparse

import kernel_variants as kv
from kernel_variants._cli import _options as opt
from kernel_variants._cli._output import print_json, render_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    opt.add_device(p)


def run(args: argparse.Namespace) -> int:
    i = kv.info(opt.device(args.device))
    specs = opt.ops()
    facts = {
        "kernel_variants": i.version,
        "fingerprint_id": i.fingerprint_id,
        "fingerprint": i.fingerprint,
        "cache_dir": i.cache_dir,
        "in_memory": i.in_memory,
        "read_only": i.read_only,
        "table_entries": i.table_entries,
        "call_path": i.call_path,
        "plugins": i.plugins,
        "broken_plugins": i.broken_plugins,
        "variants": {spec.name: [rv.id for rv in kv.variants(spec.name)] for spec in specs},
        "ops": {spec.name: {"axes": list(spec.axes), "aliases": list(spec.aliases), "sweeps": list(spec.sweeps),
                            "features": list(spec.features.model_fields), "plugin": i.op_plugins[spec.name],
                            "code_paths": i.code_paths.get(spec.name, {})}
                for spec in specs},
    }
    if args.json:
        print_json(facts)
        return 0
    rows = [["kernel_variants", i.version], ["fingerprint id", i.fingerprint_id]]
    rows += [[f"  {k}", v] for k, v in i.fingerprint.items()]
    where = i.cache_dir + (" (read-only: its entries are used, new ones stay in memory)" if i.read_only else
                           " (unusable: in memory for this process)" if i.in_memory else "")
    rows += [["cache", where], ["table entries", i.table_entries], ["call path", i.call_path],
             ["plugins", ", ".join(i.plugins)]]
    rows += [[f"broken plugin {name}", why] for name, why in i.broken_plugins.items()]
    for op, ids in facts["variants"].items():
        o = facts["ops"][op]
        rows.append([op, f"axes {','.join(o['axes'])}; aliases {', '.join(o['aliases']) or '-'}; "
                         f"sweeps {', '.join(o['sweeps']) or '-'}"])
        rows.append(["  variants", ", ".join(ids)])
        if o["code_paths"]:
            rows.append(["  code paths", ", ".join(f"{v} {path}" for v, path in o["code_paths"].items())])
    print(render_table(["", ""], rows, right=[False, False], header=False))
    return 0
