"""sglang drop-ins: its causal_conv1d functions, CUDA and Ascend, with their own signatures,
running kernel_variants' ops.

Three lines inside a running sglang worker::

    from kernel_variants.integrations import sglang as kv_sglang
    handle = kv_sglang.patch()    # every loaded binding of sglang's conv functions now runs ours
    ...; handle.undo()            # or: with kv_sglang.patch(): ...

What is covered, by the module that defines the original:

- ``sglang.srt.layers.attention.mamba.causal_conv1d_triton``: :func:`causal_conv1d_fn`
  (prefill, with ``seq_lens_cpu``) and :func:`causal_conv1d_update`.
- ``sglang.srt.layers.attention.mamba.causal_conv1d`` (the sgl_kernel CUDA wrappers):
  :func:`causal_conv1d_fn_cuda` and :func:`causal_conv1d_update_cuda`.
- ``sgl_kernel_npu.mamba.causal_conv1d``, which sglang's Ascend backends import by name (and
  alias, ``causal_conv1d_fn = causal_conv1d_fn_npu``): :func:`causal_conv1d_fn_npu`,
  :func:`causal_conv1d_update_npu`, :func:`causal_conv1d_update_v2`. ``patch()`` replaces
  them in sglang's modules, not in sgl_kernel_npu itself, whose kernels kernel_variants'
  own Ascend variants call.
- :func:`npu_causal_conv1d` has the schema of the Ascend C op ``torch.ops.npu.causal_conv1d``
  that sglang's newer Ascend GDN/KDA backends call directly. ``patch()`` does not install it:
  that would mean rewriting the global ``torch.ops.npu`` namespace, which kernel_variants'
  ``asc`` variant itself calls (a loop). Call it in place of the op by hand.

Layouts (all mapped with views): sglang's CUDA pool is ``[N, dim, W-1]`` (channel-first),
the Ascend pool ``[N, S, dim]`` (window-major); prefill ``x`` is ``(dim, T)``, the transpose of
``[T, dim]``; verify ``x`` is ``(B, dim, L)``, the transpose of ``[B, L, dim]``; the Ascend C op
and ``causal_conv1d_update_v2`` are channel-last with weight ``[W, dim]``, the others take
``(dim, W)``. As in vLLM, a slot's history is its first W-1 rows (W-1+L-1 with
``num_accepted_tokens``), and only those rows are handed to the ops.

Not supported (NotImplementedError naming it): sglang's own speculative machinery
(``intermediate_conv_window``, ``intermediate_state_indices``, ``retrieve_next_token``,
``retrieve_next_sibling``, ``retrieve_parent_token``), the circular buffer
(``cache_seqlens``), prefix caching (``block_idx_last_scheduled_token``,
``initial_state_idx``), x and state or weight of different dtypes. Accepted and ignored:
``metadata``, ``validate_data`` and (sglang ignores them too) any other keyword the prefill
functions' ``**kwargs`` take.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kernel_variants.integrations._patching import Patch, module_names, patch_engine
from kernel_variants.integrations._sglang_adapters import (
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_fn_cuda,
    causal_conv1d_fn_npu,
    causal_conv1d_update,
    causal_conv1d_update_cuda,
    causal_conv1d_update_npu,
    causal_conv1d_update_v2,
    npu_causal_conv1d,
)

TRITON_MODULE = "sglang.srt.layers.attention.mamba.causal_conv1d_triton"
CUDA_MODULE = "sglang.srt.layers.attention.mamba.causal_conv1d"
NPU_MODULE = "sgl_kernel_npu.mamba.causal_conv1d"

__all__ = [
    "CUDA_MODULE",
    "NPU_MODULE",
    "PAD_SLOT_ID",
    "TRITON_MODULE",
    "Patch",
    "causal_conv1d_fn",
    "causal_conv1d_fn_cuda",
    "causal_conv1d_fn_npu",
    "causal_conv1d_update",
    "causal_conv1d_update_cuda",
    "causal_conv1d_update_npu",
    "causal_conv1d_update_v2",
    "npu_causal_conv1d",
    "patch",
]


def _same(adapter: Callable[..., Any]) -> Callable[[Any], Any]:
    return lambda original: adapter


def patch(*, also: Sequence[str] = (), build: bool = False) -> Patch:
    """Replace sglang's causal_conv1d functions with these adapters wherever sglang's own loaded
    modules (under ``sglang``) bind them, plus the modules named in ``also``: sglang's Triton
    and sgl_kernel wrapper modules and everything of sglang's that imported from them, and the
    sglang modules that imported sgl_kernel_npu's functions by name (or aliased them). Never
    ``__main__`` or other modules of yours unless named; sgl_kernel_npu's own module and
    ``torch.ops.npu.causal_conv1d`` are left alone (see the module docstring). sglang must
    already be imported; nothing is imported.

    ``patch()`` never compiles: a variant that would build on its first call is left out of the
    routing with one :class:`IntegrationWarning` naming ``kv build``, or, with ``build=True``,
    built before this returns (announced on stderr).

    Returns the undo handle (:class:`Patch`): ``.undo()``, or ``with patch(): ...``.
    Raises RuntimeError when none of those modules is loaded, or when already patched.
    """
    return patch_engine(
        "sglang",
        {
            TRITON_MODULE: {
                "causal_conv1d_fn": _same(causal_conv1d_fn),
                "causal_conv1d_update": _same(causal_conv1d_update),
            },
            CUDA_MODULE: {
                "causal_conv1d_fn": _same(causal_conv1d_fn_cuda),
                "causal_conv1d_update": _same(causal_conv1d_update_cuda),
            },
            NPU_MODULE: {
                "causal_conv1d_fn_npu": _same(causal_conv1d_fn_npu),
                "causal_conv1d_update_npu": _same(causal_conv1d_update_npu),
                "causal_conv1d_update_v2": _same(causal_conv1d_update_v2),
            },
        },
        prefixes=("sglang",),
        also=module_names(also),
        keep=("sgl_kernel_npu",),
        build=build,
    )
