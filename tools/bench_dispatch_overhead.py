"""Dispatch overhead: what each call form adds over calling the variant it runs directly, on the
compiled call core and on the Python path, beside the Python floor.

Call forms (causal_conv1d_fn, CPU, with a state pool and slot indices, so the value check and
the write guard run on every call):
- ``dispatched``: the public op, the variant chosen by the dispatcher;
- ``forced``: the public op inside ``kv.force`` (the pins are part of the memo key);
- ``bound``: the function ``kv.bind`` returns;
- ``floor``: a function with the op's signature that does one dict lookup and calls the variant,
  the least any Python-level dispatcher adds on this machine.

With a no-op variant the difference to the direct call is exactly what the path adds,
independent of any kernel's time (KV_QUALIFY=off lets the no-op be chosen without a force). The
no-op takes the op's parameters, as a registered variant does (``_report.conv_noops``): the path
hands it every keyword, the direct call only the four it sets.
The decode step of the issue (causal_conv1d_update, B=1, D=2048, W=4, bf16, one thread, the
cpu_native kernel when it is built) is timed the same way against its chosen variant.

Each round times every form for ``--number`` calls, in turn (core on and off alternate in the
round); a form's figure is the median over ``--rounds`` rounds of its per-call time minus the
direct call's in the same round. In grad mode (a plain script) and torch.inference_mode
(serving). Targets (issue 24): <= 1.0 us added for the dispatched op and a forced variant, <= 0.6
us for kv.bind.

A last row times single calls with ``--flush-mb`` MB written before each (the caches as a large
kernel leaves them, what a call in a model step meets): each form's median per call minus the
direct call's. Not a target; it says how much of a path's cost is cache misses. Choose more
than the L2 (lscpu): what the flush evicts from a larger L3 depends on the machine.

    python tools/bench_dispatch_overhead.py [--out reports] [--number 20000] [--rounds 15] [--flush-mb 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from _report import (  # tools/ is sys.path[0]
    built_call_core,
    conv_noops,
    cpu_model,
    markdown_table,
    noop_registry,
    per_call_us,
    write_report,
)

import kernel_variants as kv
from kernel_variants._runtime import call as _call
from kernel_variants._runtime import callcore as _callcore
from kernel_variants._runtime.dispatcher import dispatcher, reset
from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.plugin import Variant

TARGETS_US = {"dispatched": 1.0, "forced": 1.0, "bound": 0.6}


def _core(on: bool) -> None:
    """Put the ops on the compiled core or the Python path; the Python memo is kept, each core
    learns its entries again on the next call."""
    os.environ[_callcore.ENV] = "1" if on else "0"
    _callcore.rearm()


def _bound_pair(op: Callable[..., object], *args: object, **kwargs: object) -> tuple[object, object]:
    """kv.bind's object with the core (C) and without it (a Python function)."""
    _core(True)
    fast = kv.bind(op, *args, **kwargs)
    assert type(fast).__name__ == "BoundCore", f"kv.bind made a {type(fast).__name__}, not the C object"
    _core(False)
    slow = kv.bind(op, *args, **kwargs)
    return fast, slow


def _rounds(forms: dict[str, tuple[bool | None, Callable[[], object]]], number: int, rounds: int) -> dict[str, list[float]]:
    """Per form, its per-call time in each round; ``forms`` maps a name to (core on, off, or
    None: either, the callable)."""
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, (on, fn) in forms.items():
            if on is not None:
                _core(on)
            fn()  # the entry learned, the first call's cost out of the window
            times[name].append(per_call_us(fn, number))
    return times


def _added(times: dict[str, list[float]]) -> dict[str, float]:
    direct = times["direct"]
    return {name: statistics.median(t - d for t, d in zip(ts, direct, strict=True))
            for name, ts in times.items() if name != "direct"}


def _floor(fn: Callable[..., object]) -> Callable[..., object]:
    """The op's signature, one dict lookup, the variant: what any Python dispatcher pays."""
    table = {("causal_conv1d_fn",): fn}

    def op(x, weight, bias=None, *, conv_states=None, cache_indices=None, has_initial_state=None,
           query_start_loc=None, activation=None, pad_slot_id=-1, out=None):
        return table.get(("causal_conv1d_fn",))(x, weight, bias, conv_states=conv_states, cache_indices=cache_indices,
                                                has_initial_state=has_initial_state, query_start_loc=query_start_loc,
                                                activation=activation, pad_slot_id=pad_slot_id)

    return op


def _noop_rows(number: int, rounds: int) -> tuple[list[list[object]], dict[str, object]]:
    B, L, D, W = 1, 1, 64, 4
    noop, _ = conv_noops(torch.empty(B, L, D), None)

    variant = Variant(id="noop", op="causal_conv1d_fn", version="1", fn=noop, priority=10_000,
                      capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"}))

    x, w, b = torch.randn(B, L, D), torch.randn(D, W), torch.randn(D)
    pool = torch.randn(4, W - 1, D)
    idx = torch.tensor([2], dtype=torch.int32)
    init = torch.tensor([True])
    kwargs = dict(conv_states=pool, cache_indices=idx, has_initial_state=init, activation="silu")
    rows, data = [], {}
    for mode_name in ("grad mode", "inference_mode"):
        mode = torch.inference_mode() if mode_name == "inference_mode" else torch.enable_grad()
        reset(noop_registry(variant))
        with mode:
            op = kv.causal_conv1d_fn
            op(x, w, b, **kwargs)
            vid = next(iter(dispatcher().memo.values())).vid
            assert vid == "noop", f"the no-op variant was not chosen ({vid})"
            bound_c, bound_py = _bound_pair(op, x, w, b, **kwargs)
            floor = _floor(noop)

            # kv.force builds its pins once per block: the forced calls run inside one block.
            pins = kv.force(causal_conv1d_fn="noop")
            pins.__enter__()
            try:
                forms = {
                    "direct": (None, lambda: noop(x, w, b, **kwargs)),
                    "floor": (None, lambda: floor(x, w, b, **kwargs)),
                    "forced, core": (True, lambda: op(x, w, b, **kwargs)),
                    "forced, Python": (False, lambda: op(x, w, b, **kwargs)),
                }
                forced_t = _rounds(forms, number, rounds)
            finally:
                pins.__exit__(None, None, None)
            forms = {
                "direct": (None, lambda: noop(x, w, b, **kwargs)),
                "dispatched, core": (True, lambda: op(x, w, b, **kwargs)),
                "dispatched, Python": (False, lambda: op(x, w, b, **kwargs)),
                "bound, core": (None, lambda: bound_c(x, w, b, **kwargs)),
                "bound, Python": (None, lambda: bound_py(x, w, b, **kwargs)),
            }
            t = _rounds(forms, number, rounds)
        added = {**_added(t), **_added(forced_t)}
        direct = statistics.median(t["direct"])
        rows.append(["no-op", mode_name, direct, added["floor"], added["dispatched, core"], added["dispatched, Python"],
                     added["forced, core"], added["forced, Python"], added["bound, core"], added["bound, Python"]])
        data[f"noop/{mode_name}"] = {"direct_us": direct, **{f"{k} added_us": v for k, v in added.items()},
                                     "rounds": {**t, **{f"forced/{k}": v for k, v in forced_t.items()}}}
    return rows, data


def _rule_rows(number: int, rounds: int) -> tuple[list[list[object]], dict[str, object]]:
    """A decode call as off the CPU: the index values not read on the host, the op's device rule
    run instead (simulated on CPU tensors), the no-op variant declaring that its kernel masks and
    counts bad values itself (as the Triton decode does): the dispatcher plans no rule for such a
    variant, so this is what a Triton decode's call path adds on a GPU, dispatched and bound."""
    B, D, W, N = 1, 64, 4, 8
    _, noop = conv_noops(None, torch.empty(B, D))
    caps = ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, slot_bounds_safe=True, counts_bad_values=True)
    reset(noop_registry(Variant(id="noop", op="causal_conv1d_update", version="1", fn=noop, priority=10_000,
                                capabilities=caps)))
    x, pool, w = torch.randn(B, D), torch.randn(N, W - 1, D), torch.randn(D, W)
    idx = torch.tensor([3], dtype=torch.int32)
    op = kv.causal_conv1d_update
    host_values = _call.host_values
    _call.host_values = lambda t: False  # as on an accelerator
    try:
        with torch.inference_mode():
            bound_c, bound_py = _bound_pair(op, x, pool, w, activation="silu", conv_state_indices=idx)
            forms = {
                "direct": (None, lambda: noop(x, pool, w, None, activation="silu", conv_state_indices=idx,
                                              num_accepted_tokens=None, pad_slot_id=-1)),
                "dispatched, core": (True, lambda: op(x, pool, w, activation="silu", conv_state_indices=idx)),
                "dispatched, Python": (False, lambda: op(x, pool, w, activation="silu", conv_state_indices=idx)),
                "bound, core": (None, lambda: bound_c(x, pool, w, activation="silu", conv_state_indices=idx)),
                "bound, Python": (None, lambda: bound_py(x, pool, w, activation="silu", conv_state_indices=idx)),
            }
            t = _rounds(forms, number, rounds)
    finally:
        _call.host_values = host_values
    added = _added(t)
    direct_us = statistics.median(t["direct"])
    row = ["no-op, counts_bad_values", "decode B=1, device rule (as off the CPU), inference_mode", direct_us, "",
           added["dispatched, core"], added["dispatched, Python"], "", "", added["bound, core"], added["bound, Python"]]
    return [row], {"device_rule": {"direct_us": direct_us, **{f"{k} added_us": v for k, v in added.items()},
                                   "rounds": t}}


def _cold_rows(calls: int, flush_mb: float) -> tuple[list[list[object]], dict[str, object]]:
    """Single calls of the no-op variant's forms, ``flush_mb`` MB written before each."""
    B, L, D, W = 1, 1, 64, 4
    noop, _ = conv_noops(torch.empty(B, L, D), None)

    variant = Variant(id="noop", op="causal_conv1d_fn", version="1", fn=noop, priority=10_000,
                      capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"}))
    x, w, b = torch.randn(B, L, D), torch.randn(D, W), torch.randn(D)
    kwargs = dict(conv_states=torch.randn(4, W - 1, D), cache_indices=torch.tensor([2], dtype=torch.int32),
                  has_initial_state=torch.tensor([True]), activation="silu")
    flush = torch.zeros(max(1, int(flush_mb * 2**20) // 4))
    reset(noop_registry(variant))
    op = kv.causal_conv1d_fn
    bound_c, _ = _bound_pair(op, x, w, b, **kwargs)
    _core(True)
    forms = {"direct": lambda: noop(x, w, b, **kwargs), "dispatched, core": lambda: op(x, w, b, **kwargs),
             "bound, core": lambda: bound_c(x, w, b, **kwargs)}
    for fn in forms.values():
        fn()  # the entry learned
    times: dict[str, list[float]] = {name: [] for name in forms}
    names = list(forms)
    clock = time.perf_counter_ns
    for i in range(calls * len(names)):
        name = names[i % len(names)]
        flush.add_(1)
        t0 = clock()
        forms[name]()
        times[name].append((clock() - t0) / 1e3)
    med = {name: statistics.median(t) for name, t in times.items()}
    row = ["no-op", f"grad mode, {flush_mb:g} MB written before each call", med["direct"], "",
           med["dispatched, core"] - med["direct"], "", "", "", med["bound, core"] - med["direct"], ""]
    return [row], {"cold": {"flush_mb": flush_mb, **{f"{k} median_us": v for k, v in med.items()}}}


def _decode_rows(number: int, rounds: int) -> tuple[list[list[object]], dict[str, object]]:
    """The issue's decode step: causal_conv1d_update, B=1, D=2048, W=4, bf16, as chosen here."""
    B, D, W, N = 1, 2048, 4, 8
    dt = torch.bfloat16
    reset()
    x = torch.randn(B, D, dtype=dt)
    state = torch.randn(N, W - 1, D, dtype=dt)
    w, b = torch.randn(D, W, dtype=dt), torch.randn(D, dtype=dt)
    idx = torch.tensor([3], dtype=torch.int32)
    op = kv.causal_conv1d_update
    with torch.inference_mode():
        op(x, state, w, b, activation="silu", conv_state_indices=idx)
        hit = next(iter(dispatcher().memo.values()))
        vid, fn = hit.vid, hit.fn
        bound_c, bound_py = _bound_pair(op, x, state, w, b, activation="silu", conv_state_indices=idx)

        def direct():
            return fn(x, state, w, b, activation="silu", conv_state_indices=idx, num_accepted_tokens=None,
                      pad_slot_id=-1)

        forms = {
            "direct": (None, direct),
            "dispatched, core": (True, lambda: op(x, state, w, b, activation="silu", conv_state_indices=idx)),
            "dispatched, Python": (False, lambda: op(x, state, w, b, activation="silu", conv_state_indices=idx)),
            "bound, core": (None, lambda: bound_c(x, state, w, b, activation="silu", conv_state_indices=idx)),
            "bound, Python": (None, lambda: bound_py(x, state, w, b, activation="silu", conv_state_indices=idx)),
        }
        t = _rounds(forms, number, rounds)
    added = _added(t)
    direct_us = statistics.median(t["direct"])
    row = [f"{vid} (chosen)", "decode B=1 D=2048 bf16, inference_mode", direct_us, "", added["dispatched, core"],
           added["dispatched, Python"], "", "", added["bound, core"], added["bound, Python"]]
    return [row], {f"decode/{vid}": {"direct_us": direct_us, **{f"{k} added_us": v for k, v in added.items()},
                                     "rounds": t}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports")
    p.add_argument("--number", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--flush-mb", type=float, default=16.0, help="MB written before each call of the last row")
    args = p.parse_args(argv)
    os.environ["KV_CACHE_DIR"] = tempfile.mkdtemp(prefix="kv-overhead-")  # never the user's table
    os.environ["KV_QUALIFY"] = "off"  # the no-op variant is chosen, not qualified (it computes nothing)
    torch.set_num_threads(1)
    built_call_core("bench_dispatch_overhead")
    on, path = _callcore.status()
    if not on:
        print(f"the compiled call core is not in use ({path}): only the Python path can be measured")
        return 1
    rows, data = _noop_rows(args.number, args.rounds)
    more, more_data = _decode_rows(max(args.number // 10, 100), args.rounds)
    rows += more
    data.update(more_data)
    more, more_data = _rule_rows(args.number, args.rounds)
    rows += more
    data.update(more_data)
    cold, cold_data = _cold_rows(max(args.number // 10, 300), args.flush_mb)
    rows += cold
    data.update(cold_data)
    os.environ.pop(_callcore.ENV, None)
    headers = ["variant", "mode", "direct us", "floor added", "dispatched added (core)", "dispatched added (Python)",
               "forced added (core)", "forced added (Python)", "bound added (core)", "bound added (Python)"]
    table = markdown_table(headers, rows)
    cpu = cpu_model()
    text = (f"# Dispatch overhead (causal_conv1d_fn, B=1, L=1, D=64, W=4, fp32, states + indices; 1 thread; {cpu})\n\n"
            f"{table}\n\n"
            "Added = median over alternating rounds of (the form's per-call us - the direct call's, same round). "
            "'floor' is the op's signature plus one dict lookup around the variant, the least any Python-level "
            "dispatcher adds here. 'core': the compiled call core; 'Python': KV_CALL_CORE=0. The device-rule row: "
            "the path of a call off the CPU (CUDA), simulated on CPU tensors. The last row: "
            "medians of single calls, each after the given megabytes were written (cold caches), not a target. "
            "Targets: "
            + ", ".join(f"{k} <= {v} us" for k, v in TARGETS_US.items()) + ".")
    print(text)
    data["cpu"] = cpu
    md, js = write_report(args.out, "dispatch_overhead", text, data)
    print(f"\nwrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
