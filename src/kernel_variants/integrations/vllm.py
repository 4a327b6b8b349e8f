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

from kernel_variants._runtime.shadow import ENV as SHADOW_ENV
from kernel_variants._runtime.shadow import parse_rate
from kernel_variants.integrations._common import IntegrationWarning
from kernel_variants.integrations._patching import CONV_OPS, Patch, module_names, patch_engine
from kernel_variants.integrations._vllm_adapters import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_fn_legacy,
    causal_conv1d_update,
    causal_conv1d_update_legacy,
)
from kernel_variants.integrations._vllm_cpu import (
    CPU_MODULE,
    GDN_MODULE,
    causal_conv1d_fn_cpu,
    causal_conv1d_update_cpu,
    gdn_causal_conv1d_fwd_cpu,
    gdn_causal_conv1d_update_cpu,
    unpack_weight,
)
from kernel_variants.integrations._vllm_gated import register_gated_norms, unregister_gated_norms
from kernel_variants.integrations._vllm_gdn import (
    DECODE_NAME,
    GATING_NAME,
    OPS_MODULE,
    PREFILL_NAME,
    chunk_gated_delta_rule_cpu,
    fused_gdn_gating_cpu,
    fused_sigmoid_gating_delta_rule_update_cpu,
)
from kernel_variants.integrations._vllm_gdn import remember as remember_gdn
from kernel_variants.integrations._vllm_ir import PROVIDER as IR_PROVIDER
from kernel_variants.integrations._vllm_ir import register_provider as register_ir_provider
from kernel_variants.integrations._vllm_ssm import (
    SSD_MODULE,
    SSD_NAME,
    SSU_MODULE,
    SSU_NAME,
    mamba_chunk_scan_combined_varlen,
    remember,
    selective_state_update,
)

#: Where vLLM defines the two functions; everything else binding them is found from there.
MODULE = "vllm.model_executor.layers.mamba.ops.causal_conv1d"

__all__ = [
    "CPU_MODULE",
    "GDN_MODULE",
    "IR_PROVIDER",
    "MODULE",
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "PLUGIN_ENV",
    "SSD_MODULE",
    "SSU_MODULE",
    "Convention",
    "IntegrationWarning",
    "Patch",
    "causal_conv1d_fn",
    "causal_conv1d_fn_cpu",
    "causal_conv1d_fn_legacy",
    "causal_conv1d_update",
    "causal_conv1d_update_cpu",
    "causal_conv1d_update_legacy",
    "chunk_gated_delta_rule_cpu",
    "convention",
    "fused_gdn_gating_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "gdn_causal_conv1d_fwd_cpu",
    "gdn_causal_conv1d_update_cpu",
    "mamba_chunk_scan_combined_varlen",
    "patch",
    "plugin",
    "register_gated_norms",
    "register_ir_provider",
    "selective_state_update",
    "unpack_weight",
    "unregister_gated_norms",
]

#: Where vLLM declares its padding ids; NULL_BLOCK_ID appears there with the null block.
UTILS_MODULE = "vllm.v1.attention.backends.utils"
#: The ops the adapters route to (patch() leaves out, or builds, those variants that would compile).
OPS = (*CONV_OPS, "selective_state_update", "ssd_chunk_scan", "gated_rms_norm")
#: The packages ``patch()`` looks in besides vLLM's: its platform plugins (entry points).
PLUGIN_GROUP = "vllm.platform_plugins"

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


def patch(*, also: Sequence[str] = (), build: bool = False, shadow: float = 0.0) -> Patch:
    """Replace vLLM's ``causal_conv1d_fn`` and ``causal_conv1d_update`` (and vLLM-CPU's
    ``causal_conv1d_fn_cpu`` / ``causal_conv1d_update_cpu``) with these adapters wherever vLLM's
    own loaded modules bind them: modules under ``vllm`` and under the packages of installed
    vLLM platform plugins, plus the modules named in ``also`` (and their submodules). Never
    ``__main__`` or other modules of yours unless named; nothing is imported.

    vLLM-CPU's GDN layers call its C++ conv kernels through two wrappers of
    ``ops/cpu/gdn_attention.py``; those are replaced too (:func:`gdn_causal_conv1d_fwd_cpu`,
    :func:`gdn_causal_conv1d_update_cpu`), so Qwen3-Next-style layers are dispatched as well.

    Mamba2's selective scan goes through the dispatcher too: ``ssu_dispatch.selective_state_update``
    (decode) and ``ssd_combined.mamba_chunk_scan_combined_varlen`` (prefill) are replaced by
    :func:`selective_state_update` and :func:`mamba_chunk_scan_combined_varlen`, which run
    vLLM's own function for the calls the ops do not cover (speculative decode, per-channel A,
    prefix-caching checkpoints; ``integrations/_vllm_ssm.py``). So does vLLM-CPU's gated delta
    rule: ``vllm._custom_ops``' ``fused_sigmoid_gating_delta_rule_update_cpu`` (decode),
    ``chunk_gated_delta_rule_cpu`` (prefill) and ``fused_gdn_gating_cpu`` (:func:`kernel_variants.gdn_gating`)
    (``integrations/_vllm_gdn.py``). The gated norms are not
    patched here but registered with vLLM's ``CustomOp.register_oot`` (:func:`register_gated_norms`),
    which must happen before the model is built (:func:`plugin` does both).

    Each binding gets the adapter that mirrors its function's padding rule (:func:`convention`,
    read from vLLM's declarations). ``patch()`` never compiles: a variant that would build on its
    first call is left out of the routing with one :class:`IntegrationWarning` naming
    ``kv build``, or, with ``build=True``, built before this returns (announced on stderr).

    ``shadow`` (0 to 1, default 0): that share of each replaced function's calls (sampled per
    function, deterministically given ``KV_SHADOW_SEED``) also runs vLLM's own function on
    copies of the call's tensors, and the adapter's outcome is judged against it: outputs at
    the op's tolerance for the dtype, the state pool bit for bit, pad slots untouched. On a
    mismatch the caller gets vLLM's outcome, the variants that served fail that class of calls
    here (``kv shadow`` lists it, ``kv shadow --replay FILE`` judges it again).

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
    }, SSU_MODULE: {SSU_NAME: remember(SSU_NAME, selective_state_update)},
        SSD_MODULE: {SSD_NAME: remember(SSD_NAME, mamba_chunk_scan_combined_varlen)},
        OPS_MODULE: {DECODE_NAME: remember_gdn(DECODE_NAME, fused_sigmoid_gating_delta_rule_update_cpu),
                     GATING_NAME: remember_gdn(GATING_NAME, fused_gdn_gating_cpu),
                     PREFILL_NAME: remember_gdn(PREFILL_NAME, chunk_gated_delta_rule_cpu)},
    }, prefixes=("vllm", *plugin_packages()), also=names, ops=OPS, build=build, shadow=shadow)
    handle.convention = rule
    return handle


#: Environment variable that opts vLLM's processes into patch() at start (see :func:`plugin`).
PLUGIN_ENV = "KV_VLLM_PATCH"
_plugin_patch: Patch | None = None


def plugin() -> Patch | None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it at the start of every process it
    runs (``vllm serve``'s API server, engine core and workers; ``LLM(...)``'s too), so that
    those processes are patched without code of yours.

    It always registers kernel_variants as the vLLM IR provider ``kernel_variants`` of
    ``rms_norm`` and ``fused_add_rms_norm`` where ``vllm.ir`` imports
    (:func:`register_ir_provider`): harmless, since vLLM uses it only where the kernel config's
    ``ir_op_priority`` names it (docs/integrations.md). The patch is opt-in: nothing more
    happens unless ``KV_VLLM_PATCH`` is ``1`` (patch, leaving out variants not built) or
    ``build`` (patch, and build them first); ``KV_SHADOW`` is the patch's ``shadow`` rate there.
    With it, the gated norms are registered too (:func:`register_gated_norms`).
    vLLM may call it more than once per process; it registers and patches once. Announces the
    patch on stderr. Returns the patch's handle (also kept for the process's lifetime), or None."""
    global _plugin_patch
    register_ir_provider()
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
    gated = register_gated_norms()  # imports Mamba2's layer module, and with it the scan's functions
    _plugin_patch = patch(build=raw == "build", shadow=parse_rate(os.environ.get(SHADOW_ENV, "")))
    print(f"kernel_variants: patched vLLM's conv functions in process {os.getpid()} "
          f"({len(_plugin_patch.replaced)} bindings; {_plugin_patch.convention}"
          + (f"; {', '.join(gated)} registered out of tree" if gated else "")
          + (f"; shadowed at rate {_plugin_patch.shadow:g}" if _plugin_patch.shadow else "") + ")",
          file=sys.stderr, flush=True)
    return _plugin_patch
