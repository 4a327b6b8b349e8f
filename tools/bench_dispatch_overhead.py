"""Dispatch overhead: the public op against a direct call of the variant it dispatches to.

Two measurements, interleaved in one run so machine noise hits both alike:
- with a no-op variant pinned, the difference is exactly what the op adds (validation, memo
  lookup, the call), independent of any kernel's own time;
- on a tiny real shape, the dispatched call against the chosen variant called directly.
Reported with value checks on (the default) and off (KV_CHECK_VALUES=0). Target: <= 2 us added.

    python tools/bench_dispatch_overhead.py [--out reports]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import timeit

import torch
from _report import markdown_table, write_report  # a sibling module: tools/ is sys.path[0]

import kernel_variants as kv
from kernel_variants.dispatch import dispatcher, reset
from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.registry import Variant, hookimpl
from kernel_variants.registry._registry import Registry, make_plugin_manager


def _per_call_us(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports")
    p.add_argument("--number", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args(argv)
    os.environ["KV_CACHE_DIR"] = tempfile.mkdtemp(prefix="kv-overhead-")  # never the user's table
    torch.set_num_threads(1)

    B, L, D, W = 1, 1, 64, 4
    out_buf = torch.empty(B, L, D)

    def noop(x, weight, bias=None, **kw):
        return out_buf

    class NoopPlugin:
        @hookimpl
        def kv_register_variants(self, register):
            register(Variant(id="noop", op="causal_conv1d_fn", version="1", fn=noop,
                             capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"})))

    x, w, b = torch.randn(B, L, D), torch.randn(D, W), torch.randn(D)
    pool = torch.randn(4, W - 1, D)
    idx = torch.tensor([2], dtype=torch.int32)
    init = torch.tensor([True])
    kwargs = dict(conv_states=pool, cache_indices=idx, has_initial_state=init, activation="silu")

    rows, data = [], {}
    for checks in ("1", "0"):
        os.environ["KV_CHECK_VALUES"] = checks
        label = "value checks on" if checks == "1" else "value checks off"
        reset(Registry(make_plugin_manager(extra_plugins=[("noop", NoopPlugin())])))
        with kv.force(causal_conv1d_fn="noop"):
            dispatched = lambda: kv.causal_conv1d_fn(x, w, b, **kwargs)  # noqa: E731
            direct = lambda: noop(x, w, b, **kwargs)  # noqa: E731
            dispatched()
            pairs = [(_per_call_us(dispatched, args.number, 3), _per_call_us(direct, args.number, 3))
                     for _ in range(args.repeat)]
        added = min(d for d, _ in pairs) - min(r for _, r in pairs)
        rows.append(["no-op variant", label, min(d for d, _ in pairs), min(r for _, r in pairs), added])
        data[f"noop/{label}"] = {"dispatched_us": min(d for d, _ in pairs), "direct_us": min(r for _, r in pairs),
                                 "added_us": added, "added_median_us": statistics.median(d - r for d, r in pairs)}

        reset()
        dispatched = lambda: kv.causal_conv1d_fn(x, w, b, **kwargs)  # noqa: E731
        dispatched()
        vid, fn, _, _ = next(iter(dispatcher().memo.values()))
        direct = lambda: fn(x, w, b, **kwargs)  # noqa: E731
        pairs = [(_per_call_us(dispatched, args.number // 10, 3), _per_call_us(direct, args.number // 10, 3))
                 for _ in range(args.repeat)]
        d_us, r_us = min(d for d, _ in pairs), min(r for _, r in pairs)
        rows.append([f"{vid} (chosen)", label, d_us, r_us, d_us - r_us])
        data[f"{vid}/{label}"] = {"dispatched_us": d_us, "direct_us": r_us, "added_us": d_us - r_us}
    os.environ.pop("KV_CHECK_VALUES", None)

    table = markdown_table(["variant", "mode", "dispatched us", "direct us", "added us"], rows)
    text = (f"# Dispatch overhead (B={B}, L={L}, D={D}, W={W}, fp32, states + indices, 1 thread)\n\n"
            f"{table}\n\nTarget: <= 2 us added per call (eager, shape already seen).")
    print(text)
    md, js = write_report(args.out, "dispatch_overhead", text, data)
    print(f"\nwrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
