"""Dispatch overhead: the public op and a bound op (``kv.bind``) against a direct call of the
variant they run.

Interleaved in one run, so machine noise hits all alike:
- with a no-op variant pinned, the difference is exactly what the op adds (validation of index
  values, memo lookup, write guard, the call), independent of any kernel's own time;
- a "floor": a function with the op's signature that does one dict lookup and calls the variant,
  the least any Python-level dispatcher adds on this machine;
- on a tiny real shape, the dispatched call against the chosen variant called directly.
Value checks on (the default; always on on the CPU) and KV_CHECK_VALUES=0, in grad mode (as a
plain script runs) and under torch.inference_mode (as serving runs). Minimum over windows.
Target: <= 1.0 us added, value checks on. The bound call is how a fixed-shape loop meets it; the
dispatched call cannot in Python (see 'metadata read').

    python tools/bench_dispatch_overhead.py [--out reports]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import timeit

import torch
from _report import markdown_table, write_report  # a sibling module: tools/ is sys.path[0]

import kernel_variants as kv
from kernel_variants.dispatch import dispatcher, reset
from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.registry import Variant, hookimpl
from kernel_variants.registry._registry import Registry, make_plugin_manager

TARGET_US = 1.0


def _per_call_us(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def _floor(fn):
    """The op's signature, one dict lookup, the variant: what any Python dispatcher pays."""
    table = {("causal_conv1d_fn",): fn}

    def op(x, weight, bias=None, *, conv_states=None, cache_indices=None, has_initial_state=None,
           query_start_loc=None, activation=None, pad_slot_id=-1, out=None):
        return table.get(("causal_conv1d_fn",))(x, weight, bias, conv_states=conv_states, cache_indices=cache_indices,
                                                has_initial_state=has_initial_state, query_start_loc=query_start_loc,
                                                activation=activation, pad_slot_id=pad_slot_id)

    return op


def _measure(calls: dict[str, object], number: int, repeat: int) -> dict[str, float]:
    """Each callable's minimum per-call time, windows interleaved."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeat):
        for name, fn in calls.items():
            best[name] = min(best[name], _per_call_us(fn, number, 3))
    return best


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
        for grad in ("grad mode", "inference_mode"):
            label = f"value checks {'on' if checks == '1' else 'off'}, {grad}"
            mode = torch.inference_mode() if grad == "inference_mode" else torch.enable_grad()
            reset(Registry(make_plugin_manager(extra_plugins=[("noop", NoopPlugin())])))
            spec = dispatcher().registry.spec("causal_conv1d_fn")
            call_args = (x, w, b, pool, idx, init, None, "silu", -1)
            value_check = spec.value_checks(*call_args)
            with kv.force(causal_conv1d_fn="noop"), mode:
                bound = kv.bind(kv.causal_conv1d_fn, x, w, b, **kwargs)
                floor = _floor(noop)
                calls = {
                    "dispatched": lambda: kv.causal_conv1d_fn(x, w, b, **kwargs),
                    "bound": lambda: bound(x, w, b, **kwargs),
                    "floor": lambda: floor(x, w, b, **kwargs),
                    "direct": lambda: noop(x, w, b, **kwargs),
                    # the op's own index value check, which every CPU call runs (bound ones too)
                    "value check": lambda: value_check(call_args),
                    # what any per-call signature check must read: each tensor's shape, dtype, device
                    "metadata read": lambda: (x.shape, x.dtype, x.device, w.shape, w.dtype, w.device,
                                              b.shape, b.dtype, b.device, pool.shape, pool.dtype, pool.device,
                                              idx.shape, idx.dtype, idx.device, init.shape, init.dtype,
                                              init.device),
                }
                calls["dispatched"]()
                t = _measure(calls, args.number, args.repeat)
            added = {k: t[k] - t["direct"] for k in ("dispatched", "bound", "floor")}
            rows.append(["no-op", label, t["dispatched"], t["bound"], t["direct"], added["dispatched"],
                         added["bound"], added["floor"], t["value check"], t["metadata read"]])
            data[f"noop/{label}"] = {**{f"{k}_us": v for k, v in t.items()},
                                     **{f"{k}_added_us": v for k, v in added.items()}}

        if checks == "1":  # a real kernel on a tiny shape, as chosen here
            reset()
            with torch.inference_mode():
                dispatched = lambda: kv.causal_conv1d_fn(x, w, b, **kwargs)  # noqa: E731
                dispatched()
                vid, fn, *_ = next(iter(dispatcher().memo.values()))
                bound = kv.bind(kv.causal_conv1d_fn, x, w, b, **kwargs)
                t = _measure({"dispatched": dispatched, "bound": lambda: bound(x, w, b, **kwargs),
                              "direct": lambda: fn(x, w, b, **kwargs)}, args.number // 10, args.repeat)
            rows.append([f"{vid} (chosen)", "value checks on, inference_mode", t["dispatched"], t["bound"],
                         t["direct"], t["dispatched"] - t["direct"], t["bound"] - t["direct"], "", "", ""])
            data[f"{vid}/value checks on"] = {**{f"{k}_us": v for k, v in t.items()},
                                              "added_us": t["dispatched"] - t["direct"]}
    os.environ.pop("KV_CHECK_VALUES", None)

    table = markdown_table(["variant", "mode", "dispatched us", "bound us", "direct us", "dispatched added",
                            "bound added", "floor added", "value check us", "metadata read us"], rows)
    text = (f"# Dispatch overhead (causal_conv1d_fn, B={B}, L={L}, D={D}, W={W}, fp32, states + indices, "
            f"1 thread)\n\n{table}\n\n"
            f"Target: <= {TARGET_US} us added per call, value checks on (eager, signature already seen); "
            "minimum over windows. 'bound' is kv.bind's function; 'floor' is the op's signature plus one "
            "dict lookup around the variant, the least any Python-level dispatcher adds here; 'value check' is "
            "the op's index value check alone (it reads cache_indices with .tolist()), which every CPU call runs; "
            "'metadata read' is reading shape, dtype and device of the call's six tensors, which a dispatched "
            "call's signature must do before it can look anything up (a bound call does not).")
    print(text)
    md, js = write_report(args.out, "dispatch_overhead", text, data)
    print(f"\nwrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
