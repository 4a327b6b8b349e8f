"""Drop-ins for inference engines: functions with vLLM's and sglang's own causal_conv1d signatures
that run kernel_variants' dispatched ops, and ``patch()`` to swap them into a running engine.

:mod:`kernel_variants.integrations.vllm` and :mod:`kernel_variants.integrations.sglang` never
import their engine; ``patch()`` only looks at modules the engine has already loaded.
"""
