"""The registration list: every built-in plugin, in load order (plugin name, module).

Built-ins register through the same hooks as third parties. The op plugins come first and are
essential: ``KV_DISABLE_PLUGINS`` cannot block them, since each brings its op's reference, the
oracle every other variant is checked against.

Declared here, at the top of the package, beside the namespace that offers the ops: the registry
stands below every plugin and names none; ``kernel_variants/__init__`` hands this list to it
(``_registry/declared.py``) and ``make_plugin_manager`` imports each module by its name here.
"""

from __future__ import annotations

ESSENTIAL_PLUGINS: tuple[str, ...] = ("causal_conv1d", "gemma_rms_norm", "rms_norm", "gated_rms_norm", "ssm", "gdn")

BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("causal_conv1d", "kernel_variants.ops.causal_conv1d"),
    ("gemma_rms_norm", "kernel_variants.ops.gemma_rms_norm"),
    ("rms_norm", "kernel_variants.ops.rms_norm"),
    ("ssm", "kernel_variants.ops.ssm"),
    ("gdn", "kernel_variants.ops.gdn"),
    ("gated_rms_norm", "kernel_variants.ops.gated_rms_norm"),
    ("torch_shift", "kernel_variants.kernels.torch_shift"),
    ("aten", "kernel_variants.kernels.aten"),
    ("cpu_native", "kernel_variants.kernels.cpu_native"),
    ("vllm_cpu", "kernel_variants.kernels.vllm_cpu"),
    ("vllm_cpu_ssm", "kernel_variants.kernels.vllm_cpu_ssm"),
    ("vllm_cpu_gdn", "kernel_variants.kernels.vllm_cpu_gdn"),
    ("asc", "kernel_variants.kernels.asc"),
    ("pto", "kernel_variants.kernels.pto"),
    ("npu_triton", "kernel_variants.kernels.npu_triton"),
    ("npu_conv_update", "kernel_variants.kernels.npu_conv_update"),
    ("triton", "kernel_variants.kernels.triton_conv"),
    ("dao", "kernel_variants.kernels.dao"),
    ("rms_aten", "kernel_variants.kernels.rms_aten"),
    ("npu_rms_norm", "kernel_variants.kernels.npu_rms_norm"),
    ("triton_rms_norm", "kernel_variants.kernels.triton_rms_norm"),
    ("cpu_rms_norm", "kernel_variants.kernels.cpu_rms_norm"),
    ("cpu_ssm", "kernel_variants.kernels.cpu_ssm"),
    ("cpu_gdn", "kernel_variants.kernels.cpu_gdn"),
    ("vllm_ir", "kernel_variants.kernels.vllm_ir"),
    ("ssm_torch", "kernel_variants.kernels.ssm_torch"),
    ("gdn_torch", "kernel_variants.kernels.gdn_torch"),
)
