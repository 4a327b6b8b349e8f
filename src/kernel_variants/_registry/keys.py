"""A call's key: everything about a call that decides which variants can run it and which is
fastest (``CallKey``), and the base of an op's group flags (``Features``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from kernel_variants._registry.spec import OpSpec

Shape = tuple[int, ...]
AUTOGRAD = frozenset({"autograd"})  # a CallKey extra: some input requires grad, and grad mode is on
CAPTURE = frozenset({"capture"})  # a CallKey extra: a CUDA/NPU graph is being captured


def device_index(t: Any) -> int | None:
    """The ordinal of the device ``t`` is on (``cuda:1`` -> 1), None on the CPU."""
    return getattr(t.device, "index", None)


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
