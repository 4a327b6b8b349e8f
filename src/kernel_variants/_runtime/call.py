"""The per-call path in Python: validate, decide (memoised), guard and run one call of an op.

A call builds a memo signature from its arguments (``OpSpec.memo_key``: shapes, dtypes, devices,
the mutated tensors' strides, every other argument's value and type, and the pins in force); a
hit skips validation of the metadata and the decision. Where the compiled call core is built
(``callcore``), it runs the memoised path in C++ and hands anything else here, which decides,
raises, and teaches it the entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime import callcore
from kernel_variants._runtime.dispatcher import Hit, dispatcher
from kernel_variants._runtime.errors import entry_error, rule_result_error, variant_failed
from kernel_variants._runtime.guards import write_plan
from kernel_variants._runtime.pins import pins_in_context

# Every op made so far, and what wants to hear of each one made later (the torch.library custom
# ops, once a compile first traced an op: registering them costs tens of milliseconds).
MADE: list[OpSpec] = []
ON_MADE: list[Callable[[OpSpec], Any]] = []


def finish(spec: OpSpec, args: tuple[Any, ...], out: Any, values: bool) -> Callable[[Any, Hit], Hit]:
    """What ``Dispatcher.resolve`` keeps for this call: the write guard; the index value checks
    (where they run: ``values``) or else, off the CPU, the op's device rule; and with ``out`` a
    runner that hands ``out`` to a variant that takes it, else copies the result into it."""

    def finish_hit(chosen: Any, hit: Hit) -> Hit:
        caps = chosen.variant.capabilities
        checks = rule = None
        if values:
            checks = spec.value_checks(*args) if spec.value_checks is not None else None
        elif dispatcher().device_values and spec.device_rule is not None:  # off the CPU: no host read
            rule = spec.device_rule(caps, *args)
        invoke = hit.invoke
        if out is not None:
            direct = caps.takes_out and all(o.is_contiguous() for o in spec.out_tensors(out))
            invoke = out_runner(spec, direct, caps.in_place)
        return dataclasses.replace(hit, invoke=invoke, guard=write_plan(spec, args, out), checks=checks, rule=rule)

    return finish_hit


def out_runner(spec: OpSpec, direct: bool, in_place: bool) -> Callable[..., Any]:
    invoke, invoke_out = spec.invoke, spec.invoke_out
    several = len(spec.outputs) > 1

    def run(fn: Callable[..., Any], args: Any, out: Any, aliased: bool) -> Any:
        if direct and (in_place or not aliased):
            invoke_out(fn, args, out)
        elif several:
            # The result is complete before the first copy, so an out that is an input is safe.
            for o, r in zip(out, invoke(fn, args), strict=True):
                o.copy_(r)
        else:
            out.copy_(invoke(fn, args))
        return tuple(out) if several else out

    return run


def host_values(t: Any) -> bool:
    """Whether index values of a call on ``t``'s device are checked on the host by default.

    Value checks read index tensors: free on the CPU, so always on there; a device sync
    elsewhere, where KV_CHECK_VALUES decides (by default the op's device rule runs instead).
    ``t``: the call's first tensor argument."""
    return getattr(t, "is_cpu", True)


def on_cpu(spec: OpSpec, args: tuple[Any, ...]) -> bool:
    return host_values(args[spec.tensor_indices[0]])


def call(spec: OpSpec, args: tuple[Any, ...], out: Any = None, core: Any = None) -> Any:
    """Validate, decide (memoised) and run one call of ``spec``; ``args`` in signature order,
    ``out`` as the public function takes it (None, a tensor, or one per output). ``core``: the
    compiled call core that handed this call over, taught the memoised entry before it runs."""
    if len(args) != len(spec.params):  # the core hands such a call here
        raise entry_error(spec, len(args))
    d = dispatcher()
    # Read before the memo: another thread's reload or invalidation after it makes this call's
    # entry one the cores must not be taught (they were cleared meanwhile; learn compares, and
    # a reload sets the new dispatcher before it clears them).
    generation = callcore.generation()
    try:
        sig = spec.memo_key(args, pins_in_context())
        if out is not None:
            sig = (sig, spec.out_key(out))
        hit = d.memo.get(sig)
    except (AttributeError, TypeError):  # not a tensor, or unhashable: validation says what is wrong
        sig = hit = None
    if hit is None:
        values = d.check_values or on_cpu(spec, args)
        key = spec.key(args, values)  # validates, index values included where they run
        if out is not None:
            spec.check_out(args, out)
        hit = d.resolve(sig, key, args, finish(spec, args, out, values))
    elif hit.checks is not None:
        hit.checks(args)
    aliased = hit.guard is not None and hit.guard(args, out)
    # Taught only what it can key and run (callcore.serves): another device's call would be
    # refused there on every call, at a frame and a key build (~1 us) each time.
    if (core is not None and sig is not None and sig in d.memo  # not one kept out of the memo
            and d is dispatcher() and callcore.serves(core, args[spec.tensor_indices[0]], hit.checks is not None)):
        callcore.learn(core, spec, args, out, hit, generation)
    if hit.subs:
        args = with_subs(args, hit.subs)
    if hit.rule is not None:
        args = run_rule(hit.rule, args)
    try:
        return hit.invoke(hit.fn, args) if out is None else hit.invoke(hit.fn, args, out, aliased)
    except Exception as exc:
        raise variant_failed(spec, hit.vid, exc) from exc


def run_rule(rule: Callable[[tuple[Any, ...]], Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments the variant gets off the CPU: ``rule(args)``, which must be a tuple of as
    many (the compiled call core raises the same TypeError)."""
    ruled = rule(args)
    if not isinstance(ruled, tuple) or len(ruled) != len(args):
        raise rule_result_error(ruled, len(args))
    return ruled


def with_subs(args: tuple[Any, ...], subs: tuple[tuple[int, Any], ...]) -> tuple[Any, ...]:
    """``args`` with the normalised values of ``subs`` in place."""
    if not subs:
        return args
    out = list(args)
    for i, value in subs:
        out[i] = value
    return tuple(out)
