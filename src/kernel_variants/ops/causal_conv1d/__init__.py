"""The causal_conv1d op family: a depthwise causal 1-D convolution with a rolling state pool,
for prefill (:func:`causal_conv1d_fn`) and decode / speculative verify
(:func:`causal_conv1d_update`). Channel-last, as the serving engines hold it.

Everything specific to these two ops is in this package: the signatures, validation
(``_checks``), the capabilities and feature models below, the reference (``_reference``),
realistic calls for conformance and calibration (``_cases``) and the named sweeps
(``_sweeps``). The core knows them only through the two :class:`OpSpec` registered here.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator

from kernel_variants._registry.hookspecs import hookimpl
from kernel_variants._registry.keys import CallKey, Features
from kernel_variants._registry.models import Capabilities, Range, Variant, format_range, in_range
from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime.entry import make_op
from kernel_variants.ops.causal_conv1d import _cases, _checks, _reference, _sweeps

FN, UPDATE = "causal_conv1d_fn", "causal_conv1d_update"


class ConvFeatures(Features):
    """The group flags of a conv call; the defaults are what a calibration measures."""

    width: int = Field(4, ge=1, description="convolution width W")
    bias: bool = Field(True, description="a bias")
    activation: Literal["none", "silu"] = Field("silu", description="silu or none")
    states: bool = Field(True, description="a conv_states pool (prefill)")
    varlen: bool = Field(False, description="packed sequences with query_start_loc (prefill)")
    spec: bool = Field(False, description="num_accepted_tokens (update, L > 1)")

    @field_validator("activation", mode="before")
    @classmethod
    def _activation(cls, v: object) -> object:
        # Written by people too (kv --activation, sweeps): any case, and "none" for None.
        v = v.lower() if isinstance(v, str) else v
        return "none" if v == "none" else _checks.activation_name(v)


class FnFeatures(ConvFeatures):
    @model_validator(mode="after")
    def _prefill(self) -> FnFeatures:
        if self.spec:
            raise ValueError("num_accepted_tokens exists only for causal_conv1d_update (use --op update)")
        return self


class UpdateFeatures(ConvFeatures):
    @model_validator(mode="after")
    def _decode(self) -> UpdateFeatures:
        if self.varlen:
            raise ValueError("packed sequences exist only for causal_conv1d_fn")
        if not self.states:
            raise ValueError("causal_conv1d_update always has a conv_state")
        return self


class ConvCapabilities(Capabilities):
    """What a conv variant can run. ``limits`` take the axes B, D and L."""

    width: Range = (2, 4)
    varlen: bool = False
    conv_states: bool = True
    # Opt-in: a kernel that assumes a dense pool would write a strided one in the wrong places.
    noncontiguous_states: bool = False
    num_accepted_tokens: bool = False
    # Some kernels honour num_accepted_tokens for one width only; None means the whole ``width`` range.
    num_accepted_tokens_width: tuple[int, int] | None = None
    bias: bool = True
    activations: frozenset[Literal["none", "silu"]] = frozenset({"none", "silu"})
    # Its kernel treats a slot outside [0, N) (and, in decode, a num_accepted_tokens outside
    # 1..L) as a pad, never addressing memory outside the pool: off the CPU the dispatcher then
    # only counts such values instead of rewriting the index tensors first.
    slot_bounds_safe: bool = False
    # Decode only (read by causal_conv1d_update's device rule): its kernel also counts what the
    # rule counts (the slots above, live slots used twice, the counts above) into
    # bad_value_counter(x), so off the CPU the dispatcher launches nothing for the rule at all.
    counts_bad_values: bool = False

    @field_validator("width", "num_accepted_tokens_width")
    @classmethod
    def _ordered(cls, v: Range | None) -> Range | None:
        if v is not None and (v[0] < 0 or (v[1] is not None and v[1] < v[0])):
            raise ValueError(f"range must satisfy 0 <= lo <= hi, got {v}")
        return v

    @model_validator(mode="after")
    def _spec_width_inside(self) -> ConvCapabilities:
        if self.num_accepted_tokens_width is not None and not self.num_accepted_tokens:
            raise ValueError("num_accepted_tokens_width is set but num_accepted_tokens is False")
        if self.counts_bad_values and not self.slot_bounds_safe:
            raise ValueError("counts_bad_values is set but slot_bounds_safe is False (the rule it replaces also "
                             "makes bad values pads)")
        return self

    def uncovered(self, key: CallKey) -> str | None:
        why = super().uncovered(key)
        if why is not None:
            return why
        f = key.features
        if not in_range(f.width, self.width):
            return f"width W={f.width} outside {format_range(self.width)}"
        if f.varlen and not self.varlen:
            return "varlen input (query_start_loc) not supported"
        if f.states and not self.conv_states:
            return "conv states not supported"
        if _checks.NONCONTIG_STATES in key.extra and not self.noncontiguous_states:
            return "non-contiguous state view not supported"
        if f.spec:
            if not self.num_accepted_tokens:
                return "num_accepted_tokens not supported"
            spec_width = self.num_accepted_tokens_width
            if spec_width is not None and not in_range(f.width, spec_width):
                return f"num_accepted_tokens only for width {format_range(spec_width)}, got W={f.width}"
        if f.bias and not self.bias:
            return "bias not supported"
        if f.activation not in self.activations:
            return f"activation {f.activation} not in {sorted(self.activations)}"
        return None


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_states: torch.Tensor | None = None,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    activation: str | None = None,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal 1-D convolution over whole sequences (prefill), channel-last.

    Args:
        x: ``[B, L, D]``, or ``[T, D]`` with ``query_start_loc`` for packed variable lengths.
        weight: ``[D, W]``. bias: ``[D]`` or None.
        conv_states: ``[N, S, D]`` cache pool, S >= W-1, or None. The last W-1 rows of a slot are
            the history (oldest first); after the call they hold the last W-1 rows of history ++
            sequence. Updated in place, also when it is a non-contiguous view.
        cache_indices: ``[B]`` int32/int64 slot per sequence (None: slot b). A slot equal to
            ``pad_slot_id`` skips the sequence: zero output, no state read or written.
        has_initial_state: ``[B]`` bool, whether the slot's history is used (None: all False).
        query_start_loc: ``[B+1]`` int32/int64, 0 = start <= ... <= end = T.
        activation: None, ``"silu"`` or ``"swish"``.
        out: None, or a tensor of x's shape, dtype and device: the result is written there and
            ``out`` is returned. Any overlap with an argument is a ValueError; nothing is
            written then.

    Returns:
        A tensor of x's shape and dtype; accumulation is in fp32.
    """
    return _FN(x, weight, bias, conv_states, cache_indices, has_initial_state, query_start_loc, activation,
               pad_slot_id, out)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode (or speculative verify) step of the causal convolution, channel-last.

    Args:
        x: ``[B, D]`` (one token) or ``[B, L, D]``.
        conv_state: ``[N, S, D]`` cache pool, S >= W-1 (S >= W-1+L-1 with num_accepted_tokens),
            updated in place. Without ``num_accepted_tokens`` the slot becomes the last S rows of
            slot ++ x; with it the history starts at row ``n-1`` and the slot shifts by ``n``.
        weight: ``[D, W]``. bias: ``[D]`` or None.
        conv_state_indices: ``[B]`` int32/int64 slot per sequence (None: slot b); slots equal
            to ``pad_slot_id`` give zero output and are neither read nor written.
        num_accepted_tokens: ``[B]`` int32/int64 in 1..L, for speculative decoding.
        out: None, or a tensor of x's shape, dtype and device: the result is written there and
            ``out`` is returned. It may be exactly ``x`` (in place); any other overlap with an
            argument is a ValueError, and nothing is written then.

    Returns:
        A tensor of x's shape and dtype.
    """
    return _UPDATE(x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens, pad_slot_id,
                   out)


# What a conv written in plain torch ops can run: any float dtype and width, any state pool
# strides (index_put_ writes through a view), autograd (the state writes are detached).
TORCH_CAPS = dict(dtypes={"float32", "bfloat16", "float16", "float64"}, width=(1, None), noncontiguous_states=True,
                  autograd=True)
_REFERENCE_CAPS = dict(devices={"cpu", "cuda", "npu"}, takes_out=True, **TORCH_CAPS)
_ORACLE = "the contract in plain torch, per sequence; the oracle for every other variant"
_SWEEPS = _sweeps.sweeps()


def _normalize_activation(a: object) -> str | None:
    """What variants receive: None or "silu" (the call was validated already)."""
    return None if _checks.activation_name(a) == "none" else "silu"


def _reference_variant(op: str, fn, **caps) -> Variant:
    return Variant(id="reference", op=op, version="1", fn=fn, priority=-100, isolate=False,
                   capabilities=ConvCapabilities(**caps, **_REFERENCE_CAPS), description=_ORACLE)


# What the two ops share: the key's axes, the capabilities model, the traps of a calibrated
# shape's check, the activation variants receive.
_FAMILY = dict(axes=("B", "D", "L"), axis_aliases=_sweeps.AXIS_ALIASES, capabilities=ConvCapabilities,
               check_options=_cases.CHECK_OPTIONS, normalize={"activation": _normalize_activation})

FN_SPEC = OpSpec(
    name=FN,
    signature=causal_conv1d_fn,
    features=FnFeatures,
    check=lambda *a, values: _checks.check_fn(FnFeatures, *a, values=values),
    value_checks=_checks.fn_value_checks,
    device_rule=_checks.device_fn_rule,
    reference=_reference_variant(FN, _reference.causal_conv1d_fn, varlen=True),
    make_case=_cases.spec_case(FN),
    conformance=_cases.conformance(_cases.FN_CASES),
    edge_cases=_cases.FN_CASES,
    sweeps=_SWEEPS[FN],
    default_sweep="smoke",
    mutates=("conv_states",),
    aliases=("fn", "prefill"),
    description="prefill: whole sequences, state written in place",
    **_FAMILY,
)

UPDATE_SPEC = OpSpec(
    name=UPDATE,
    signature=causal_conv1d_update,
    features=UpdateFeatures,
    check=lambda *a, values: _checks.check_update(UpdateFeatures, *a, values=values),
    value_checks=_checks.update_value_checks,
    device_rule=_checks.device_update_rule,
    reference=_reference_variant(UPDATE, _reference.causal_conv1d_update, num_accepted_tokens=True, in_place=True),
    make_case=_cases.spec_case(UPDATE),
    conformance=_cases.conformance(_cases.UPDATE_CASES),
    edge_cases=_cases.UPDATE_CASES,
    sweeps=_SWEEPS[UPDATE],
    default_sweep="decode",
    mutates=("conv_state",),
    out_aliases={"out": "x"},  # sgl-kernel-npu's update writes its output over x
    aliases=("update", "decode"),
    description="decode / speculative verify: a few tokens per sequence, state shifted in place",
    **_FAMILY,
)

SPECS = {FN: FN_SPEC, UPDATE: UPDATE_SPEC}
_cases.SPECS.update(SPECS)
_FN, _UPDATE = make_op(FN_SPEC), make_op(UPDATE_SPEC)


@hookimpl
def kv_register_ops(register) -> None:
    for spec in SPECS.values():
        register(spec)


bad_value_counter = _checks.bad_value_counter

__all__ = ["TORCH_CAPS", "ConvCapabilities", "ConvFeatures", "bad_value_counter", "causal_conv1d_fn",
           "causal_conv1d_update"]
