"""Compile every variant that is built on this machine (the cpu_native C++ kernel, and any
plugin's that declares a build) and the ops' compiled call core, so that no process pays for it
on its first call (the core is never built by a call: without it the ops take the Python call
path), then qualify
what it built on this machine's CPU (kv qualify), so that no call pays for that either. Run it
when building a container image or in CI; it reports where each build went and each verdict
(exit status 1 when a build or a qualification failed, with the reason)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import kernel_variants as kv

if TYPE_CHECKING:
    from kernel_variants import types
from kernel_variants._cli._output import print_json, render_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    records = kv.build()
    if args.json:
        print_json([{"variant": r.variant, "ops": r.ops, "plugin": r.plugin, "ok": r.ok, "where": r.where,
                     "seconds": r.seconds, "reason": r.reason,
                     "qualified": {"passed": r.qualified, "failed": list(r.failed)}} for r in records])
    else:
        rows = [[r.variant, ",".join(r.ops), "built" if r.ok else "failed", r.seconds, _qualified(r),
                 r.where if r.ok else r.reason] for r in records]
        print(render_table(["variant", "ops", "status", "s", "qualified (cpu)", "where / why"], rows))
    return 0 if all(r.ok and not r.failed for r in records) else 1


def _qualified(r: types.BuildResult) -> str:
    if r.failed:
        return f"FAILED {r.failed[0]}" + (f" (+{len(r.failed) - 1})" if len(r.failed) > 1 else "")
    return f"{r.qualified} classes" if r.qualified else "-"
