"""The caller's tools around one op: ``explain`` (the decision for a call, with every variant's
fate), ``call_key`` and ``bind`` (the chosen variant as a function of the op's signature, for a
loop whose shapes do not change)."""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kernel_variants._capture import capturing
from kernel_variants._codegen import define
from kernel_variants._policy import Decision
from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime import call as _call
from kernel_variants._runtime import callcore
from kernel_variants._runtime.call import finish, out_runner, run_rule, with_subs
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._runtime.errors import (
    capture_error,
    changed_error,
    unlike_error,
    variant_failed,
)
from kernel_variants._runtime.guards import guard_writes, write_plan


def explain(op_name: str, *args: object, **kwargs: object) -> Decision:
    """The decision the dispatcher makes for this call, with every variant's verdict and reason.

    Takes the op's arguments exactly as the op would (``out=`` included: checked, never written;
    it changes no decision); runs nothing. ``print()`` it for a trace.
    """
    d = dispatcher()
    spec = d.registry.spec(op_name)
    out = kwargs.pop("out", None)
    bound = spec.bind(*args, **kwargs)
    key = spec.key(bound, d.check_values or _call.on_cpu(spec, bound))
    if out is not None:
        spec.check_out(bound, out)
    return d.decide(key, d.pinned(spec.name), tune=False, qualify=False)


def call_key(op_name: str, *args: object, **kwargs: object):
    """Validate a call to ``op_name`` given as it would be written, and return its key."""
    d = dispatcher()
    kwargs.pop("out", None)
    spec = d.registry.spec(op_name)
    bound = spec.bind(*args, **kwargs)
    return spec.key(bound, d.check_values or _call.on_cpu(spec, bound))


class BoundOp(Protocol):
    """What :func:`bind` returns: the op's public signature, calling one variant directly."""

    op: str
    variant: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def bind(op: str | Callable[..., Any], *example_args: Any, **example_kwargs: Any) -> BoundOp:
    """The variant the dispatcher chooses for this example call, as a function with the op's
    signature, for a loop whose shapes do not change.

    The example (``out=`` included) is validated and decided once, as the op would. Each call of
    the result checks that it is a call of the same kind, then what can change without that:
    every tensor like the example's (shape, dtype, device; strides of a tensor the op writes;
    None where the example had None) and no gradient needed where the example needed none
    (``TypeError`` for a dtype or None, ``ValueError`` otherwise: the variant qualified and was
    chosen for the example's class and shape, and may not even support another), every
    non-tensor argument equal to the example's (``ValueError``), index values where the op
    checks them (always on the CPU; on accelerators when ``KV_CHECK_VALUES`` is on; against the
    example's sizes), no overlap with a tensor the op writes, and a given ``out`` (its shape,
    dtype, device and overlap). On a CUDA or NPU device, a variant not declared ``graph_safe``
    refuses a call made while a graph is captured (``ValueError``: bind inside the capture). The
    choice is fixed: calibration, ``force`` or ``reload`` after ``bind`` do not change it (bind
    again). ``op`` is the op's name or its public function; ``.variant`` says what runs.
    Where the compiled call core is built, the result is usually a C object that behaves as this
    function (and hands it every call it does not run itself, which this function runs or refuses
    with its message: ``out=``, a changed value or tensor, a bad index, an overlap); a Python
    function where the variant must check for a graph capture on each call.
    """
    d = dispatcher()
    name = op if isinstance(op, str) else getattr(op, "__name__", None)
    if not isinstance(name, str):
        raise TypeError(f"op: expected an op name or an op function, got {type(op).__name__}")
    spec = d.registry.spec(name)
    out = example_kwargs.pop("out", None)
    args = spec.bind(*example_args, **example_kwargs)
    values = d.check_values or _call.on_cpu(spec, args)
    key = spec.key(args, values)
    if out is not None:
        spec.check_out(args, out)
    hit = d.resolve(None, key, args, finish(spec, args, None, values))
    vid, fn, subs, checks, rule = hit.vid, hit.fn, hit.subs, hit.checks, hit.rule
    guard_writes(spec, args, out)
    guard = write_plan(spec, args, None)
    grad = spec.needs_grad(args)
    caps = d.registry.get(spec.name, vid).variant.capabilities
    # Captured into a CUDA/NPU graph, the op chooses among graph_safe variants only: a bound
    # variant that is not must see each call's capture state (which the C object does not read).
    capture = _capturable(key.device) and not caps.graph_safe
    tensors = set(spec.tensor_indices)
    fixed = [i for i in range(len(spec.params)) if i not in tensors]
    normalized = dict(subs)
    namespace: dict[str, Any] = {
        "_with": with_subs, "_fn": fn, "_check_values": checks, "_changed": _changed(spec, fixed, tuple(args[i] for i in fixed)),
        "_out": _bound_out(spec, vid, fn, caps, subs, rule), "_variant_failed": variant_failed, "_spec": spec,
        "_vid": vid, "_rule": rule, "_run_rule": run_rule, "_invoke": spec.invoke, "_subs": subs, "_guard": guard,
        "_unlike": _unlike(spec, args, grad), "_grad_enabled": torch.is_grad_enabled,
        "_capturing": _capturing(key.device), "_capture_error": lambda: capture_error(spec, vid, key.device),
    }
    like = _like_source(spec, args, grad, namespace)
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
    # A value of another type is another call (the memo key holds each value's type): -1.0 for -1.
    namespace.update({f"_f{k}": args[i] for k, i in enumerate(fixed)})
    namespace.update({f"_ft{k}": type(args[i]) for k, i in enumerate(fixed)})
    differs = " or ".join(f"type({spec.params[i]}) is not _ft{k} or {spec.params[i]} != _f{k}"
                          for k, i in enumerate(fixed)) or "False"
    # The op's device rule runs before the variant's try, as on every other path: its failure is
    # not the variant's.
    ruled = f"    _a = _run_rule(_rule, _with(({names},), _subs))\n" if rule is not None else ""
    run = "_invoke(_fn, _a)" if rule is not None else f"_fn({', '.join(call_args)})"
    src = (f"def bound({params}):\n"
           f"    if {differs}:\n"
           f"        raise _changed({fixed_src})\n"
           "    try:\n"
           f"        _like_ok = {like}\n"
           "    except AttributeError:  # not a tensor where the example had one\n"
           "        _like_ok = False\n"
           "    if not _like_ok:\n"
           f"        raise _unlike(({names},))\n"
           + ("    if _capturing():\n        raise _capture_error()\n" if capture else "")
           + (f"    _check_values(({names},))\n" if checks is not None else "")
           + "    if out is not None:\n"
           f"        return _out(({names},), out)\n"
           + (f"    _guard(({names},), None)\n" if guard is not None else "")
           + ruled
           + "    try:\n"
           f"        return {run}\n"
           "    except Exception as exc:\n"
           "        raise _variant_failed(_spec, _vid, exc) from exc\n")
    bound = define("bound", src, namespace, what=spec.name)
    # The same in C where the call core is built: this function then serves only what the C
    # object hands it, running it or raising with its messages.
    fast = None if capture else callcore.bound(
        spec, bound, vid, fn, subs, checks, rule, fixed, tuple(args[i] for i in fixed), tuple(args), grad,
        () if guard is None else guard.declared.writes)
    for made in (bound, fast) if fast is not None else (bound,):
        made.__doc__ = f"{spec.name}, bound to variant {vid!r} for calls shaped like the example (kernel_variants.bind)."
        made.__qualname__ = made.__name__ = f"{spec.name}_bound"
        made.__signature__ = spec.py_signature
        made.op, made.variant = spec.name, vid
    return fast if fast is not None else bound


def grad_source(spec: OpSpec) -> str:
    """An expression: whether a tensor argument requires grad (by parameter name)."""
    hints = typing.get_type_hints(spec.signature)
    parts = []
    for i in spec.tensor_indices:
        name = spec.params[i]
        parts.append(f"{name}.requires_grad" if hints[name] is torch.Tensor
                     else f"({name} is not None and {name}.requires_grad)")
    return " or ".join(parts)


def _like_source(spec: OpSpec, example: tuple[Any, ...], grad: bool, namespace: dict[str, Any]) -> str:
    """An expression: whether a call's tensors are like the example's (what the compiled bound
    object compares as the memo key's words), and it needs a gradient only if the example did."""
    parts = []
    for i in spec.tensor_indices:
        name, a = spec.params[i], example[i]
        if a is None:
            parts.append(f"{name} is None")
            continue
        namespace.update({f"_s{i}": a.shape, f"_t{i}": a.dtype, f"_v{i}": a.device})
        part = f"{name} is not None and {name}.shape == _s{i} and {name}.dtype is _t{i} and {name}.device == _v{i}"
        if i in spec.mutated_indices:
            namespace[f"_st{i}"] = a.stride()
            part += f" and {name}.stride() == _st{i}"
        parts.append(part)
    if not grad:
        parts.append(f"not (_grad_enabled() and ({grad_source(spec)}))")
    return " and ".join(f"({p})" for p in parts) or "True"


_Meta = tuple[torch.Size, torch.dtype, torch.device, tuple[int, ...]]


def _meta(t: Any) -> _Meta | None:
    """What a bound call compares of a tensor (None for anything else)."""
    return (t.shape, t.dtype, t.device, t.stride()) if isinstance(t, torch.Tensor) else None


def _describe(t: Any, meta: _Meta | None, strides: bool) -> str:
    if meta is None:
        return "None" if t is None else f"a {type(t).__name__}"
    shape, dtype, device, stride = meta
    where = f" with strides {list(stride)}" if strides else ""
    return f"a {list(shape)} {str(dtype)[6:]} tensor on {device}{where}"


def _unlike(spec: OpSpec, example: tuple[Any, ...], grad: bool) -> Callable[[tuple[Any, ...]], Exception]:
    """``unlike(args)``: the error of a bound call whose tensors are not like the example's. Keeps
    the example's metadata, not its tensors (a throw-away example's pool is freed)."""
    metas = {i: _meta(example[i]) for i in spec.tensor_indices}

    def unlike(got: tuple[Any, ...]) -> Exception:
        for i, e in metas.items():
            g = _meta(got[i])
            written = i in spec.mutated_indices
            if (e is None) != (g is None) or (g is None and got[i] is not None):
                return unlike_error(spec.params[i], _describe(None, e, False), _describe(got[i], g, False),
                                    type_error=True)
            if e is not None and g is not None and (e[:3] != g[:3] or (written and e[3] != g[3])):
                return unlike_error(spec.params[i], _describe(None, e, written), _describe(got[i], g, written),
                                    type_error=e[1] != g[1])
        needing = [spec.params[i] for i in metas if got[i] is not None and got[i].requires_grad]
        return unlike_error(", ".join(needing), "no tensor that requires grad in grad mode (the example's call "
                            "needed no gradient)", "one that does", type_error=False)

    return unlike


def _capturable(device: str) -> bool:
    """Whether calls on ``device`` can be captured into a graph (what ``capturing`` can say yes to)."""
    return device in ("cuda", "npu")


def _capturing(device: str) -> Callable[[], bool]:
    """Whether a CUDA/NPU graph is being captured on ``device`` now (what the op's key asks)."""
    return lambda: capturing(device) and not torch.compiler.is_compiling()


def _changed(spec: OpSpec, fixed: list[int], expected: tuple[Any, ...]) -> Callable[[tuple[Any, ...]], ValueError]:
    names = [spec.params[i] for i in fixed]
    return lambda got: changed_error(names, expected, got)


def _bound_out(spec: OpSpec, vid: str, fn: Callable[..., Any], caps: Any, subs: tuple[tuple[int, Any], ...],
               rule: Callable[[tuple[Any, ...]], Any] | None) -> Callable[[tuple[Any, ...], Any], Any]:
    """A bound call with ``out``: ``out`` checked against the call (and for overlap) each time."""

    def run(args: tuple[Any, ...], out: Any) -> Any:
        spec.check_out(args, out)
        aliased = guard_writes(spec, args, out)
        direct = caps.takes_out and all(o.is_contiguous() for o in spec.out_tensors(out))
        args = with_subs(args, subs)
        if rule is not None:
            args = run_rule(rule, args)
        try:
            return out_runner(spec, direct, caps.in_place)(fn, args, out, aliased)
        except Exception as exc:
            raise variant_failed(spec, vid, exc) from exc

    return run


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
