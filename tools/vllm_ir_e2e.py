"""One generate run of a tiny dense model (Qwen3-shaped, fp32, random weights from a local config,
no download) on vLLM-CPU, with or without kernel_variants first in vLLM IR's ``ir_op_priority``
for ``rms_norm`` and ``fused_add_rms_norm``, eager or under vLLM's torch.compile; prints one JSON
line: the token ids, how many RMSNorm calls vLLM's own ``native`` provider ran eagerly, and how
many the dispatcher served (eager: kv.rms_norm / kv.fused_add_rms_norm; compiled: the library's
custom ops as the compiled graph calls them, read from the profiler). ``tools/vllm_cpu_e2e.sh``
runs it four ways and compares.

    python tools/vllm_ir_e2e.py --dir /tmp/q [--provider] [--compiled]

The provider is registered by the package's ``vllm.general_plugins`` entry point, as in
``vllm serve``; the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the
counters see its calls. Only the generate call is counted (not the engine's warm-up runs).
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

CONFIG = {  # hidden 64, 2 layers: input/post-attention norms (the add form), q/k norms, final norm
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128,
    "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "float32",
}
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 64, 11], [300, 301, 302], [9] * 37, [77, 1, 400, 23, 5]]
OPS = ("rms_norm", "fused_add_rms_norm")
COUNTS: dict[str, int] = {}
COUNTING = [False]  # only the generate call is counted


def _counted(name: str, fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        if COUNTING[0]:
            COUNTS[name] = COUNTS.get(name, 0) + 1
        return fn(*args, **kwargs)

    return counted


def _reseed(model) -> None:
    """Weights at a scale where the norms matter to the logits (vLLM's dummy weights are flat)."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                values = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
            else:
                values = torch.randn(p.shape, generator=gen) / math.sqrt(max(p.shape[-1] if p.ndim > 1 else 1, 1))
            p.copy_(values.to(p.dtype))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="where to write the model's config.json")
    ap.add_argument("--provider", action="store_true", help="kernel_variants first in ir_op_priority")
    ap.add_argument("--compiled", action="store_true", help="vLLM's torch.compile (no enforce_eager)")
    ap.add_argument("--tokens", type=int, default=12)
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    (args.dir / "config.json").write_text(json.dumps(CONFIG, indent=1))

    import torch
    import vllm.ir.ops as ir_ops

    import kernel_variants as kv

    for op in OPS:  # vLLM's own provider, as it runs eagerly
        impl = getattr(ir_ops, op).impls["native"]
        impl.impl_fn = _counted(f"native.{op}", impl.impl_fn)
        setattr(kv, op, _counted(f"kv.{op}", getattr(kv, op)))  # what the provider calls eagerly
    from vllm import LLM, SamplingParams

    priority = {op: ["kernel_variants"] for op in OPS} if args.provider else {}
    llm = LLM(model=str(args.dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=not args.compiled,
              dtype="float32", max_model_len=256, seed=0, max_num_seqs=4, gpu_memory_utilization=0.1,
              ir_op_priority=priority)
    llm.apply_model(_reseed)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    COUNTING[0] = True
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    COUNTING[0] = False
    graph_calls = {op: sum(e.count for e in prof.key_averages() if e.key == f"kernel_variants::{op}") for op in OPS}
    from kernel_variants._runtime.dispatcher import dispatcher

    served = sorted({vid for text, (_, vid) in dispatcher().decided.items() if "rms_norm" in text})
    print(json.dumps({
        "pid": os.getpid(), "provider": args.provider, "compiled": args.compiled,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "native": sum(COUNTS.get(f"native.{op}", 0) for op in OPS),
        "dispatched": sum(COUNTS.get(f"kv.{op}", 0) for op in OPS) + sum(graph_calls.values()),
        "counts": COUNTS, "graph_calls": graph_calls, "served_by": served,
        "priority": {op: getattr(ir_ops, op).get_priority() for op in OPS},
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
