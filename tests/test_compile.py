"""torch.compile: the ops trace to the kernel_variants ops, compile with fullgraph=True and match
eager, the in-place state update included, for a contiguous pool and a strided view; the pool is
never copied; the variant is chosen when the graph runs (priority, force(), KV_FORCE and
calibration apply to an already compiled graph); a call needing a gradient runs eagerly."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
from helpers.calibration import quick

import kernel_variants
from kernel_variants._runtime import callcore as _callcore
from kernel_variants._runtime.dispatcher import Dispatcher
from kernel_variants.ops.causal_conv1d import FN_SPEC, UPDATE_SPEC
from kernel_variants.ops.causal_conv1d._cases import make_case


def _custom_ops():
    """The custom ops' module, imported when a test runs, as a process's first trace imports it
    (not at collection: a test sees the module as a process that traces does)."""
    from kernel_variants._runtime import custom_ops

    return custom_ops


def step(x, weight, bias, pool, idx, init, x_next):
    """A prefill then a decode step on the same pool, with ordinary torch around them."""
    y = kernel_variants.causal_conv1d_fn(x, weight, bias, conv_states=pool, cache_indices=idx,
                                         has_initial_state=init, activation="silu")
    z = kernel_variants.causal_conv1d_update(x_next * 2, pool, weight, bias, activation="silu",
                                             conv_state_indices=idx)
    return y.sum(dim=1), torch.tanh(z)


def _inputs(case):
    x, weight, bias = case.args
    kw = case.kwargs
    x_next = torch.randn(x.shape[0], x.shape[-1], generator=torch.Generator().manual_seed(1))
    return x, weight, bias, kw["conv_states"], kw["cache_indices"], kw["has_initial_state"], x_next


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_model_using_both_ops_compiles_fullgraph_and_matches_eager():
    compiled = torch.compile(step, fullgraph=True)
    for noncontig in (False, True):
        case = make_case("causal_conv1d_fn", batch=3, dim=16, seqlen=5, noncontig=noncontig, pad=True)
        eager, traced = case.fresh(), case.fresh()
        expected = step(*_inputs(eager))
        got = compiled(*_inputs(traced))
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e)  # inductor may sum in another order
        assert torch.equal(traced.pool_base, eager.pool_base), f"state differs (noncontig={noncontig})"
        assert not torch.equal(traced.pool_base, case.pool_base), "the state update was dropped"


def test_the_graph_holds_the_custom_ops_and_tracing_decides_nothing(monkeypatch):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    decisions = []
    real = Dispatcher.decide

    def counting(self, key, forced=None, **how):
        decisions.append(key.op)
        return real(self, key, forced, **how)

    monkeypatch.setattr(Dispatcher, "decide", counting)
    case = make_case("causal_conv1d_fn", batch=2, dim=8, seqlen=4)
    torch.compile(step, fullgraph=True, backend=backend)(*_inputs(case.fresh()))
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {"kernel_variants.causal_conv1d_fn.default", "kernel_variants.causal_conv1d_update.default"} <= targets
    # Once per op when the graph ran, none while tracing (fake tensors never reach a decision).
    assert sorted(decisions) == ["causal_conv1d_fn", "causal_conv1d_update"]


def test_eager_calls_never_go_through_the_custom_op(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("eager call routed through the custom op")

    for spec in (FN_SPEC, UPDATE_SPEC):
        _custom_ops().register(spec)  # as after a first compile: the traced function is there
        monkeypatch.setattr(_callcore.entry_of(spec), "traced", refuse)
    case = make_case("causal_conv1d_fn", batch=2, dim=8, seqlen=4)
    step(*_inputs(case.fresh()))


@pytest.mark.parametrize("strict", [True, False])
def test_export_records_the_custom_op(strict):
    """torch.export, traced by Dynamo (strict) or run for real on fake tensors (non-strict,
    where the call core hands the call back and the entry sees a compile): the graph holds the op."""
    class Model(torch.nn.Module):
        def forward(self, x, state, weight, idx):
            return kernel_variants.causal_conv1d_update(x, state, weight, conv_state_indices=idx) * 2

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 8, generator=g), torch.randn(4, 3, 8, generator=g), torch.randn(8, 4, generator=g),
            torch.tensor([1, 3], dtype=torch.int32))
    _custom_ops().register(UPDATE_SPEC)
    entry = _callcore.entry_of(UPDATE_SPEC)
    real, ran = entry.traced, []

    def counting(*call_args):
        ran.append(True)
        return real(*call_args)

    entry.traced = counting
    try:
        with torch.no_grad():
            ep = torch.export.export(Model(), args, strict=strict)
    finally:
        entry.traced = real
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "kernel_variants.causal_conv1d_update.default" in targets, targets
    # Non-strict runs the entry for real: handed back by the call core, it takes the compile branch.
    assert bool(ran) == (not strict)


@pytest.mark.parametrize("route", ["public op", "vLLM adapter", "sglang adapter"])
def test_non_strict_export_keeps_a_dynamic_batch(route):
    """Non-strict export runs the call for real on fake tensors with a symbolic batch: nothing on
    the way (the adapters' fast steps included) may read a size that fixes it to a constant."""
    from kernel_variants.integrations import sglang as kv_sglang
    from kernel_variants.integrations import vllm as kv_vllm

    def call(x, state, weight, idx):
        if route == "vLLM adapter":  # the pool as vLLM holds it: (N, dim, W-1), a view of [N, W-1, dim]
            return kv_vllm.causal_conv1d_update(x, state.transpose(-1, -2), weight, activation="silu",
                                                conv_state_indices=idx)
        if route == "sglang adapter":
            return kv_sglang.causal_conv1d_update(x, state.transpose(-1, -2), weight, activation="silu",
                                                  conv_state_indices=idx)
        return kernel_variants.causal_conv1d_update(x, state, weight, activation="silu", conv_state_indices=idx)

    class Model(torch.nn.Module):
        def forward(self, x, state, weight, idx):
            return call(x, state, weight, idx) * 2

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 8, generator=g), torch.randn(4, 3, 8, generator=g), torch.randn(8, 4, generator=g),
            torch.tensor([1, 3], dtype=torch.int32))
    batch = torch.export.Dim("B", min=2, max=4)
    with torch.no_grad():
        ep = torch.export.export(Model(), args, strict=False,
                                 dynamic_shapes={"x": {0: batch}, "state": None, "weight": None, "idx": {0: batch}})
        x, idx = torch.randn(3, 8, generator=g), torch.tensor([0, 2, 3], dtype=torch.int32)
        state, expected_state = args[1].clone(), args[1].clone()
        got = ep.module()(x, state, args[2], idx)
        expected = Model()(x, expected_state, args[2], idx)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(state, expected_state)


_FIRST_TRACE = """
import sys
import torch
from torch._dynamo.utils import counters
import kernel_variants as kv

def f(x, st, w, idx):
    return kv.causal_conv1d_update(x, st, w, conv_state_indices=idx) * 2

def g(x, st, w, idx):
    return torch.relu(kv.causal_conv1d_update(x + 1, st, w, conv_state_indices=idx))

def inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 8, generator=gen), torch.randn(4, 3, 8, generator=gen), torch.randn(8, 4, generator=gen),
            torch.tensor([1, 3], dtype=torch.int32))

assert "kernel_variants._runtime.custom_ops" not in sys.modules
with torch.no_grad():
    for fn in (f, g):
        compiled = torch.compile(fn, fullgraph=True)
        for seed in range(3):
            a, b = inputs(seed), inputs(seed)
            assert torch.equal(fn(*a), compiled(*b)) and torch.equal(a[1], b[1]), (fn.__name__, seed)
assert not counters["recompiles"], dict(counters["recompiles"])
print("ok", counters["stats"]["unique_graphs"])
"""


def test_the_first_trace_in_a_process_imports_the_custom_ops_and_later_graphs_need_no_recompile():
    """In a fresh process the first trace imports the custom ops while it is traced (the entry's
    own compile branch), and registers the traced function in the entry's place for later ones."""
    run = subprocess.run([sys.executable, "-c", _FIRST_TRACE], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["ok", "2"], run.stdout


def test_the_custom_ops_are_well_formed():
    case = make_case("causal_conv1d_fn", batch=2, dim=8, seqlen=3).fresh()
    x, weight, bias, pool, idx, init, x_next = _inputs(case)
    torch.library.opcheck(torch.ops.kernel_variants.causal_conv1d_fn.default,
                          (x, weight, bias, pool, idx, init, None, "silu", -1),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.kernel_variants.causal_conv1d_update.default,
                          (x_next, pool, weight, bias, None, idx, None, -1),
                          test_utils=("test_schema", "test_faketensor"))


# --- the op is registered directly, and the variant is chosen when the graph runs

UPDATE = "causal_conv1d_update"
FN = "causal_conv1d_fn"


def _spy(op, vid, seen, fn=None, priority=0, **caps):
    """A variant of ``op`` that records (its id, the call's state tensor) and runs the reference."""
    from kernel_variants.ops.causal_conv1d import ConvCapabilities
    from kernel_variants.ops.causal_conv1d import _reference as reference
    from kernel_variants.plugin import Variant

    real = getattr(reference, op)

    def run(*args, **kwargs):
        seen.append((vid, kwargs.get("conv_states", args[1] if op == UPDATE else None)))
        if fn is not None:
            fn()
        return real(*args, **kwargs)

    return Variant(id=vid, op=op, version="1", fn=run, priority=priority,
                   capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, varlen=True, **caps))


def _counting_inductor(compiles):
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        compiles.append(gm)
        return compile_fx(gm, example_inputs)
    return backend


def test_force_kv_force_and_calibration_take_effect_in_a_compiled_graph(reference_only, with_variants, monkeypatch):
    """One compile; every later call chooses its variant when the graph runs: priority, then a
    force() block, KV_FORCE, and a calibration that makes another variant the winner."""
    import time

    from kernel_variants._runtime.dispatcher import dispatcher, reset

    seen = []
    with_variants(_spy(FN, "first", seen, fn=lambda: time.sleep(0.002), priority=100), _spy(FN, "second", seen))
    x, w, b, pool = torch.randn(2, 16, 32), torch.randn(32, 4), torch.randn(32), torch.randn(2, 3, 32)

    def prefill(x, w, b, pool):
        return kv_fn(x, w, b, conv_states=pool, activation="silu") * 2

    kv_fn = kernel_variants.causal_conv1d_fn
    compiles = []
    compiled = torch.compile(prefill, fullgraph=True, backend=_counting_inductor(compiles))

    def ran(**pins):
        seen.clear()
        with kernel_variants.force(**pins) if pins else contextlib.nullcontext():
            compiled(x, w, b, pool)
        return [vid for vid, _ in seen]

    assert ran() == ["first"]  # priority
    assert ran(causal_conv1d_fn="second") == ["second"]  # force(), inside the block only
    assert ran() == ["first"]
    monkeypatch.setenv("KV_FORCE", "causal_conv1d_fn=second")
    reset(dispatcher().registry)  # the environment is read when the dispatcher is made
    assert ran() == ["second"]
    monkeypatch.delenv("KV_FORCE")
    reset(dispatcher().registry)
    assert ran() == ["first"]
    kernel_variants.calibrate(FN, [(2, 32, 16)], variants=["first", "second"],
                              **quick(windows=2, iters=3))
    assert kernel_variants.explain(FN, x, w, b, conv_states=pool, activation="silu").source == "table"
    assert ran() == ["second"]  # "first" sleeps: the table's winner is "second"
    assert len(compiles) == 1, "a pin or the table changed and the graph was recompiled"


def _zeros_pool(slots, d, noncontig):
    if not noncontig:
        return torch.zeros(slots, 3, d)
    return torch.zeros(slots, 3, 2 * d)[:, :, ::2]  # a strided view: channel stride 2


def _allocations_and_ops(fn):
    """What a call allocates on the CPU (each allocation's bytes, sorted) and the ops it runs (their
    names, in order), counted by the profiler's memory and op records: no clock is read."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocated = sorted(e.nbytes() for e in prof.profiler.kineto_results.events()
                       if e.name() == "[memory]" and e.nbytes() > 0)
    return allocated, [e.name for e in prof.events() if "::" in e.name]  # aten:: and the custom ops


@pytest.mark.parametrize("noncontig", [False, True])
def test_the_state_pool_is_written_in_place_and_never_copied(with_variants, noncontig):
    """The kernel the graph calls receives the caller's pool itself (no functional copy, no
    copy back), a 48 MB pool costs what an 8-slot one does, and the state matches eager.

    Counted, not timed: a copy of the pool (a functional one, or a buffer copied back) needs a
    buffer the pool's size; the compiled call allocates the same bytes and runs the same ops,
    whatever the pool's size, none of its allocations near the small pool's size."""
    seen = []
    with_variants(_spy(UPDATE, "spy", seen, noncontiguous_states=True))
    d, big_slots = 1024, 4096  # 4096 x 3 x 1024 fp32 = 48 MB
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, d, generator=gen), torch.randn(d, 4, generator=gen), torch.randn(d, generator=gen)
    idx = torch.tensor([5, 7], dtype=torch.int32)

    def decode(x, pool, w, b, idx):
        return kernel_variants.causal_conv1d_update(x, pool, w, b, activation="silu", conv_state_indices=idx)

    compiled = torch.compile(decode, fullgraph=True)
    with kernel_variants.force(causal_conv1d_update="spy"):
        pools = {}
        for slots in (8, big_slots):
            pool, expected_pool = _zeros_pool(slots, d, noncontig), _zeros_pool(slots, d, noncontig)
            pool[:8].normal_(generator=torch.Generator().manual_seed(1))
            expected_pool.copy_(pool)
            seen.clear()
            got = compiled(x, pool, w, b, idx)
            assert len(seen) == 1 and seen[0][1].data_ptr() == pool.data_ptr(), "the kernel got a copy of the pool"
            assert seen[0][1].stride() == pool.stride()
            torch.testing.assert_close(got, decode(x, expected_pool, w, b, idx))
            assert torch.equal(pool, expected_pool), "the state differs from eager's"
            pools[slots] = pool
        counted = {}
        for slots, pool in pools.items():
            seen.clear()
            counted[slots] = _allocations_and_ops(lambda p=pool: compiled(x, p, w, b, idx))
            assert len(seen) == 1 and seen[0][1].data_ptr() == pool.data_ptr(), "the kernel got a copy of the pool"
    small = pools[8].untyped_storage().nbytes()
    assert counted[big_slots] == counted[8], f"the call's work grows with the pool: {counted}"
    assert all(n < small for n in counted[big_slots][0]), f"a buffer the pool's size: {counted[big_slots][0]}"
    assert "kernel_variants::causal_conv1d_update" in counted[8][1], counted[8][1]


def test_the_schemas_come_from_the_signatures():
    kernel_variants.add_gemma_rms_norm, kernel_variants.gemma_rms_norm  # noqa: B018 - made (and registered) on first use
    schemas = {name: str(_custom_ops().op_overload(name)._schema) for name in
               (FN, UPDATE, "gemma_rms_norm", "add_gemma_rms_norm")}
    assert schemas[FN] == (
        "kernel_variants::causal_conv1d_fn(Tensor x, Tensor weight, Tensor? bias, Tensor(a!)? conv_states, "
        "Tensor? cache_indices, Tensor? has_initial_state, Tensor? query_start_loc, str? activation, "
        "int pad_slot_id) -> Tensor")
    assert schemas[UPDATE] == (
        "kernel_variants::causal_conv1d_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, "
        "str? activation, Tensor? conv_state_indices, Tensor? num_accepted_tokens, int pad_slot_id) -> Tensor")
    assert schemas["gemma_rms_norm"] == "kernel_variants::gemma_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"
    assert schemas["add_gemma_rms_norm"].endswith("(Tensor x, Tensor weight, Tensor residual, float eps) -> "
                                                  "(Tensor, Tensor)")


def test_no_python_layer_between_the_graph_and_the_eager_call():
    """Registered on the Library directly: one Python kernel (the eager call), no autograd or
    ADInplaceOrView kernel of torch.library.custom_op's (~35 us per call in a graph)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in (FN, UPDATE):
        qualname = f"kernel_variants::{name}"
        assert has(qualname, "CompositeExplicitAutograd")
        assert not has(qualname, "Autograd") and not has(qualname, "ADInplaceOrView")


# Dynamo itself reads .grad of the non-leaf tensor it resumes with after the graph break.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_a_call_that_needs_a_gradient_runs_eagerly_from_a_compiled_graph():
    """No autograd formula: under torch.compile such a call graph-breaks and runs the eager op,
    which differentiates; fullgraph=True refuses it, saying why."""
    def f(x, w):
        return (kernel_variants.causal_conv1d_fn(x, w, activation="silu") ** 2).sum()

    gen = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(2, 5, 16, generator=gen), torch.randn(16, 4, generator=gen)
    grads = []
    for fn in (f, torch.compile(f)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn(x, w).backward()
        grads.append((x.grad, w.grad))
    for e, g in zip(*grads, strict=True):
        torch.testing.assert_close(g, e)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="no autograd formula"):
        torch.compile(f, fullgraph=True)(x0.clone().requires_grad_(), w0)
    with torch.no_grad():  # without a gradient the op stays in the graph
        torch.compile(f, fullgraph=True)(x0.clone().requires_grad_(), w0)


def test_the_rms_ops_compile_with_inductor_fullgraph_and_match_eager():
    gen = torch.Generator().manual_seed(0)
    x, w, r = (torch.randn(3, 5, 64, generator=gen), torch.randn(64, generator=gen),
               torch.randn(3, 5, 64, generator=gen))

    def block(x, w, r):
        out, s = kernel_variants.add_gemma_rms_norm(x, w, r)
        return kernel_variants.gemma_rms_norm(out * 2, w), s

    eager = block(x, w, r)
    compiled = torch.compile(block, fullgraph=True)(x, w, r)
    for g, e in zip(compiled, eager, strict=True):
        torch.testing.assert_close(g, e)
    for name, args in (("gemma_rms_norm", (x, w, 1e-6)), ("add_gemma_rms_norm", (x, w, r, 1e-6))):
        torch.library.opcheck(_custom_ops().op_overload(name), args, test_utils=("test_schema", "test_faketensor"))


def test_a_prefill_without_a_state_pool_compiles_with_inductor():
    """A None passed for the optional mutated conv_states goes to the overload that declares no
    mutation (Inductor cannot lower a mutable argument that is None)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    def f(x, w, b):
        return torch.tanh(kernel_variants.causal_conv1d_fn(x, w, b, activation="silu"))

    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 7, 16, generator=gen), torch.randn(16, 4, generator=gen), torch.randn(16, generator=gen)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend=backend)(x, w, b), f(x, w, b))
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "kernel_variants.causal_conv1d_fn.no_conv_states" in targets
    assert str(_custom_ops().op_overload(FN, "no_conv_states")._schema).startswith(
        "kernel_variants::causal_conv1d_fn.no_conv_states(Tensor x, Tensor weight, Tensor? bias, Tensor? conv_states, ")
    torch.library.opcheck(_custom_ops().op_overload(FN, "no_conv_states"), (x, w, b, None, None, None, None, "silu", -1),
                          test_utils=("test_schema", "test_faketensor"))


def test_a_graph_guards_on_nothing_of_the_op_s_own():
    """Each global a traced call reads is a guard the graph checks before every run, a cache
    miss after a large kernel. The op's public function is replaced by its traced twin, whose
    defaults carry what it reads: the graph guards on the public function's identity (as for
    any function it calls) and on the tensors, never on the entry, the custom op, grad mode's
    function or the public function's defaults."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    case = make_case("causal_conv1d_fn", batch=3, dim=16, seqlen=5, pad=True)
    with torch.no_grad():
        torch.compile(step, fullgraph=True)(*_inputs(case.fresh()))  # the first trace imports the custom ops
        torch._dynamo.reset()
        torch.compile(step, fullgraph=True)(*_inputs(case.fresh()))
    text = "\n".join(str(e.guard_manager) for e in _debug_get_cache_entry_list(step.__code__))
    text = "\n".join(line.split("  # ")[0] for line in text.splitlines())  # the guards, not the source they cite
    assert "causal_conv1d_fn" in text  # the public functions' identity is guarded, as it must be
    for internal in ("_FN", "_UPDATE", "_grad_enabled", "_op_default", "__kwdefaults__", "__defaults__"):
        assert internal not in text, f"the graph guards on {internal}:\n{text}"
