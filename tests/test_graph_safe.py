"""Every conv variant that declares ``graph_safe`` runs, on the CPU, under a guard that raises on
any host synchronisation or data-dependent allocation, and still matches the reference.

Under a CUDA/NPU graph capture the dispatcher chooses only variants that declare ``graph_safe``
(no ``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero()``, boolean-mask indexing, ``.cpu()``...:
each reads a device tensor on the host, which a capture forbids, or sizes a tensor by its
values, which a replay would not repeat). The guard (``helpers.no_sync``) is a
``TorchFunctionMode`` that sees every torch function and tensor method the adapter calls; the
bodies of the kernels themselves (the CPU doubles of ``helpers.ascend_conv``, Triton under its
interpreter) run on the device side and are exempt. The adapters run on those doubles, the Triton kernels under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from helpers import ascend_conv, no_sync
from helpers.no_sync import HostSync, NoHostSync, device_dao_module, guarded, on_device

import kernel_variants
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._tuning.verify import verify
from kernel_variants.kernels import _adapters
from kernel_variants.ops.causal_conv1d._cases import make_case

OPS = ("causal_conv1d_fn", "causal_conv1d_update")


@pytest.fixture
def adapters(monkeypatch):
    monkeypatch.setitem(sys.modules, ascend_conv.DAO_MODULE, device_dao_module())
    return ascend_conv.adapters(npu_triton_target=f"{no_sync.__name__}:device_update_v2")


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
            return on_device(self.kernel[grid])

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
    assert configs, "the Triton block configurations are registered beside triton"
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
