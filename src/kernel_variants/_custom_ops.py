"""The two ops as ``torch.library`` custom ops, for ``torch.compile`` and ``torch.export``.

``kernel_variants::causal_conv1d_fn`` mutates ``conv_states`` and
``kernel_variants::causal_conv1d_update`` mutates ``conv_state``; each has a fake implementation
(an empty tensor of x's shape) so that tracing never runs a kernel, calibrates or reads the
calibration table. At run time the op body is the ordinary eager call, which validates and
dispatches per shape as always.

The public functions route here only while ``torch.compiler.is_compiling()``: calling a custom
op from Python costs tens of microseconds that eager calls should not pay. Importing this module
registers the ops (``kernel_variants.ops`` imports it when a compile first traces a call).
"""

from __future__ import annotations

import torch

from kernel_variants import ops


@torch.library.custom_op("kernel_variants::causal_conv1d_fn", mutates_args=("conv_states",))
def causal_conv1d_fn_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor | None,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    activation: str | None,
    pad_slot_id: int,
) -> torch.Tensor:
    out = ops.causal_conv1d_fn(x, weight, bias, conv_states=conv_states, cache_indices=cache_indices,
                               has_initial_state=has_initial_state, query_start_loc=query_start_loc,
                               activation=activation, pad_slot_id=pad_slot_id)
    # A custom op may not return an alias of an input; no variant does, but the op cannot know.
    return out.clone() if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else out


@causal_conv1d_fn_op.register_fake
def _(x, weight, bias, conv_states, cache_indices, has_initial_state, query_start_loc, activation, pad_slot_id):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("kernel_variants::causal_conv1d_update", mutates_args=("conv_state",))
def causal_conv1d_update_op(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    conv_state_indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    pad_slot_id: int,
) -> torch.Tensor:
    out = ops.causal_conv1d_update(x, conv_state, weight, bias, activation=activation,
                                   conv_state_indices=conv_state_indices,
                                   num_accepted_tokens=num_accepted_tokens, pad_slot_id=pad_slot_id)
    return out.clone() if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else out


@causal_conv1d_update_op.register_fake
def _(x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens, pad_slot_id):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def causal_conv1d_fn(x, weight, bias=None, *, conv_states=None, cache_indices=None, has_initial_state=None,
                     query_start_loc=None, activation=None, pad_slot_id=-1):
    """The public op's signature, through the custom op."""
    return causal_conv1d_fn_op(x, weight, bias, conv_states, cache_indices, has_initial_state, query_start_loc,
                               activation, pad_slot_id)


def causal_conv1d_update(x, conv_state, weight, bias=None, *, activation=None, conv_state_indices=None,
                         num_accepted_tokens=None, pad_slot_id=-1):
    """The public op's signature, through the custom op."""
    return causal_conv1d_update_op(x, conv_state, weight, bias, activation, conv_state_indices,
                                   num_accepted_tokens, pad_slot_id)
