"""What a variant declares about itself: frozen pydantic models, unknown fields refused.

:class:`Capabilities` holds what every op shares (devices, dtypes, size limits per named shape
axis); an op whose calls vary in more ways (a convolution width, packed sequences, state pools)
subclasses it in its own module and extends :meth:`Capabilities.uncovered`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from kernel_variants._registry.keys import CallKey

DeviceType = Literal["cpu", "cuda", "npu"]
DTypeName = Literal["float32", "bfloat16", "float16", "float64"]
Range = tuple[int, int | None]

_ID = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")
ID_RULE = "lowercase letters, digits, '_', '.', '-' (<= 64, starting with a letter)"


def valid_id(value: str) -> bool:
    """The one rule for op and variant ids: stable lowercase names (they key stored tables)."""
    return isinstance(value, str) and _ID.match(value) is not None


def valid_candidate(name: str) -> bool:
    """A name the table and ``force`` take: a variant id, or ``variant:tactic`` (see ``Variant.tactics``)."""
    return isinstance(name, str) and all(valid_id(part) for part in name.split(":", 1))


def check_id(value: str, what: str) -> str:
    if not valid_id(value):
        raise ValueError(f"{what} must be {ID_RULE}, got {value!r}")
    return value


def in_range(value: int, bounds: Range) -> bool:
    lo, hi = bounds
    return value >= lo and (hi is None or value <= hi)


def format_range(bounds: Range, *, compact: bool = False) -> str:
    """``lo..hi`` (``lo..`` when unbounded); ``compact`` writes a single value once."""
    lo, hi = bounds
    if hi is None:
        return f"{lo}.."
    return str(lo) if compact and lo == hi else f"{lo}..{hi}"


def _ordered(v: Range) -> Range:
    lo, hi = v
    if lo < 0 or (hi is not None and hi < lo):
        raise ValueError(f"range must satisfy 0 <= lo <= hi, got {v}")
    return v


class Capabilities(BaseModel):
    """The calls a variant can run. The dispatcher never sends it a call outside these.

    ``limits`` bounds the op's named shape axes (``{"D": (16, None)}``), inclusive; a ``None``
    upper bound means unbounded. An op's own capabilities model adds its fields and extends
    :meth:`uncovered`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    devices: frozenset[DeviceType]
    dtypes: frozenset[DTypeName]
    limits: Mapping[str, Range] = Field(default_factory=dict)
    # A shape axis the kernel takes only in multiples of a size ({"D": 32}: vendor kernels that
    # vectorise over whole blocks of channels). Qualification builds its cases at such sizes.
    multiple_of: Mapping[str, int] = Field(default_factory=dict)
    # Its outputs carry correct gradients (to every differentiable input) when inputs require
    # grad. A call that needs grad goes only to variants that say so, never to a detached output.
    autograd: bool = False
    # Safe inside a CUDA/NPU graph capture: no host synchronisation (no .item(), .tolist(),
    # nonzero() or boolean-mask indexing), no allocation a replay would not repeat. Under
    # capture the dispatcher chooses only among variants that say so.
    graph_safe: bool = False
    # Its fn accepts keyword ``out=`` (one dense tensor, or one per output, of the result's shape,
    # dtype and device) and writes the result there. Without it, a call with ``out=`` runs the
    # variant as usual and the dispatcher copies the result into ``out``: no variant is
    # excluded by ``out=``, this only spares the copy.
    takes_out: bool = False
    # With takes_out: it is also correct when ``out`` is exactly the input the op lets it alias
    # (``x``: in place). Without it, such a call is computed apart and copied into ``out``.
    in_place: bool = False

    @model_validator(mode="after")
    def _in_place_takes_out(self) -> Capabilities:
        if self.in_place and not self.takes_out:
            raise ValueError("in_place is set but takes_out is False: in place means writing out=x")
        return self

    @field_validator("limits")
    @classmethod
    def _limits_ordered(cls, v: Mapping[str, Range]) -> Mapping[str, Range]:
        for bounds in v.values():
            _ordered(bounds)
        return v

    @field_validator("multiple_of")
    @classmethod
    def _positive_steps(cls, v: Mapping[str, int]) -> Mapping[str, int]:
        for axis, step in v.items():
            if isinstance(step, bool) or not isinstance(step, int) or step < 1:
                raise ValueError(f"multiple_of[{axis!r}] must be a positive int, got {step!r}")
        return v

    def uncovered(self, key: CallKey) -> str | None:
        """Why these capabilities do not cover the call ``key``, or ``None`` when they do."""
        if key.device not in self.devices:
            return f"device {key.device} not in {sorted(self.devices)}"
        if key.dtype not in self.dtypes:
            return f"dtype {key.dtype} not in {sorted(self.dtypes)}"
        if "autograd" in key.extra and not self.autograd:
            return "no autograd support (an input requires grad)"
        if "capture" in key.extra and not self.graph_safe:
            return "not declared graph_safe (a CUDA/NPU graph is being captured)"
        for axis, value in zip(key.spec.axes, key.shape, strict=True):
            bounds = self.limits.get(axis)
            if bounds is not None and not in_range(value, bounds):
                return f"{axis}={value} outside {format_range(bounds)}"
            step = self.multiple_of.get(axis)
            if step is not None and value % step:
                return f"{axis}={value} not a multiple of {step}"
        return None

    def fit(self, axes: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """``shape`` moved to the nearest sizes these limits accept (each axis rounded up to its
        ``multiple_of``, then into its range), or None when no size of some axis fits. A zero
        size stays zero: an empty call is a case of its own."""
        out = []
        for axis, value in zip(axes, shape, strict=True):
            lo, hi = self.limits.get(axis, (0, None))
            step = self.multiple_of.get(axis, 1)
            if value:
                value = max(value, lo)
                value = -(-value // step) * step
                if hi is not None and value > hi:
                    value = hi // step * step
                    if value < max(lo, 1):
                        return None
            out.append(value)
        return tuple(out)

    def summary(self) -> str:
        """The op-specific part, short, for ``kv list``: limits and whatever the subclass adds."""
        parts = [f"{axis}={format_range(b, compact=True)}" for axis, b in self.limits.items()]
        parts += [f"{axis}%{step}" for axis, step in self.multiple_of.items()]
        for name in type(self).model_fields:
            if name in ("devices", "dtypes", "limits", "multiple_of"):
                continue
            value = getattr(self, name)
            if value is True:
                parts.append(name)
            elif isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int | None) for v in value):
                parts.append(f"{name}={format_range(value, compact=True)}")
            elif isinstance(value, frozenset):
                parts.append(f"{name}={'+'.join(sorted(map(str, value)))}")
        return ",".join(parts)


DEPENDS_HELP = """\
What a variant's speed depends on beyond its own source (``Variant.depends``):

- a distribution name (``"torch"``, ``"torch_npu"``, ``"causal-conv1d"``...): its installed
  version, read from package metadata (``"absent"`` when it is not installed);
- ``"triton"``: the first of triton, pytorch-triton, pytorch-triton-rocm installed;
- ``"cann"``: the CANN toolkit release (``$ASCEND_TOOLKIT_HOME/version.cfg``);
- ``"compiler"``: the C++ compiler's version line (``$CXX``, else ``c++``);
- ``"isa"``: the CPU instruction set ATen dispatches to (``torch.backends.cpu.get_cpu_capability()``);
- ``"python"``: the interpreter's version;

or a function returning ``{name: version}`` (for anything else). Undeclared (``None``) means
``("torch",)``; ``()`` declares nothing beyond the variant's source."""


class Variant(BaseModel):
    """One implementation of one op, as a plugin registers it.

    ``fn`` takes exactly the public op's arguments (already validated, and normalised where the
    op says so) and returns what the op returns, updating state tensors in place.
    ``capabilities`` is an instance of the op's capabilities model. ``probe`` returns ``None``
    when the variant can run on this machine, else a one-line reason. ``sources`` lists files
    beyond ``fn``'s own module whose content defines the implementation (a C++ kernel, say):
    their hash is part of the variant's version, so editing one makes its old timings stale.

    A variant compiled on this machine declares ``build`` (compile or load it now; return where
    it went; raise ``RuntimeError`` with the reason on failure) and ``is_built`` (whether that is
    done, without doing it). ``probe`` must then only check that a build is possible: listing
    and explaining never build, the first dispatched call or ``kv build`` does.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    id: str
    op: str
    version: str = Field(min_length=1, max_length=64)
    capabilities: Capabilities
    fn: Callable[..., Any] = Field(exclude=True, repr=False)
    probe: Callable[[], str | None] | None = Field(default=None, exclude=True, repr=False)
    build: Callable[[], str] | None = Field(default=None, exclude=True, repr=False)
    is_built: Callable[[], bool] | None = Field(default=None, exclude=True, repr=False)
    # Which of its code paths runs on this machine, in a word ("avx512-bf16", say), for one whose
    # speed depends on a path chosen at run time; shown by `kv list --wide` and `kv info`, and
    # asked only once the variant is built (``is_built``): answering never builds it.
    code_path: Callable[[], str] | None = Field(default=None, exclude=True, repr=False)
    priority: int = 0
    # Qualified in a child process (see _tuning/isolate.py): it runs compiled code (its own C++,
    # a vendor op, an engine's kernel) whose crash or hang must be a verdict, not the caller's
    # death. None is taken as True: only a variant declared pure (False) qualifies in-process.
    isolate: bool | None = None
    sources: tuple[str, ...] = ()
    # None: ("torch",), as every variant here runs through torch. A tuple of distribution names
    # or named facts, or a function returning {name: version}; () for nothing beyond its source.
    depends: tuple[str, ...] | Callable[[], Mapping[str, str]] | None = Field(default=None, exclude=True, repr=False)
    description: str = ""
    # Named alternatives of ``fn`` for the same calls (a kernel's block configurations, say):
    # each is verified, qualified, timed and chosen as a candidate of its own, named
    # ``id:name`` in the table, ``force`` and ``KV_FORCE``; ``fn`` stays the default (``id``).
    tactics: Mapping[str, Callable[..., Any]] = Field(default_factory=dict, exclude=True, repr=False)
    # Variant ids these tactics replace ({"old_id": "tactic"}): table rows kept under an old id
    # are moved to ``id:tactic`` when the table is read, with one warning naming them.
    replaces: Mapping[str, str] = Field(default_factory=dict)

    @field_validator("tactics")
    @classmethod
    def _tactic_names(cls, v: Mapping[str, Callable[..., Any]]) -> Mapping[str, Callable[..., Any]]:
        for name, fn in v.items():
            check_id(name, "tactic name")
            if not callable(fn):
                raise ValueError(f"tactic {name!r} must be callable, got {type(fn).__name__}")
        return dict(v)

    @model_validator(mode="after")
    def _replaced_by_tactics(self) -> Variant:
        for old, tactic in self.replaces.items():
            check_id(old, "replaced variant id")
            if tactic not in self.tactics:
                raise ValueError(f"replaces[{old!r}] names tactic {tactic!r}, which is not one of "
                                 f"{', '.join(self.tactics) or '(no tactics)'}")
        return self

    @field_validator("id")
    @classmethod
    def _stable_id(cls, v: str) -> str:
        return check_id(v, "variant id")

    @field_validator("op")
    @classmethod
    def _op_id(cls, v: str) -> str:
        return check_id(v, "op")

    @model_validator(mode="after")
    def _build_pair(self) -> Variant:
        if (self.build is None) != (self.is_built is None):
            raise ValueError("build and is_built are declared together, or neither")
        return self
