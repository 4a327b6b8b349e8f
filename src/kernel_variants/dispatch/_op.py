"""From an :class:`OpSpec` to the public, dispatched function, and the per-call path it runs.

``make_op(spec)`` generates a function with exactly the spec's signature (so ``help()``,
positional and keyword binding and defaults are Python's own, at no cost per call). A call
builds a memo signature from its arguments (``OpSpec.memo_key``: shapes, dtypes, devices, the
mutated tensors' strides, every other argument's value and type, and the pins in force); a hit
skips validation of the metadata and the decision. Under ``torch.compile`` the call goes through the op's
``torch.library`` custom op instead, which dispatches when the graph runs.

Where the compiled call core is built (``_callcore``), an eager call goes to it first: it runs
the memoised path (key, lookup, index value checks, write guard, variant) in C++ and hands
anything else to :func:`call`, which decides, raises, and teaches it the entry.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kernel_variants.registry import OpSpec

from . import _callcore
from ._dispatcher import Hit, VariantFailed, dispatcher, pins_in_context
from ._select import Decision

_compiling = torch.compiler.is_compiling


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, past the last byte] that ``t``'s elements can occupy (strides are never
    negative in torch, so the first element is the lowest address)."""
    start = t.data_ptr()
    return start, start + _span(t)


def _span(t: torch.Tensor) -> int:
    """How many bytes from ``t``'s first element to past its last one."""
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def _inference_error(name: str) -> ValueError:
    return ValueError(f"{name}: an inference tensor (made under torch.inference_mode) cannot be "
                      "updated outside inference mode; allocate it outside, or call inside inference_mode")


def _overlap_error(spec: OpSpec, i: int, written: str) -> ValueError:
    return ValueError(f"{spec.params[i]}: expected memory apart from {written}, which the op writes, got a view "
                      f"that overlaps it; pass a copy")


def guard_writes(spec: OpSpec, args: tuple[Any, ...], out: Any = None) -> bool:
    """Before anything runs: no argument may share memory with a tensor the op writes (a mutated
    state, or ``out``): the answer would depend on the order a variant reads and writes in. The
    one exception is an ``out`` that is exactly the input the spec lets it alias (same first
    byte, shape and strides: in place). An inference tensor cannot be written outside inference
    mode. One behaviour whichever variant runs. Only tensors of the written tensor's dtype are
    compared (index tensors cannot alias a float pool but by a deliberate reinterpretation).
    Returns whether an ``out`` is exactly an input."""
    plan = _write_plan(spec, args, out)
    return plan is not None and plan(args, out)


def _guard_out(spec: OpSpec, args: tuple[Any, ...], outs: tuple[torch.Tensor, ...]) -> bool:
    aliased = False
    several = len(outs) > 1
    done: list[tuple[str, int, int]] = []
    for k, o in enumerate(outs):
        name = f"out[{k}]" if several else "out"
        if o.numel() == 0:
            continue
        if o.is_inference() and not torch.is_inference_mode_enabled():
            raise _inference_error(name)
        if not o.is_contiguous() and torch._debug_has_internal_overlap(o) == 1:  # 1: certainly overlaps
            raise ValueError(f"{name}: expected a tensor whose elements are apart in memory, got one whose "
                             f"strides {list(o.stride())} make elements share memory (an expand()?)")
        lo, hi = _extent(o)
        allowed = spec.out_alias_indices[k]
        for i in spec.tensor_indices:
            a = args[i]
            if a is None or a.dtype != o.dtype or a.numel() == 0:
                continue
            a_lo, a_hi = _extent(a)
            if not (a_lo < hi and lo < a_hi):
                continue
            if i == allowed and a_lo == lo and a.shape == o.shape and a.stride() == o.stride():
                aliased = True
                continue
            what = "memory apart from" if i != allowed else "exactly (in place) or memory apart from"
            raise ValueError(f"{name}: expected {what} {spec.params[i]}, got a view that overlaps it "
                             f"{'partially' if i == allowed else ''}".rstrip() + "; pass another tensor")
        for other, o_lo, o_hi in done:
            if o_lo < hi and lo < o_hi:
                raise ValueError(f"{name}: expected memory apart from {other}, got a view that overlaps it")
        done.append((name, lo, hi))
    return aliased


def _write_plan(spec: OpSpec, args: tuple[Any, ...], out: Any) -> Callable[..., bool] | None:
    """:func:`guard_writes` split for one memo signature: what depends only on
    metadata (which tensors share the written tensor's dtype, how many bytes it spans) is
    worked out here, once; a call then reads data pointers (and a tensor's span only when it
    starts inside the written tensor's allocation, before it). ``None``: nothing to guard.
    Its ``declared`` attribute is that work as data, (checks, has out), where checks are
    (written index, its span, the indices compared with it): what the call core reads."""
    checks = []
    for mi in spec.mutated_indices:
        m = args[mi]
        if m is None or m.numel() == 0:
            continue
        near = tuple(i for i in spec.tensor_indices
                     if i != mi and args[i] is not None and args[i].dtype == m.dtype and args[i].numel() > 0)
        checks.append((mi, _span(m), near))
    if not checks and out is None:
        return None
    checks_t = tuple(checks)
    inference_mode = torch.is_inference_mode_enabled

    def plan(args: tuple[Any, ...], out: Any) -> bool:
        for mi, span, near in checks_t:
            m = args[mi]
            if not inference_mode() and m.is_inference():  # serving runs in inference mode
                raise _inference_error(spec.params[mi])
            lo = m.data_ptr()
            hi = lo + span
            base = m.untyped_storage().data_ptr()
            for i in near:
                a = args[i]
                a_lo = a.data_ptr()
                if a_lo >= hi or a_lo < base:
                    # Past m's last byte, or in another allocation (allocations are disjoint,
                    # and a tensor never reaches below its first byte: strides are >= 0).
                    continue
                if a_lo >= lo or a_lo + _span(a) > lo:
                    raise _overlap_error(spec, i, spec.params[mi])
        return False if out is None else _guard_out(spec, args, spec.out_tensors(out))

    plan.declared = (checks_t, out is not None)  # type: ignore[attr-defined]
    return plan


def _finish(spec: OpSpec, args: tuple[Any, ...], out: Any, values: bool) -> Callable[[Any, Hit], Hit]:
    """What ``Dispatcher.resolve`` keeps for this call: the write guard; the index value checks
    (where they run: ``values``) or else, off the CPU, the op's device rule; and with ``out`` a
    runner that hands ``out`` to a variant that takes it, else copies the result into it."""

    def finish(chosen: Any, hit: Hit) -> Hit:
        caps = chosen.variant.capabilities
        checks = rule = None
        if values:
            checks = spec.value_checks(*args) if spec.value_checks is not None else None
        elif dispatcher().device_values and spec.device_values is not None:  # off the CPU: no host read
            def rule(a: Any) -> Any:
                return spec.device_values(a, caps)
        invoke = hit.invoke
        if out is not None:
            direct = caps.takes_out and all(o.is_contiguous() for o in spec.out_tensors(out))
            invoke = _out_runner(spec, direct, caps.in_place)
        return hit._replace(invoke=invoke, guard=_write_plan(spec, args, out), checks=checks, rule=rule)

    return finish


def _out_runner(spec: OpSpec, direct: bool, in_place: bool) -> Callable[..., Any]:
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


def _on_cpu(spec: OpSpec, args: tuple[Any, ...]) -> bool:
    # Value checks read index tensors: free on the CPU, so always on there; a device sync
    # elsewhere, where KV_CHECK_VALUES decides (by default the op's device rule runs instead).
    return getattr(args[spec.tensor_indices[0]], "is_cpu", True)


def variant_failed(spec: OpSpec, vid: str, exc: BaseException) -> VariantFailed:
    """What a variant's exception becomes, on every call path (``__cause__``: the original)."""
    return VariantFailed(f"variant {vid!r} of {spec.name} failed: {type(exc).__name__}: {exc}")


def call(spec: OpSpec, args: tuple[Any, ...], out: Any = None, core: Any = None) -> Any:
    """Validate, decide (memoised) and run one call of ``spec``; ``args`` in signature order,
    ``out`` as the public function takes it (None, a tensor, or one per output). ``core``: the
    compiled call core that handed this call over, taught the memoised entry before it runs."""
    d = dispatcher()
    try:
        sig = spec.memo_key(args, pins_in_context())
        if out is not None:
            sig = (sig, spec.out_key(out))
        hit = d.memo.get(sig)
    except (AttributeError, TypeError):  # not a tensor, or unhashable: validation says what is wrong
        sig = hit = None
    if hit is None:
        values = d.check_values or _on_cpu(spec, args)
        key = spec.key(args, values)  # validates, index values included where they run
        if out is not None:
            spec.check_out(args, out)
        hit = d.resolve(sig, key, args, _finish(spec, args, out, values))
    elif hit.checks is not None:
        hit.checks(args)
    vid, fn, invoke, subs, guard, _, rule = hit
    aliased = guard is not None and guard(args, out)
    if core is not None and sig is not None and sig in d.memo:  # not a decision kept out of the memo
        _callcore.learn(core, spec, args, out, hit)
    if subs:
        args = _with(args, subs)
    if rule is not None:
        args = rule(args)
    try:
        return invoke(fn, args) if out is None else invoke(fn, args, out, aliased)
    except Exception as exc:
        raise variant_failed(spec, vid, exc) from exc


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
    namespace: dict[str, Any] = {"_call": call, "_spec": spec, "_compiling": _compiling, "_MISS": _callcore.MISS}
    params = _params_source(spec, namespace)
    names = ", ".join(spec.params)
    # Traced: one custom op, which dispatches when the graph runs. The import runs for real under
    # Dynamo (it is not traced), and importing _custom_ops registers the ops made so far.
    # Eager: the compiled call core when there is one (_core: None otherwise), which hands a
    # call it does not serve to the Python path with itself, to learn the decision.
    src = (f"def {spec.name}({params}):\n"
           f"    if _compiling():\n"
           f"        from kernel_variants.dispatch import _custom_ops\n"
           f"        return _custom_ops.OPS[{spec.name!r}]({names}, out)\n"
           f"    if _core is not None:\n"
           f"        r = _core({names}, out)\n"
           f"        if r is not _MISS:\n"
           f"            return r\n"
           f"        return _call(_spec, ({names},), out, _core)\n"
           f"    if out is None:\n"
           f"        return _call(_spec, ({names},))\n"
           f"    return _call(_spec, ({names},), out)\n")
    exec(src, namespace)  # noqa: S102 - source made from the spec's own signature
    _callcore.arm(spec, namespace)
    fn = namespace[spec.name]
    stub = spec.signature
    fn.__doc__ = (stub.__doc__ or "").rstrip() + "\n\n" + out_doc(spec)
    fn.__module__ = stub.__module__
    fn.__qualname__ = spec.name
    fn.__annotations__ = {**getattr(stub, "__annotations__", {}), "out": spec.py_signature.parameters["out"].annotation}
    fn.__signature__ = spec.py_signature
    MADE.append(spec)
    custom_ops = sys.modules.get("kernel_variants.dispatch._custom_ops")
    if custom_ops is not None:  # a compile already happened: this op needs its custom op now
        custom_ops.register(spec)
    return fn


def out_doc(spec: OpSpec) -> str:
    """The ``out=`` paragraph of an op's docstring, the same rules for every op."""
    like = spec.params[spec.out_like_index]
    if len(spec.outputs) == 1:
        what = f"a tensor of the result's shape, dtype and device ({like}'s)"
        alias = spec.out_aliases.get(spec.outputs[0])
        may = f" It may be exactly ``{alias}`` (in place)." if alias else ""
    else:
        what = (f"a tuple ({', '.join(spec.outputs)}) of tensors of the results' shape, dtype and device "
                f"({like}'s), returned as that tuple")
        pairs = [f"``out[{k}]`` exactly ``{spec.out_aliases[n]}``" for k, n in enumerate(spec.outputs)
                 if n in spec.out_aliases]
        may = f" It may have {' and '.join(pairs)} (in place)." if pairs else ""
    return (f"    Keyword ``out`` (default None): {what}; the result is written there and ``out`` is returned.{may}\n"
            f"    Any other overlap with an argument is a ValueError; nothing is written then.")


# Every op made so far. Registering torch.library ops costs tens of milliseconds, so it happens
# when a compile first traces an op (or for ops made after that, at once).
MADE: list[OpSpec] = []


def explain(op_name: str, *args: object, **kwargs: object) -> Decision:
    """The decision the dispatcher makes for this call, with every variant's verdict and reason.

    Takes the op's arguments exactly as the op would (``out=`` included: checked, never written;
    it changes no decision); runs nothing. ``print()`` it for a trace.
    """
    d = dispatcher()
    spec = d.registry.spec(op_name)
    out = kwargs.pop("out", None)
    bound = spec.bind(*args, **kwargs)
    key = spec.key(bound, d.check_values or _on_cpu(spec, bound))
    if out is not None:
        spec.check_out(bound, out)
    return d.decide(key, d.pinned(spec.name), tune=False, qualify=False)


def call_key(op_name: str, *args: object, **kwargs: object):
    """Validate a call to ``op_name`` given as it would be written, and return its key."""
    d = dispatcher()
    kwargs.pop("out", None)
    spec = d.registry.spec(op_name)
    bound = spec.bind(*args, **kwargs)
    return spec.key(bound, d.check_values or _on_cpu(spec, bound))


class BoundOp(Protocol):
    """What :func:`bind` returns: the op's public signature, calling one variant directly."""

    op: str
    variant: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def bind(op: str | Callable[..., Any], *example_args: Any, **example_kwargs: Any) -> BoundOp:
    """The variant the dispatcher chooses for this example call, as a function with the op's
    signature, for a loop whose shapes do not change.

    The example (``out=`` included) is validated and decided once, as the op would. Each call of
    the result then checks only what can change without changing shapes: index values where the
    op checks them (always on the CPU; on accelerators when ``KV_CHECK_VALUES`` is on), that
    every non-tensor argument equals the example's (``ValueError`` otherwise), and a given
    ``out`` (its shape, dtype, device and overlap). Index values are checked against the
    example's sizes (slot count, T, L). It does not re-check the tensors' shapes,
    dtypes, devices, strides, whether they require grad, or overlap with a written state: pass
    tensors like the example's.
    The choice is fixed: calibration, ``force`` or ``reload`` after ``bind`` do not change it
    (bind again). ``op`` is the op's name or its public function; ``.variant`` says what runs.
    Where the compiled call core is built, the result is a C object that behaves as this
    function (and hands it what it does not run itself: ``out=``, a changed value, a bad index).
    """
    d = dispatcher()
    name = op if isinstance(op, str) else getattr(op, "__name__", None)
    if not isinstance(name, str):
        raise TypeError(f"op: expected an op name or an op function, got {type(op).__name__}")
    spec = d.registry.spec(name)
    out = example_kwargs.pop("out", None)
    args = spec.bind(*example_args, **example_kwargs)
    values = d.check_values or _on_cpu(spec, args)
    key = spec.key(args, values)
    if out is not None:
        spec.check_out(args, out)
    vid, fn, _, subs, _, checks, rule = d.resolve(None, key, args, _finish(spec, args, None, values))
    guard_writes(spec, args, out)
    caps = d.registry.get(spec.name, vid).variant.capabilities
    tensors = set(spec.tensor_indices)
    fixed = [i for i in range(len(spec.params)) if i not in tensors]
    normalized = dict(subs)
    namespace: dict[str, Any] = {
        "_with": _with, "_fn": fn, "_check_values": checks, "_changed": _changed(spec, fixed, tuple(args[i] for i in fixed)),
        "_out": _bound_out(spec, vid, fn, caps, subs, rule), "_variant_failed": variant_failed, "_spec": spec,
        "_vid": vid, "_rule": rule, "_invoke": spec.invoke, "_subs": subs,
    }
    params = _params_source(spec, namespace)
    pos = set(spec.positional)
    call_args = []
    for i, n in enumerate(spec.params):
        value = n
        if i in normalized:  # already normalised once, from the example
            namespace[f"_n{i}"] = normalized[i]
            value = f"_n{i}"
        call_args.append(value if n in pos else f"{n}={value}")
    names = ", ".join(spec.params)
    fixed_src = f"({', '.join(spec.params[i] for i in fixed)},)" if fixed else "()"
    # One comparison per value rather than a tuple built and compared: it is on every call.
    namespace.update({f"_f{k}": args[i] for k, i in enumerate(fixed)})
    differs = " or ".join(f"{spec.params[i]} != _f{k}" for k, i in enumerate(fixed)) or "False"
    run = (f"_invoke(_fn, _rule(_with(({names},), _subs)))" if rule is not None
           else f"_fn({', '.join(call_args)})")
    src = (f"def bound({params}):\n"
           f"    if {differs}:\n"
           f"        raise _changed({fixed_src})\n"
           + (f"    _check_values(({names},))\n" if checks is not None else "")
           + "    if out is not None:\n"
           f"        return _out(({names},), out)\n"
           "    try:\n"
           f"        return {run}\n"
           "    except Exception as exc:\n"
           "        raise _variant_failed(_spec, _vid, exc) from exc\n")
    exec(src, namespace)  # noqa: S102 - source made from the spec's own signature
    bound = namespace["bound"]
    # The same in C where the call core is built: this function then serves only what the C
    # object hands it (out=, a changed value, a bad index value), raising with its messages.
    fast = None if rule is not None else _callcore.bound(spec, bound, vid, fn, subs, checks, fixed,
                                                         tuple(args[i] for i in fixed))
    for made in (bound, fast) if fast is not None else (bound,):
        made.__doc__ = f"{spec.name}, bound to variant {vid!r} for calls shaped like the example (kernel_variants.bind)."
        made.__qualname__ = made.__name__ = f"{spec.name}_bound"
        made.__signature__ = spec.py_signature
        made.op, made.variant = spec.name, vid
    return fast if fast is not None else bound


def _changed(spec: OpSpec, fixed: list[int], expected: tuple[Any, ...]) -> Callable[[tuple[Any, ...]], ValueError]:
    names = [spec.params[i] for i in fixed]

    def error(got: tuple[Any, ...]) -> ValueError:
        which = [n for n, e, g in zip(names, expected, got, strict=True) if e != g]
        return ValueError(f"{', '.join(which)}: a bound op runs with the example's values; expected "
                          f"{ {n: e for n, e in zip(names, expected, strict=True) if n in which} }, got "
                          f"{ {n: g for n, g in zip(names, got, strict=True) if n in which} }; "
                          "call kernel_variants.bind again for other values")

    return error


def _with(args: tuple[Any, ...], subs: tuple[tuple[int, Any], ...]) -> tuple[Any, ...]:
    """``args`` with the normalised values of ``subs`` in place."""
    if not subs:
        return args
    out = list(args)
    for i, value in subs:
        out[i] = value
    return tuple(out)


def _bound_out(spec: OpSpec, vid: str, fn: Callable[..., Any], caps: Any, subs: tuple[tuple[int, Any], ...],
               rule: Callable[[tuple[Any, ...]], Any] | None) -> Callable[[tuple[Any, ...], Any], Any]:
    """A bound call with ``out``: ``out`` checked against the call (and for overlap) each time."""

    def run(args: tuple[Any, ...], out: Any) -> Any:
        spec.check_out(args, out)
        aliased = guard_writes(spec, args, out)
        direct = caps.takes_out and all(o.is_contiguous() for o in spec.out_tensors(out))
        args = _with(args, subs)
        if rule is not None:
            args = rule(args)
        try:
            return _out_runner(spec, direct, caps.in_place)(fn, args, out, aliased)
        except Exception as exc:
            raise variant_failed(spec, vid, exc) from exc

    return run
