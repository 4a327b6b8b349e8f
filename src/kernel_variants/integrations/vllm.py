"""vLLM drop-ins: ``causal_conv1d_fn`` and ``causal_conv1d_update`` with the signatures of
``vllm/model_executor/layers/mamba/ops/causal_conv1d.py``, running kernel_variants' ops.

Three lines inside a running vLLM worker::

    from kernel_variants.integrations import vllm as kv_vllm
    handle = kv_vllm.patch()      # every loaded binding of vLLM's two functions now runs ours
    ...; handle.undo()            # or: with kv_vllm.patch(): ...

How vLLM lays its tensors out, and how each maps to the channel-last ops (views only):

- prefill ``x`` is ``(dim, tokens)``, the transpose of vLLM's ``[tokens, dim]`` activations:
  ``x.transpose(0, 1)`` is that ``[T, D]`` tensor again. The result is returned the same way.
- the pool is ``cache.transpose(-1, -2)`` of an ``[N, W-1(+spec), D]`` allocation, ``(N, D, S)``;
  its transpose is the allocation itself. vLLM keeps the history in the slot's first W-1 rows
  (W-1+L-1 with ``num_accepted_tokens``) and never touches the rest, so the ops get that many
  leading rows as a view.
- ``weight`` is ``(dim, width)``, as the ops take it.
- decode ``x`` is ``(batch, dim)``, ``(batch, dim, seqlen)`` (a transposed view) or, with
  ``query_start_loc``, ``[tokens, dim]``; the result has x's shape and strides.

Padding: since vLLM PR #35431 padded entries of the state indices are the null block
(``null_block_id``, 0), which the kernels skip; before it they were ``pad_slot_id`` (-1).
:func:`causal_conv1d_fn` / :func:`causal_conv1d_update` skip ``null_block_id`` when it is not
None, else ``pad_slot_id``. vLLM-CPU binds its own functions under those names, with their own
rules, mirrored by :func:`causal_conv1d_fn_cpu` (skips ``pad_slot_id`` -1, slot 0 is a slot)
and :func:`causal_conv1d_update_cpu` (skips ``pad_slot_id`` if given, else ``null_block_id``,
else 0). ``patch()`` reads the convention from vLLM's declarations (:func:`convention`: its
``NULL_BLOCK_ID``, its version) and which function it replaces from where that function is
declared, installing :func:`causal_conv1d_fn_legacy` / :func:`causal_conv1d_update_legacy`
(old signatures, ``pad_slot_id`` rule) only into a vLLM that predates the null block.
Skipped sequences give zero output rows (vLLM leaves them uninitialised).

Trailing entries: a varlen prefill may pass more ``cache_indices`` (and ``has_initial_state``)
than sequences, as vLLM's own tests do; its kernel reads the first B, and so do the adapters.

Not supported (NotImplementedError naming the argument): automatic prefix caching
(``block_idx_first_scheduled_token``, ``block_idx_last_scheduled_token``,
``initial_state_idx``), EAGLE tree verification (``retrieve_parent_token``), x and state of
different dtypes. Accepted and ignored, as they only tune vLLM's own kernel or only matter with
prefix caching: ``metadata``, ``validate_data``, ``num_computed_tokens``,
``block_size_to_align``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernel_variants.integrations._common import (
    IntegrationWarning,
    Patch,
    as_activation,
    decode,
    decode_varlen,
    mark,
    module_names,
    patch_engine,
    prefill,
    refuse,
    slot_column,
)

ENGINE = "vLLM"
#: vLLM's ``vllm.v1.attention.backends.utils`` values.
PAD_SLOT_ID = -1
NULL_BLOCK_ID = 0
#: Where vLLM defines the two functions; everything else binding them is found from there.
MODULE = "vllm.model_executor.layers.mamba.ops.causal_conv1d"

__all__ = [
    "CPU_MODULE",
    "GDN_MODULE",
    "MODULE",
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "PLUGIN_ENV",
    "Convention",
    "IntegrationWarning",
    "Patch",
    "causal_conv1d_fn",
    "causal_conv1d_fn_cpu",
    "causal_conv1d_fn_legacy",
    "causal_conv1d_update",
    "causal_conv1d_update_cpu",
    "causal_conv1d_update_legacy",
    "convention",
    "gdn_causal_conv1d_fwd_cpu",
    "gdn_causal_conv1d_update_cpu",
    "patch",
    "plugin",
    "unpack_weight",
]


def _sentinel(null_block_id: int | None, pad_slot_id: int | None) -> int:
    if null_block_id is not None:
        return int(null_block_id)
    if pad_slot_id is not None:
        return int(pad_slot_id)
    return PAD_SLOT_ID  # nothing is skipped; -1 is never a slot


@mark
def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int | None = PAD_SLOT_ID,
    null_block_id: int | None = NULL_BLOCK_ID,
    block_idx_first_scheduled_token: torch.Tensor | None = None,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    num_computed_tokens: torch.Tensor | None = None,
    block_size_to_align: int | None = 0,
    metadata: Any = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """vLLM's prefill. x: ``(dim, T)`` (a view of ``[T, dim]``); weight ``(dim, W)``; bias
    ``(dim,)``; conv_states ``(N, dim, S)`` (a view of ``[N, S, dim]``), S >= W-1, updated in
    place in its first W-1 rows; query_start_loc ``[B+1]``; cache_indices ``[B]`` (or
    ``[B, blocks]``, column 0 used); has_initial_state ``[B]`` bool.

    Sequences whose slot is ``null_block_id`` (or ``pad_slot_id`` when that is None) are
    skipped. ``pad_slot_id`` is otherwise only vLLM's internal launch sentinel. ``metadata``,
    ``validate_data``, ``num_computed_tokens`` and ``block_size_to_align`` are ignored.

    Returns ``(dim, T)``, the transpose of a ``[T, dim]`` tensor, like vLLM's.
    """
    refuse(
        ENGINE,
        block_idx_first_scheduled_token=block_idx_first_scheduled_token,
        block_idx_last_scheduled_token=block_idx_last_scheduled_token,
        initial_state_idx=initial_state_idx,
    )
    if x.ndim != 2:
        raise ValueError(f"{ENGINE}: x: expected (dim, tokens), got shape {list(x.shape)}")
    pool = conv_states.transpose(-1, -2) if conv_states is not None else None
    y = prefill(
        ENGINE, x.transpose(0, 1), weight, bias, pool, query_start_loc,
        slot_column(cache_indices), has_initial_state, as_activation(activation),
        _sentinel(null_block_id, pad_slot_id),
    )
    return y.transpose(0, 1)


@mark
def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    null_block_id: int | None = NULL_BLOCK_ID,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    validate_data: bool = False,
    out: torch.Tensor | None = None,
    *,
    retrieve_parent_token: torch.Tensor | None = None,
    pad_slot_id: int | None = None,
) -> torch.Tensor:
    """vLLM's decode / speculative verify. x: ``(B, dim)``, ``(B, dim, L)`` (a view of
    ``[B, L, dim]``), or ``[T, dim]`` with query_start_loc ``[B+1]`` and max_query_len;
    conv_state ``(N, dim, S)`` (a view of ``[N, S, dim]``), updated in place in its first W-1
    rows (W-1+L-1 with num_accepted_tokens ``[B]``); weight ``(dim, W)``; bias ``(dim,)``;
    conv_state_indices ``[B]`` (or ``[B, blocks]``, column 0 used).

    Slots equal to ``null_block_id`` (or to ``pad_slot_id``, the pre-null-block keyword, when
    ``null_block_id`` is None) are skipped. Packed sequences of unequal lengths are run one at
    a time (reading query_start_loc on the host; refused inside a graph capture).
    ``validate_data`` is ignored.

    Returns a tensor of x's shape, and for ``(B, dim, L)`` input the same transposed layout;
    with ``out`` (x's shape, as vLLM takes it) the result is written there and ``out`` returned.
    """
    refuse(
        ENGINE,
        block_idx_last_scheduled_token=block_idx_last_scheduled_token,
        initial_state_idx=initial_state_idx,
        retrieve_parent_token=retrieve_parent_token,
    )
    if out is not None and out.shape != x.shape:
        raise ValueError(f"{ENGINE}: out: expected x's shape {list(x.shape)}, got {list(out.shape)}")
    y = _update(x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens,
                query_start_loc, max_query_len, _sentinel(null_block_id, pad_slot_id))
    return y if out is None else out.copy_(y)


def _update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | bool | None,
    conv_state_indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    max_query_len: int | None,
    sentinel: int,
) -> torch.Tensor:
    act = as_activation(activation)
    indices = slot_column(conv_state_indices)
    pool = conv_state.transpose(-1, -2)
    if query_start_loc is not None:
        if x.ndim != 2:
            raise ValueError(
                f"{ENGINE}: x: expected (tokens, dim) with query_start_loc, got {list(x.shape)}"
            )
        return decode_varlen(
            ENGINE, x, pool, weight, bias, act, indices, num_accepted_tokens, query_start_loc,
            max_query_len, sentinel, short_plain=False,
        )
    if x.ndim == 2:
        return decode(ENGINE, x, pool, weight, bias, act, indices, num_accepted_tokens, sentinel)
    if x.ndim == 3:
        y = decode(ENGINE, x.transpose(1, 2), pool, weight, bias, act, indices,
                   num_accepted_tokens, sentinel)
        return y.transpose(1, 2)
    raise ValueError(
        f"{ENGINE}: x: expected (batch, dim) or (batch, dim, seqlen), got {list(x.shape)}"
    )


@mark
def causal_conv1d_fn_legacy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int | None = PAD_SLOT_ID,
    block_idx_first_scheduled_token: torch.Tensor | None = None,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    num_computed_tokens: torch.Tensor | None = None,
    block_size_to_align: int | None = 0,
    metadata: Any = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """:func:`causal_conv1d_fn` with the signature of vLLM before the null block (no
    ``null_block_id``): sequences whose slot is ``pad_slot_id`` are skipped, slot 0 is a slot."""
    return causal_conv1d_fn(
        x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
        activation, pad_slot_id, None, block_idx_first_scheduled_token,
        block_idx_last_scheduled_token, initial_state_idx, num_computed_tokens,
        block_size_to_align, metadata, validate_data,
    )


@mark
def causal_conv1d_update_legacy(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    pad_slot_id: int | None = PAD_SLOT_ID,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """:func:`causal_conv1d_update` with the signature of vLLM before the null block: slots
    equal to ``pad_slot_id`` are skipped, slot 0 is a slot. Shapes as there."""
    return causal_conv1d_update(
        x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens,
        query_start_loc, max_query_len, None, block_idx_last_scheduled_token, initial_state_idx,
        validate_data, retrieve_parent_token=retrieve_parent_token, pad_slot_id=pad_slot_id,
    )


#: Names, in the null-block era of vLLM, of the CPU platform's own functions and of the module
#: that defines them (vLLM-CPU binds them under MODULE's names at import).
CPU_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d"
#: Where vLLM declares its padding ids; NULL_BLOCK_ID appears there with the null block.
UTILS_MODULE = "vllm.v1.attention.backends.utils"
#: The packages ``patch()`` looks in besides vLLM's: its platform plugins (entry points).
PLUGIN_GROUP = "vllm.platform_plugins"


@mark
def causal_conv1d_fn_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    **kwargs: Any,
) -> torch.Tensor:
    """vLLM-CPU's prefill (``ops/cpu/causal_conv1d.py``, bound as ``causal_conv1d_fn`` on the
    CPU platform), with its rule: sequences whose slot is ``pad_slot_id`` (-1) are skipped and
    slot 0 is processed like any other; ``null_block_id`` and vLLM's other keywords
    (``metadata``, ``validate_data``...) are accepted and, as there, ignored. Prefix caching
    arguments with values are refused (vLLM-CPU's function cannot run them either). Shapes as
    :func:`causal_conv1d_fn`; empty sequences write no state, as there.
    """
    refuse(
        ENGINE,
        block_idx_first_scheduled_token=kwargs.get("block_idx_first_scheduled_token"),
        block_idx_last_scheduled_token=kwargs.get("block_idx_last_scheduled_token"),
        initial_state_idx=kwargs.get("initial_state_idx"),
    )
    return causal_conv1d_fn(
        x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
        activation, pad_slot_id, None,
    )


@mark
def causal_conv1d_update_cpu(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    pad_slot_id: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """vLLM-CPU's decode (``ops/cpu/causal_conv1d.py``), with its rule: the skipped slot is
    ``pad_slot_id`` when given, else ``null_block_id`` (keyword) when given and not None, else
    vLLM's NULL_BLOCK_ID (0). ``num_accepted_tokens`` and ``max_query_len`` are honoured as in
    :func:`causal_conv1d_update` (vLLM-CPU's function drops them); ``out`` (x's shape) is
    written and returned. Other keywords are ignored, as there. Shapes as
    :func:`causal_conv1d_update`.
    """
    refuse(
        ENGINE,
        block_idx_last_scheduled_token=kwargs.get("block_idx_last_scheduled_token"),
        initial_state_idx=kwargs.get("initial_state_idx"),
        retrieve_parent_token=kwargs.get("retrieve_parent_token"),
    )
    sentinel = pad_slot_id
    if sentinel is None:
        sentinel = kwargs.get("null_block_id", NULL_BLOCK_ID)
        if sentinel is None:
            sentinel = NULL_BLOCK_ID
    out = kwargs.get("out")
    if out is not None and out.shape != x.shape:
        raise ValueError(f"{ENGINE}: out: expected x's shape {list(x.shape)}, got {list(out.shape)}")
    max_query_len = kwargs.get("max_query_len", -1)
    y = _update(x, conv_state, weight, bias, activation, conv_state_indices,
                kwargs.get("num_accepted_tokens"), query_start_loc, max_query_len, int(sentinel))
    return y if out is None else out.copy_(y)


#: vLLM-CPU's GDN layers (Qwen3-Next) call the C++ conv kernels through these two wrappers.
GDN_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
#: ``causal_conv1d_weight_pack`` lays a ``[D, 4]`` bf16 weight out in blocks of 32 channels,
#: each holding taps (0, 1) then taps (2, 3), channel-interleaved: ``[D/32, 2, 32, 2]``.
PACK_BLOCK, PACK_WIDTH = 32, 4


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The ``[D, 4]`` weight that vLLM-CPU's ``causal_conv1d_weight_pack`` packed (a copy: no
    ``[D, W]`` view of the packed layout exists). ValueError for a tensor of another shape."""
    if packed.ndim != 2 or packed.shape[1] != PACK_WIDTH or packed.shape[0] % PACK_BLOCK:
        raise ValueError(f"{ENGINE}: weight: expected a packed [D, {PACK_WIDTH}] weight with D a "
                         f"multiple of {PACK_BLOCK}, got shape {list(packed.shape)}")
    dim = packed.shape[0]
    blocks = packed.contiguous().view(dim // PACK_BLOCK, PACK_WIDTH // 2, PACK_BLOCK, 2)
    return blocks.permute(0, 2, 1, 3).reshape(dim, PACK_WIDTH)


def _unpacked(weight: torch.Tensor, is_weight_packed: bool) -> torch.Tensor:
    if not is_weight_packed:
        return weight.view(weight.shape[0], -1) if weight.ndim == 3 else weight
    from kernel_variants.kernels.vllm_cpu import PackCache

    global _UNPACKED
    if _UNPACKED is None:
        _UNPACKED = PackCache(lambda w: unpack_weight(w.detach()))
    return _UNPACKED.get(weight)


_UNPACKED: Any = None


@mark
def gdn_causal_conv1d_fwd_cpu(
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    silu_activation: bool,
    is_weight_packed: bool,
) -> torch.Tensor:
    """vLLM-CPU's GDN prefill wrapper (``gdn_attention._causal_conv1d_fwd_cpu``), which calls
    ``torch.ops._C.causal_conv1d_fwd_cpu``: x ``(dim, T)`` (a view of ``[T, dim]``), weight
    packed by ``causal_conv1d_weight_pack`` (``is_weight_packed``; unpacked once per weight),
    conv_states ``(N, dim, S)`` in either of vLLM's layouts (a view of ``[N, S, dim]``, or the
    dim-first allocation itself), history in the first W-1 rows. The C++ kernel skips no
    slot; here a slot of -1 (which it would write outside the pool) is skipped and every other
    one, 0 included, is processed. Returns ``(dim, T)``."""
    y = prefill(
        ENGINE, x.transpose(0, 1), _unpacked(weight, is_weight_packed), bias,
        conv_states.transpose(-1, -2), query_start_loc, cache_indices, has_initial_state,
        "silu" if silu_activation else None, PAD_SLOT_ID,
    )
    return y.transpose(0, 1)


@mark
def gdn_causal_conv1d_update_cpu(
    *,
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_activation: bool,
    conv_state_indices: torch.Tensor,
    is_weight_packed: bool,
    num_accepted_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM-CPU's GDN decode / verify wrapper (``gdn_attention._causal_conv1d_update_cpu``, over
    ``torch.ops._C.causal_conv1d_update_cpu``): x ``[B, dim]`` or ``[B, L, dim]`` (verify, with
    num_accepted_tokens ``[B]``), conv_states ``(N, dim, S)`` as in
    :func:`gdn_causal_conv1d_fwd_cpu`, weight packed or ``[dim, W]``. Slot rule as there.
    Returns x's shape."""
    return decode(
        ENGINE, x, conv_states.transpose(-1, -2), _unpacked(weight, is_weight_packed), bias,
        "silu" if silu_activation else None, conv_state_indices, num_accepted_tokens, PAD_SLOT_ID,
    )


@dataclass(frozen=True)
class Convention:
    """Which padding rule the loaded vLLM declares, and what it was read from."""

    null_block: bool
    evidence: str

    def __str__(self) -> str:
        rule = "null block" if self.null_block else "pad_slot_id (before the null block)"
        return f"{rule}: {self.evidence}"


def _vllm_version() -> str | None:
    """The loaded vLLM's version, from its own module, else the distribution's metadata
    (vLLM-CPU ships as ``vllm-cpu``); nothing is imported."""
    for name in ("vllm.version", "vllm._version", "vllm"):
        value = getattr(sys.modules.get(name), "__version__", None)
        if isinstance(value, str):
            return value
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def convention() -> Convention:
    """The padding rule of the loaded vLLM, read from its declarations, never from its kernels:
    ``NULL_BLOCK_ID`` in ``vllm.v1.attention.backends.utils`` (loaded by vLLM's conv module,
    which imports its padding ids from there) means padded state indices are the null block.
    A vLLM whose conv module does not load that module predates it (and the null block).
    RuntimeError when vLLM declares values other than the ones these adapters mirror."""
    version = _vllm_version()
    at = f"vLLM {version}" if version else "vLLM (version unknown)"
    utils = sys.modules.get(UTILS_MODULE)
    if utils is None:
        return Convention(False, f"{at}; {UTILS_MODULE} not loaded by its conv module")
    declared = {name: vars(utils)[name] for name in ("PAD_SLOT_ID", "NULL_BLOCK_ID") if name in vars(utils)}
    if declared.get("PAD_SLOT_ID", PAD_SLOT_ID) != PAD_SLOT_ID:
        raise RuntimeError(f"{at} declares PAD_SLOT_ID = {declared['PAD_SLOT_ID']!r}; these "
                           f"adapters mirror {PAD_SLOT_ID}")
    if "NULL_BLOCK_ID" not in declared:
        return Convention(False, f"{at}; {UTILS_MODULE} declares no NULL_BLOCK_ID")
    if declared["NULL_BLOCK_ID"] != NULL_BLOCK_ID:
        raise RuntimeError(f"{at} declares NULL_BLOCK_ID = {declared['NULL_BLOCK_ID']!r}; these "
                           f"adapters mirror {NULL_BLOCK_ID}")
    return Convention(True, f"{at}; {UTILS_MODULE}.NULL_BLOCK_ID = {NULL_BLOCK_ID}")


def _adapter_for(original: Any, null_block: bool, prefill: bool) -> Callable[..., Any]:
    """The adapter mirroring ``original``: vLLM-CPU's own functions are told by where they are
    declared (module and name, as vLLM-CPU binds them under the generic names); anything else
    follows the release's convention."""
    origin = (getattr(original, "__module__", None), getattr(original, "__name__", None))
    if origin == (CPU_MODULE, "causal_conv1d_fn_cpu"):
        return causal_conv1d_fn_cpu
    if origin == (CPU_MODULE, "causal_conv1d_update_cpu"):
        return causal_conv1d_update_cpu
    if prefill:
        return causal_conv1d_fn if null_block else causal_conv1d_fn_legacy
    return causal_conv1d_update if null_block else causal_conv1d_update_legacy


def plugin_packages() -> tuple[str, ...]:
    """Top-level packages of the installed vLLM platform plugins (their entry points' modules;
    nothing is imported)."""
    try:
        eps = importlib.metadata.entry_points(group=PLUGIN_GROUP)
    except Exception:  # broken metadata: no plugin packages can be told
        return ()
    return tuple(sorted({ep.module.split(".")[0] for ep in eps if ep.module}))


def patch(*, also: Sequence[str] = (), build: bool = False) -> Patch:
    """Replace vLLM's ``causal_conv1d_fn`` and ``causal_conv1d_update`` (and vLLM-CPU's
    ``causal_conv1d_fn_cpu`` / ``causal_conv1d_update_cpu``) with these adapters wherever vLLM's
    own loaded modules bind them: modules under ``vllm`` and under the packages of installed
    vLLM platform plugins, plus the modules named in ``also`` (and their submodules). Never
    ``__main__`` or other modules of yours unless named; nothing is imported.

    vLLM-CPU's GDN layers call its C++ conv kernels through two wrappers of
    ``ops/cpu/gdn_attention.py``; those are replaced too (:func:`gdn_causal_conv1d_fwd_cpu`,
    :func:`gdn_causal_conv1d_update_cpu`), so Qwen3-Next-style layers are dispatched as well.

    Each binding gets the adapter that mirrors its function's padding rule (:func:`convention`,
    read from vLLM's declarations). ``patch()`` never compiles: a variant that would build on its
    first call is left out of the routing with one :class:`IntegrationWarning` naming
    ``kv build``, or, with ``build=True``, built before this returns (announced on stderr).

    Returns the undo handle (:class:`Patch`, its ``convention`` set): ``.undo()``, or
    ``with patch(): ...``. Raises RuntimeError when vLLM's conv module is not loaded, or is
    already patched.
    """
    names = module_names(also)
    rule = convention()
    handle = patch_engine("vllm", {
        module: {
            name: (lambda original, pre=prefill: _adapter_for(original, rule.null_block, pre))
            for name, prefill in functions.items()
        }
        for module, functions in {
            MODULE: {"causal_conv1d_fn": True, "causal_conv1d_update": False},
            CPU_MODULE: {"causal_conv1d_fn_cpu": True, "causal_conv1d_update_cpu": False},
        }.items()
    } | {GDN_MODULE: {
        "_causal_conv1d_fwd_cpu": lambda original: gdn_causal_conv1d_fwd_cpu,
        "_causal_conv1d_update_cpu": lambda original: gdn_causal_conv1d_update_cpu,
    }}, prefixes=("vllm", *plugin_packages()), also=names, build=build)
    handle.convention = rule
    return handle


#: Environment variable that opts vLLM's processes into patch() at start (see :func:`plugin`).
PLUGIN_ENV = "KV_VLLM_PATCH"
_plugin_patch: Patch | None = None


def plugin() -> Patch | None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it at the start of every process it
    runs (``vllm serve``'s API server, engine core and workers; ``LLM(...)``'s too), so that
    those processes are patched without code of yours. Opt-in: nothing happens unless
    ``KV_VLLM_PATCH`` is ``1`` (patch, leaving out variants not built) or ``build`` (patch, and
    build them first). vLLM may call it more than once per process; it patches once. Announces
    what it did on stderr. Returns the handle (also kept for the process's lifetime)."""
    global _plugin_patch
    raw = os.environ.get(PLUGIN_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return None
    if raw not in ("1", "true", "yes", "on", "build"):
        raise ValueError(f"{PLUGIN_ENV}: expected 1 (patch) or build (build, then patch), got {raw!r}")
    if _plugin_patch is not None and _plugin_patch.active:
        return _plugin_patch
    # The one import here: vLLM's own conv module, which patch() needs loaded; importing it at
    # process start is what vLLM's model code does moments later.
    importlib.import_module(MODULE)
    _plugin_patch = patch(build=raw == "build")
    print(f"kernel_variants: patched vLLM's conv functions in process {os.getpid()} "
          f"({len(_plugin_patch.replaced)} bindings; {_plugin_patch.convention})",
          file=sys.stderr, flush=True)
    return _plugin_patch
