"""What the index value checks cost per decode call, on this machine's CPU.

A no-op variant of ``causal_conv1d_update`` is pinned, so each figure is the dispatched call
path alone. Three ways of treating the index values, timed in alternating rounds (minimum of
each):

- ``host``: the host checks (what every CPU call runs, and every call with ``KV_CHECK_VALUES=1``);
- ``none``: no value work (``KV_CHECK_VALUES=0`` off the CPU);
- ``device rule``: the accelerator default, run here on CPU tensors: the host-side cost of the
  device ops it queues (on CUDA/NPU they run asynchronously, with no sync).

The call path is made to believe it is off the CPU for the last two (``_runtime/call.py: on_cpu``).

    python tools/bench_value_checks.py [--number 20000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import timeit

import torch
from _report import cpu_model  # a sibling module: tools/ is sys.path[0]

import kernel_variants as kv
from kernel_variants._registry.registry import Registry, make_plugin_manager
from kernel_variants._runtime import call as _op
from kernel_variants._runtime import device_errors as _device_errors
from kernel_variants._runtime.dispatcher import dispatcher, reset
from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.plugin import Variant, hookimpl


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--number", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args(argv)
    os.environ["KV_CACHE_DIR"] = tempfile.mkdtemp(prefix="kv-values-")  # never the user's table
    torch.set_num_threads(1)
    D, W, N = 64, 4, 512

    def noop(x, conv_state, weight, bias=None, **kw):
        return x

    class NoopPlugin:
        @hookimpl
        def kv_register_variants(self, register):
            register(Variant(id="noop", op="causal_conv1d_update", version="1", fn=noop,
                             capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"},
                                                           num_accepted_tokens=True)))

    reset(Registry(make_plugin_manager(builtins=True, entry_points=False, extra_plugins=[("bench", NoopPlugin())])))
    d = dispatcher()
    on_cpu = _op.on_cpu
    modes = {
        "host": (on_cpu, False),
        "none": (lambda spec, a: False, False),
        "device rule": (lambda spec, a: False, True),
    }
    cases = []
    for batch, length in ((1, 1), (64, 1), (64, 2)):
        g = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, length, D) if length > 1 else torch.randn(batch, D)
        pool = torch.zeros(N, W - 1 + length - 1, D)
        idx = torch.randperm(N, generator=g)[:batch].to(torch.int32)
        kw = dict(conv_state_indices=idx, pad_slot_id=-1)
        if length > 1:
            kw["num_accepted_tokens"] = torch.randint(1, length + 1, (batch,), generator=g, dtype=torch.int32)
        cases.append((f"B={batch}, L={length}" + (", num_accepted_tokens" if length > 1 else ""),
                      x, pool, torch.randn(D, W), kw))
    results: dict[tuple[str, str], float] = {}
    rule_counters: dict = {}
    with kv.force(causal_conv1d_update="noop"):
        for _ in range(args.repeat):
            for label, x, pool, w, kw in cases:
                for mode, (decide, rule) in modes.items():
                    _op.on_cpu, d.device_values = decide, rule
                    # The rule's counter lives on "the device", here the CPU: kept away from the
                    # host checks, which would otherwise read it on every call.
                    _device_errors._counters = rule_counters if rule else {}
                    d.memo.clear()  # checks or rule are decided once per signature, with the memo entry

                    def call(x=x, pool=pool, w=w, kw=kw):
                        kv.causal_conv1d_update(x, pool, w, **kw)

                    call()
                    t = timeit.timeit(call, number=args.number) / args.number * 1e6
                    results[(label, mode)] = min(t, results.get((label, mode), float("inf")))
    _op.on_cpu = on_cpu
    _device_errors._counters = {}
    print(f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread; us per dispatched call "
          "(no-op variant)")
    print(f"{'call':38} {'host':>8} {'none':>8} {'device rule':>12} {'host - none':>12}")
    for label, *_ in cases:
        h, n, r = (results[(label, m)] for m in modes)
        print(f"{label:38} {h:8.2f} {n:8.2f} {r:12.2f} {h - n:12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
