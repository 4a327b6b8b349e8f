"""vLLM's gated RMSNorm layers through vLLM's own out-of-tree mechanism: ``CustomOp.register_oot``
(``vllm/model_executor/custom_op.py``) makes every later construction of a registered class,
told by its class name, build the subclass registered for it instead. Two are registered:

- ``Mixer2RMSNormGated`` (Mamba2's ``mamba_mixer2.py``): ``kernel_variants.gated_rms_norm`` with
  ``group_size = full_hidden_size / n_groups``, the gate before the norm, silu, as its
  ``forward_native``; with ``use_rms_norm=False`` or tensor parallelism (its norm then reduces
  across ranks) the original forward runs.
- ``RMSNormGated`` (``layers/layernorm.py``: Qwen3-Next's GDN output norm and others):
  ``gated_rms_norm`` with the layer's own ``group_size``, ``norm_before_gate`` and activation,
  the semantics of its ``forward_static``.

Each subclass's forwards (``forward_native`` and the per-platform ones, whichever vLLM's
``dispatch_forward`` picks) call the op; the dispatcher picks the variant per shape. Only layers
built after registration are affected: vLLM calls the package's general plugin (which registers
them under ``KV_VLLM_PATCH``) at the start of each process, before any model is built.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import kernel_variants

MIXER2_MODULE = "vllm.model_executor.layers.mamba.mamba_mixer2"
LAYERNORM_MODULE = "vllm.model_executor.layers.layernorm"
CUSTOM_OP_MODULE = "vllm.model_executor.custom_op"
#: The classes registered for: (module, class name).
TARGETS = ((MIXER2_MODULE, "Mixer2RMSNormGated"), (LAYERNORM_MODULE, "RMSNormGated"))
_FORWARDS = ("forward_native", "forward_cpu", "forward_cuda", "forward_hip", "forward_xpu", "forward_oot")


def _mixer2(base: type) -> type:
    def forward_native(self: Any, x: Any, gate: Any) -> Any:
        if not self.use_rms_norm or self.tp_size > 1:
            return base.forward_native(self, x, gate)
        return kernel_variants.gated_rms_norm(x, gate, self.weight, float(self.variance_epsilon),
                                              group_size=self.group_size, norm_before_gate=False,
                                              activation="silu")

    return type("KvMixer2RMSNormGated", (base,), {name: forward_native for name in _FORWARDS}
                | {"__doc__": "Mixer2RMSNormGated whose forward is kernel_variants.gated_rms_norm."})


def _gated(base: type) -> type:
    def forward_native(self: Any, x: Any, z: Any = None) -> Any:
        return kernel_variants.gated_rms_norm(x, z, self.weight, float(self.eps), group_size=self.group_size,
                                              norm_before_gate=self.norm_before_gate, activation=self.activation)

    return type("KvRMSNormGated", (base,), {name: forward_native for name in _FORWARDS}
                | {"__doc__": "RMSNormGated whose forward is kernel_variants.gated_rms_norm."})


_MAKERS = {"Mixer2RMSNormGated": _mixer2, "RMSNormGated": _gated}


def register_gated_norms() -> tuple[str, ...]:
    """Register the two subclasses with ``CustomOp.register_oot`` (importing vLLM's two layer
    modules); returns the class names registered now. Idempotent: a name already registered by
    kernel_variants is left as it is; one registered by someone else is left to them (and not
    returned); a layer this vLLM does not have is skipped."""
    try:
        registry = importlib.import_module(CUSTOM_OP_MODULE).op_registry_oot
    except (ImportError, AttributeError):  # a vLLM without the out-of-tree registry
        return ()
    done = []
    for module_name, name in TARGETS:
        try:
            base = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):  # a vLLM without this layer: nothing to register
            continue
        held = registry.get(name)
        if held is not None:
            continue  # ours from an earlier call, or another plugin's: either way, it stands
        base.register_oot(_MAKERS[name](base))
        done.append(name)
    return tuple(done)


def unregister_gated_norms() -> None:
    """Take back what :func:`register_gated_norms` registered (layers already built keep theirs)."""
    module = sys.modules.get(CUSTOM_OP_MODULE)
    registry = getattr(module, "op_registry_oot", {})
    for _, name in TARGETS:
        held = registry.get(name)
        if held is not None and held.__name__ == f"Kv{name}":
            del registry[name]
