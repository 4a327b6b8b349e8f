"""What a measurement is only valid on: the device and the software stack around the kernels."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform

import torch

from kernel_variants._version import __version__


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
    threads = torch.get_num_threads() if torch.device(device).type == "cpu" else 0
    return dict(_fingerprint(device, threads))


@functools.cache
def _fingerprint(device: str, threads: int) -> tuple[tuple[str, str], ...]:
    dev = torch.device(device)
    info: dict[str, str] = {"device": dev.type}
    if dev.type == "cpu":
        info.update(name=_cpu_model(), threads=str(threads), machine=platform.machine())
    elif dev.type == "cuda":
        info.update(_cuda(dev.index or 0))
    elif dev.type == "npu":
        info.update(_npu(dev.index or 0))
    else:
        info["name"] = dev.type
    info.update(torch=torch.__version__, kernel_variants=__version__)
    return tuple(info.items())


def fingerprint_id(fp: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
