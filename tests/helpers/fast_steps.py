"""The engine adapters with their fast steps refused, so that their general path serves."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock


@contextlib.contextmanager
def general_path() -> Iterator[None]:
    """Inside it every adapter's ``decode_step`` / ``prefill_step`` declines (returns None), as
    a fast step does for a call it does not serve."""
    from kernel_variants.integrations import _sglang_adapters, _vllm_adapters, _vllm_cpu

    with contextlib.ExitStack() as stack:
        for module in (_vllm_adapters, _vllm_cpu, _sglang_adapters):
            for step in ("decode_step", "prefill_step"):
                if hasattr(module, step):
                    stack.enter_context(mock.patch.object(module, step, lambda *a, **k: None))
        yield
