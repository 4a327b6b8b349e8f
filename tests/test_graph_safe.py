"""Every conv variant that declares ``graph_safe`` runs, on the CPU, under a guard that raises on
any host synchronisation or data-dependent allocation, and still matches the reference.

Under a CUDA/NPU graph capture the dispatcher chooses only variants that declare ``graph_safe``
(no ``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero()``, boolean-mask indexing, ``.cpu()``...:
each reads a device tensor on the host, which a capture forbids, or sizes a tensor by its
values, which a replay would not repeat). The guard is a ``TorchFunctionMode`` that sees every
torch function and tensor method the adapter calls; the bodies of the kernels themselves (the
CPU doubles of ``test_npu_adapters``, Triton under its interpreter) run on the device side and
are exempt. The adapters run on those doubles, the Triton kernels under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import types

import pytest
import torch
from test_npu_adapters import _asc, _cpu, _dao_module, _npu_conv_update, _pto, update_v2
from torch.overrides import TorchFunctionMode

import kernel_variants
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._tuning.verify import verify
from kernel_variants.kernels import _adapters, dao, npu_triton
from kernel_variants.kernels._adapters import FunctionRef
from kernel_variants.ops.causal_conv1d._cases import make_case

OPS = ("causal_conv1d_fn", "causal_conv1d_update")


class HostSync(AssertionError):
    """A host synchronisation (or a tensor sized by its values) where a graph capture forbids one."""


_DEVICE_SIDE = threading.local()


@contextlib.contextmanager
def device_side():
    """The body of a kernel (a CPU double, the Triton interpreter): exempt from the guard."""
    depth = getattr(_DEVICE_SIDE, "depth", 0)
    _DEVICE_SIDE.depth = depth + 1
    try:
        yield
    finally:
        _DEVICE_SIDE.depth = depth


def _has_bool_index(index) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, tuple | list):
        return any(_has_bool_index(i) for i in index)
    return False


class NoHostSync(TorchFunctionMode):
    """Raise :class:`HostSync` on any torch function that reads a tensor's values on the host."""

    READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "nonzero",
                       "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose", "cpu",
                       "numpy", "bincount"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_DEVICE_SIDE, "depth", 0) == 0:
            why = self.why(func, args, kwargs)
            if why is not None:
                raise HostSync(why)
        return func(*args, **kwargs)

    def why(self, func, args, kwargs) -> str | None:
        name = getattr(func, "__name__", str(func)).split(".")[0]
        if name in self.READS:
            return f"{name}() reads a tensor's value on the host"
        if name == "where" and len(args) + len(kwargs) == 1:
            return "torch.where(condition) is nonzero(): a host sync and a data-dependent size"
        if name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"),
                                                      torch.Tensor) and "output_size" not in kwargs:
            return "repeat_interleave(tensor) without output_size sizes its result by the values"
        if name in ("__getitem__", "__setitem__", "index", "index_put", "index_put_") and _has_bool_index(args[1:]):
            return f"{name} with a boolean mask: a host sync and a data-dependent size"
        if name in ("to", "copy_") and any(isinstance(a, str | torch.device) and torch.device(a).type == "cpu"
                                           for a in (*args[1:], kwargs.get("device"))):
            return f"{name}(cpu): a copy to the host"
        return None


def guarded(fn):
    def run(*args, **kwargs):
        with NoHostSync():
            return fn(*args, **kwargs)

    run.__qualname__ = f"guarded({getattr(fn, '__qualname__', fn)})"
    return run


def _device_side(fn):
    def kernel(*args, **kwargs):
        with device_side():
            return fn(*args, **kwargs)

    return kernel


# The Python-function doubles run on the "device": wrapped so that their own loops are exempt.
device_update_v2 = _device_side(update_v2)
device_update_v2.calls = update_v2.calls


def _device_dao_module() -> types.ModuleType:
    real = _dao_module()
    mod = types.ModuleType("kv_test_causal_conv1d")
    mod.causal_conv1d_fn = _device_side(real.causal_conv1d_fn)
    mod.causal_conv1d_update = _device_side(real.causal_conv1d_update)
    # the adapter's finder reads the signatures
    mod.causal_conv1d_fn.__signature__ = inspect.signature(real.causal_conv1d_fn)
    mod.causal_conv1d_update.__signature__ = inspect.signature(real.causal_conv1d_update)
    return mod


device_update_v2.__signature__ = inspect.signature(update_v2)  # what the adapter's finder reads


def _npu_triton():
    adapter = npu_triton.NpuTritonAdapter(FunctionRef(f"{__name__}:device_update_v2"))
    return _cpu(npu_triton.variants(adapter, devices={"cpu"}))


def _dao():
    return _cpu(dao.variants(dao.DaoAdapter("kv_test_causal_conv1d", needs_cuda=False), devices={"cpu"}))


@pytest.fixture
def adapters(monkeypatch):
    monkeypatch.setitem(sys.modules, "kv_test_causal_conv1d", _device_dao_module())
    return {"asc": _asc(), "pto": _pto(), "npu_triton_update": _npu_triton(), "dao": _dao(),
            "npu_conv_update": _npu_conv_update()}


# Cases that exercise every path of the adapters: pads (-1 and inside the pool), packed input with
# empty sequences, strided pools, extra rows, speculative decoding, unaligned D.
CASES = {
    "causal_conv1d_fn": [dict(pad=True), dict(pad=True, pad_slot_id=0, noncontig=True), dict(varlen=True, pad=True),
                         dict(varlen=True, pad=True, noncontig=True), dict(extra_rows=2, dim=40),
                         dict(initial_flags=False), dict(states=False)],
    "causal_conv1d_update": [dict(pad=True, seqlen=1), dict(pad=True, pad_slot_id=0, noncontig=True),
                             dict(spec=True, pad=True), dict(spec=True, pad=True, extra_rows=1, noncontig=True),
                             dict(extra_rows=2, dim=40), dict(slot_indices=False)],
}


def _prove(rv, dtype) -> int:
    caps = rv.variant.capabilities
    assert caps.graph_safe, f"{rv.id} does not declare graph_safe"
    spec = dispatcher().registry.spec(rv.op)
    ran = 0
    for options in CASES[rv.op]:
        if options.get("spec") and not caps.num_accepted_tokens:
            continue
        if options.get("varlen") and not caps.varlen:
            continue
        if not options.get("states", True) and not caps.conv_states:
            continue
        base = dict(batch=5, dim=32, seqlen=1 if rv.op == "causal_conv1d_update" and not options.get("spec") else 3,
                    width=4, dtype=dtype, poison=True)
        case = make_case(rv.op, **{**base, **options})
        assert caps.uncovered(spec.key_of_case(case)) is None, (rv.id, options)
        why = verify(guarded(rv.variant.fn), case)
        assert why is None, f"{rv.id} {options}: {why}"
        ran += 1
    return ran


ADAPTERS = [("asc", "causal_conv1d_fn"), ("asc", "causal_conv1d_update"), ("pto", "causal_conv1d_fn"),
            ("npu_triton_update", "causal_conv1d_update"), ("npu_conv_update", "causal_conv1d_update"),
            ("dao", "causal_conv1d_update")]


@pytest.mark.parametrize(("name", "op"), ADAPTERS, ids=[f"{n}:{o}" for n, o in ADAPTERS])
def test_adapters_that_declare_graph_safe_never_sync(adapters, name, op):
    dtype = torch.bfloat16 if name != "dao" else torch.float32
    assert _prove(adapters[name][op], dtype) >= 4


@pytest.fixture
def interpreter(monkeypatch):
    """Triton under its interpreter, each launch exempt from the guard (it is the device's work)."""
    pytest.importorskip("triton", reason="triton not installed (the 'triton' extra)")
    from kernel_variants.kernels import triton_conv

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real = triton_conv.kernels

    class Launch:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return _device_side(self.kernel[grid])

    def kernels(interpret):
        k = real(interpret)
        return types.SimpleNamespace(**{n: Launch(v) if n in ("fn_conv", "fn_state", "update") else v
                                        for n, v in vars(k).items()})

    monkeypatch.setattr(triton_conv, "kernels", kernels)
    kernel_variants.reload()
    yield
    monkeypatch.undo()
    kernel_variants.reload()


@pytest.mark.parametrize("op", OPS)
def test_the_triton_kernels_never_sync(interpreter, op):
    rv = dispatcher().registry.get(op, "triton")
    assert _prove(rv, torch.float32) >= 5


def test_every_conv_variant_that_declares_graph_safe_is_proven_here(interpreter):
    proven = {(op, vid) for vid, op in ADAPTERS} | {(op, "triton") for op in OPS}
    claimed = {(rv.op, rv.id) for rv in kernel_variants.variants() if rv.op in OPS
               and rv.variant.capabilities.graph_safe}
    # The block configurations (tactics) are the same kernels as "triton", with other block sizes.
    configs = {(op, vid) for op, vid in claimed if vid.startswith("triton:")}
    assert claimed - configs <= proven, f"declared graph_safe without a proof here: {sorted(claimed - configs - proven)}"
    for op, vid in configs:
        rv = dispatcher().registry.get(op, vid)
        assert rv.variant.fn.__qualname__.startswith(("causal_conv1d_fn[", "causal_conv1d_update["))


@pytest.mark.parametrize("vid", ["reference", "aten", "torch_shift"])
def test_the_guard_catches_what_a_capture_forbids(vid):
    """The guard has teeth: the variants that do not declare graph_safe trip it."""
    kernel_variants.reload()
    rv = dispatcher().registry.get("causal_conv1d_fn", vid)
    assert not rv.variant.capabilities.graph_safe
    case = make_case("causal_conv1d_fn", 3, 16, 4, pad=True, varlen=vid == "reference")
    assert "raised HostSync" in (verify(guarded(rv.variant.fn), case) or "")


def test_the_state_write_back_needs_no_nonzero():
    """scatter_rows keeps only live sequences without selecting them (nonzero() is a sync)."""
    case = make_case("causal_conv1d_update", 5, 8, 1, pad=True, pad_slot_id=0).fresh()
    pool, slots_t = case.args[1], case.kwargs["conv_state_indices"]
    slots = _adapters.Slots(slots_t, 5, 0, pool.device)
    before = pool.clone()
    values = torch.randn(5, pool.shape[1], pool.shape[2])
    with NoHostSync():
        _adapters.scatter_rows(pool, slots, slice(0, pool.shape[1]), values)
    for b, s in enumerate(slots_t.tolist()):
        assert torch.equal(pool[s], before[s] if s == 0 else values[b])
    untouched = [s for s in range(pool.shape[0]) if s not in slots_t.tolist()]
    assert torch.equal(pool[untouched], before[untouched])
    # no live sequence at all: nothing changes
    dead = _adapters.Slots(torch.zeros(5, dtype=torch.int32), 5, 0, pool.device)
    snapshot = pool.clone()
    with NoHostSync():
        _adapters.scatter_rows(pool, dead, slice(0, pool.shape[1]), values)
    assert torch.equal(pool, snapshot)
    with NoHostSync(), pytest.raises(HostSync, match="nonzero"):
        slots.live.nonzero()
