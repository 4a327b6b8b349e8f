"""torch.compile against eager: what a dispatched op costs inside a compiled graph.

Per case, in alternating rounds (machine noise hits every mode alike; medians over rounds):
- ``eager``: the function as written, each op dispatched per call;
- ``compiled``: ``torch.compile(fn, fullgraph=True)`` (Inductor), each op the registered
  ``kernel_variants::<op>`` that dispatches when the graph runs;
- ``plain``: the same graph with each op's chosen kernel registered as a plain ``torch.library``
  op of the same schema, its Python kernel calling the variant directly (no dispatch): the
  baseline of the target, compiled - plain <= 1 us (issue 24);
- ``custom_op``: the same graph with each op registered the way it was before (a
  ``torch.library.custom_op`` around the same eager call), for comparison;
- ``floor``: the same graph with each op replaced by a no-op of the same schema (a Python kernel
  that only allocates its outputs): what the graph costs with the op free, the least a compiled
  call of an op with a Python kernel can cost.

Cases: ``causal_conv1d_update`` decode at B=1, D=64 fp32 and at B=4, D=4096 bf16 with a 50 MB
state pool (and the same with an 8-slot pool: equal times show the pool is never copied),
``causal_conv1d_fn`` prefill at B=4, L=128, D=2048 bf16, ``add_gemma_rms_norm`` +
``gemma_rms_norm`` at T=4, D=2048 bf16, and a model block step (Linear + prefill op, 3x17x256
fp32). Before timing, each compiled case is checked against eager: same outputs, the state pool
updated in place (same data_ptr), the same state.

The target's column is paired call by call: ``compiled`` and ``plain`` called alternately, each
call timed, the median of the pairs' differences with its quartiles (``--pairs-s`` seconds per
case; every call but those at a switch of order runs after the other mode's, so both find the
caches alike). Each of the two is compiled twice, in the order compiled, plain, plain, compiled,
and the pairs alternate between the copies and between which call comes first: which graph is
compiled first moves a large kernel's figure by 1-4 us (where each graph's code and guards lie
in memory), and this way neither mode has the better place. The ``compiled us`` and ``plain op
us`` columns are medians over rounds, so their difference need not equal the paired column.

    python tools/bench_compile.py [--out reports] [--rounds 41] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import timeit
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _report import (  # tools/ is sys.path[0]
    built_call_core,
    cpu_model,
    markdown_table,
    write_report,
)

import kernel_variants as kv
from kernel_variants._runtime import callcore
from kernel_variants._runtime.bind import _params_source
from kernel_variants._runtime.call import call
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants.plugin import OpSpec

MODES = ("eager", "compiled", "plain", "custom_op", "floor")
# The two modes of the target, each compiled twice, in this order (see the module's docstring).
PAIRED = (("compiled", 0), ("plain", 0), ("plain", 1), ("compiled", 1))
PLAIN_TARGET_US = 1.0  # what the dispatched op may add over the chosen kernel as a plain op
POOL_BYTES = 50 * 2**20


# --- each op three ways: the public function, a custom_op twin (the old registration), a no-op


def _public_like(spec: OpSpec, target: Callable[..., Any]) -> Callable[..., Any]:
    """A function with the op's signature that calls ``target`` with every argument in order."""
    namespace: dict[str, Any] = {"_target": target}
    params = _params_source(spec, namespace)
    exec(f"def {spec.name}({params}):\n    return _target({', '.join(spec.params)})\n", namespace)  # noqa: S102
    return namespace[spec.name]


def _custom_op_twin(spec: OpSpec) -> Callable[..., Any]:
    """``kv_bench_custom_op::<name>``: the op as ``torch.library.custom_op`` registered it before."""
    hints = typing.get_type_hints(spec.signature)
    names = ", ".join(spec.params)
    several = len(spec.outputs) > 1

    def body(args: tuple[Any, ...]) -> Any:
        out = call(spec, args)
        inputs = [a for a in args if isinstance(a, torch.Tensor)]

        def unalias(o: torch.Tensor) -> torch.Tensor:
            ptr = o.untyped_storage().data_ptr()
            return o.clone() if any(t.untyped_storage().data_ptr() == ptr for t in inputs) else o

        return tuple(unalias(o) for o in out) if several else unalias(out)

    def fake(args: tuple[Any, ...]) -> Any:
        like = next(a for a in args if isinstance(a, torch.Tensor))
        outs = tuple(torch.empty_like(like, memory_format=torch.contiguous_format) for _ in spec.outputs)
        return outs if several else outs[0]

    namespace: dict[str, Any] = {"_body": body, "_fake": fake}
    exec(f"def impl({names}):\n    return _body(({names},))\n"  # noqa: S102
         f"def fake({names}):\n    return _fake(({names},))\n", namespace)
    impl = namespace["impl"]
    impl.__annotations__ = {n: hints[n] for n in spec.params} | {"return": hints["return"]}
    op = torch.library.custom_op(f"kv_bench_custom_op::{spec.name}", impl, mutates_args=spec.mutates)
    op.register_fake(namespace["fake"])
    return _public_like(spec, op)


_NOOP_LIB = torch.library.Library("kv_bench_noop", "FRAGMENT")
_PLAIN_LIB = torch.library.Library("kv_bench_plain", "FRAGMENT")


def _plain_twin(spec: OpSpec, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    """``kv_bench_plain::<label>``: the variant ``fn`` registered as a plain ``torch.library`` op
    with the op's schema, its kernel calling ``fn`` directly (no dispatch): the least a compiled
    graph can pay for this kernel as an op, and the baseline of issue 24's compile target."""
    # Imported here, after built_call_core: that import picks the ops' graph kernel.
    from kernel_variants._runtime import custom_ops

    _PLAIN_LIB.define(label + custom_ops.schema(spec))
    names = ", ".join(spec.params)
    pos = set(spec.positional)
    call_args = ", ".join(n if n in pos else f"{n}={n}" for n in spec.params)
    namespace: dict[str, Any] = {"_fn": fn, "_torch": torch}
    first = spec.params[spec.tensor_indices[0]]
    empty = "_torch.empty_like(like, memory_format=_torch.contiguous_format)"
    outs = empty if len(spec.outputs) == 1 else "(" + ", ".join([empty] * len(spec.outputs)) + ",)"
    exec(f"def kernel({names}):\n    return _fn({call_args})\n"  # noqa: S102
         f"def fake({names}):\n    like = {first}\n    return {outs}\n", namespace)
    _PLAIN_LIB.impl(label, namespace["kernel"], "CompositeExplicitAutograd")
    torch.library.register_fake(f"kv_bench_plain::{label}", namespace["fake"], lib=_PLAIN_LIB)
    return _public_like(spec, getattr(torch.ops.kv_bench_plain, label).default)


def _noop_twin(spec: OpSpec) -> Callable[..., Any]:
    """``kv_bench_noop::<name>``: the op's schema, a Python kernel that only allocates its outputs."""
    from kernel_variants._runtime import custom_ops

    _NOOP_LIB.define(spec.name + custom_ops.schema(spec))
    names = ", ".join(spec.params)
    namespace: dict[str, Any] = {"_torch": torch}
    first = spec.params[spec.tensor_indices[0]]
    empty = "_torch.empty_like(like, memory_format=_torch.contiguous_format)"
    outs = empty if len(spec.outputs) == 1 else "(" + ", ".join([empty] * len(spec.outputs)) + ",)"
    exec(f"def fake({names}):\n    like = {first}\n    return {outs}\n", namespace)  # noqa: S102
    _NOOP_LIB.impl(spec.name, namespace["fake"], "CompositeExplicitAutograd")
    torch.library.register_fake(f"kv_bench_noop::{spec.name}", namespace["fake"], lib=_NOOP_LIB)
    return _public_like(spec, getattr(torch.ops.kv_bench_noop, spec.name).default)


# --- the cases


@dataclass
class Case:
    name: str
    fn: Callable[..., Any]  # fn(ops, *inputs), ops: a namespace of the four public ops
    inputs: Callable[[], tuple[Any, ...]]  # fresh inputs (the pool first among mutated tensors)
    pool: int | None  # index of the state pool among the inputs, if any


def _decode(ops, x, pool, w, b, idx):
    return ops.causal_conv1d_update(x, pool, w, b, activation="silu", conv_state_indices=idx)


def _prefill(ops, x, w, b, pool, idx, init):
    return ops.causal_conv1d_fn(x, w, b, conv_states=pool, cache_indices=idx, has_initial_state=init,
                                activation="silu")


def _rms(ops, x, w, r):
    out, s = ops.add_gemma_rms_norm(x, w, r)
    return ops.gemma_rms_norm(out, w), s


def _block(ops, x, lin, w, b, pool, idx, init):
    return ops.causal_conv1d_fn(lin(x), w, b, conv_states=pool, cache_indices=idx, has_initial_state=init,
                                activation="silu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*size, generator=_gen(seed)).to(dtype)


def decode_inputs(B: int, D: int, dtype: torch.dtype, slots: int, W: int = 4) -> Callable[[], tuple]:
    def make():
        pool = _randn(slots, W - 1, D, dtype=dtype, seed=1)
        idx = torch.linspace(0, slots - 1, B).round().to(torch.int32)  # slots spread over the pool
        return (_randn(B, D, dtype=dtype, seed=0), pool, _randn(D, W, dtype=dtype, seed=2),
                _randn(D, dtype=dtype, seed=3), idx)
    return make


def prefill_inputs(B: int, L: int, D: int, dtype: torch.dtype, W: int = 4) -> Callable[[], tuple]:
    def make():
        return (_randn(B, L, D, dtype=dtype, seed=0), _randn(D, W, dtype=dtype, seed=2),
                _randn(D, dtype=dtype, seed=3), _randn(2 * B, W - 1, D, dtype=dtype, seed=1),
                torch.arange(B, dtype=torch.int32) * 2, torch.ones(B, dtype=torch.bool))
    return make


def block_inputs(B: int, L: int, D: int, W: int = 4) -> Callable[[], tuple]:
    lin = torch.nn.Linear(D, D)
    with torch.no_grad():
        lin.weight.copy_(_randn(D, D, dtype=torch.float32, seed=4) / D**0.5)

    def make():
        x, w, b, pool, idx, init = prefill_inputs(B, L, D, torch.float32, W)()
        return x, lin, w, b, pool, idx, init
    return make


def cases(quick: bool) -> list[Case]:
    big = POOL_BYTES // (3 * 4096 * 2)  # slots of [3, 4096] bf16 in 50 MB
    out = [
        Case("update B=1 D=64 fp32 (decode)", _decode, decode_inputs(1, 64, torch.float32, 8), 1),
        Case(f"update B=4 D=4096 bf16, {big} slots = 50 MB pool", _decode,
             decode_inputs(4, 4096, torch.bfloat16, big), 1),
        Case("update B=4 D=4096 bf16, 8-slot pool", _decode, decode_inputs(4, 4096, torch.bfloat16, 8), 1),
        Case("fn B=4 L=128 D=2048 bf16 (prefill)", _prefill, prefill_inputs(4, 128, 2048, torch.bfloat16), 3),
        Case("add_gemma_rms_norm + gemma_rms_norm T=4 D=2048 bf16", _rms,
             lambda: (_randn(4, 2048, dtype=torch.bfloat16, seed=0), _randn(2048, dtype=torch.bfloat16, seed=1),
                      _randn(4, 2048, dtype=torch.bfloat16, seed=2)), None),
        Case("model block: Linear + fn, 3x17x256 fp32", _block, block_inputs(3, 17, 256), 4),
    ]
    return out[:2] + out[3:4] if quick else out


# --- measuring


class Ops:
    def __init__(self, **fns: Callable[..., Any]) -> None:
        self.__dict__.update(fns)


def _flat(x: Any) -> list[torch.Tensor]:
    return list(x) if isinstance(x, tuple) else [x]


def check(case: Case, fn: Callable[..., Any], label: str) -> None:
    """``fn`` (compiled) against eager on fresh inputs: same outputs, the pool updated in place."""
    eager_in, comp_in = case.inputs(), case.inputs()
    expected = case.fn(MODE_OPS["eager"], *eager_in)
    ptr = comp_in[case.pool].data_ptr() if case.pool is not None else None
    before = comp_in[case.pool].clone() if case.pool is not None else None
    got = fn(*comp_in)
    for e, g in zip(_flat(expected), _flat(got), strict=True):
        torch.testing.assert_close(g, e, msg=lambda m: f"{case.name}, {label}: {m}")
    if case.pool is not None:
        pool = comp_in[case.pool]
        assert pool.data_ptr() == ptr, f"{case.name}, {label}: the pool was replaced"
        assert not torch.equal(pool, before), f"{case.name}, {label}: the state update was dropped"
        assert torch.equal(pool, eager_in[case.pool]), f"{case.name}, {label}: the state differs from eager"


def _step(fn: Callable[..., Any], ops: Ops, label: str) -> Callable[..., Any]:
    """``fn`` bound to ``ops``, as a function of its own code, named by ``label``: Dynamo caches
    compiled code per code object, and marks a function's shapes dynamic when one of the same
    file, line and name was traced with other shapes (a slower graph)."""
    namespace: dict[str, Any] = {"_fn": fn, "_ops": ops}
    code = compile("def step(*args):\n    return _fn(_ops, *args)\n", f"<bench_compile {label}>", "exec")
    exec(code, namespace)  # noqa: S102 - a fixed line
    return namespace["step"]


def per_call_us(fn: Callable[[], Any], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=3)) / number * 1e6


def paired_us(compiled: list[Callable[[], Any]], plain: list[Callable[[], Any]], pairs: int) -> list[float]:
    """``pairs`` differences (us), each a call of a compiled copy minus the adjacent call of the
    plain copy of the same rank, the copies and the order within a pair alternating."""
    clock = time.perf_counter_ns
    diffs = []
    for i in range(pairs):
        a, b = compiled[i % len(compiled)], plain[i % len(plain)]
        if i // len(compiled) % 2:
            t0 = clock(); a(); t1 = clock(); b(); t2 = clock()  # noqa: E702 - nothing between the clocks
            diffs.append((t1 - t0 - (t2 - t1)) / 1e3)
        else:
            t0 = clock(); b(); t1 = clock(); a(); t2 = clock()  # noqa: E702
            diffs.append((t2 - t1 - (t1 - t0)) / 1e3)
    return diffs


MODE_OPS: dict[str, Ops] = {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports")
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budget-ms", type=float, default=2.0, help="time per measurement (number of calls chosen to fit)")
    p.add_argument("--pairs-s", type=float, default=2.0, help="seconds of paired calls per case (the target)")
    p.add_argument("--quick", action="store_true", help="three cases, three rounds")
    args = p.parse_args(argv)
    os.environ["KV_CACHE_DIR"] = tempfile.mkdtemp(prefix="kv-compile-")  # never the user's table
    torch.set_num_threads(args.threads)
    built_call_core("bench_compile")  # before custom_ops is imported: the graph kernel is chosen then
    rounds = 3 if args.quick else args.rounds

    specs = {s.name: s for s in dispatcher().registry.ops()}
    public = Ops(**{n: getattr(kv, n) for n in specs})
    MODE_OPS["eager"] = MODE_OPS["compiled"] = public
    MODE_OPS["custom_op"] = Ops(**{n: _custom_op_twin(s) for n, s in specs.items()})
    MODE_OPS["floor"] = Ops(**{n: _noop_twin(s) for n, s in specs.items()})

    todo = cases(args.quick)
    # (case, mode) -> the copies timed for it: one per mode, two for the paired modes.
    timed: dict[tuple[str, str], list[Callable[[], Any]]] = {}
    chosen: dict[str, str] = {}
    with torch.no_grad():
        for case in todo:
            inputs = case.inputs()
            case.fn(public, *case.inputs())
            hits = list(dispatcher().memo.values())
            chosen[case.name] = ", ".join(sorted({hit.vid for hit in hits}))
            # The chosen kernels, each as a plain torch.library op (ops this case does not call
            # stay the public ones: they are never traced).
            used = {id(hit.fn) for hit in hits}
            plain = {rv.op: rv.variant.fn for rv in dispatcher().registry.variants() if id(rv.variant.fn) in used}
            plain_ops = Ops(**{n: getattr(kv, n) for n in specs})
            for k, (op, fn) in enumerate(plain.items()):
                setattr(plain_ops, op, _plain_twin(specs[op], fn, f"{op}_{len(timed)}_{k}"))
            dispatcher().invalidate()
            order = [("eager", 0), *PAIRED, ("custom_op", 0), ("floor", 0)]
            for mode, copy in order:
                ops = plain_ops if mode == "plain" else MODE_OPS[mode]
                fn = _step(case.fn, ops, f"{case.name} {mode} {copy}")
                if mode != "eager":
                    fn = torch.compile(fn, fullgraph=True)
                if mode in ("compiled", "plain", "custom_op"):
                    check(case, fn, mode)
                fn(*inputs)
                timed.setdefault((case.name, mode), []).append((lambda f=fn, a=inputs: (lambda: f(*a)))())
        # torch.compile's own least cost per call: a graph of one elementwise op on one small tensor.
        small = torch.randn(4, 64)
        trivial = torch.compile(_step(lambda _ops, t: t * 2, None, "trivial"), fullgraph=True)
        trivial(small)
        timed[("trivial", "compiled")] = [lambda: trivial(small)]
        timed[("trivial", "eager")] = [lambda: small * 2]
        # Calls per measurement, from one quick timing of each.
        number = {k: max(5, int(args.budget_ms / 1e3 / max(per_call_us(fs[0], 3) / 1e6, 1e-7)))
                  for k, fs in timed.items()}
        samples: dict[tuple[str, str], list[float]] = {k: [] for k in timed}
        for r in range(rounds):
            keys = list(timed)
            for k in keys[r % len(keys):] + keys[:r % len(keys)]:  # each round starts elsewhere
                samples[k].append(statistics.fmean(per_call_us(f, number[k]) for f in timed[k]))
        budget = 0.2 if args.quick else args.pairs_s
        diffs: dict[str, list[float]] = {}
        for case in todo:
            pair_us = 2 * per_call_us(timed[(case.name, "plain")][0], 3)
            pairs = max(200, min(20000, int(budget / (pair_us / 1e6))))
            diffs[case.name] = paired_us(timed[(case.name, "compiled")], timed[(case.name, "plain")], pairs)
    best = {k: statistics.median(v) for k, v in samples.items()}

    rows, data = [], {}
    for case in todo:
        e, c, pl, o, f = (best[(case.name, m)] for m in MODES)
        gap = statistics.median(diffs[case.name])
        q1, _, q3 = statistics.quantiles(diffs[case.name], n=4)
        met = "met" if gap <= PLAIN_TARGET_US else "missed"
        rows.append([case.name, e, c, c / e, pl, gap, f"{q1:.2f} .. {q3:.2f}", f"<= {PLAIN_TARGET_US} ({met})",
                     o, f, c - f])
        data[case.name] = {"eager_us": e, "compiled_us": c, "plain_us": pl, "custom_op_us": o, "floor_us": f,
                           "compiled_minus_plain_us": gap, "compiled_minus_plain_quartiles_us": [q1, q3],
                           "compiled_over_eager": c / e, "custom_op_over_eager": o / e, "floor_over_eager": f / e,
                           "variants": chosen[case.name]}
    headers = ["case", "eager us", "compiled us", "compiled/eager", "plain op us", "compiled - plain us",
               "its quartiles", "target (issue 24)", "custom_op us", "floor us", "compiled - floor us"]
    table = markdown_table(headers, rows)
    pools = [c.name for c in todo if "pool" in c.name]
    note = ""
    if len(pools) == 2:
        a, b = (best[(n, "compiled")] for n in pools)
        note = (f"\n\nCompiled decode with the 50 MB pool / with the 8-slot pool: {a / b:.2f} "
                "(the pool is updated in place, never copied).")
    trivial_us = best[("trivial", "compiled")]
    note += (f"\n\ntorch.compile's own least cost per call here: {trivial_us:.1f} us for a compiled `t * 2` on "
             f"one [4, 64] tensor ({best[('trivial', 'eager')]:.1f} us eager): guards, the AOTAutograd and "
             "Inductor wrappers; `floor` adds the graph's inputs and one call of an op with a Python kernel.")
    data["trivial graph"] = {"compiled_us": trivial_us, "eager_us": best[("trivial", "eager")]}
    variants = "; ".join(f"{k}: {v}" for k, v in chosen.items())
    on, where = callcore.status()
    text = (f"# torch.compile against eager (per call, {args.threads} thread(s), median of {rounds} "
            f"alternating rounds)\n\n{cpu_model()}; the op's call path: "
            f"{'compiled call core' if on else where + ' (the figures time the Python path)'}\n\n{table}{note}\n\n"
            "`compiled - plain`: the median difference of calls paired one by one (the two called "
            "alternately), with its quartiles; both modes compiled twice, in the order compiled, plain, "
            "plain, compiled, the pairs alternating between the copies and which call comes first.\n\n"
            "`compiled`: torch.compile(fullgraph=True), the op as registered now; `plain op`: the same "
            "graph with the chosen kernel registered as a plain torch.library op (no dispatch), the baseline "
            "of issue 24's <= 1 us; `custom_op`: the same "
            "graph with the op registered through torch.library.custom_op (as before); `floor`: the same "
            "graph with the op a Python kernel that only allocates its outputs (the graph's own cost with the op free).\n\n"
            f"Variants chosen: {variants}.")
    print(text)
    md, js = write_report(args.out, "compile", text, data)
    print(f"\nwrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
