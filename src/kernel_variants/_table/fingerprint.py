"""What a measurement is only valid on: the device (and its driver or runtime).

The software a kernel's speed depends on beyond that (torch, Triton, torch_npu, a compiler, the
package that ships the kernel) is keyed per variant: each variant declares its dependencies and
their versions are part of its version (``Variant.depends``), so upgrading kernel_variants, or
torch under a variant that does not use it, keeps the rows it does not affect.

Rows written before that (until kernel_variants 0.1) carried torch's and kernel_variants'
versions here: ``is_legacy`` tells them apart, and the table ignores them with one warning
(``kv calibrate --stale`` re-measures them).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform

import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


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
    if dev.type in ("cuda", "npu") and dev.index is None:  # "cuda" means the current device, as in torch
        dev = torch.device(dev.type, getattr(torch, dev.type).current_device())
    return dict(_fingerprint(str(dev), threads))


@functools.cache
def _fingerprint(device: str, threads: int) -> tuple[tuple[str, str], ...]:
    dev = torch.device(device)
    info: dict[str, str] = {"device": dev.type}
    if dev.type == "cpu":
        info.update(name=_cpu_model(), threads=str(threads), machine=platform.machine())
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


def is_legacy(fp: dict[str, str]) -> bool:
    """A fingerprint written before staleness was kept per variant."""
    return "kernel_variants" in fp


def device_part(fp: dict[str, str]) -> dict[str, str]:
    """A fingerprint without the software versions that were once part of it: for a legacy row,
    the fingerprint it would have now."""
    return {k: v for k, v in fp.items() if k not in LEGACY_KEYS}
