"""Compile every variant that is built on this machine (the cpu_native C++ kernel, and any
plugin's that declares a build) and the ops' compiled call core, so that no process pays for it
on its first call (the core is never built by a call: without it the ops take the Python call
path), then qualify
what it built on this machine's CPU (kv qualify), so that no call pays for that either. Run it
when building a container image or in CI; it reports where each build went and each verdict
(exit status 1 when a build or a qualification failed, with the reason)."""

from __future__ import annotations

import argparse
import time

import kernel_variants as kv
from kernel_variants._cli._output import print_json, render_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    records: list[dict] = []
    seen: dict[object, dict] = {}
    for rv in kv.variants():
        build = rv.variant.build
        if build is None:
            continue
        if build in seen:  # one extension can serve several ops' variants
            seen[build]["ops"].append(rv.op)
            continue
        record = {"variant": rv.id, "ops": [rv.op], "plugin": rv.plugin, "ok": False, "where": None,
                  "seconds": None, "reason": rv.unavailable_reason()}
        seen[build] = record
        records.append(record)
        if record["reason"] is not None:
            continue
        t0 = time.perf_counter()
        try:
            record["where"] = build()
            record["ok"] = True
        except Exception as exc:  # the build's own message is the verdict
            record["reason"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        record["seconds"] = round(time.perf_counter() - t0, 1)
    built = [r["variant"] for r in records if r["ok"]]
    records.append(_call_core())
    verdicts = kv.qualify(variants=built) if built else []
    for r in records:
        if r["variant"] == "call core":
            continue
        mine = [v for v in verdicts if v.variant == r["variant"] and v.group.op in r["ops"]]
        failed = [v for v in mine if not v.passed]
        r["qualified"] = {"passed": len(mine) - len(failed),
                          "failed": [f"{v.group.op} {v.group.dtype}: {v.failed_case or v.reason}" for v in failed]}
    if args.json:
        print_json(records)
    else:
        rows = [[r["variant"], ",".join(r["ops"]), "built" if r["ok"] else "failed", r["seconds"],
                 _qualified(r["qualified"]), r["where"] if r["ok"] else r["reason"]] for r in records]
        print(render_table(["variant", "ops", "status", "s", "qualified (cpu)", "where / why"], rows))
    return 0 if all(r["ok"] and not r["qualified"]["failed"] for r in records) else 1


def _call_core() -> dict:
    """The dispatched ops' compiled call path, built like a variant (it runs no kernel: there is
    nothing to qualify)."""
    from kernel_variants._runtime.dispatcher import dispatcher
    from kernel_variants.kernels.cpu_native import _build

    record = {"variant": "call core", "ops": [spec.name for spec in dispatcher().registry.ops()],
              "plugin": "kernel_variants", "ok": False, "where": None, "seconds": None,
              "reason": _build.toolchain_missing(), "qualified": {"passed": 0, "failed": []}}
    if record["reason"] is not None:
        return record
    t0 = time.perf_counter()
    try:
        record["where"] = _build.build(_build.CORE)
        record["ok"] = True
    except Exception as exc:  # the build's own message is the verdict
        record["reason"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    record["seconds"] = round(time.perf_counter() - t0, 1)
    return record


def _qualified(q: dict) -> str:
    if q["failed"]:
        return f"FAILED {q['failed'][0]}" + (f" (+{len(q['failed']) - 1})" if len(q["failed"]) > 1 else "")
    return f"{q['passed']} classes" if q["passed"] else "-"
