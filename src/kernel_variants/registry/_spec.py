"""An op, declared once: what the core needs to validate, key, dispatch, verify and calibrate it.

Everything specific to an op family lives in its own module, which builds an :class:`OpSpec`
per public op and registers it through the ``kv_register_ops`` hook. The registry, the
dispatcher, the calibration table, ``kv`` and the conformance suite know no op by name: they
work from these specs.
"""

from __future__ import annotations

import csv
import functools
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import BaseModel, ConfigDict

from ._models import Capabilities, Variant, check_id

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]
AUTOGRAD = frozenset({"autograd"})  # a CallKey extra: some input requires grad, and grad mode is on
CAPTURE = frozenset({"capture"})  # a CallKey extra: a CUDA/NPU graph is being captured


def device_index(t: Any) -> int | None:
    """The ordinal of the device ``t`` is on (``cuda:1`` -> 1), None on the CPU."""
    return getattr(t.device, "index", None)


def _compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()
# What an op's check returns: (device type, dtype name, features, shape, extra); the core adds the spec.
KeyParts = tuple[str, str, "Features", Shape, frozenset[str]]


class Features(BaseModel):
    """Base of an op's *group* flags: the parts of a call other than its shape that change which
    variants can run it or how fast (a width, a bias, an activation). Timings are compared only
    within a group. Field defaults are what a calibration measures unless told otherwise."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class CallKey(NamedTuple):
    """Everything about a call that decides which variants can run it and which is fastest.

    ``extra`` holds properties that decide whether a variant can run the call but not how fast
    it is (so they do not split calibration groups), such as a strided state pool.
    ``device`` is the device type (what capabilities and table rows are keyed by); ``index`` the
    ordinal of the device the call's tensors are on (None on the CPU, or where unknown), so that
    each GPU of a process is fingerprinted as itself: two models are two sets of rows, two of one
    model share theirs.
    """

    spec: OpSpec
    device: str
    dtype: str
    features: Features
    shape: Shape
    extra: frozenset[str] = frozenset()
    index: int | None = None

    @property
    def op(self) -> str:
        return self.spec.name

    @property
    def where(self) -> str:
        """The device as torch names it: ``"cpu"``, ``"cuda:1"``."""
        return self.device if self.index is None else f"{self.device}:{self.index}"

    def describe(self) -> str:
        dims = ", ".join(f"{a}={v}" for a, v in zip(self.spec.axes, self.shape, strict=True))
        flags = " ".join(f"{k}={v}" for k, v in self.features.model_dump().items())
        more = "".join(f" {e}" for e in sorted(self.extra))
        return f"{self.op} on {self.where} {self.dtype} ({dims}) {flags}{more}".rstrip()


@dataclass(frozen=True)
class Sweep:
    """Named shapes of one op, measured with ``features`` (overrides of the feature defaults)."""

    name: str
    op: str
    shapes: tuple[Shape, ...]
    features: Mapping[str, Any] = field(default_factory=dict)
    description: str = field(default="", compare=False)


@dataclass
class Case:
    """One realistic call of an op, replayable on fresh copies of the tensors it mutates.

    ``args``/``kwargs`` are the call as written; ``bases`` maps each mutated parameter to the
    allocation its tensor is a view of, so a fresh copy keeps the view's strides and offset.
    """

    spec: OpSpec
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    bases: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def op(self) -> str:
        return self.spec.name

    def _where(self, name: str) -> int | None:
        pos = self.spec.positional
        return pos.index(name) if name in pos and pos.index(name) < len(self.args) else None

    def get(self, name: str) -> Any:
        """The argument ``name`` as the call passes it (``None`` when left to its default)."""
        i = self._where(name)
        return self.args[i] if i is not None else self.kwargs.get(name)

    def fresh(self) -> Case:
        """The same call with fresh copies of the mutated tensors, with the same strides and offset."""
        if not self.bases:
            return self
        args, kwargs, bases = list(self.args), dict(self.kwargs), {}
        for name, base in self.bases.items():
            view = self.get(name)
            bases[name] = copy = base.clone(memory_format=_contiguous())
            new = copy.as_strided(view.size(), view.stride(), view.storage_offset())
            i = self._where(name)
            if i is not None:
                args[i] = new
            else:
                kwargs[name] = new
        return Case(self.spec, tuple(args), kwargs, bases)

    def state(self) -> torch.Tensor | None:
        """The (first) mutated tensor, as the call sees it."""
        return next((self.get(n) for n in self.bases), None)

    @property
    def pool_base(self) -> torch.Tensor | None:
        return next(iter(self.bases.values()), None)

    def run(self, fn: Callable[..., Any]) -> tuple[Any, dict[str, torch.Tensor]]:
        """Call ``fn`` on a fresh copy; return (its result, each mutated allocation after the call)."""
        case = self.fresh()
        return fn(*case.args, **case.kwargs), case.bases


def _contiguous():
    import torch  # the registry itself imports no torch: plugins declare before anything runs

    return torch.contiguous_format


@dataclass(frozen=True, eq=False)
class OpSpec:
    """The declaration of one public op.

    - ``signature``: a function whose parameters, defaults, annotations and docstring are the
      op's (its body is never called). The public function, ``explain``'s binding, the memo
      signature and the ``torch.library`` schema are all derived from it.
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
    - ``device_values(args, capabilities) -> args``: optional; off the CPU, unless
      KV_CHECK_VALUES says otherwise, replaces the host value checks: makes bad index values
      harmless with device ops (no sync) for the chosen variant (``capabilities``), counting them
      for ``kv.check_errors()``.
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
    - ``out``: every op takes a keyword-only ``out=`` that the core adds to the public signature
      (the stub must not declare it): one tensor, or with several outputs a tuple of one tensor
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
    device_values: Callable[[Sequence[Any], Capabilities], Sequence[Any]] | None = None
    out_like: str | None = None
    out_aliases: Mapping[str, str] = field(default_factory=dict)
    edge_cases: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    check_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_id(self.name, "op name")
        sig = inspect.signature(self.signature)
        object.__setattr__(self, "_sig", sig)
        params = list(sig.parameters.values())
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            raise ValueError(f"op {self.name}: the signature must name every parameter (no *args/**kwargs)")
        for name in (*self.mutates, *self.normalize, *self.out_aliases.values(), *filter(None, [self.out_like])):
            if name not in sig.parameters:
                raise ValueError(f"op {self.name}: {name!r} is not a parameter of its signature")
        if "out" in sig.parameters:
            raise ValueError(f"op {self.name}: the signature must not declare 'out': the core adds it to every op")
        for name in self.out_aliases:
            if name not in self.outputs:
                raise ValueError(f"op {self.name}: out_aliases names {name!r}, which is not one of its outputs")
        object.__setattr__(self, "_public_sig", _with_out(sig, len(self.outputs)))
        if self.reference.id != "reference" or self.reference.op != self.name:
            raise ValueError(f"op {self.name}: the reference must be registered as variant 'reference' of this op")
        if not isinstance(self.reference.capabilities, self.capabilities):
            raise ValueError(f"op {self.name}: the reference's capabilities must be a {self.capabilities.__name__}")
        for sweep in self.sweeps.values():
            if sweep.op != self.name or any(len(s) != len(self.axes) for s in sweep.shapes):
                raise ValueError(f"op {self.name}: sweep {sweep.name!r} has another op or shapes of another length")
        if self.default_sweep is not None and self.default_sweep not in self.sweeps:
            raise ValueError(f"op {self.name}: default_sweep {self.default_sweep!r} is not one of its sweeps")

    @property
    def params(self) -> tuple[str, ...]:
        """Every parameter name, in signature order."""
        return tuple(self._sig.parameters)

    @property
    def positional(self) -> tuple[str, ...]:
        """The parameters a call may pass by position (the rest are keyword-only)."""
        return tuple(n for n, p in self._sig.parameters.items()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))

    @property
    def py_signature(self) -> inspect.Signature:
        """The public function's signature: the stub's parameters, then keyword-only ``out``."""
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
        exec(src, namespace)  # noqa: S102 - from the signature
        return namespace["memo_key"]

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
        namespace: dict[str, Any] = {}
        exec(f"def invoke_out(fn, a, out):\n    return fn({call_args}, out=out)\n", namespace)  # noqa: S102
        return namespace["invoke_out"]

    @functools.cached_property
    def invoke(self) -> Callable[[Callable[..., Any], Sequence[Any]], Any]:
        """``invoke(fn, args)``: call a variant with ``args`` (signature order) the way the
        signature passes them: positional parameters by position, keyword-only ones by name."""
        pos = set(self.positional)
        call_args = ", ".join(f"a[{i}]" if n in pos else f"{n}=a[{i}]" for i, n in enumerate(self.params))
        namespace: dict[str, Any] = {}
        exec(f"def invoke(fn, a):\n    return fn({call_args})\n", namespace)  # noqa: S102 - from the signature
        return namespace["invoke"]

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


def read_shapes(header: Sequence[str], rows: Sequence[Mapping[str, str | None]], axes: Sequence[str],
                aliases: Mapping[str, tuple[str, ...]], where: str) -> tuple[list[str], list[Shape]]:
    """(the columns used, the shapes) from CSV rows with a column per axis (named by one of its
    ``aliases``, else by the axis); the first row that does not parse is the error."""
    columns = []
    for axis in axes:
        names = aliases.get(axis, (axis,))
        found = next((n for n in names if n in header), None)
        if found is None:
            raise ValueError(f"{where}: no column {' or '.join(names)} (columns: {', '.join(header)})")
        columns.append(found)
    shapes = []
    for line, row in enumerate(rows, start=2):
        try:
            shape = tuple(int(row[c] or "") for c in columns)
        except (TypeError, ValueError):
            raise ValueError(f"{where}, line {line}: expected integer {', '.join(columns)}, "
                             f"got {[row.get(c) for c in columns]}") from None
        if min(shape) < 1:
            raise ValueError(f"{where}, line {line}: expected positive sizes, got {shape}")
        shapes.append(shape)
    if not shapes:
        raise ValueError(f"{where}: no rows below the header")
    return columns, shapes


def read_csv_rows(path: str | Path) -> tuple[list[str], list[dict[str, str | None]]]:
    """(the header, every row as a dict) of a CSV file; one that is not readable UTF-8 CSV is one
    ValueError."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            return list(reader.fieldnames or []), rows
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path}: not a CSV file ({exc})") from None


def load_sweep_csv(path: str | Path, spec: OpSpec) -> Sweep:
    header, rows = read_csv_rows(path)
    _, shapes = read_shapes(header, rows, spec.axes, spec.axis_aliases, str(path))
    return Sweep(Path(path).stem, spec.name, tuple(shapes))
