"""GPU check: one prepared run of everything that needs a CUDA device, in under 4 minutes.

Five steps, in this order, each in its own child process with its own timeout (a hung kernel
kills its step, not the run; the steps after it still run):

- ``environment``: GPU, torch, Triton, CUDA and Python versions, each variant's availability;
  it builds the compiled call core (``kv build``'s; a cache hit where built), which serves CUDA
  calls as it serves CPU ones, and says which call path CUDA calls take (the Python one where
  the build failed: no compiler or no ninja, the reason in the report);
- ``qualify``: every available variant of all four ops on the device in bf16, fp16 and fp32
  (``kv.qualify``), passed / failed with each failure; tactics (``triton:d64``...) only with
  ``--tactics`` (on a fresh H200 the fp16 conv tactics alone compiled 382 Triton kernels, more
  than a run's budget); Triton variants stop being started once
  ``--compile-cap`` kernels have been compiled (the report says how many were, and which
  variants that cap or the step's budget left out);
- ``calibrate``: fp16 (the seed table's dtype) calibration of a subset of ``seed69`` and of the
  decode sweeps (device-event timing on CUDA), the decision table, each variant's effective
  bandwidth against a device-to-device copy of x timed in the same rounds, and the Triton
  variants' median share of copy bandwidth on shapes whose x is above 64 MB;
- ``graphs``: a decode step captured in a CUDA graph through the dispatched op and replayed 10
  times against eager, and ``torch.compile(fullgraph=True)`` of a small block against eager;
- ``overhead``: what the dispatched op adds over the chosen variant called directly, eager, at
  decode sizes (B = 1..256), and the aten ops it issues outside the variant.

Everything is written into OUTDIR: ``report.json`` (all steps), ``summary.md``, and one
``STEP.json`` per step (7 files: within what the device tool brings back). Tables and Triton's
kernel cache live in a state directory outside OUTDIR (in the temp directory, named after
OUTDIR), wiped at the start of a full run and kept for ``--only`` reruns, whose steps then reuse
the verdicts and kernels of the run before.

    python3 tools/gpu_check.py OUTDIR                    # on a CUDA machine: every step
    python3 tools/gpu_check.py OUTDIR --only calibrate   # rerun one step (or STEP,STEP)
    python3 tools/gpu_check.py OUTDIR --device cpu --tiny   # what the test suite runs

Without CUDA (and without ``--device cpu``) it prints "no CUDA device: nothing to check here"
and exits 0. Exit status: 0 when every step ran to its end, whatever the variants did (a failed
qualification is a finding, not an error of the script); 1 when a step raised or timed out (the
report and summary are written all the same, saying which and why).

On the device tool's H200 (torch, Triton and pluggy there; no package index), carry the other
dependencies as wheels for its Python 3.12. Once, here, in the repository root (the versions
this project is tested with)::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
        typing-inspection==0.4.5 typing-extensions==4.16.0 diskcache==5.6.3 ninja==1.13.0

(about 3 MB; never committed; ninja builds the call core there). Then one run, carrying ``.whl``, with a timeout that leaves
room for a rerun::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \
    PYTHONUNBUFFERED=1 python3 tools/gpu_check.py $OUT

The script finds ``src/`` beside it when kernel_variants is not installed, and hands that path
on to every process it starts (the library's own qualification children included).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEPS = ("environment", "qualify", "calibrate", "graphs", "overhead")
# Seconds per step on CUDA: 240 in all, so that a run with every step at its limit still ends
# inside the 4 minutes a device call is planned for (the environment step builds the call core:
# ~15 s of one compiler process).
CUDA_TIMEOUTS = {"environment": 40, "qualify": 65, "calibrate": 75, "graphs": 40, "overhead": 20}
# On the CPU the check is the test suite's: generous, since a first run may build cpu_native.
CPU_TIMEOUTS = dict.fromkeys(STEPS, 240)
COMPILE_CAP = 150  # Triton kernels compiled before no further Triton variant is qualified
DTYPES = ("bfloat16", "float16", "float32")
CALIBRATED = "float16"  # the seed table's dtype: calibrated, so qualified first
FN, UPDATE, RMS, ADD_RMS = "causal_conv1d_fn", "causal_conv1d_update", "gemma_rms_norm", "add_gemma_rms_norm"
PLAIN_RMS, FUSED_RMS = "rms_norm", "fused_add_rms_norm"  # vLLM IR's RMSNorm ops
# seed69's smallest shapes (x 67 to 268 MB in fp16), a spread over B, D and L: the case builder
# draws them on the device, and each variant is timed on them within the step's budget.
SEED_SUBSET = ((64, 1024, 512), (64, 1024, 1024), (128, 1024, 512), (64, 2048, 512), (64, 4096, 512),
               (256, 1024, 512))
BIG_X_BYTES = 64e6  # "x above 64 MB": the shapes where a copy's bandwidth is the ceiling
DECODE_B = (1, 8, 64, 256)
# The KV_* settings change what is chosen or checked; the check measures the defaults.
_DROPPED_ENV = ("KV_FORCE", "KV_DISABLE_PLUGINS", "KV_TUNE", "KV_QUALIFY", "KV_CHECK_VALUES", "KV_RECORD",
                "KV_CACHE_DIR")

_SRC = Path(__file__).resolve().parent.parent / "src"


def _importable() -> None:
    """Run from a checkout that was never installed (the device machine): use src/ beside this
    script, in this process and, through PYTHONPATH, in every process started from it."""
    try:
        import kernel_variants  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(_SRC))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_SRC), os.environ.get("PYTHONPATH")]))


# ---------------------------------------------------------------- the steps' shared context


@dataclass
class Ctx:
    """What a step is told: its device, its size, its time, and where to leave partial results."""

    outdir: Path
    name: str
    device: str
    tiny: bool
    budget_s: float  # the step's timeout less a margin for writing its result
    compile_cap: int
    tactics: bool  # the Triton variants' tactics too (each compiles its kernels anew)
    triton_cache: Path
    started: float

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def partial(self, result: dict[str, Any]) -> None:
        """Leave what is done so far: a step killed at its timeout still reports it."""
        _write_json(self.outdir / f"{self.name}.json",
                    {"step": self.name, "status": "partial", "seconds": time.monotonic() - self.started,
                     "result": result})


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=_plain) + "\n")
    tmp.replace(path)  # a reader (the parent, after a kill) never sees half a file


def _plain(v: Any) -> Any:
    if isinstance(v, set | frozenset | tuple):
        return list(v)
    return str(v)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _triton_variant(rv: Any) -> bool:
    """Whether a variant runs Triton kernels (and so compiles them on first use)."""
    return "triton" in (rv.variant.depends or ()) or "triton" in rv.plugin


def compiled_kernels(cache: Path) -> int:
    """Kernels Triton compiled into this run's cache directory. Counted on disk, not with a
    hook: most compiles happen in the library's qualification children, not in this process."""
    if not cache.is_dir():
        return 0
    return sum(1 for p in cache.rglob("*") if p.suffix in (".cubin", ".hsaco"))


# ---------------------------------------------------------------- step 1: environment


def _call_path(ctx: Ctx) -> str:
    from kernel_variants._runtime import callcore

    on, words = callcore.status()
    if not ctx.cuda:
        return words
    if not on:
        return f"Python on {ctx.device} ({words})"
    return f"{words} on {ctx.device} (from the first CUDA call on; the overhead rows say what it served)"


def step_environment(ctx: Ctx) -> dict[str, Any]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    import kernel_variants as kv
    from kernel_variants._runtime.dispatcher import dispatcher

    def dist(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    # On the CPU (the test suite's --tiny run) the core is what kv build left: no compile here.
    build: dict[str, Any] = {"ok": None, "reason": "a CPU run builds nothing"}
    if ctx.cuda:
        from _report import built_call_core  # a sibling module: tools/ is sys.path[0]

        started = time.monotonic()
        why = built_call_core("gpu_check")
        build = {"ok": why is None, "reason": why, "seconds": round(time.monotonic() - started, 1)}
    out: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": dist("triton") or dist("pytorch-triton"), "kernel_variants": kv.__version__,
        "kernel_variants_from": str(Path(kv.__file__).parent),
        "packages": {n: dist(n) for n in ("pydantic", "pydantic-core", "diskcache", "pluggy", "numpy")},
        "device": ctx.device, "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "call_core": _call_path(ctx), "call_core_build": build,
    }
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                      "memory_gib": round(p.total_memory / 2**30, 1),
                      "l2_mb": round(getattr(p, "L2_cache_size", 0) / 1e6, 1), "count": torch.cuda.device_count()}
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=5, check=False)
            out["gpu"]["nvidia_smi"] = smi.stdout.strip()
    else:
        from _report import cpu_model  # a sibling module: tools/ is sys.path[0]

        out["cpu"] = cpu_model()
    reg = dispatcher().registry
    dev_type = ctx.device.split(":")[0]
    variants: dict[str, dict[str, str]] = {}
    for spec in reg.ops():
        variants[spec.name] = {}
        for rv in reg.variants(spec.name):
            if dev_type not in rv.variant.capabilities.devices:
                continue
            why = rv.unavailable_reason()
            variants[spec.name][rv.id] = "available" if why is None else f"unavailable: {why}"
    out["variants"] = variants
    return out


# ---------------------------------------------------------------- step 2: qualification


def qualify_jobs(ctx: Ctx, ops: tuple[str, ...], dtypes: tuple[str, ...], jobs: int) -> dict[str, Any]:
    """Qualify every available variant of ``ops`` on the device in ``dtypes``, cheapest first.

    In-process variants run one after the other. Isolated ones (each a child process of the
    library's) run ``jobs`` at a time: on CUDA a child is a fresh interpreter, seconds each,
    mostly spent importing and compiling, so several overlap well on the machine's cores.
    Triton variants go last, the heuristic ``triton`` of every op and dtype before the block
    configurations, so a cap leaves out the least informative ones; none is started once
    ``ctx.compile_cap`` kernels are compiled or the step's budget is spent."""
    import torch

    import kernel_variants as kv
    from kernel_variants._runtime.dispatcher import dispatcher
    from kernel_variants._tuning.isolate import isolated
    from kernel_variants.plugin import CallKey

    d = dispatcher()
    reg = d.registry
    dev = torch.device(ctx.device)
    dev_type = dev.type
    todo: list[tuple[int, str, str, str, bool, bool]] = []  # (order, op, variant, dtype, isolated, triton)
    for op in ops:
        spec = reg.spec(op)
        for rv in reg.variants(op):
            caps = rv.variant.capabilities
            if rv.variant.fn is spec.reference.fn or dev_type not in caps.devices:
                continue
            if rv.unavailable_reason() is not None:
                continue  # the environment step lists it with why
            if rv.tactic is not None and not ctx.tactics:
                continue  # left out of the whole run, and said so in the summary
            tri = _triton_variant(rv)
            for i, dt in enumerate(dtypes):
                if dt in caps.dtypes:
                    order = 0 if not isolated(rv) else 1 if not tri else 2 if rv.id == "triton" else 3
                    # fp16 first within each kind: the dtype the calibration step times
                    todo.append((order * 10 + (dt != CALIBRATED) * (1 + i), op, rv.id, dt, isolated(rv), tri))
    todo.sort(key=lambda j: (j[0], j[1], j[2]))
    verdicts: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    before = compiled_kernels(ctx.triton_cache)

    def run(job: tuple[int, str, str, str, bool, bool]) -> None:
        _, op, vid, dt, _, tri = job
        if ctx.left() <= 0:
            skipped.append({"op": op, "variant": vid, "dtype": dt, "why": "not started: the step's time budget"})
            return
        if tri and compiled_kernels(ctx.triton_cache) - before >= ctx.compile_cap:
            skipped.append({"op": op, "variant": vid, "dtype": dt,
                            "why": f"not started: the Triton compilation cap ({ctx.compile_cap}) was reached"})
            return
        # kv.qualify's own loop, for one (variant, dtype): kv.qualify forgets the qualifier's
        # cache when it returns, which would race with the other threads' lookups.
        spec, rv = reg.spec(op), reg.get(op, vid)
        shape = rv.variant.capabilities.fit(spec.axes, (1,) * len(spec.axes))
        key = CallKey(spec, dev_type, dt, spec.features(), shape or (1,) * len(spec.axes), index=dev.index)
        if shape is None or rv.why_not(key) is not None:
            return  # does not claim this class here
        v = d.qualifier.stored(rv, key) or d.qualifier.qualify(rv, key)
        verdicts.append({"op": v.group.op, "dtype": v.group.dtype, "variant": v.variant, "passed": v.passed,
                         "cases": v.cases, "failed_case": v.failed_case, "reason": v.reason,
                         "where": v.where, "seconds": v.seconds})

    def summary() -> dict[str, Any]:
        failed = [v for v in verdicts if not v["passed"]]
        return {"device": ctx.device, "dtypes": list(dtypes), "passed": len(verdicts) - len(failed),
                "failed": len(failed), "skipped": len(skipped), "failures": failed, "not_run": skipped,
                "triton_compilations": compiled_kernels(ctx.triton_cache) - before,
                "compile_cap": ctx.compile_cap, "parallel_children": jobs, "tactics": ctx.tactics,
                "verdicts": verdicts}

    inline = [j for j in todo if not j[4]]
    spawned = [j for j in todo if j[4]]
    kv.verdicts(ctx.device)  # opens the table's store here, before any thread can race to
    for job in inline:
        run(job)
    ctx.partial(summary())
    if jobs <= 1:  # on the CPU the children are forked: never from a process with threads
        for job in spawned:
            run(job)
            ctx.partial(summary())
    else:
        from concurrent.futures import ThreadPoolExecutor, as_completed

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for fut in as_completed([pool.submit(run, j) for j in spawned]):
                fut.result()
                ctx.partial(summary())
    d.invalidate()  # decisions made before these verdicts are stale
    out = summary()
    out["verdicts"].sort(key=lambda v: (v["op"], v["variant"], v["dtype"]))
    return out


def _parallel(ctx: Ctx) -> int:
    """Qualification children at a time: forked on the CPU (one), spawned on CUDA (several)."""
    # On CUDA a child is mostly one CPU core compiling Triton kernels: one per core, but two.
    return 1 if not ctx.cuda else max(1, min(14, (os.cpu_count() or 2) - 2))


def step_qualify(ctx: Ctx) -> dict[str, Any]:
    return qualify_jobs(ctx, (FN, UPDATE, RMS, ADD_RMS, PLAIN_RMS, FUSED_RMS), DTYPES, _parallel(ctx))


# ---------------------------------------------------------------- step 3: calibration


def _tiny_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    b, d, length = shape
    return (max(1, b // 64), max(16, d // 64), max(1, length // 16))


def _sweeps(ctx: Ctx) -> list[tuple[str, str, list[tuple[int, ...]], dict[str, Any]]]:
    """(label, op, shapes, features) of each calibration: the seed subset, then the decode sweeps."""
    from kernel_variants._runtime.dispatcher import dispatcher

    reg = dispatcher().registry
    seed = reg.spec(FN).sweeps["seed69"]
    missing = [s for s in SEED_SUBSET if s not in seed.shapes]
    if missing:
        raise RuntimeError(f"SEED_SUBSET: {missing} are not seed69 shapes any more")
    out = [("seed69 subset", FN, list(SEED_SUBSET), dict(seed.features))]
    for name in ("decode", "decode-spec"):
        sw = reg.spec(UPDATE).sweeps[name]
        out.append((name, UPDATE, list(sw.shapes), dict(sw.features)))
    if ctx.tiny:  # two shapes each, shrunk: the same code on sizes a CPU measures in a second
        out = [(label, op, [_tiny_shape(s) for s in shapes[:2]] if op == FN
                else [(b, 64, length) for b, d, length in shapes if d == 1024 and b <= 8], feats)
               for label, op, shapes, feats in out]
    return out


def _timing(ctx: Ctx) -> dict[str, Any]:
    if ctx.tiny:
        return dict(warmup=1, windows=2, iters=5, window_budget_s=0.02)
    return dict(warmup=3, windows=5, iters=50, window_budget_s=0.01)


def _bandwidth_rounds(ctx: Ctx, op: str, shape: tuple[int, ...], features: dict[str, Any], timed: list[str],
                      timing: dict[str, Any]) -> dict[str, Any]:
    """Each timed variant and a copy of x's bytes into an x-sized buffer, in the same rounds.

    A causal conv reads x once and writes an output of x's size: that copy is the floor any
    implementation is held to, and timing it in the same rounds lets load and clocks hit both
    alike. Effective bandwidth counts those 2·|x| bytes for both."""
    import torch

    from kernel_variants._dtypes import as_dtype
    from kernel_variants._runtime.dispatcher import dispatcher
    from kernel_variants._tuning.timing import Timing, TimingConfig, measure_interleaved

    reg = dispatcher().registry
    spec = reg.spec(op)
    case = spec.sweep_case(shape, spec.features(**features), dtype=as_dtype("float16"), device=ctx.device)
    x = case.args[0]
    dst = torch.empty_like(x)
    calls: dict[str, list[Callable[[], Any]]] = {"copy": [lambda: dst.copy_(x)]}
    for vid in timed:
        fn, c = reg.get(op, vid).variant.fn, case.fresh()
        calls[vid] = [lambda fn=fn, c=c: fn(*c.args, **c.kwargs)]
    res = measure_interleaved(calls, ctx.device, TimingConfig(**timing))
    moved = 2 * x.numel() * x.element_size()
    copy = res["copy"]
    if not isinstance(copy, Timing):
        return {"x_bytes": moved // 2, "error": f"the copy was not timed: {copy}"}
    row: dict[str, Any] = {"x_bytes": moved // 2, "copy_us": copy.best_us, "copy_gbps": moved / copy.best_us / 1e3,
                           "method": copy.method, "variants": {}}
    for vid in timed:
        r = res[vid]
        if isinstance(r, Timing):
            row["variants"][vid] = {"us": r.best_us, "gbps": moved / r.best_us / 1e3,
                                    "share_of_copy": copy.best_us / r.best_us}
        else:
            row["variants"][vid] = {"error": str(r)}
    return row


def step_calibrate(ctx: Ctx) -> dict[str, Any]:
    import kernel_variants as kv
    from kernel_variants._runtime.dispatcher import dispatcher

    reg = dispatcher().registry
    sweeps = _sweeps(ctx)
    # Verdicts for fp16 first: in a full run the qualify step left them all (this returns at
    # once); in a rerun of this step alone it qualifies what it needs, several at a time, so
    # that calibration does not qualify them one by one inside its own budget.
    pre = qualify_jobs(ctx, (FN, UPDATE), ("float16",), _parallel(ctx))
    passed = {(v["op"], v["variant"]) for v in pre["verdicts"] if v["passed"]}
    out: dict[str, Any] = {"dtype": "float16", "timing": _timing(ctx), "prequalified": {
        k: pre[k] for k in ("passed", "failed", "skipped", "triton_compilations")}, "sweeps": [], "bandwidth": []}
    # The budget: 70% for calibration, half of it for the seed shapes (the largest inputs), a
    # quarter for each decode sweep; the rest for the copy rounds.
    total = ctx.left() * 0.7
    dev_type = ctx.device.split(":")[0]
    for (label, op, shapes, feats), part in zip(sweeps, (0.5, 0.25, 0.25), strict=True):
        spec = reg.spec(op)
        candidates = [rv.id for rv in reg.variants(op)
                      if rv.variant.fn is spec.reference.fn or (op, rv.id) in passed]
        left_out = [rv.id for rv in reg.variants(op) if rv.id not in candidates and rv.unavailable_reason() is None
                    and dev_type in rv.variant.capabilities.devices and (rv.tactic is None or ctx.tactics)]
        t0 = time.monotonic()
        res = kv.calibrate(op, shapes, dtype="float16", device=ctx.device, variants=candidates,
                           budget_s=max(1.0, min(total * part, ctx.left() - 5)),
                           timing=kv.TimingConfig(**_timing(ctx)), **feats)
        out["sweeps"].append({
            "sweep": label, "op": op, "features": feats, "shapes": [list(s) for s in shapes],
            "candidates": candidates, "left_out_unqualified": left_out, "seconds": time.monotonic() - t0,
            "skipped": [list(s) for s in res.skipped],
            "measurements": [{"shape": list(m.shape), "variant": m.variant, "status": m.status,
                              "best_us": m.best_us, "noise": m.noise, "method": m.method, "reason": m.reason}
                             for m in res.measurements],
            "winners": {",".join(map(str, s)): (w.variant if w is not None else None) for s, w in res.winners.items()},
        })
        ctx.partial(out)
    out["table"] = [{"op": r.group.op, "group": r.group.slug(), "shape": list(r.shape), "winner": r.winner,
                     "confidence": r.confidence, "margin": r.margin, "times_us": r.times_us,
                     "rejected": r.rejected, "pruned": r.pruned, "methods": list(r.methods)}
                    for op in (FN, UPDATE) for r in kv.table(op, device=ctx.device)]
    ctx.partial(out)
    for sw in out["sweeps"]:
        for shape in sw["shapes"]:
            if ctx.left() < 3:
                out["bandwidth_skipped"] = "the step's time budget ran out before every shape's copy rounds"
                break
            timed = sorted({m["variant"] for m in sw["measurements"]
                            if m["shape"] == shape and m["status"] == "ok"})
            if timed:
                row = _bandwidth_rounds(ctx, sw["op"], tuple(shape), sw["features"], timed, _timing(ctx))
                out["bandwidth"].append({"sweep": sw["sweep"], "op": sw["op"], "shape": shape, **row})
                ctx.partial(out)
    triton_ids = {rv.id for op in (FN, UPDATE) for rv in reg.variants(op) if _triton_variant(rv)}
    shares: dict[str, list[float]] = {}
    for row in out["bandwidth"]:
        if row.get("x_bytes", 0) > BIG_X_BYTES:
            for vid, v in row.get("variants", {}).items():
                if vid in triton_ids and "share_of_copy" in v:
                    shares.setdefault(f"{row['op']}/{vid}", []).append(v["share_of_copy"])
    out["triton_share_above_64MB"] = {k: {"median": statistics.median(v), "shapes": len(v)}
                                      for k, v in sorted(shares.items())}
    if not shares:
        out["triton_share_note"] = ("no Triton variant was timed on a shape whose x is above 64 MB"
                                    + (" (--tiny shapes are far smaller)" if ctx.tiny else ""))
    return out


# ---------------------------------------------------------------- step 4: graphs and compile


def _decode_call(device: str, b: int, d: int, dtype: Any, seed: int = 0) -> dict[str, Any]:
    """A decode call of causal_conv1d_update as the op's case builder makes it, by parameter."""
    from kernel_variants._runtime.dispatcher import dispatcher

    spec = dispatcher().registry.spec(UPDATE)
    case = spec.sweep_case((b, d, 1), spec.features(), dtype=dtype, device=device, seed=seed)
    return dict(zip(spec.params, spec.bind(*case.args, **case.kwargs), strict=True))


def _qualified_graph_safe(ctx: Ctx, dtype: str) -> list[str]:
    """A qualified graph_safe decode variant (nothing is qualified during a capture, where an
    unqualified one is passed over); a stored verdict returns at once."""
    import kernel_variants as kv
    from kernel_variants._runtime.dispatcher import dispatcher

    reg = dispatcher().registry
    spec = reg.spec(UPDATE)
    dev_type = ctx.device.split(":")[0]
    safe = [rv.id for rv in reg.variants(UPDATE) if rv.variant.capabilities.graph_safe
            and dev_type in rv.variant.capabilities.devices and rv.unavailable_reason() is None
            and rv.variant.fn is not spec.reference.fn]
    # One qualified variant is enough for the capture to choose; the heuristic one first.
    safe.sort(key=lambda v: v != "triton")
    for vid in safe:
        if ctx.left() < 10:
            break
        passed = [v.variant for v in kv.qualify(UPDATE, device=ctx.device, dtype=dtype, variants=[vid]) if v.passed]
        if passed:
            return passed
    return []


def _graph_replay(ctx: Ctx) -> dict[str, Any]:
    """One decode step captured through the dispatched op and replayed on 10 new tokens, against
    the same 10 steps run eagerly on a copy of the pool."""
    import torch

    import kernel_variants as kv
    from kernel_variants._registry.keys import CAPTURE
    from kernel_variants._runtime.dispatcher import dispatcher
    from kernel_variants._tolerances import mismatch

    dtype = torch.bfloat16
    b, d = (4, 64) if ctx.tiny else (64, 4096)
    qualified = _qualified_graph_safe(ctx, "bfloat16")
    a = _decode_call(ctx.device, b, d, dtype)
    weight, kw = a["weight"], dict(bias=a["bias"], activation=a["activation"],
                                   conv_state_indices=a["conv_state_indices"], pad_slot_id=a["pad_slot_id"])
    gen = torch.Generator(device=ctx.device).manual_seed(1)
    tokens = [torch.randn(a["x"].shape, generator=gen, device=ctx.device).to(dtype) for _ in range(10)]
    pool_g, pool_e = a["conv_state"].clone(), a["conv_state"].clone()
    x_static = tokens[0].clone()
    d_ = dispatcher()
    spec = d_.registry.spec(UPDATE)
    key = spec.key_of(x_static, pool_g, weight, **kw)
    ahead = d_.decide(key._replace(extra=key.extra | CAPTURE), None, qualify=False)
    if ahead.chosen is None:
        return {"status": "no variant", "qualified_graph_safe": qualified, "decision": str(ahead)}
    saved = pool_g.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # Warm the variant the capture will choose on a side stream, as torch.cuda.graphs asks: its
    # kernels compile and load here, not inside the capture.
    with torch.cuda.stream(side), kv.force(**{UPDATE: ahead.chosen.id}):
        for _ in range(2):
            kv.causal_conv1d_update(x_static, pool_g, weight, **kw)
    torch.cuda.current_stream().wait_stream(side)
    pool_g.copy_(saved)  # the warm-up steps wrote the pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = kv.causal_conv1d_update(x_static, pool_g, weight, **kw)
    captured = sorted({vid for k, vid in d_.decided.values() if k.op == UPDATE and k.extra >= CAPTURE})
    outs_g = []
    for t in tokens:
        x_static.copy_(t)
        graph.replay()
        outs_g.append(out_static.clone())
    outs_e = [kv.causal_conv1d_update(t, pool_e, weight, **kw) for t in tokens]
    _sync(ctx.device)
    eager_vid = kv.explain(UPDATE, tokens[0], pool_e, weight, **kw).chosen.id
    out_bad = next((m for i, (g, e) in enumerate(zip(outs_g, outs_e, strict=True))
                    if (m := mismatch(g, e, f"output of step {i + 1}")) is not None), None)
    state_bad = mismatch(pool_g, pool_e, "state after 10 steps", exact=True)  # copies of input rows
    return {"status": "ok" if out_bad is None and state_bad is None else "mismatch", "dtype": "bfloat16",
            "shape": [b, d, 1], "replays": len(tokens), "captured_variant": captured or [ahead.chosen.id],
            "eager_variant": eager_vid, "qualified_graph_safe": qualified,
            "state_equal_exactly": bool(torch.equal(pool_g, pool_e)), "output_mismatch": out_bad,
            "state_mismatch": state_bad}


def _block(x, residual, w_norm, pool, w_conv, b_conv, idx):
    """A small decoder block: the fused add + Gemma RMSNorm, a decode conv step on the pool,
    and plain torch around them (what a compiled model holds)."""
    import torch

    import kernel_variants as kv

    h, r = kv.add_gemma_rms_norm(x, w_norm, residual)
    y = kv.causal_conv1d_update(h, pool, w_conv, b_conv, activation="silu", conv_state_indices=idx)
    return torch.nn.functional.silu(y) * 2 + r


def _compiled_block(ctx: Ctx) -> dict[str, Any]:
    import torch

    from kernel_variants._tolerances import mismatch

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    b, d = (4, 64) if ctx.tiny else (64, 4096)
    a = _decode_call(ctx.device, b, d, dtype, seed=2)
    gen = torch.Generator(device=ctx.device).manual_seed(3)
    residual = torch.randn(b, d, generator=gen, device=ctx.device).to(dtype)
    w_norm = (torch.randn(d, generator=gen, device=ctx.device) * 0.1).to(dtype)
    args = [a["x"], residual, w_norm, a["conv_state"], a["weight"], a["bias"], a["conv_state_indices"]]
    start = a["conv_state"].clone()
    eager_pool, comp_pool = start.clone(), start.clone()
    t0 = time.monotonic()
    compiled = torch.compile(_block, fullgraph=True)
    with torch.inference_mode():  # the ops have no autograd formula: a compiled model runs them so
        got = compiled(*args[:3], comp_pool, *args[4:])
        _sync(ctx.device)
        compile_s = time.monotonic() - t0
        expected = _block(*args[:3], eager_pool, *args[4:])
        again = compiled(*args[:3], start.clone(), *args[4:])  # the same graph, from the same state
    _sync(ctx.device)
    bad = mismatch(got, expected, "output") or mismatch(comp_pool, eager_pool, "state")
    return {"status": "ok" if bad is None else "mismatch", "dtype": str(dtype)[6:], "shape": [b, d],
            "fullgraph": True, "backend": "inductor", "compile_and_first_call_s": compile_s,
            "mismatch": bad, "state_equal_exactly": bool(torch.equal(comp_pool, eager_pool)),
            "second_call_matches": mismatch(again, got, "second call") is None}


def step_graphs(ctx: Ctx) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if ctx.cuda:
        try:
            out["cuda_graph"] = _graph_replay(ctx)
        except Exception as exc:  # the compile half still runs: one failure must not hide the other
            out["cuda_graph"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()[-2000:]}
    else:
        out["cuda_graph"] = {"status": "skipped: needs CUDA"}
    ctx.partial(out)
    try:
        out["compile"] = _compiled_block(ctx)
    except Exception as exc:
        out["compile"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()[-2000:]}
    return out


# ---------------------------------------------------------------- step 5: dispatch overhead


def _aten_ops(fn: Callable[[], Any]) -> Counter[str]:
    """The aten ops one call of ``fn`` issues (a kernel launched by Triton is no aten op)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: Counter[str] = Counter()

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Watch():
        fn()
    return seen


def _served_by_core(fn: Callable[[], Any]) -> bool:
    """Whether a warm call of ``fn`` was served by the compiled call core (it then reads
    nothing of the Python path's memo)."""
    from kernel_variants._runtime import dispatcher as _dispatcher

    lookups = []
    get = _dispatcher.Memo.get
    _dispatcher.Memo.get = lambda self, *a: lookups.append(1) or get(self, *a)
    try:
        fn()
    finally:
        _dispatcher.Memo.get = get
    return not lookups


def _host_us(calls: dict[str, Callable[[], Any]], device: str, iters: int, rounds: int,
             within: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Host microseconds per call of each entry: ``iters`` calls in a row with no sync between
    them, in alternating rounds, the minimum over rounds; ``within[name]()`` is a context the
    whole window runs in. A launch returns before its kernel runs, so this is what the call costs
    the CPU that feeds the GPU (the serving loop's cost) for as long as the launch queue does not
    fill, which ``iters`` small launches do not."""
    best = dict.fromkeys(calls, math.inf)
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = calls[name]
            _sync(device)
            with within.get(name, contextlib.nullcontext)():
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                dt = time.perf_counter() - t0
            best[name] = min(best[name], dt / iters * 1e6)
    _sync(device)
    return best


def _kernels_per_call(fn: Callable[[], Any], ctx: Ctx, calls: int = 10) -> float | None:
    """Device kernels launched per call of ``fn`` (Triton's and aten's alike), from the torch
    profiler's CUDA activity; None off CUDA."""
    if not ctx.cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    _sync(ctx.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync(ctx.device)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return len(kernels) / calls


def _host_breakdown(ctx: Ctx, a: dict[str, Any], iters: int, rounds: int) -> dict[str, float]:
    """Host microseconds of the pieces of a ``triton`` decode call (CUDA only): the variant as
    the dispatcher calls it, its kernel's launch alone (the arguments it was handed, recorded
    from one call), and the torch calls around it."""
    import torch

    from kernel_variants.kernels import triton_conv
    from kernel_variants.ops.causal_conv1d import bad_value_counter

    k = triton_conv.kernels(triton_conv.interpreting())
    jit, seen = k.update, []

    class Record:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((grid, args, kwargs))
                return jit[grid](*args, **kwargs)
            return launch

    pos = (a["x"], a["conv_state"], a["weight"], a["bias"])
    kw = dict(activation=a["activation"], conv_state_indices=a["conv_state_indices"], pad_slot_id=a["pad_slot_id"])
    k.update = Record()
    try:
        triton_conv.causal_conv1d_update(*pos, **kw)
    finally:
        k.update = jit
    grid, args, kwargs = seen[0]
    x = a["x"]

    def guard():
        with torch.cuda.device(x.device):
            pass

    calls = {
        "variant": lambda: triton_conv.causal_conv1d_update(*pos, **kw),
        "kernel launch alone": lambda: jit[grid](*args, **kwargs),
        "torch.cuda.device enter+exit": guard,
        "torch.empty (the output)": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
        "bad_value_counter": lambda: bad_value_counter(x),
    }
    return _host_us(calls, ctx.device, iters, rounds, {})


def step_overhead(ctx: Ctx) -> dict[str, Any]:
    """Each call form of issue 24 beside the chosen variant called directly, at decode sizes:
    the dispatched op, a forced variant and ``kv.bind``; timed on the device's clock (what the
    GPU waits for) and on the host's (what the CPU spends), and the aten ops each issues."""
    import torch

    import kernel_variants as kv
    from kernel_variants._runtime.dispatcher import dispatcher
    from kernel_variants._tuning.timing import Timing, TimingConfig, measure_interleaved
    from kernel_variants.ops.causal_conv1d import _device_rule

    spec = dispatcher().registry.spec(UPDATE)
    d = 64 if ctx.tiny else 4096
    sizes = DECODE_B[:2] if ctx.tiny else DECODE_B
    config = TimingConfig(warmup=5, windows=3, iters=50) if ctx.tiny else \
        TimingConfig(warmup=20, windows=7, iters=200, window_budget_s=0.05)
    host_iters, host_rounds = (20, 3) if ctx.tiny else (200, 9)
    rows = []
    with torch.inference_mode():  # as serving calls it
        for b in sizes:
            if ctx.left() < 3:
                rows.append({"B": b, "skipped": "the step's time budget"})
                continue
            a = _decode_call(ctx.device, b, d, torch.float16)
            pos = (a["x"], a["conv_state"], a["weight"], a["bias"])
            kw = dict(activation=a["activation"], conv_state_indices=a["conv_state_indices"],
                      pad_slot_id=a["pad_slot_id"])

            def dispatched(pos=pos, kw=kw):
                return kv.causal_conv1d_update(*pos, **kw)

            dispatched()  # decides (and qualifies, if no verdict is stored) once
            chosen = kv.explain(UPDATE, *pos, **kw).chosen
            fn, args = chosen.variant.fn, spec.bind(*pos, **kw)
            bound = kv.bind(UPDATE, *pos, **kw)

            def direct(fn=fn, args=args):
                return spec.invoke(fn, args)

            def bound_call(bound=bound, pos=pos, kw=kw):
                return bound(*pos, **kw)

            # A forced call is the public op inside kv.force, which builds its pins once per
            # block: its windows run inside one block (timed apart on the device clock).
            def pinned(vid=chosen.id):
                return kv.force(**{UPDATE: vid})

            def rule(a=a, b=b):  # the device rule's own launch, as a variant without counts_bad_values gets it
                return _device_rule.apply(a["x"].device, a["conv_state_indices"], None, None, a["pad_slot_id"],
                                          batch=b, n_slots=a["conv_state"].shape[0], rewrite=False)

            unpinned = {"dispatched": dispatched, "bind": bound_call, "direct": direct}
            forms = {**unpinned, "forced": dispatched}
            _sync(ctx.device)
            t = measure_interleaved({k: [f] for k, f in unpinned.items()}, ctx.device, config)
            ops = {k: _aten_ops(f) for k, f in unpinned.items()}
            by_core = {"dispatched": _served_by_core(dispatched), "bind": type(bound).__name__ == "BoundCore"}
            with pinned():
                t["forced"] = measure_interleaved({"forced": [dispatched]}, ctx.device, config)["forced"]
                ops["forced"] = _aten_ops(dispatched)
                by_core["forced"] = _served_by_core(dispatched)
            # Off the CPU only: a rule run on the CPU makes its counter, which every CPU call after
            # it then reads first (the host checks report the device's counts before their own).
            extra = {"rule": rule} if ctx.cuda else {}
            host = _host_us({**forms, **extra}, ctx.device, host_iters, host_rounds, {"forced": pinned})
            rule_us = host.pop("rule", None)
            _sync(ctx.device)
            outside = ops["dispatched"] - ops["direct"]
            row: dict[str, Any] = {"B": b, "D": d, "dtype": "float16", "variant": chosen.id,
                                   "aten_ops_outside": dict(sorted(outside.items())),
                                   "aten_ops_outside_total": sum(outside.values()),
                                   "aten_ops_outside_by_form": {k: sum((ops[k] - ops["direct"]).values())
                                                                for k in forms if k != "direct"},
                                   "aten_ops_in_variant": sum(ops["direct"].values()),
                                   "served_by_core": by_core,
                                   "host_us": host, "rule_host_us": rule_us,
                                   "chosen_counts_bad_values": bool(getattr(chosen.variant.capabilities,
                                                                            "counts_bad_values", False)),
                                   "kernels_per_call": {k: _kernels_per_call(f, ctx) for k, f in unpinned.items()},
                                   "host_added_us": {k: host[k] - host["direct"] for k in forms if k != "direct"}}
            if all(isinstance(t[k], Timing) for k in t):
                row.update(dispatched_us=t["dispatched"].best_us, direct_us=t["direct"].best_us,
                           added_us=t["dispatched"].best_us - t["direct"].best_us, method=t["direct"].method,
                           device_us={k: t[k].best_us for k in forms})
            else:
                row["error"] = {k: str(v) for k, v in t.items() if not isinstance(v, Timing)}
            rows.append(row)
            ctx.partial({"rows": rows})
        breakdown: dict[str, Any] = {}
        if ctx.cuda and ctx.left() > 3:
            try:
                breakdown = _host_breakdown(ctx, _decode_call(ctx.device, 1, d, torch.float16), host_iters,
                                            host_rounds)
            except Exception as exc:  # a finding, not a reason to lose the rows above
                breakdown = {"error": f"{type(exc).__name__}: {exc}"}
    return {"op": UPDATE, "eager": True, "inference_mode": True, "rows": rows, "host_breakdown_b1": breakdown,
            "note": "added_us = dispatched - direct on the device clock, minimum over windows of each, "
                    "interleaved; host_us: the host's time per call with no sync between calls"}


STEP_FUNCS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "environment": step_environment, "qualify": step_qualify, "calibrate": step_calibrate,
    "graphs": step_graphs, "overhead": step_overhead,
}


# ---------------------------------------------------------------- the child: one step


def child_main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    _importable()
    name = args.run_step
    ctx = Ctx(outdir=Path(args.outdir), name=name, device=args.device, tiny=args.tiny, budget_s=args.budget,
              compile_cap=args.compile_cap, tactics=args.tactics, triton_cache=Path(args.state) / "triton",
              started=started)
    try:
        result, status, error = STEP_FUNCS[name](ctx), "ok", None
    except Exception as exc:  # the parent reports it; the other steps still run
        result, status, error = {}, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    _write_json(ctx.outdir / f"{name}.json", {"step": name, "status": status, "seconds": time.monotonic() - started,
                                              "result": result, "error": error})
    return 0


# ---------------------------------------------------------------- the parent: every step


def _state_dir(outdir: Path) -> Path:
    tag = hashlib.sha256(str(outdir.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"kv-gpu-check-{tag}"


def _child_env(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    env.update(KV_CACHE_DIR=str(state / "kv"), TRITON_CACHE_DIR=str(state / "triton"), PYTHONUNBUFFERED="1")
    return env


def run_step(name: str, args: argparse.Namespace, state: Path, timeout: float) -> dict[str, Any]:
    outdir = Path(args.outdir)
    path = outdir / f"{name}.json"
    path.unlink(missing_ok=True)  # no result of an earlier run can pass for this one's
    budget = timeout - max(3.0, 0.1 * timeout)
    cmd = [sys.executable, str(Path(__file__).resolve()), str(outdir), "--run-step", name, "--device", args.device,
           "--budget", f"{budget:.1f}", "--compile-cap", str(args.compile_cap), "--state", str(state)]
    if args.tactics:
        cmd.append("--tactics")
    if args.tiny:
        cmd.append("--tiny")
    t0 = time.monotonic()
    # Its own session: a timeout kills the step with every process it started (the library's
    # qualification children too), so a hung kernel holds neither the run nor the GPU.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_child_env(state), start_new_session=True)
    timed_out = False
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
    # Whatever the step left running (a qualification child it gave up on) goes with it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    seconds = time.monotonic() - t0
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    record: dict[str, Any] = {"step": name, "seconds": round(seconds, 2), "timeout_s": timeout,
                              "returncode": proc.returncode, "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "result": (data or {}).get("result") or {}, "error": (data or {}).get("error")}
    if timed_out:
        record["status"] = "timed out"
        record["error"] = f"killed after {timeout:.0f} s; result: what it had finished by then"
    elif data is None:
        record["status"] = "error"
        record["error"] = f"exited with status {proc.returncode} without writing a result"
    else:
        record["status"] = data["status"]
    record["log_tail"] = (log or "")[-3000:]
    _write_json(path, record)
    return record


# ---------------------------------------------------------------- the summary


def _f(v: Any, digits: int = 3) -> str:
    if isinstance(v, float):
        return "-" if not math.isfinite(v) else f"{v:.{digits}g}" if abs(v) < 100 else f"{v:.0f}"
    return "-" if v is None else str(v)


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    from _report import markdown_table  # a sibling module: tools/ is sys.path[0]

    return markdown_table(headers, [[_f(c) for c in r] for r in rows]) if rows else "(none)"


def summary_md(report: dict[str, Any]) -> str:
    steps = report["steps"]
    env = steps.get("environment", {}).get("result", {})
    gpu = env.get("gpu", {})
    lines = [f"# GPU check: {gpu.get('name') or env.get('cpu') or report['device']}", "",
             f"device {report['device']}{' (--tiny)' if report['tiny'] else ''}; python {env.get('python')}, "
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}, Triton {env.get('triton')}, "
             f"kernel_variants {env.get('kernel_variants')}; call path: {env.get('call_core', '-')}", "",
             _table(["step", "status", "seconds", "timeout s", "error"],
                    [[n, s["status"], s["seconds"], s["timeout_s"], (s.get("error") or "").splitlines()[0][:120]
                      if s.get("error") else ""] for n, s in steps.items()]), ""]
    q = steps.get("qualify", {}).get("result")
    if q:
        lines += ["## Qualification", "",
                  f"{q['passed']} passed, {q['failed']} failed, {q['skipped']} not run "
                  f"({', '.join(q['dtypes'])}); Triton compilations: {q['triton_compilations']} "
                  f"(cap {q['compile_cap']}); {q['parallel_children']} qualification children at a time"
                  + ("." if q.get("tactics") else "; tactics left out (--tactics includes them)."), ""]
        if q["failures"]:
            lines += [_table(["op", "variant", "dtype", "case", "reason"],
                             [[v["op"], v["variant"], v["dtype"], v["failed_case"], v["reason"][:160]]
                              for v in q["failures"]]), ""]
        if q["not_run"]:
            lines += [_table(["op", "variant", "dtype", "why"],
                             [[v["op"], v["variant"], v["dtype"], v["why"]] for v in q["not_run"]]), ""]
    c = steps.get("calibrate", {}).get("result")
    if c:
        lines += ["## Calibration (fp16)", "", "Decision table:", ""]
        rows = []
        for r in c.get("table", []):
            best = sorted(r["times_us"].items(), key=lambda kv_: kv_[1])[:3]
            rows.append([r["op"], "x".join(map(str, r["shape"])), r["winner"], r["confidence"], r["margin"],
                         ", ".join(f"{v} {_f(t)}" for v, t in best)])
        lines += [_table(["op", "shape (B x D x L)", "winner", "confidence", "margin", "fastest (us)"], rows), ""]
        lines += ["Effective bandwidth (2·|x| bytes per call) against a copy of x in the same rounds:", ""]
        rows = []
        for r in c.get("bandwidth", []):
            vs = {k: v for k, v in r.get("variants", {}).items() if "gbps" in v}
            best = max(vs.items(), key=lambda kv_: kv_[1]["gbps"], default=(None, {}))
            rows.append([r["op"], "x".join(map(str, r["shape"])), r["x_bytes"] / 1e6, r.get("copy_gbps"),
                         best[0], best[1].get("gbps"), best[1].get("share_of_copy")])
        lines += [_table(["op", "shape", "x MB", "copy GB/s", "best variant", "its GB/s", "share of copy"], rows), ""]
        shares = c.get("triton_share_above_64MB", {})
        lines += ["Triton variants' median share of copy bandwidth, shapes with x above 64 MB:", "",
                  _table(["op/variant", "median share", "shapes"],
                         [[k, v["median"], v["shapes"]] for k, v in shares.items()]) if shares
                  else c.get("triton_share_note", "(none)"), ""]
    g = steps.get("graphs", {}).get("result")
    if g:
        cg, cc = g.get("cuda_graph", {}), g.get("compile", {})
        lines += ["## CUDA graph and torch.compile", "",
                  f"- CUDA graph, decode step through the dispatched op: {cg.get('status')}"
                  + (f" (captured {cg.get('captured_variant')}, eager {cg.get('eager_variant')}, "
                     f"{cg.get('replays')} replays, state exactly equal: {cg.get('state_equal_exactly')})"
                     if "replays" in cg else "") + (f": {cg.get('error') or cg.get('output_mismatch') or cg.get('state_mismatch')}"
                                                    if cg.get("status") not in ("ok", "skipped: needs CUDA") else ""),
                  f"- torch.compile(fullgraph=True) of a small block: {cc.get('status')}"
                  + (f" ({cc.get('dtype')}, compile + first call {_f(cc.get('compile_and_first_call_s'))} s, "
                     f"state exactly equal: {cc.get('state_equal_exactly')})" if "dtype" in cc else "")
                  + (f": {cc.get('error') or cc.get('mismatch')}" if cc.get("status") != "ok" else ""), ""]
    o = steps.get("overhead", {}).get("result")
    if o:
        lines += ["## Dispatch overhead (causal_conv1d_update, eager, inference_mode)", "",
                  "Device clock (what the GPU waits for):", "",
                  _table(["B", "D", "variant", "dispatched us", "direct us", "added us", "aten ops outside"],
                         [[r["B"], r.get("D"), r.get("variant"), r.get("dispatched_us"), r.get("direct_us"),
                           r.get("added_us"), ", ".join(f"{k} x{n}" for k, n in r.get("aten_ops_outside", {}).items())
                           or r.get("skipped", "none")] for r in o["rows"]]), "",
                  "Host clock (what the CPU spends per call; added = form - direct; the rule: its own "
                  "launch, which a variant declaring counts_bad_values is spared):", "",
                  _table(["B", "direct us", "dispatched +", "forced +", "bind +", "rule us", "by the core (d/f/b)",
                          "aten ops outside (d/f/b)", "kernels per call (d/b/direct)"],
                         [[r["B"], r.get("host_us", {}).get("direct"),
                           *(r.get("host_added_us", {}).get(k) for k in ("dispatched", "forced", "bind")),
                           r.get("rule_host_us"),
                           "/".join("yes" if r.get("served_by_core", {}).get(k) else "no"
                                    for k in ("dispatched", "forced", "bind")),
                           "/".join(str(r.get("aten_ops_outside_by_form", {}).get(k, "-"))
                                    for k in ("dispatched", "forced", "bind")),
                           "/".join(_f(r.get("kernels_per_call", {}).get(k)) for k in ("dispatched", "bind", "direct"))]
                          for r in o["rows"] if "host_us" in r]), ""]
        if o.get("host_breakdown_b1"):
            lines += ["Host microseconds of a triton decode call's pieces, B = 1:", "",
                      _table(["piece", "us"], [[k, v] for k, v in o["host_breakdown_b1"].items()]), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- entry


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir", help="where report.json, summary.md and each step's STEP.json go")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="shrink every shape and sweep (the test suite's run)")
    p.add_argument("--only", default="", help=f"comma-separated steps among {', '.join(STEPS)}")
    p.add_argument("--step-timeout", type=float, default=None, help="seconds for every step (default: per step)")
    p.add_argument("--tactics", action="store_true",
                   help="qualify and calibrate each variant's tactics too (triton:d64...): on a fresh GPU "
                        "machine their Triton compilations take minutes")
    p.add_argument("--compile-cap", type=int, default=COMPILE_CAP,
                   help=f"Triton kernels compiled before no further Triton variant is qualified ({COMPILE_CAP})")
    p.add_argument("--run-step", default=None, help=argparse.SUPPRESS)  # the child's entry
    p.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--state", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device not in ("cuda", "cpu"):
        p.error(f"--device: expected cuda or cpu, got {args.device!r}")
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in STEPS]
    if unknown:
        p.error(f"--only: expected steps among {', '.join(STEPS)}, got {', '.join(unknown)}")
    args.steps = [s for s in STEPS if s in only] if only else list(STEPS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.run_step:
        return child_main(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 0
    _importable()
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    state = _state_dir(outdir)
    if args.steps == list(STEPS):  # a full run measures afresh; --only reuses the last run's state
        shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True, exist_ok=True)
    timeouts = CUDA_TIMEOUTS if args.device == "cuda" else CPU_TIMEOUTS
    t0 = time.monotonic()
    ran = {}
    for name in args.steps:
        timeout = args.step_timeout or timeouts[name]
        print(f"[gpu_check] {name}: running (timeout {timeout:.0f} s)", flush=True)
        ran[name] = rec = run_step(name, args, state, timeout)
        print(f"[gpu_check] {name}: {rec['status']} in {rec['seconds']:.1f} s"
              + (f": {rec['error'].splitlines()[0]}" if rec.get("error") else ""), flush=True)
    steps = {}
    for name in STEPS:  # every step's latest result: this run's, and earlier runs' for --only
        with contextlib.suppress(OSError, ValueError):
            steps[name] = json.loads((outdir / f"{name}.json").read_text())
    code = 0 if all(r["status"] == "ok" for r in ran.values()) else 1
    report = {"device": args.device, "tiny": args.tiny, "argv": sys.argv[1:], "ran": list(ran),
              "seconds": round(time.monotonic() - t0, 1), "exit_status": code, "state_dir": str(state),
              "generated_at": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": steps}
    _write_json(outdir / "report.json", report)
    text = summary_md(report)
    (outdir / "summary.md").write_text(text + "\n")
    print(text)
    print(f"\n[gpu_check] wrote {outdir / 'report.json'} and {outdir / 'summary.md'} "
          f"({report['seconds']} s, exit {code})")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
