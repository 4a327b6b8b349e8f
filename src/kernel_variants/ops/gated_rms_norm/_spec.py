"""Validation, reference, cases and sweeps of the gated RMSNorm op, with the semantics of vLLM's
``RMSNormGated.forward_static`` (``vllm/model_executor/layers/layernorm.py``, vLLM 0.32):

- x, z and the weight in fp32; ``act`` is SiLU (``"silu"``, alias ``"swish"``) or the sigmoid;
- with z and not ``norm_before_gate``: ``x = x * act(z)`` (Mamba2's gated norm);
- per group of ``group_size`` channels (the whole row when None):
  ``n = x * rsqrt(mean(x^2 over the group) + eps)``, then ``n = n * weight``;
- with z and ``norm_before_gate``: ``n = n * act(z)`` (Qwen3-Next's GDN output norm);
- the result is ``n`` rounded once to x's dtype.

The building blocks (x's, eps's and the weight's checks, the tensors of a case) are the RMSNorm
families': this op is their norm with a gate and groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator

from kernel_variants._dtypes import acc_dtype, dtype_name
from kernel_variants._registry.case import Case, Sweep
from kernel_variants._registry.keys import CallKey, Features, KeyParts
from kernel_variants._registry.models import Capabilities
from kernel_variants._validate import like_x, shape_str, tensor
from kernel_variants.ops.gemma_rms_norm import _spec as gemma
from kernel_variants.ops.rms_norm import _spec as plain
from kernel_variants.ops.rms_norm._spec import WeightKind

OP = "gated_rms_norm"
Activation = Literal["silu", "sigmoid"]
ACTIVATIONS = {"silu": "silu", "swish": "silu", "sigmoid": "sigmoid"}  # as called -> as variants get it

# The package's spec, filled in by the package once built (the spec holds this module's functions).
SPECS: dict[str, Any] = {}


class GatedFeatures(Features):
    """What besides the shape decides which variants can run a call, or how fast: whether a gate
    z is given, where it applies (``norm_before_gate``) and its ``activation`` (both at their
    defaults without a gate), the number of groups (``D // group_size``; 1 when None) and the
    weight's kind (x's dtype, float32, or none)."""

    gate: bool = True
    norm_before_gate: bool = False
    activation: Activation = "silu"
    groups: int = Field(1, ge=1)
    weight: WeightKind = "x"

    @field_validator("activation", mode="before")
    @classmethod
    def _activation(cls, v: object) -> object:
        # Written by people too (kv calibrate's features, sweeps): "swish" is SiLU.
        return normalize_activation(v) if isinstance(v, str) else v


class GatedCapabilities(Capabilities):
    """What a gated RMSNorm variant can run: which weights and activations, and whether it takes
    more than one group (on unless declared off)."""

    weights: frozenset[WeightKind] = frozenset({"x", "float32", "none"})
    activations: frozenset[Activation] = frozenset({"silu", "sigmoid"})
    groups: bool = True

    def uncovered(self, key: CallKey) -> str | None:
        why = super().uncovered(key)
        if why is not None:
            return why
        f = key.features
        if f.weight not in self.weights:
            return f"weight {f.weight} not in {sorted(self.weights)}"
        if f.gate and f.activation not in self.activations:
            return f"activation {f.activation} not in {sorted(self.activations)}"
        if f.groups > 1 and not self.groups:
            return "groups not supported (group_size < D)"
        return None


def check_z(z: object, x: torch.Tensor) -> None:
    """z: None, or a tensor of x's shape, dtype and device."""
    if z is None:
        return
    tensor("z", z, optional=True)
    assert isinstance(z, torch.Tensor)
    if z.shape != x.shape:
        raise ValueError(f"z: expected None or shape {shape_str(x)} (x's), got {shape_str(z)}")
    like_x("z", z, x)


def check_group_size(group_size: object, x: torch.Tensor) -> None:
    """group_size: None, or an int >= 1 that divides D."""
    if group_size is None:
        return
    dim = x.shape[-1]
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size: expected None or an int, got {type(group_size).__name__}")
    if group_size < 1 or dim % group_size:
        raise ValueError(f"group_size: expected None or a divisor of D={dim}, got {group_size}")


def check_flags(norm_before_gate: object, activation: object) -> None:
    if not isinstance(norm_before_gate, bool):
        raise TypeError(f"norm_before_gate: expected a bool, got {type(norm_before_gate).__name__}")
    if not isinstance(activation, str):
        raise TypeError(f"activation: expected a str, got {type(activation).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected \"silu\", \"swish\" or \"sigmoid\", got {activation!r}")


def normalize_activation(activation: str) -> str:
    """``"swish"`` -> ``"silu"``; the rest as given (a bad name is the check's to refuse)."""
    return ACTIVATIONS.get(activation, activation)


def check(x: object, z: object, weight: object, eps: object, group_size: object, norm_before_gate: object,
          activation: object, *, values: bool) -> KeyParts:
    """Validate a ``gated_rms_norm`` call; return its key parts (T, D)."""
    x = gemma.check_x(x)
    check_z(z, x)
    plain.check_weight(weight, x)
    gemma.check_eps(eps, "eps")
    check_group_size(group_size, x)
    check_flags(norm_before_gate, activation)
    dim = x.shape[-1]
    gate = z is not None
    features = GatedFeatures(gate=gate, norm_before_gate=gate and bool(norm_before_gate),
                             activation=ACTIVATIONS[activation] if gate else "silu",  # type: ignore[index]
                             groups=dim // group_size if group_size else 1,  # type: ignore[operator]
                             weight=plain.weight_kind(x, weight))  # type: ignore[arg-type]
    return x.device.type, dtype_name(x.dtype), features, (x.numel() // dim, dim), frozenset()


def _act(z: torch.Tensor, activation: str) -> torch.Tensor:
    return torch.sigmoid(z) if activation == "sigmoid" else F.silu(z)


def reference(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
              group_size: int | None = None, norm_before_gate: bool = False, activation: str = "silu", *,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x, z: [..., D]; weight: [D] or None. The definition in fp32 (fp64 for fp64, for
    gradcheck): a new tensor of x's shape and dtype, or ``out`` (x's shape and dtype; it may be
    x) written."""
    acc = acc_dtype(x.dtype)
    s = x.to(acc)
    g = None if z is None else _act(z.to(acc), activation)
    if g is not None and not norm_before_gate:
        s = s * g
    dim = s.shape[-1]
    groups = s.unflatten(-1, (dim // (group_size or dim), group_size or dim))
    n = (groups * torch.rsqrt(groups.pow(2).mean(dim=-1, keepdim=True) + eps)).flatten(-2)
    if weight is not None:
        n = n * weight.to(acc)
    if g is not None and norm_before_gate:
        n = n * g
    return n.to(x.dtype) if out is None else out.copy_(n)


# z outliers: SiLU's and the sigmoid's exponentials overflow (exp(-z) for z < -88) or vanish.
OUTLIERS = (-1e4, 1e4, -100.0, 100.0, -89.0, 89.0, -40.0, 40.0, -20.5, 20.5, -25.0, 25.0)


def make_case(shape: tuple[int, ...], *, dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0,
              batched: bool = False, strided: bool = False, offset: bool = False, eps: float = 1e-6,
              gate: bool = True, norm_before_gate: bool = False, activation: str = "silu", groups: int = 1,
              weight: WeightKind = "x", outliers: bool = False) -> Case:
    """A call on (T, D) (the RMSNorm families' tensors: x, a weight around 1, and their residual
    as z, in the same layout): ``groups`` splits D into that many groups (``group_size =
    D // groups``; None for 1); ``outliers`` puts |z| from 20 to 1e4 (and |x| to 1e3) in every
    row."""
    dim = shape[1]
    if groups < 1 or dim % groups:
        raise ValueError(f"groups: expected a divisor of D={dim}, got {groups}")
    x, w, z = gemma.tensors(shape, dtype=dtype, device=device, seed=seed, batched=batched, strided=strided,
                            offset=offset, weight_base=1.0,
                            weight_dtype=torch.float32 if weight == "float32" else None)
    if outliers and x.numel():
        vals = torch.tensor(OUTLIERS, dtype=torch.float32, device=device).to(dtype)
        idx = torch.arange(min(dim, len(OUTLIERS)), device=device)
        z[..., idx * dim // len(idx)] = vals[: len(idx)]  # spread over the row (and the groups)
        x[..., -1] = 1e3
    return Case(SPECS[OP], (x, z if gate else None, None if weight == "none" else w, eps,
                            dim // groups if groups > 1 else None, norm_before_gate, activation), {})


CASES: dict[str, dict[str, Any]] = {
    **gemma.CASES,  # layouts, sizes, T=0, eps, wide rows: with a SiLU gate before the norm (Mamba2's)
    "no-gate": dict(shape=(5, 48), gate=False),
    "no-gate-groups": dict(shape=(4, 64), gate=False, groups=4),
    "gate-after-norm": dict(shape=(6, 96), norm_before_gate=True),
    "sigmoid": dict(shape=(5, 80), activation="sigmoid"),
    "sigmoid-after-norm": dict(shape=(3, 72), activation="sigmoid", norm_before_gate=True),
    "swish": dict(shape=(3, 40), activation="swish"),
    "groups-8": dict(shape=(4, 512), groups=8),
    "groups-odd": dict(shape=(3, 99), groups=3, norm_before_gate=True),
    "groups-one-channel": dict(shape=(2, 24), groups=24),
    "gdn-heads": dict(shape=(64, 128), norm_before_gate=True),
    "outliers-silu": dict(shape=(4, 256), outliers=True),
    "outliers-silu-after": dict(shape=(4, 256), outliers=True, norm_before_gate=True),
    "outliers-sigmoid": dict(shape=(4, 256), outliers=True, activation="sigmoid", groups=2),
    "outliers-sigmoid-after": dict(shape=(3, 200), outliers=True, activation="sigmoid", norm_before_gate=True),
    "no-weight": dict(shape=(5, 48), weight="none"),
    "fp32-weight": dict(shape=(6, 40), weight="float32"),
    "fp32-weight-groups-strided": dict(shape=(4, 64), weight="float32", groups=2, strided=True),
    "no-weight-sigmoid-offset-batched": dict(shape=(4, 24), weight="none", activation="sigmoid", offset=True,
                                             batched=True),
    "groups-after-strided-batched": dict(shape=(4, 96), groups=3, norm_before_gate=True, strided=True,
                                         batched=True),
    "groups-wide": dict(shape=(2, 8320), groups=2, weight="float32"),
}


def conformance(caps: Capabilities) -> Iterator[tuple[str, dict[str, Any]]]:
    yield from CASES.items()


def sweeps() -> dict[str, Sweep]:
    """Mamba2 (mamba2-1.3b: an intermediate size D of 4096, one group; and 8 groups of 512) and
    Qwen3-Next's GDN output norm (128 channels per head, the gate after the norm; rows = tokens x
    32 value heads), at decode- and prefill-like token counts; and a few small shapes."""
    tokens = (1, 16, 64, 256, 1024, 4096)
    mamba = tuple((t, 4096) for t in tokens)
    return {
        "gated-norm": Sweep("gated-norm", OP, mamba, description="Mamba2's gated norm: T 1..4096, D=4096, 1 group"),
        "gated-norm-groups": Sweep("gated-norm-groups", OP, mamba, features={"groups": 8},
                                   description="Mamba2's gated norm with 8 groups of 512: T 1..4096, D=4096"),
        "gated-norm-gdn": Sweep("gated-norm-gdn", OP, tuple((t * 32, 128) for t in tokens),
                                features={"norm_before_gate": True},
                                description="Qwen3-Next's GDN output norm: rows = tokens x 32 heads, D=128, "
                                            "the gate after the norm"),
        "gated-norm-smoke": Sweep("gated-norm-smoke", OP, ((1, 256), (16, 1024), (128, 2048)),
                                  description="a few small shapes, seconds to calibrate"),
    }
