"""From an :class:`OpSpec` to the public, dispatched function, and the per-call path it runs.

``make_op(spec)`` generates a function with exactly the spec's signature (so ``help()``,
positional and keyword binding and defaults are Python's own, at no cost per call). A call
builds a memo signature from its arguments (``OpSpec.memo_key``: shapes, dtypes, devices, the
mutated tensors' strides, every other argument's value and type, and the pins in force); a hit
skips validation of the metadata and the decision. Under ``torch.compile`` the call goes through the op's
``torch.library`` custom op instead, which dispatches when the graph runs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from kernel_variants.registry import OpSpec

from ._dispatcher import VariantFailed, dispatcher, pins_in_context
from ._select import Decision

_compiling = torch.compiler.is_compiling


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, past the last byte] that ``t``'s elements can occupy."""
    start = t.data_ptr()
    span = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    return start, start + (span + 1) * t.element_size()


def guard_writes(spec: OpSpec, args: tuple[Any, ...]) -> None:
    """Before anything runs: no argument may share memory with a tensor the op writes (the
    answer would depend on the order a variant reads and writes in), and an inference tensor
    cannot be written outside inference mode. One behaviour whichever variant runs. Only
    tensors of the written tensor's dtype are compared (index tensors cannot alias a float pool
    but by a deliberate reinterpretation), each by its storage first: a pointer compare."""
    for mi in spec.mutated_indices:
        m = args[mi]
        if m is None or m.numel() == 0:
            continue
        if m.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(f"{spec.params[mi]}: an inference tensor (made under torch.inference_mode) cannot be "
                             "updated outside inference mode; allocate it outside, or call inside inference_mode")
        dtype = m.dtype
        storage = m.untyped_storage().data_ptr()
        lo = hi = None
        for i in spec.tensor_indices:
            a = args[i]
            if i == mi or a is None or a.dtype != dtype or a.untyped_storage().data_ptr() != storage:
                continue
            if a.numel() == 0:
                continue
            if lo is None:
                lo, hi = _extent(m)
            a_lo, a_hi = _extent(a)
            if a_lo < hi and lo < a_hi:
                raise ValueError(f"{spec.params[i]}: expected memory apart from {spec.params[mi]}, which the op "
                                 f"writes, got a view that overlaps it; pass a copy")


def _on_cpu(spec: OpSpec, args: tuple[Any, ...]) -> bool:
    # Value checks read index tensors: free on the CPU, so always on there; a device sync
    # elsewhere, where KV_CHECK_VALUES decides (by default the op's device rule runs instead).
    return getattr(args[spec.tensor_indices[0]], "is_cpu", True)


def call(spec: OpSpec, args: tuple[Any, ...]) -> Any:
    """Validate, decide (memoised) and run one call of ``spec``; ``args`` in signature order."""
    d = dispatcher()
    values = d.check_values or _on_cpu(spec, args)
    try:
        sig = spec.memo_key(args, pins_in_context())
        hit = d.memo.get(sig)
    except (AttributeError, TypeError):  # not a tensor, or unhashable: validation says what is wrong
        sig = hit = None
    if hit is None:
        key = spec.key(args, values)
        hit = d.resolve(sig, key, args)
    elif values:
        spec.check_values(*args)
    if spec.mutated_indices:
        guard_writes(spec, args)
    vid, fn, invoke, subs = hit
    if subs:
        args = list(args)
        for i, value in subs:
            args[i] = value
    if not values and d.device_values and spec.device_values is not None:  # off the CPU: no host read
        args = spec.device_values(args, d.registry.get(spec.name, vid).variant.capabilities)
    try:
        return invoke(fn, args)
    except Exception as exc:
        raise VariantFailed(f"variant {vid!r} of {spec.name} failed: {type(exc).__name__}: {exc}") from exc


def _params_source(spec: OpSpec, namespace: dict[str, Any]) -> str:
    """The parameter list of ``spec``'s signature as source, defaults bound in ``namespace``."""
    parts: list[str] = []
    star = False
    params = list(spec.py_signature.parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.default is p.empty:
            parts.append(p.name)
        else:
            namespace[f"_d{i}"] = p.default
            parts.append(f"{p.name}=_d{i}")
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    return ", ".join(parts)


def make_op(spec: OpSpec) -> Callable[..., Any]:
    """The public function of ``spec``: its signature and docstring, dispatched per call."""
    namespace: dict[str, Any] = {"_call": call, "_spec": spec, "_compiling": _compiling}
    params = _params_source(spec, namespace)
    names = ", ".join(spec.params)
    # Traced: one custom op, which dispatches when the graph runs. The import runs for real under
    # Dynamo (it is not traced), and importing _custom_ops registers the ops made so far.
    src = (f"def {spec.name}({params}):\n"
           f"    if _compiling():\n"
           f"        from kernel_variants.dispatch import _custom_ops\n"
           f"        return _custom_ops.OPS[{spec.name!r}]({names})\n"
           f"    return _call(_spec, ({names},))\n")
    exec(src, namespace)  # noqa: S102 - source made from the spec's own signature
    fn = namespace[spec.name]
    stub = spec.signature
    fn.__doc__ = stub.__doc__
    fn.__module__ = stub.__module__
    fn.__qualname__ = spec.name
    fn.__annotations__ = dict(getattr(stub, "__annotations__", {}))
    fn.__signature__ = spec.py_signature
    MADE.append(spec)
    custom_ops = sys.modules.get("kernel_variants.dispatch._custom_ops")
    if custom_ops is not None:  # a compile already happened: this op needs its custom op now
        custom_ops.register(spec)
    return fn


# Every op made so far. Registering torch.library ops costs tens of milliseconds, so it happens
# when a compile first traces an op (or for ops made after that, at once).
MADE: list[OpSpec] = []


def explain(op_name: str, *args: object, **kwargs: object) -> Decision:
    """The decision the dispatcher makes for this call, with every variant's verdict and reason.

    Takes the op's arguments exactly as the op would; runs nothing. ``print()`` it for a trace.
    """
    d = dispatcher()
    spec = d.registry.spec(op_name)
    bound = spec.bind(*args, **kwargs)
    key = spec.key(bound, d.check_values or _on_cpu(spec, bound))
    return d.decide(key, d.pinned(spec.name), tune=False)


def call_key(op_name: str, *args: object, **kwargs: object):
    """Validate a call to ``op_name`` given as it would be written, and return its key."""
    d = dispatcher()
    spec = d.registry.spec(op_name)
    bound = spec.bind(*args, **kwargs)
    return spec.key(bound, d.check_values or _on_cpu(spec, bound))
