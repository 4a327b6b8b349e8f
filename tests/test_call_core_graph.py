"""The ops' graph kernels (what a compiled graph calls) on the compiled call core and on the Python
path: the same results, errors and output copies, and the core's C++ graph kernel in a process.

Shared calls and helpers: ``tests/helpers/call_core.py``; the ``path`` fixture: ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.call_core import (
    CALLS,
    CORE_MARKS,
    FN,
    UP,
    D,
    _decode_call,
    _fn_call,
    _rms_call,
    _run,
    _same,
)

import kernel_variants as kv
from kernel_variants._runtime import callcore as _callcore
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._runtime.errors import VariantFailed, result_error
from kernel_variants.ops.causal_conv1d import FN_SPEC, ConvCapabilities, _reference
from kernel_variants.plugin import Variant

pytestmark = CORE_MARKS


def test_a_compiled_graph_takes_the_core_as_an_eager_call_does(reference_only, path, python_calls):
    """The custom op's kernel enters the core directly: the Python path serves a signature once."""
    def step(x, conv_state, weight, conv_state_indices):
        return kv.causal_conv1d_update(x, conv_state, weight, conv_state_indices=conv_state_indices) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    call = _decode_call()
    with torch.no_grad():
        expected = step(**{k: v.clone() for k, v in call.items()})
        for on, python in ((True, 1), (False, 3)):
            path(on)
            python_calls[0] = 0
            for _ in range(3):
                got = compiled(**{k: v.clone() for k, v in call.items()})
            torch.testing.assert_close(got, expected)
            assert python_calls[0] == python, f"core {'on' if on else 'off'}"


def _overload_args(op: str, call: dict) -> tuple:
    """The op's arguments in signature order, as a compiled graph passes them to its overload."""
    return tuple(dispatcher().registry.spec(op).bind(**call))


# The subprocess scripts' variant: the reference's decode, chosen by priority under
# KV_QUALIFY=off, returning `returns[0]` instead where a script sets it; and its call's tensors.
_ODD_VARIANT = """
returns = [None]
def odd(*args, **kwargs):
    res = _reference.causal_conv1d_update(*args, **kwargs)
    return res if returns[0] is None else returns[0]

class Plugin:
    @hookimpl
    def kv_register_variants(self, register):
        register(Variant(id="odd", op="causal_conv1d_update", version="1", fn=odd, priority=10_000,
                         capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"})))

reset(Registry(make_plugin_manager(extra_plugins=[("odd", Plugin())])))
g = torch.Generator().manual_seed(0)
x, w, idx = torch.randn(2, 8, generator=g), torch.randn(8, 4, generator=g), torch.tensor([3, 1], dtype=torch.int32)
pool = torch.randn(4, 3, 8, generator=g)
"""


_GRAPH_KERNEL = """
import os, sys, torch
import kernel_variants as kv
from kernel_variants._registry.registry import Registry, make_plugin_manager
from kernel_variants._runtime.dispatcher import reset
from kernel_variants.ops.causal_conv1d import ConvCapabilities, _reference
from kernel_variants.plugin import Capabilities, Variant, hookimpl
import kernel_variants._runtime.custom_ops  # what a process's first trace imports

c_level = os.environ.get("KV_CALL_CORE") != "0"
for name in ("causal_conv1d_fn", "causal_conv1d_update", "gemma_rms_norm", "add_gemma_rms_norm"):
    getattr(kv, name)  # makes (and registers) the op
    kernel = torch._C._dispatch_dump("kernel_variants::" + name).split("CompositeExplicitAutograd")[1]
    assert ("graph.cpp" in kernel) == c_level and ("custom_ops.py" in kernel) != c_level, kernel

""" + _ODD_VARIANT + """args = lambda p: (x, p, w, None, "silu", idx, None, -1)
op = torch.ops.kernel_variants.causal_conv1d_update.default
with torch.no_grad():
    mine, theirs = pool.clone(), pool.clone()
    expected = kv.causal_conv1d_update(x, theirs, w, activation="silu", conv_state_indices=idx)
    entered = set()
    def profile(frame, event, arg):
        if event == "call":
            entered.add(frame.f_code.co_name)
    sys.setprofile(profile)
    got = op(*args(mine))
    sys.setprofile(None)
    assert torch.equal(got, expected) and torch.equal(mine, theirs)
    assert "odd" in entered, entered
    kernels = entered & {"kernel", "kernel_miss"}  # the Python kernel's code names
    assert bool(kernels) != c_level, entered  # the served call enters no Python kernel where it is C++
    returns[0] = "not a tensor"
    try:
        op(*args(pool.clone()))
    except (TypeError, RuntimeError) as exc:
        print(type(exc).__name__ + ": " + str(exc).splitlines()[0])

# A two-output op's variant returning one tensor.
class One:
    @hookimpl
    def kv_register_variants(self, register):
        register(Variant(id="one", op="add_gemma_rms_norm", version="1", fn=lambda x, weight, residual, eps=1e-6: x,
                         priority=10_000, capabilities=Capabilities(devices={"cpu"}, dtypes={"float32"})))

reset(Registry(make_plugin_manager(extra_plugins=[("one", One())])))
with torch.no_grad():
    try:
        torch.ops.kernel_variants.add_gemma_rms_norm.default(x, torch.randn(8), x.clone(), 1e-6)
    except (TypeError, RuntimeError) as exc:
        print(type(exc).__name__ + ": " + str(exc).splitlines()[0])
print("ok")
"""


@pytest.mark.parametrize("on", [True, False])
def test_a_process_s_graph_kernel_is_the_core_s_c_kernel_where_the_core_is_built(on, tmp_path):
    """In a process whose first trace finds the core built, each op's graph kernel is the core's
    C++ one: a served call enters no Python kernel, only the variant, with the eager call's result
    and state write. With KV_CALL_CORE=0 the Python kernel is registered, with the same results.
    A variant returning no tensor: the same TypeError from either kernel, written once
    (``errors.result_error``)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, _callcore.ENV: "1" if on else "0", "KV_QUALIFY": "off"}
    env.pop("KV_FORCE", None)
    script = tmp_path / "graph_kernel.py"  # a file: the plugin's version is read from its source
    script.write_text(_GRAPH_KERNEL)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[-1] == "ok", run.stdout
    assert lines[0] == "TypeError: " + str(result_error("causal_conv1d_update", 1, "not a tensor")), lines
    assert lines[1] == "TypeError: " + str(result_error("add_gemma_rms_norm", 2, torch.empty(0))), lines


_ONE_ENTRY = """
import importlib.util, os, sys, torch
import kernel_variants as kv
import kernel_variants.ops.causal_conv1d as conv
from kernel_variants._registry.registry import Registry, make_plugin_manager
from kernel_variants._runtime.dispatcher import reset
from kernel_variants.ops.causal_conv1d import ConvCapabilities, _reference
from kernel_variants.plugin import Variant, hookimpl

core, order = os.environ.get("KV_CALL_CORE") != "0", os.environ["ORDER"]

""" + _ODD_VARIANT + """step = lambda p: kv.causal_conv1d_update(x, p, w, activation="silu", conv_state_indices=idx)
graphs = []
def compiled(p):  # torch.compile imports Dynamo: made at the first compiled call
    graphs or graphs.append(torch.compile(lambda p: step(p) * 2, fullgraph=True, backend="aot_eager"))
    return graphs[0](p)
python_entry = conv._UPDATE
with torch.no_grad():
    theirs = pool.clone()
    expected = _reference.causal_conv1d_update(x, theirs, w, activation="silu", conv_state_indices=idx)
    if order == "dynamo imported first":
        import torch._dynamo
    if order == "dynamo's spec asked first":  # an availability check: nothing imported
        import importlib.util
        assert importlib.util.find_spec("torch._dynamo") is not None
    if order == "compiled first":
        mine = pool.clone()
        assert torch.equal(compiled(mine), expected * 2) and torch.equal(mine, theirs)
    step(pool.clone())  # the first eager call makes the dispatcher, which binds the op's core
    assert conv._UPDATE is python_entry  # the public function's entry is never rebound
    assert ("torch._dynamo" in sys.modules) == (order in ("dynamo imported first", "compiled first"))  # eager calls import nothing
    from kernel_variants.integrations import vllm  # its fast path calls the op's core
    mine = pool.clone()
    got = vllm.causal_conv1d_update(x, mine.transpose(1, 2), w, None, "silu", conv_state_indices=idx, null_block_id=None)
    assert torch.equal(got, expected) and torch.equal(mine, theirs)
    entered = []
    def profile(frame, event, arg):
        if event == "call":
            entered.append(frame.f_code.co_name)
    mine = pool.clone()
    sys.setprofile(profile)
    got = step(mine)
    sys.setprofile(None)
    assert torch.equal(got, expected) and torch.equal(mine, theirs)
    # Served by the core: no Python frame between the entry and the variant.
    entered = [name for name in entered if name != "is_dynamo_compiling"]  # the entry's tracing test
    assert entered[1:3] == ["causal_conv1d_update", "entry"], entered
    assert (entered[3] == "odd") if core else ("call" in entered), entered
    mine = pool.clone()
    assert torch.equal(compiled(mine), expected * 2) and torch.equal(mine, theirs)  # fullgraph: traced through
    mine = pool.clone()
    assert torch.equal(step(mine), expected) and torch.equal(mine, theirs)
print("ok")
"""


@pytest.mark.parametrize("on, order", [(True, "eager first"), (True, "dynamo imported first"),
                                       (True, "dynamo's spec asked first"), (True, "compiled first"),
                                       (False, "eager first")])
def test_the_public_function_calls_one_entry_bound_once(on, order, tmp_path):
    """An op's public function calls the entry make_op made, in every order of eager calls,
    Dynamo's import and a first compile: it is never rebound. With the core built a served call
    enters the entry and then the variant, no Python frame between; eager calls import nothing
    (not Dynamo); a compiled graph (fullgraph) traces the op whichever came first; the engine
    adapters serve through the same core. Results and state writes are the reference's throughout."""
    import os
    import subprocess
    import sys

    env = {**os.environ, _callcore.ENV: "1" if on else "0", "KV_QUALIFY": "off", "ORDER": order}
    env.pop("KV_FORCE", None)
    script = tmp_path / "one_entry.py"  # a file: the plugin's version is read from its source
    script.write_text(_ONE_ENTRY)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-1] == "ok", run.stdout


def test_the_graph_kernel_serves_as_the_eager_call_does(reference_only, path, python_calls):
    """The op's overloads called through the dispatcher (what a compiled graph calls) give the
    eager call's results and state writes, the call core serving them once the eager call taught
    it the signature (the Python path every time with the core off)."""
    from kernel_variants._runtime import custom_ops  # noqa: F401 - registers the ops (a first trace imports it)

    calls = {**CALLS, "add_gemma_rms_norm": ("add_gemma_rms_norm", lambda seed=0: {
        **_rms_call(seed), "residual": torch.randn(4, D, generator=torch.Generator().manual_seed(seed + 7))})}
    with torch.no_grad():
        for on in (True, False):
            path(on)
            for label, (op, make) in calls.items():
                expected = _run(op, make(0))
                args = _overload_args(op, make(0))
                overload = getattr(torch.ops.kernel_variants, op)
                # A call without a state pool: the overload that declares no write, as a graph calls it.
                overload = overload.no_conv_states if op == FN and args[3] is None else overload.default
                python_calls[0] = 0
                for _ in range(2):
                    call = make(0)
                    got = overload(*_overload_args(op, call))
                    _same((got, {k: v for k, v in call.items() if isinstance(v, torch.Tensor)}), expected)
                assert python_calls[0] == (0 if on else 2), (label, on)


def test_the_graph_kernel_raises_the_eager_call_s_errors(with_variants, path):
    """Through the op's graph kernel: bad input raises the eager call's error (its type and
    message), a variant's failure is a VariantFailed, on the core's path and on the Python one."""
    returns = [None]

    def fn(*args, **kwargs):
        res = _reference.causal_conv1d_fn(*args, **kwargs)
        if isinstance(returns[0], Exception):
            raise returns[0]
        return res if returns[0] is None else returns[0]

    overload = torch.ops.kernel_variants.causal_conv1d_fn.default
    bad = _fn_call(cache_indices=torch.tensor([4, 9, 2], dtype=torch.int32))
    for on in (True, False):
        path(on)
        with_variants(Variant(id="odd", op=FN, version="1", fn=fn, capabilities=ConvCapabilities(
            devices={"cpu"}, dtypes={"float32"}, noncontiguous_states=True, varlen=True)))
        with torch.no_grad(), kv.force(causal_conv1d_fn="odd"):
            kv.causal_conv1d_fn(**_fn_call())  # qualifies the variant and teaches the core the entry
            with pytest.raises(ValueError) as eager:
                kv.causal_conv1d_fn(**bad)
            for _ in range(2):
                with pytest.raises(ValueError) as graph:
                    overload(*_overload_args(FN, bad))
                assert str(graph.value) == str(eager.value)
            returns[0] = RuntimeError("kernel exploded")
            with pytest.raises(VariantFailed, match="variant 'odd' of causal_conv1d_fn failed: RuntimeError"):
                overload(*_overload_args(FN, _fn_call()))
            returns[0] = None


def test_a_graph_call_to_the_core_copies_an_output_that_aliases_an_input(with_variants, path):
    """A compiled graph's kernel calls the core with ``GRAPH`` for ``out``: the core clones an
    output sharing an input's storage in the same call; an ordinary call hands it back as is."""
    path(True)
    alias = [False]

    def fn(*args, **kwargs):
        return args[0] if alias[0] else _reference.causal_conv1d_fn(*args, **kwargs)

    with_variants(Variant(id="aliasing", op=FN, version="1", fn=fn, capabilities=ConvCapabilities(
        devices={"cpu"}, dtypes={"float32"}, noncontiguous_states=True, varlen=True)))
    call = _fn_call()
    with kv.force(causal_conv1d_fn="aliasing"):
        kv.causal_conv1d_fn(**call)  # qualifies the variant and teaches the core the entry
        args = FN_SPEC.bind(**call)
        core = _callcore.core_for(FN_SPEC)
        alias[0] = True
        graph = core(*args, _callcore.GRAPH)
        plain = core(*args, None)
    x = call["x"]
    assert plain is x, "an ordinary call returns what the variant returned"
    assert graph is not x and torch.equal(graph, x)
    assert graph.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("on", [True, False])
def test_a_compiled_graph_copies_an_aliasing_output_and_runs_the_variant_once(with_variants, path, on):
    """End to end: a forced variant returning its input, in a fullgraph compile (the kernel passes
    GRAPH to the core, or takes the Python path): one variant call per graph call, a copy out."""
    path(on)
    calls, fail = [0], [False]

    def fn(x, conv_state, weight, *args, **kwargs):
        calls[0] += 1
        if fail[0]:
            raise RuntimeError("boom")
        _reference.causal_conv1d_update(x, conv_state, weight, *args, **kwargs)
        return x

    with_variants(Variant(id="aliasing", op=UP, version="1", fn=fn, capabilities=ConvCapabilities(
        devices={"cpu"}, dtypes={"float32"}, noncontiguous_states=True, num_accepted_tokens=True, varlen=True)))

    def step(x, conv_state, weight, conv_state_indices):
        return kv.causal_conv1d_update(x, conv_state, weight, conv_state_indices=conv_state_indices)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    call = _decode_call()
    with torch.no_grad(), kv.force(causal_conv1d_update="aliasing"):
        step(**call)  # qualifies the variant and teaches the core the entry
        for _ in range(2):
            calls[0] = 0
            got = compiled(**call)
            assert calls[0] == 1
            assert torch.equal(got, call["x"])
            assert got.untyped_storage().data_ptr() != call["x"].untyped_storage().data_ptr()
        fail[0], calls[0] = True, 0
        with pytest.raises(VariantFailed, match="boom"):
            compiled(**call)
        assert calls[0] == 1, "a failed variant is reported, never run again"


@pytest.mark.parametrize("on", [True, False])
def test_an_output_sharing_an_inputs_storage_is_copied_on_both_paths(path, on):
    """A torch.library op's output may not alias an input: the compiled graph's kernel copies it."""
    path(on)
    x, other = torch.randn(4, 3), torch.randn(2)
    from kernel_variants._runtime.callcore import FUNCTIONS as fresh
    view = x[1:]
    got = fresh.unaliased(view, x, other, None)
    assert torch.equal(got, view) and got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    mine = torch.randn(3)
    assert fresh.unaliased(mine, x, None) is mine
    pair = fresh.unaliased((mine, other), x, other)
    assert pair[0] is mine and torch.equal(pair[1], other) and pair[1] is not other
    assert (fresh.unaliased.__module__ or "").startswith("kernel_variants") != on, "the C function serves where the core does"


def test_graph_kernel_reads_its_spec_by_field_name():
    """The graph kernel's hand-over is the op's name and one core_specs.GraphSpec: a missing
    field fails by its name, and the old positional form is refused, before anything registers."""
    module = _callcore.graph_module()
    if module is None:
        pytest.skip("the call core is not built")

    class NoBad:
        entry, kernel, miss, n, n_out = object(), print, print, 1, 1

    with pytest.raises(AttributeError, match="bad"):
        module.graph_kernel("never_registered", NoBad())
    with pytest.raises(TypeError, match="GraphSpec"):
        module.graph_kernel("never_registered", object(), print, print, print, 1, 1)
