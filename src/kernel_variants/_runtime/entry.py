"""An op's entry: the one function its public function calls, made once with the op.

A call of ``kv.causal_conv1d_fn(...)`` runs its public function (in the op's package: signature
and docstring), which returns ``entry(*args, out)``. The entry takes one of three ways, each
decided where it is written below:

- traced by Dynamo: the op's ``torch.library`` custom op (``custom_ops``), which dispatches
  when the compiled graph runs;
- eagerly, the compiled call core bound to the entry (``callcore.Entry.core``, bound by each
  new dispatcher, never by a call): it serves a call whose decision is memoised, in C++;
- anything else (no core, a call the core does not serve or has not seen: it returns
  ``callcore.MISS``) goes to the Python path (``call.call``), which validates, decides, raises
  with its message, or memoises the decision and teaches the core; a real run under
  ``torch.export`` or a compile session (fake or functional tensors) records the custom op.

The engine adapters' fast steps (``integrations._fast``) call the same core and this entry where
it misses; ``kv.bind`` binds one decision of the same op (``bind``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime import callcore
from kernel_variants._runtime.call import MADE, ON_MADE, call


def make_op(spec: OpSpec) -> Callable[..., Any]:
    """The dispatched entry of ``spec``: ``entry(*args, out)``, every parameter of the op in
    signature order, then ``out``. The op's public function returns ``entry(...)``."""
    name = spec.name
    # Folded to True while Dynamo traces; eagerly a function that returns False (one frame, where
    # is_compiling takes two: with cold caches each frame entered is a few cache misses).
    tracing = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
    compiling = torch.compiler.is_compiling
    miss = callcore.MISS
    bound = callcore.arm(spec)

    def traced(args: tuple[Any, ...]) -> Any:
        # Importing custom_ops runs for real, also under Dynamo (it is not traced): it registers
        # the ops made so far and sets each entry's ``traced``, read only after it. Through the
        # entry rather than custom_ops.OPS: each object a traced call reads is a guard the
        # compiled graph checks per call, and after a large kernel each costs a cache miss.
        from kernel_variants._runtime import custom_ops

        # custom_ops.register sets the newest entry of a spec; an older one of the same spec
        # (made twice) finds its traced function by name.
        return (bound.traced or custom_ops.OPS[name])(*args)

    def entry(*args: Any) -> Any:
        if tracing():
            return traced(args)
        core = bound.core
        if core is not None:
            r = core(*args)
            if r is not miss:
                return r
        if compiling():
            # A real run under torch.export or a compile session (fake or functional tensors,
            # which the core never serves): the graph records the op's custom op.
            return traced(args)
        if core is None:
            callcore.python_path_notice()
        return call(spec, args[:-1], args[-1], core)

    entry.__qualname__ = entry.__name__ = f"{name}_entry"
    bound.call = entry
    MADE.append(spec)
    for hook in ON_MADE:  # a compile already happened: this op needs its custom op now
        hook(spec)
    return entry
