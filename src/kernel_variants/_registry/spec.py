"""An op, declared once: what the core needs to validate, key, dispatch, verify and calibrate it.

Everything specific to an op family lives in its own module, which builds an :class:`OpSpec`
per public op and registers it through the ``kv_register_ops`` hook. The registry, the
dispatcher, the calibration table, ``kv`` and the conformance suite know no op by name: they
work from these specs.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kernel_variants._codegen import define
from kernel_variants._registry.case import Case, Sweep
from kernel_variants._registry.keys import (
    AUTOGRAD,
    CAPTURE,
    CallKey,
    Features,
    KeyParts,
    Shape,
    device_index,
)
from kernel_variants._registry.models import Capabilities, Variant, check_id

if TYPE_CHECKING:
    import torch


def _compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()


@dataclass(frozen=True, eq=False)
class OpSpec:
    """The declaration of one public op.

    - ``signature``: the op's public function (it returns its entry's answer, see
      ``make_op``), whose parameters, defaults and annotations ``explain``'s binding, the memo
      signature and the ``torch.library`` schema are derived from.
    - ``axes``: names of the dispatch key's shape axes (``("B", "D", "L")``), ``check`` returns
      them in this order. ``axis_aliases``: the CSV column names each axis may have, in order
      of preference (default: the axis name).
    - ``features``: the op's group flags (a :class:`Features` model). ``capabilities``: the
      op's capabilities model (a :class:`Capabilities` subclass, or the base).
    - ``check(*args, values)``: validate a call given in signature order and return its key's
      parts (device type, dtype name, features, shape, extra); raise ``TypeError``/``ValueError``
      naming the argument. With ``values`` it also checks the index tensors' values.
    - ``value_checks(*args)``: optional (None: the op reads no index values); for a call whose
      metadata passed, the function ``checks(args)`` that checks the index values of every call
      with the same memo signature (args in signature order; raise ``ValueError`` naming the
      argument), or None when such calls have nothing to read. Made once per signature, so it
      may rely on the call's shapes, dtypes, devices and non-tensor arguments: a memoised call
      then pays only for reading its indices. ``check`` with ``values`` runs the same checks.
    - ``device_rule(capabilities, *args)``: optional; off the CPU, unless KV_CHECK_VALUES says
      otherwise, it replaces ``value_checks``: for a call whose metadata passed and the chosen
      variant's ``capabilities``, the function ``rule(args) -> args`` (a tuple in signature
      order) that makes bad index values harmless with device ops (no sync) and counts them for
      ``kv.check_errors()``, on every call with the same memo signature; or None when such
      calls need no rule (nothing to check, or a variant whose kernel checks and counts itself),
      so that they pay nothing for it. It is planned from the caller's arguments; ``rule``
      receives them normalised (below) and must return a tuple of the same length (else a
      TypeError, on every call path). Its errors reach the caller as raised, not as the
      variant's ``VariantFailed``.
    - ``normalize``: per non-tensor parameter, the value variants receive (``"swish"`` ->
      ``"silu"``); applied once per memoised signature.
    - ``reference``: the oracle, registered as the variant ``reference`` (never blockable).
    - ``make_case(shape, *, dtype, device, seed, **options)``: a realistic call; ``options``
      are feature fields and the op's own case variations. ``conformance(caps)`` yields
      ``(label, options)`` for the suite to try (it keeps those ``caps`` cover).
    - ``edge_cases``: the op's named edge cases, as ``make_case`` options (a ``shape`` among
      them): qualification builds each at the features of the class it qualifies (empty: the
      ``conformance`` list serves). ``check_options``: the ``make_case`` options that put the
      op's traps (pad slots, poisoned rows) into the check a calibration runs at each shape.
    - ``sweeps``: named shape lists; ``default_sweep`` is calibrated when none is named.
    - ``mutates``: parameters written in place; ``outputs``: names of the returned tensors.
      ``written_within_tolerance``: what the op writes in place is computed (a scan's state),
      so a variant's written values are judged within the dtype's tolerance, as outputs are;
      the elements the reference leaves as they were must still be so bit for bit. Otherwise
      (a conv's state rows, copies of inputs) they must equal the reference's bit for bit.
    - ``out``: every op takes a keyword-only ``out=None``, its last parameter (added to the
      signature where a function does not declare it): one tensor, or with several outputs a tuple of one tensor
      per output, each with the shape, dtype and device of the parameter ``out_like`` (default:
      the first tensor parameter). ``out_aliases`` maps an output to the input its ``out`` may
      be exactly (``{"out": "x"}``: in place over x); any other overlap is refused.
    """

    name: str
    signature: Callable[..., Any]
    axes: tuple[str, ...]
    features: type[Features]
    capabilities: type[Capabilities]
    check: Callable[..., KeyParts]
    reference: Variant
    make_case: Callable[..., Case]
    conformance: Callable[[Capabilities], Iterable[tuple[str, dict[str, Any]]]]
    sweeps: Mapping[str, Sweep] = field(default_factory=dict)
    default_sweep: str | None = None
    normalize: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    mutates: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ("out",)
    axis_aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    description: str = ""
    value_checks: Callable[..., Callable[[Sequence[Any]], None] | None] | None = None
    device_rule: Callable[..., Callable[[Sequence[Any]], tuple[Any, ...]] | None] | None = None
    out_like: str | None = None
    out_aliases: Mapping[str, str] = field(default_factory=dict)
    edge_cases: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    check_options: Mapping[str, Any] = field(default_factory=dict)
    written_within_tolerance: bool = False

    def __post_init__(self) -> None:
        check_id(self.name, "op name")
        sig = public = inspect.signature(self.signature)
        if "out" in sig.parameters:  # the op's public function itself: its ``out`` is the core's
            p = sig.parameters["out"]
            if list(sig.parameters)[-1] != "out" or p.kind is not p.KEYWORD_ONLY or p.default is not None:
                raise ValueError(f"op {self.name}: 'out' must be the last parameter, keyword-only, default None")
            sig = sig.replace(parameters=list(sig.parameters.values())[:-1])
        else:
            public = _with_out(sig, len(self.outputs))
        object.__setattr__(self, "_sig", sig)
        params = list(sig.parameters.values())
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            raise ValueError(f"op {self.name}: the signature must name every parameter (no *args/**kwargs)")
        for name in (*self.mutates, *self.normalize, *self.out_aliases.values(), *filter(None, [self.out_like])):
            if name not in sig.parameters:
                raise ValueError(f"op {self.name}: {name!r} is not a parameter of its signature")
        for name in self.out_aliases:
            if name not in self.outputs:
                raise ValueError(f"op {self.name}: out_aliases names {name!r}, which is not one of its outputs")
        object.__setattr__(self, "_public_sig", public)
        if self.reference.id != "reference" or self.reference.op != self.name:
            raise ValueError(f"op {self.name}: the reference must be registered as variant 'reference' of this op")
        if not isinstance(self.reference.capabilities, self.capabilities):
            raise ValueError(f"op {self.name}: the reference's capabilities must be a {self.capabilities.__name__}")
        for sweep in self.sweeps.values():
            if sweep.op != self.name or any(len(s) != len(self.axes) for s in sweep.shapes):
                raise ValueError(f"op {self.name}: sweep {sweep.name!r} has another op or shapes of another length")
        if self.default_sweep is not None and self.default_sweep not in self.sweeps:
            raise ValueError(f"op {self.name}: default_sweep {self.default_sweep!r} is not one of its sweeps")

    @functools.cached_property  # read on every call the Python path serves
    def params(self) -> tuple[str, ...]:
        """Every parameter name, in signature order."""
        return tuple(self._sig.parameters)

    @functools.cached_property
    def positional(self) -> tuple[str, ...]:
        """The parameters a call may pass by position (the rest are keyword-only)."""
        return tuple(n for n, p in self._sig.parameters.items()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))

    @property
    def py_signature(self) -> inspect.Signature:
        """The public function's signature: the op's parameters, then keyword-only ``out``."""
        return self._public_sig

    @functools.cached_property
    def out_like_index(self) -> int:
        """The parameter whose shape, dtype and device each output has."""
        return self.params.index(self.out_like) if self.out_like is not None else self.tensor_indices[0]

    @functools.cached_property
    def out_alias_indices(self) -> tuple[int | None, ...]:
        """Per output, the index of the input its ``out`` may be exactly (None: no input)."""
        return tuple(self.params.index(self.out_aliases[n]) if n in self.out_aliases else None
                     for n in self.outputs)

    def out_tensors(self, out: Any) -> tuple[Any, ...]:
        """``out`` as a tuple of one tensor per output (a single output's ``out`` is one tensor)."""
        return (out,) if len(self.outputs) == 1 else tuple(out)

    def check_out(self, args: Sequence[Any], out: Any) -> None:
        """``out`` must hold one tensor per output with the result's shape, dtype and device;
        ``TypeError``/``ValueError`` naming ``out`` otherwise."""
        import torch

        n = len(self.outputs)
        if n > 1 and (not isinstance(out, tuple | list) or len(out) != n):
            got = f"{type(out).__name__} of {len(out)}" if isinstance(out, tuple | list) else type(out).__name__
            raise TypeError(f"out: expected a tuple of {n} tensors ({', '.join(self.outputs)}), got {got}")
        like = args[self.out_like_index]
        for k, o in enumerate(self.out_tensors(out)):
            name = "out" if n == 1 else f"out[{k}] ({self.outputs[k]})"
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor, got {type(o).__name__}")
            if o.shape != like.shape:
                raise ValueError(f"{name}: expected shape {list(like.shape)} (the result's), got {list(o.shape)}")
            if o.dtype != like.dtype:
                raise TypeError(f"{name}: expected dtype {str(like.dtype)[6:]} (the result's), got {str(o.dtype)[6:]}")
            if o.device != like.device:
                raise ValueError(f"{name}: expected device {like.device} (the result's), got {o.device}")
            if o.requires_grad and torch.is_grad_enabled():
                # A kernel that takes out writes it through its data pointer: nothing is recorded.
                raise ValueError(f"{name}: expected a tensor that does not require grad (what is written "
                                 "into out is not recorded for autograd), got one that does")

    @functools.cached_property
    def out_key(self) -> Callable[[Any], tuple[Any, ...]]:
        """``out_key(out)``: the part of a memo signature that ``out`` adds: each out tensor's
        shape, dtype, device, contiguity (a kernel that takes ``out`` writes a dense one) and
        whether it requires grad while grad mode is on (refused then)."""
        import torch

        grad = torch.is_grad_enabled
        if len(self.outputs) == 1:
            return lambda o: (o.shape, o.dtype, o.device, o.is_contiguous(), o.requires_grad and grad())
        n = len(self.outputs)
        return lambda out: (type(out), len(out), *((o.shape, o.dtype, o.device, o.is_contiguous(),
                                                     o.requires_grad and grad()) for o in out[:n]))

    @functools.cached_property
    def _tensor_params(self) -> tuple[tuple[int, bool], ...]:
        """(index, optional) of each parameter annotated as a tensor."""
        import torch

        hints = typing.get_type_hints(self.signature)
        out = []
        for i, name in enumerate(self.params):
            hint = hints.get(name)
            if hint is torch.Tensor:
                out.append((i, False))
            elif hint == torch.Tensor | None or hint == typing.Optional[torch.Tensor]:  # noqa: UP045
                out.append((i, True))
        return tuple(out)

    @functools.cached_property
    def tensor_indices(self) -> tuple[int, ...]:
        return tuple(i for i, _ in self._tensor_params)

    @functools.cached_property
    def mutated_indices(self) -> tuple[int, ...]:
        return tuple(self.params.index(n) for n in self.mutates)

    @functools.cached_property
    def memo_key(self) -> Callable[[Sequence[Any], Any], tuple[Any, ...]]:
        """``memo_key(args, pins)``: what a memoised decision and metadata check depend on: the
        pins in force, each tensor's shape, dtype and device (and strides, for the tensors the op
        mutates, whose layout decides which variants can write them), whether the call needs
        autograd, and every other argument with its type (``1.0 == 1 == True`` would share an
        entry otherwise). Generated from the signature's annotations, so a call builds it without
        a loop; a non-tensor passed where a tensor is declared raises ``AttributeError``, and the
        call is then validated unmemoised."""
        import torch

        tensors = dict(self._tensor_params)
        names = [f"a{i}" for i in range(len(self.params))]
        first = names[self.tensor_indices[0]]
        # Inline, short-circuiting on grad mode: serving runs under no_grad/inference_mode.
        grads = " or ".join(f"({names[i]} is not None and {names[i]}.requires_grad)" if opt
                            else f"{names[i]}.requires_grad" for i, opt in self._tensor_params)
        # The first tensor's device is read once: it is part of the key and says whether a graph
        # capture can be under way (never on the CPU: no lookup there; is_cpu is read because
        # device.type builds a new string, 4x the cost).
        parts = ["self", f"(_grad_enabled() and ({grads}))", f"(not {first}.is_cpu and _capturing(_d.type))"]
        for i, name in enumerate(self.params):
            a = names[i]
            device = "_d" if a == first else f"{a}.device"
            meta = f"{a}.shape, {a}.dtype, {device}" + (f", {a}.stride()" if name in self.mutates else "")
            if i not in tensors:
                parts.append(f"{a}, type({a})")
            elif tensors[i]:
                parts.append(f"None if {a} is None else ({meta})")
            else:
                parts.append(meta)
        from kernel_variants._capture import capturing

        namespace: dict[str, Any] = {"self": self, "_grad_enabled": torch.is_grad_enabled, "_capturing": capturing}
        src = (f"def memo_key(a, pins):\n    {', '.join(names)}, = a\n    _d = {first}.device\n"
               f"    return (pins, {', '.join(parts)})\n")
        return define("memo_key", src, namespace, what=self.name)

    def needs_grad(self, args: Sequence[Any]) -> bool:
        """Whether the call must give a differentiable output: grad mode on and a tensor argument
        that requires grad."""
        import torch

        if not torch.is_grad_enabled():
            return False
        return any(args[i] is not None and args[i].requires_grad for i in self.tensor_indices)

    @functools.cached_property
    def invoke_out(self) -> Callable[[Callable[..., Any], Sequence[Any], Any], Any]:
        """``invoke_out(fn, args, out)``: as :attr:`invoke`, with ``out=out`` by keyword."""
        pos = set(self.positional)
        call_args = ", ".join(f"a[{i}]" if n in pos else f"{n}=a[{i}]" for i, n in enumerate(self.params))
        return define("invoke_out", f"def invoke_out(fn, a, out):\n    return fn({call_args}, out=out)\n", {},
                      what=self.name)

    @functools.cached_property
    def invoke(self) -> Callable[[Callable[..., Any], Sequence[Any]], Any]:
        """``invoke(fn, args)``: call a variant with ``args`` (signature order) the way the
        signature passes them: positional parameters by position, keyword-only ones by name."""
        pos = set(self.positional)
        call_args = ", ".join(f"a[{i}]" if n in pos else f"{n}=a[{i}]" for i, n in enumerate(self.params))
        return define("invoke", f"def invoke(fn, a):\n    return fn({call_args})\n", {}, what=self.name)

    def bind(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """A call as written -> every argument in signature order, defaults filled in."""
        try:
            bound = self._sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}: {exc}") from None
        bound.apply_defaults()
        return tuple(bound.arguments[n] for n in self.params)

    def key(self, args: Sequence[Any], values: bool) -> CallKey:
        """Validate a call given in signature order and return its key (``extra`` gains
        ``"autograd"`` when the output must be differentiable)."""
        device, dtype, features, shape, extra = self.check(*args, values=values)
        if self.needs_grad(args):
            extra = extra | AUTOGRAD
        index = None
        if device != "cpu":
            from kernel_variants._capture import capturing

            if capturing(device) and not _compiling():
                extra = extra | CAPTURE
            index = device_index(args[self.tensor_indices[0]])
        return CallKey(self, device, dtype, features, shape, extra, index)

    def key_of(self, *args: Any, values: bool = True, **kwargs: Any) -> CallKey:
        """Validate a call given as it would be written and return its key."""
        return self.key(self.bind(*args, **kwargs), values)

    def key_of_case(self, case: Case) -> CallKey:
        return self.key_of(*case.args, **case.kwargs)

    def sweep_case(self, shape: Shape, features: Features, *, dtype: torch.dtype, device: str,
                   seed: int = 0) -> Case:
        """The call a calibration measures for ``shape`` with ``features``."""
        return self.make_case(tuple(shape), dtype=dtype, device=device, seed=seed, **features.model_dump())


def _with_out(sig: inspect.Signature, n_outputs: int) -> inspect.Signature:
    # A string annotation: declaring an op imports no torch.
    hint = "torch.Tensor | None" if n_outputs == 1 else f"tuple[{', '.join(['torch.Tensor'] * n_outputs)}] | None"
    out = inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hint)
    return sig.replace(parameters=[*sig.parameters.values(), out])
