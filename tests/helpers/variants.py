"""Test variants: one factory, and the bodies tests give them (slow, wrong, counting)."""

from __future__ import annotations

import time

from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.plugin import Variant

FN = "causal_conv1d_fn"
UPDATE = "causal_conv1d_update"


def variant(vid: str, op: str = FN, fn=None, *, version: str = "1", priority: int = 0, capabilities=None,
            devices=("cpu",), dtypes=("float32",), varlen: bool = False, **kw) -> Variant:
    """A variant of a conv op: ``fn`` (the reference of ``op`` if omitted), CPU and float32 only
    unless ``devices``/``dtypes``/``capabilities`` say otherwise; ``kw`` goes to ``Variant``
    (probe, depends, isolate...)."""
    if fn is None:
        fn = getattr(reference, op)
    if capabilities is None:
        capabilities = ConvCapabilities(devices=set(devices), dtypes=set(dtypes), varlen=varlen)
    return Variant(id=vid, op=op, version=version, priority=priority, fn=fn, capabilities=capabilities, **kw)


def slow(seconds: float, op: str = FN):
    """The reference of ``op``, after sleeping ``seconds``: a variant that is right and slower."""
    real = getattr(reference, op)

    def fn(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    return fn


def off_by_one(*args, **kwargs):
    """causal_conv1d_fn's reference plus one: a variant that is fast and wrong."""
    return reference.causal_conv1d_fn(*args, **kwargs) + 1


def counting(vid: str, fn, **kw) -> tuple[Variant, list[str]]:
    """A variant running ``fn`` that appends its id to the returned list on each call."""
    calls: list[str] = []

    def counted(*args, **kwargs):
        calls.append(vid)
        return fn(*args, **kwargs)

    return variant(vid, fn=counted, **kw), calls
