"""What a variant declares about itself: frozen pydantic models, unknown fields refused."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

OpName = Literal["causal_conv1d_fn", "causal_conv1d_update"]
OPS: tuple[OpName, ...] = ("causal_conv1d_fn", "causal_conv1d_update")
DeviceType = Literal["cpu", "cuda", "npu"]
DTypeName = Literal["float32", "bfloat16", "float16", "float64"]
ActivationName = Literal["none", "silu"]

_ID = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")


class Capabilities(BaseModel):
    """The calls a variant can run. The dispatcher never sends it a call outside these.

    Ranges are inclusive; a ``None`` upper bound means unbounded.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    devices: frozenset[DeviceType]
    dtypes: frozenset[DTypeName]
    width: tuple[int, int | None] = (2, 4)
    batch: tuple[int, int | None] = (1, None)
    dim: tuple[int, int | None] = (1, None)
    seqlen: tuple[int, int | None] = (1, None)
    varlen: bool = False
    conv_states: bool = True
    # Opt-in: a kernel that assumes a dense pool would write a strided one in the wrong places.
    noncontiguous_states: bool = False
    num_accepted_tokens: bool = False
    # Some kernels honour num_accepted_tokens for one width only; None means the whole ``width`` range.
    num_accepted_tokens_width: tuple[int, int] | None = None
    bias: bool = True
    activations: frozenset[ActivationName] = frozenset({"none", "silu"})

    @field_validator("width", "batch", "dim", "seqlen", "num_accepted_tokens_width")
    @classmethod
    def _ordered(cls, v: tuple[int, int | None] | None) -> tuple[int, int | None] | None:
        if v is None:
            return v
        lo, hi = v
        if lo < 0 or (hi is not None and hi < lo):
            raise ValueError(f"range must satisfy 0 <= lo <= hi, got {v}")
        return v


class Variant(BaseModel):
    """One implementation of one op, as a plugin registers it.

    ``fn`` takes exactly the public op's arguments (already validated; ``activation`` normalised
    to ``None`` or ``"silu"``) and returns the output tensor, updating state tensors in place.
    ``probe`` returns ``None`` when the variant can run on this machine, else a one-line reason.
    ``sources`` lists files beyond ``fn``'s own module whose content defines the implementation
    (a C++ kernel, say): their hash is part of the variant's version, so editing one makes its
    old timings stale.

    A variant compiled on this machine declares ``build`` (compile or load it now; return where
    it went; raise ``RuntimeError`` with the reason on failure) and ``is_built`` (whether that is
    done, without doing it). ``probe`` must then only check that a build is possible: listing
    and explaining never build, the first dispatched call or ``kv build`` does.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    id: str
    op: OpName
    version: str = Field(min_length=1, max_length=64)
    capabilities: Capabilities
    fn: Callable[..., Any] = Field(exclude=True, repr=False)
    probe: Callable[[], str | None] | None = Field(default=None, exclude=True, repr=False)
    build: Callable[[], str] | None = Field(default=None, exclude=True, repr=False)
    is_built: Callable[[], bool] | None = Field(default=None, exclude=True, repr=False)
    priority: int = 0
    sources: tuple[str, ...] = ()
    description: str = ""

    @field_validator("id")
    @classmethod
    def _stable_id(cls, v: str) -> str:
        if not _ID.match(v):
            raise ValueError(
                f"variant id must be lowercase letters, digits, '_', '.', '-' (<= 64, starting "
                f"with a letter), got {v!r}"
            )
        return v

    @model_validator(mode="after")
    def _build_pair(self) -> Variant:
        if (self.build is None) != (self.is_built is None):
            raise ValueError("build and is_built are declared together, or neither")
        return self

    @model_validator(mode="after")
    def _spec_width_inside(self) -> Variant:
        caps = self.capabilities
        if caps.num_accepted_tokens_width is not None and not caps.num_accepted_tokens:
            raise ValueError("num_accepted_tokens_width is set but num_accepted_tokens is False")
        return self
