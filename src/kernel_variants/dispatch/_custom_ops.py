"""Each op as a ``torch.library`` custom op, for ``torch.compile`` and ``torch.export``.

The schema comes from the op spec's signature (its annotations), with the spec's ``mutates``
parameters declared as mutated. The fake implementation returns empty tensors like the first
tensor argument, one per output, so tracing never runs a kernel, calibrates or reads the table.
At run time the op body is the ordinary eager call, which validates and dispatches per shape.

The public functions route here only while ``torch.compiler.is_compiling()``: calling a custom
op from Python costs tens of microseconds that eager calls should not pay. Importing this module
(which the first traced call does) registers every op made so far; later ops register as made.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import torch

from kernel_variants.registry import OpSpec

from ._op import MADE, call

OPS: dict[str, Callable[..., Any]] = {}  # op name -> its custom op


def register(spec: OpSpec) -> Callable[..., Any]:
    """The custom op ``kernel_variants::<name>`` of ``spec``, registered once."""
    op = OPS.get(spec.name)
    if op is None:
        op = OPS[spec.name] = _register(spec)
    return op


def _unalias(out: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    # A custom op may not return an alias of an input; no variant does, but the op cannot know.
    ptr = out.untyped_storage().data_ptr()
    return out.clone() if any(t.untyped_storage().data_ptr() == ptr for t in inputs) else out


def _register(spec: OpSpec) -> Callable[..., Any]:
    hints = typing.get_type_hints(spec.signature)
    names = ", ".join(spec.params)
    several = len(spec.outputs) > 1

    def body(args: tuple[Any, ...]) -> Any:
        out = call(spec, args)
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        return tuple(_unalias(o, inputs) for o in out) if several else _unalias(out, inputs)

    def fake(args: tuple[Any, ...]) -> Any:
        like = next(a for a in args if isinstance(a, torch.Tensor))
        outs = tuple(torch.empty_like(like, memory_format=torch.contiguous_format) for _ in spec.outputs)
        return outs if several else outs[0]

    # Generated with the spec's parameter names, so the schema names them as the signature does.
    namespace: dict[str, Any] = {"_body": body, "_fake": fake}
    src = f"def impl({names}):\n    return _body(({names},))\ndef fake({names}):\n    return _fake(({names},))\n"
    exec(src, namespace)  # noqa: S102 - source made from the spec's parameter names only
    impl = namespace["impl"]
    impl.__annotations__ = {n: hints[n] for n in spec.params} | {"return": hints["return"]}
    op = torch.library.custom_op(f"kernel_variants::{spec.name}", impl, mutates_args=spec.mutates)
    op.register_fake(namespace["fake"])
    return op


for _spec in MADE:
    register(_spec)
