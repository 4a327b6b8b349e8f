"""The no-sync guard: a ``TorchFunctionMode`` that fails a test on any host synchronisation or
data-dependent allocation, the thing a CUDA/NPU graph capture forbids (``.item()``,
``.tolist()``, ``bool(t)``, ``nonzero()``, boolean-mask indexing, ``.cpu()``...).

Kernel bodies (the CPU doubles of :mod:`helpers.ascend_conv`, Triton under its interpreter)
stand for device code: they run inside :func:`device_side` and are exempt.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types

import torch
from torch.overrides import TorchFunctionMode

from helpers.ascend_conv import DAO_MODULE, make_dao_module, update_v2


class HostSync(AssertionError):
    """A host synchronisation (or a tensor sized by its values) where a graph capture forbids one."""


_DEVICE_SIDE = threading.local()


@contextlib.contextmanager
def device_side():
    """The body of a kernel (a CPU double, the Triton interpreter): exempt from the guard."""
    depth = getattr(_DEVICE_SIDE, "depth", 0)
    _DEVICE_SIDE.depth = depth + 1
    try:
        yield
    finally:
        _DEVICE_SIDE.depth = depth


def _has_bool_index(index) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, tuple | list):
        return any(_has_bool_index(i) for i in index)
    return False


class NoHostSync(TorchFunctionMode):
    """Raise :class:`HostSync` on any torch function that reads a tensor's values on the host."""

    READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "nonzero",
                       "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose", "cpu",
                       "numpy", "bincount"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_DEVICE_SIDE, "depth", 0) == 0:
            why = self.why(func, args, kwargs)
            if why is not None:
                raise HostSync(why)
        return func(*args, **kwargs)

    def why(self, func, args, kwargs) -> str | None:
        name = getattr(func, "__name__", str(func)).split(".")[0]
        if name in self.READS:
            return f"{name}() reads a tensor's value on the host"
        if name == "where" and len(args) + len(kwargs) == 1:
            return "torch.where(condition) is nonzero(): a host sync and a data-dependent size"
        if name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"),
                                                      torch.Tensor) and "output_size" not in kwargs:
            return "repeat_interleave(tensor) without output_size sizes its result by the values"
        if name in ("__getitem__", "__setitem__", "index", "index_put", "index_put_") and _has_bool_index(args[1:]):
            return f"{name} with a boolean mask: a host sync and a data-dependent size"
        if name in ("to", "copy_") and any(isinstance(a, str | torch.device) and torch.device(a).type == "cpu"
                                           for a in (*args[1:], kwargs.get("device"))):
            return f"{name}(cpu): a copy to the host"
        return None


def guarded(fn):
    """``fn`` run under :class:`NoHostSync`."""
    def run(*args, **kwargs):
        with NoHostSync():
            return fn(*args, **kwargs)

    run.__qualname__ = f"guarded({getattr(fn, '__qualname__', fn)})"
    return run


def on_device(fn):
    """``fn`` run as device code: exempt from the guard (a kernel body, a Triton launch)."""
    def kernel(*args, **kwargs):
        with device_side():
            return fn(*args, **kwargs)

    return kernel


# The Python-function doubles run on the "device": wrapped so that their own loops are exempt.
device_update_v2 = on_device(update_v2)
device_update_v2.calls = update_v2.calls


def device_dao_module() -> types.ModuleType:
    """The causal-conv1d double with both entry points run as device code."""
    real = make_dao_module()
    mod = types.ModuleType(DAO_MODULE)
    mod.causal_conv1d_fn = on_device(real.causal_conv1d_fn)
    mod.causal_conv1d_update = on_device(real.causal_conv1d_update)
    # the adapter's finder reads the signatures
    mod.causal_conv1d_fn.__signature__ = inspect.signature(real.causal_conv1d_fn)
    mod.causal_conv1d_update.__signature__ = inspect.signature(real.causal_conv1d_update)
    return mod


device_update_v2.__signature__ = inspect.signature(update_v2)  # what the adapter's finder reads
