"""gated_rms_norm's ``cpu_native`` against vLLM's composites, side by side in one run, one thread,
timed in alternating rounds: Mamba2's gated norm (``Mixer2RMSNormGated.forward_native``'s
formula: the gate before the norm, SiLU, one group or groups of 128) at D=4096, and Qwen3-Next's
GDN output norm (``RMSNormGated.forward_static``: the gate after the norm, D=128 per head, rows =
tokens x 32 heads). Every variant is checked against the reference first. A ratio is cpu_native's
time over the composite's (the target: at most 0.5).

    python tools/bench_gated_rms_norm.py [--dtype bf16] [--windows 5]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _report import cpu_model  # a sibling module: tools/ is sys.path[0]

from kernel_variants._dtypes import as_dtype
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._tolerances import mismatch
from kernel_variants._tuning.timing import Timing, TimingConfig, measure_interleaved
from kernel_variants.ops.gated_rms_norm._spec import reference

TOKENS = (1, 16, 256, 1024)
# (label, rows per token, D, group_size, norm_before_gate)
FORMS = (("mamba2 1 group", 1, 4096, None, False), ("mamba2 groups of 128", 1, 4096, 128, False),
         ("gdn x32 heads", 32, 128, None, True))


def mixer2_native(x, gate, weight, eps, group_size):
    """vLLM's Mixer2RMSNormGated.forward_native (tp 1), written out in torch."""
    input_dtype = x.dtype
    x = x * F.silu(gate.to(torch.float32))
    if group_size is None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    else:
        *prefix, hidden = x.shape
        g = x.view(*prefix, hidden // group_size, group_size)
        x = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view(*prefix, hidden)
    return weight * x.to(input_dtype)


def forward_static(x, z, weight, eps, group_size, norm_before_gate):
    """vLLM's RMSNormGated.forward_static (SiLU), written out in torch."""
    orig_dtype = x.dtype
    x, weight, z = x.float(), weight.float(), z.float()
    if not norm_before_gate:
        x = x * F.silu(z)
    g = x if group_size is None else x.unflatten(-1, (-1, group_size))
    out = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2 if group_size else -1) * weight
    if norm_before_gate:
        out = out * F.silu(z)
    return out.to(orig_dtype)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--windows", type=int, default=5)
    args = p.parse_args(argv)
    native = dispatcher().registry.get("gated_rms_norm", "cpu_native")
    if native.ensure_built() is not None:
        raise SystemExit(f"cpu_native unavailable: {native.unavailable_reason()}")
    fn = native.variant.fn
    dtype = as_dtype(args.dtype)
    eps = 1e-6
    torch.set_num_threads(1)
    timing = TimingConfig(warmup=2, windows=args.windows, iters=20, window_budget_s=0.1)
    print(f"{cpu_model()}, torch {torch.__version__}, {args.dtype}, 1 thread; best window, timed in alternating "
          "rounds; ratio = cpu_native / vLLM's composite")
    print(f"{'form':22} {'rows':>6} {'D':>5} {'cpu_native':>11} {'composite':>10} {'ratio':>6}")
    for label, heads, d, gs, after in FORMS:
        for t in TOKENS:
            rows = t * heads
            g = torch.Generator().manual_seed(rows * d)
            x, z = (torch.randn(rows, d, generator=g).to(dtype) for _ in range(2))
            w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
            want = reference(x, z, w, eps, gs, after)
            if after:
                def composite(x=x, z=z, w=w, gs=gs):
                    return forward_static(x, z, w, eps, gs, True)
            else:
                def composite(x=x, z=z, w=w, gs=gs):
                    return mixer2_native(x, z, w, eps, gs)

            def ours(x=x, z=z, w=w, gs=gs, after=after):
                return fn(x, z, w, eps, gs, after)

            for name, f in (("cpu_native", ours), ("composite", composite)):
                why = mismatch(f(), want, name)
                if why is not None:
                    raise SystemExit(f"{label} rows={rows}: {why}")
            timed = measure_interleaved({"ours": [ours], "composite": [composite]}, "cpu", timing)
            us = {}
            for k, v in timed.items():
                if not isinstance(v, Timing):
                    raise SystemExit(f"{label} rows={rows}: {k} failed: {v}")
                us[k] = v.best_us
            print(f"{label:22} {rows:6d} {d:5d} {us['ours']:8.1f} us {us['composite']:7.1f} us "
                  f"{us['ours'] / us['composite']:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
