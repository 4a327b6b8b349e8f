"""What a measurement is only valid on: the device (and its driver or runtime).

The software a kernel's speed depends on beyond that (torch, Triton, torch_npu, a compiler, the
package that ships the kernel) is keyed per variant: each variant declares its dependencies and
their versions are part of its version (``Variant.depends``), so upgrading kernel_variants, or
torch under a variant that does not use it, keeps the rows it does not affect.

A CPU is named by what it is, not by its marketing name (a VM may call a Zen 3 and a Zen 4 both
"AMD EPYC"): its vendor, family, model and stepping, and the ISA level its vector code paths run
at (``isa``, read from its flags and capped as ATen and cpu_native cap them: see ``isa_level``).
Timings and verdicts of one CPU kind are never used on another.

Rows written before that (until kernel_variants 0.1) carried torch's and kernel_variants'
versions here, and CPU rows of later releases had no ``CPU_KIND``: ``is_legacy`` tells both
apart, and the table ignores them with one warning (``kv calibrate --stale`` re-measures them).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
from collections.abc import Iterable

import torch

# What a CPU fingerprint holds beyond its name, thread count and architecture.
CPU_KIND = ("vendor", "family", "model", "stepping", "isa")
# The levels of cpu_native's builds (csrc/cpu_common.h: isa_level), each with the flags it needs
# on top of the level below; "scalar" below them all.
_X86_LEVELS = (("avx2", ("avx2", "fma", "f16c")),
               ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
               ("avx512-bf16", ("avx512_bf16",)))
# ATEN_CPU_CAPABILITY's values, as the highest level they allow (any other value caps nothing).
_ATEN_CAPS = {"default": 0, "avx2": 1, "avx512": 2}
_X86 = ("x86_64", "amd64", "i386", "i686")


def isa_level(flags: Iterable[str], aten_cap: str = "", onednn_cap: str = "") -> str:
    """The ISA level of an x86 CPU with ``flags`` (as /proc/cpuinfo names them): "scalar",
    "avx2", "avx512" or "avx512-bf16", the highest whose flags are all there, capped by
    ``aten_cap`` (ATEN_CPU_CAPABILITY: ATen's kernels and cpu_native's builds honour it alike, so
    rows timed under ``avx2`` are not an AVX-512 machine's); "+amx" when it has AMX tiles, which
    oneDNN's matrix kernels use unless ``onednn_cap`` (ONEDNN_MAX_CPU_ISA) rules them out."""
    have = set(flags)
    level = 0
    for i, (_, need) in enumerate(_X86_LEVELS, 1):
        if not have.issuperset(need):
            break
        level = i
    level = min(level, _ATEN_CAPS.get(aten_cap.strip().lower(), len(_X86_LEVELS)))
    name = _X86_LEVELS[level - 1][0] if level else "scalar"
    cap = onednn_cap.strip().upper()
    if {"amx_tile", "amx_bf16"} <= have and (not cap or cap == "ALL" or "AMX" in cap):
        name += "+amx"
    return name


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return f.read(1 << 20)
    except OSError:
        return ""


def _first_processor(text: str) -> dict[str, str]:
    """The ``key: value`` fields of the first processor's block of /proc/cpuinfo."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _torch_isa() -> str:
    try:  # ATen's own choice (it honours ATEN_CPU_CAPABILITY too)
        return str(torch.backends.cpu.get_cpu_capability()).lower()
    except Exception:  # an old torch without the query
        return "unknown"


def cpu_info(text: str, machine: str, aten_cap: str = "", onednn_cap: str = "") -> dict[str, str]:
    """A CPU's name and kind (``CPU_KIND``) from its /proc/cpuinfo ``text`` ("" where there is
    none). x86: vendor_id, cpu family, model, stepping, and the level of its flags (``isa_level``);
    Arm: the implementer, architecture, part and variant.revision, and ATen's ISA; elsewhere what
    the platform module says (Windows names family, model and stepping), else "unknown"."""
    f = _first_processor(text)
    name = (f.get("model name") or f.get("Model") or f.get("cpu model") or platform.processor() or machine
            or "unknown cpu")
    unknown = "unknown"
    if "vendor_id" in f or "flags" in f:
        kind = [f.get("vendor_id", unknown), f.get("cpu family", unknown), f.get("model", unknown),
                f.get("stepping", unknown)]
    elif "CPU implementer" in f:
        kind = [f["CPU implementer"], f.get("CPU architecture", unknown), f.get("CPU part", unknown),
                f"{f.get('CPU variant', unknown)}.{f.get('CPU revision', unknown)}"]
    else:
        found = re.search(r"Family (\d+) Model (\d+) Stepping (\d+), (\w+)", platform.processor())
        kind = [found[4], found[1], found[2], found[3]] if found else [unknown] * 4
    if machine.lower() in _X86 and "flags" in f:
        isa = isa_level(f["flags"].split(), aten_cap, onednn_cap)
    else:  # no flags to read: ATen's choice, named as the levels above are
        isa = _torch_isa()
        isa = "scalar" if isa == "default" and machine.lower() in _X86 else isa
    return {"name": name, **dict(zip(CPU_KIND, [*kind, isa], strict=True))}


def _cuda(index: int) -> dict[str, str]:
    props = torch.cuda.get_device_properties(index)
    info = {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "cuda_runtime": str(torch.version.cuda or torch.version.hip or ""),
    }
    try:  # the driver matters (kernel timings move with it) but only NVML reports it
        import pynvml

        pynvml.nvmlInit()
        info["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # pynvml absent or unusable: the runtime version must do
        info["driver"] = "unknown"
    return info


def _npu(index: int) -> dict[str, str]:
    import torch_npu

    info = {"name": str(torch.npu.get_device_name(index))}
    info["cann"] = "unknown"
    home = os.environ.get("ASCEND_TOOLKIT_HOME", "")
    try:  # set_env.sh exports the toolkit home; its version.cfg names the CANN release
        with open(os.path.join(home, "version.cfg"), encoding="utf-8") as f:
            lines = f.read().split()
        info["cann"] = lines[0] if lines else "unknown"
    except OSError:
        pass
    info["torch_npu"] = getattr(torch_npu, "__version__", "unknown")
    return info


def fingerprint(device: str = "cpu") -> dict[str, str]:
    """A stable description of ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"npu"``).

    On the CPU it includes the intra-op thread count, read now: timings taken with 1 thread say
    nothing about 8, and ``torch.set_num_threads`` can change it at any time."""
    dev = torch.device(device)
    threads = torch.get_num_threads() if dev.type == "cpu" else 0
    # Read now, as the thread count: they decide which code paths run (see isa_level).
    caps = (os.environ.get("ATEN_CPU_CAPABILITY", ""),
            os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", ""))) if dev.type == "cpu" else ()
    if dev.type in ("cuda", "npu") and dev.index is None:  # "cuda" means the current device, as in torch
        dev = torch.device(dev.type, getattr(torch, dev.type).current_device())
    return dict(_fingerprint(str(dev), threads, caps))


@functools.cache
def _fingerprint(device: str, threads: int, caps: tuple[str, ...] = ()) -> tuple[tuple[str, str], ...]:
    dev = torch.device(device)
    info: dict[str, str] = {"device": dev.type}
    if dev.type == "cpu":
        machine = platform.machine()
        cpu = cpu_info(_read_cpuinfo(), machine, *caps)
        info.update(name=cpu.pop("name"), threads=str(threads), machine=machine, **cpu)
    elif dev.type == "cuda":
        info.update(_cuda(dev.index))
    elif dev.type == "npu":
        info.update(_npu(dev.index))
    else:
        info["name"] = dev.type
    return tuple(info.items())


def fingerprint_id(fp: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


# What fingerprints held until per-variant dependencies replaced them.
LEGACY_KEYS = ("torch", "kernel_variants")


def lacks_cpu_kind(fp: dict[str, str]) -> bool:
    """A CPU fingerprint written before the CPU's kind was kept: it may be any CPU of its name."""
    return fp.get("device") == "cpu" and not all(k in fp for k in CPU_KIND)


def is_legacy(fp: dict[str, str]) -> bool:
    """A fingerprint written before staleness was kept per variant, or (a CPU's) before the CPU's
    kind was: what it was measured on cannot be told current."""
    return "kernel_variants" in fp or lacks_cpu_kind(fp)


def device_part(fp: dict[str, str]) -> dict[str, str]:
    """For a legacy row, the fingerprint it would have now if it was measured here: without the
    software versions that were once part of it and, a CPU's without its kind, with this CPU's
    (it names the same CPU and thread count as this one; whether it was this kind, only measuring
    again can tell, which is why its rows stay ignored until they are)."""
    out = {k: v for k, v in fp.items() if k not in LEGACY_KEYS}
    if lacks_cpu_kind(out):
        here = fingerprint("cpu")
        out.update({k: here[k] for k in CPU_KIND})
    return out


def cpu_kind(fp: dict[str, str]) -> tuple[str, ...]:
    return tuple(fp.get(k, "") for k in CPU_KIND)


def describe_cpu(fp: dict[str, str]) -> str:
    """A CPU fingerprint's kind in words: "AuthenticAMD family 25 model 17 stepping 1 avx512-bf16"."""
    if lacks_cpu_kind(fp):
        return f"{fp.get('name', 'unknown cpu')!r} (kind not recorded)"
    return "{} family {} model {} stepping {} {}".format(*cpu_kind(fp))
