"""Whether the current code runs under torch.compile tracing or a CUDA/NPU graph capture.

Inside either, nothing may be measured, and nothing may read a device tensor's values (that
synchronises, which a capture forbids).
"""

from __future__ import annotations

import torch


def capturing(device_type: str) -> bool:
    if torch.compiler.is_compiling():
        return True
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.is_current_stream_capturing()
    if device_type == "npu":
        npu = getattr(torch, "npu", None)
        check = getattr(npu, "is_current_stream_capturing", None)
        return bool(check()) if check is not None else False
    return False
