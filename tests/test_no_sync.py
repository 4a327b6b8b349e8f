"""Off the CPU, a dispatched conv call reads no tensor on the host, and bad index values still
corrupt nothing: they are made pads on the device and counted for ``kv.check_errors()``.

The accelerator path is exercised on this CPU-only machine by making the dispatcher's single
"on the CPU?" decision (``_op.host_values``) answer no, with every torch call watched by a torch
function mode that fails the test on anything that would synchronise a device (``.tolist()``,
``.item()``, ``.cpu()``, ``bool()``, ``int()``, ``nonzero``, boolean-mask indexing...:
``helpers.no_sync.NoHostSync``). The kernels themselves (the CPU doubles of the Ascend and
causal-conv1d kernels, the Triton interpreter, a fake variant running the reference) stand for
device code and may read what they like: they run inside ``device_side()``, or below the
torch-function layer as a ``torch.library`` op's implementation does.
"""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import ascend_conv, no_sync
from helpers.no_sync import NoHostSync, device_dao_module, device_side, on_device

import kernel_variants as kv
from kernel_variants._runtime import call as _op
from kernel_variants._runtime import device_errors as _device_errors
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants.kernels import asc, dao, npu_conv_update, npu_triton, pto
from kernel_variants.kernels._adapters import FunctionRef, OpRef
from kernel_variants.ops.causal_conv1d import ConvCapabilities, _checks
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.plugin import Variant

FN, UP = "causal_conv1d_fn", "causal_conv1d_update"
N, D, W = 6, 16, 4
DT = torch.bfloat16
PAD = -1

received: dict[str, dict] = {}


def _fake(op: str) -> Variant:
    """Not slot_bounds_safe: the reference as the kernel, remembering what it was handed."""
    ref = getattr(reference, op)

    def run(*args, **kwargs):
        received[op] = dict(args=args, kwargs=kwargs)
        with device_side():
            return ref(*args, **kwargs)

    caps = ConvCapabilities(devices={"cpu"}, dtypes={"bfloat16", "float32"}, width=(1, None), varlen=op == FN,
                            num_accepted_tokens=op == UP, noncontiguous_states=True)
    return Variant(id="fake", op=op, version="1", fn=run, capabilities=caps)


def _test_variants() -> list[Variant]:
    return [
        *asc.variants(asc.AscAdapter(OpRef("kv_test_asc::causal_conv1d")), vid="test_asc", devices={"cpu"}),
        *pto.variants(pto.PtoAdapter(OpRef("kv_test_pto::causal_conv1d")), vid="test_pto", devices={"cpu"}),
        *npu_triton.variants(npu_triton.NpuTritonAdapter(FunctionRef(f"{no_sync.__name__}:device_update_v2")),
                             vid="test_npu_triton", devices={"cpu"}),
        *npu_conv_update.variants(npu_conv_update.NpuConvUpdateAdapter(OpRef("kv_test_upd::causal_conv1d_update")),
                                  vid="test_npu_conv_update", devices={"cpu"}),
        *dao.variants(dao.DaoAdapter(ascend_conv.DAO_MODULE, needs_cuda=False), vid="test_dao", devices={"cpu"}),
        _fake(FN), _fake(UP),
    ]


def _triton_in_kernel(monkeypatch) -> bool:
    """The Triton kernels under the interpreter, their launches marked as device code."""
    if importlib.util.find_spec("triton") is None:
        return False
    from kernel_variants.kernels import triton_conv

    real = triton_conv.kernels(True)

    class Launch:
        def __init__(self, jit) -> None:
            self.jit = jit

        def __getitem__(self, grid):
            return on_device(self.jit[grid])

    ns = SimpleNamespace(**{**vars(real), **{k: Launch(getattr(real, k)) for k in ("fn_conv", "fn_state", "update")}})
    monkeypatch.setattr(triton_conv, "kernels", lambda interpret: ns)
    return True


@pytest.fixture
def accelerator(monkeypatch, with_variants):
    """The dispatched ops as on an accelerator, with the test variants, counters of their own,
    and every torch call outside a kernel watched for host reads."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, ascend_conv.DAO_MODULE, device_dao_module())
    monkeypatch.setattr(_device_errors, "_counters", {})
    triton = _triton_in_kernel(monkeypatch)
    with_variants(*_test_variants())
    monkeypatch.setattr(_op, "host_values", lambda t: False)
    received.clear()
    return SimpleNamespace(triton=triton)


def _run(op: str, vid: str, kwargs: dict):
    with kv.force(**{op: vid}), NoHostSync():
        return getattr(kv, op)(**kwargs)


def _pool(rows: int) -> torch.Tensor:
    return torch.randn(N, rows, D).to(DT)


def _expect(op: str, kwargs: dict, **fixed) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference on a copy of the pool, with the bad values as the device rule makes them."""
    pool_name = "conv_states" if op == FN else "conv_state"
    pool = kwargs[pool_name].clone()
    out = getattr(reference, op)(**{**kwargs, pool_name: pool, **fixed})
    return out, pool


def _assert_matches(out, pool, before, expected, live: list[int], dead_rows):
    torch.testing.assert_close(out.float(), expected[0].float(), atol=3e-2, rtol=3e-2)
    assert (out[dead_rows] == 0).all(), "a sequence made a pad must give zero output"
    others = [s for s in range(N) if s not in live]
    assert torch.equal(pool[others], before[others]), "only live slots may change"
    torch.testing.assert_close(pool[live].float(), expected[1][live].float(), atol=3e-2, rtol=3e-2)


def _counted(**kinds: int) -> None:
    """check_errors() raises naming each kind with its count, and a second call finds nothing."""
    with pytest.raises(ValueError) as info:
        kv.check_errors()
    msg = str(info.value)
    for kind, n in kinds.items():
        assert f"{n} x {_device_errors.KINDS[getattr(_device_errors, kind)]}" in msg, msg
    assert msg.count(" x ") == len(kinds), msg
    kv.check_errors()  # reset: nothing left


UPDATE_VIDS = ["test_asc", "test_npu_triton", "test_npu_conv_update", "test_dao", "triton", "fake"]


@pytest.mark.parametrize("vid", UPDATE_VIDS)
def test_decode_slots_outside_the_pool_are_pads_and_counted(accelerator, vid):
    if vid == "triton" and not accelerator.triton:
        pytest.skip("triton not installed")
    torch.manual_seed(0)
    idx = torch.tensor([2, N, PAD, -3, 4], dtype=torch.int32)  # N and -3: outside [0, N), not the pad
    kwargs = dict(x=torch.randn(5, D).to(DT), conv_state=_pool(W - 1), weight=torch.randn(D, W).to(DT),
                  bias=torch.randn(D).to(DT), activation="silu", conv_state_indices=idx, pad_slot_id=PAD)
    before = kwargs["conv_state"].clone()
    expected = _expect(UP, kwargs, conv_state_indices=torch.tensor([2, PAD, PAD, PAD, 4], dtype=torch.int32))
    out = _run(UP, vid, kwargs)
    _assert_matches(out, kwargs["conv_state"], before, expected, live=[2, 4], dead_rows=[1, 2, 3])
    _counted(SLOT=2)


SPEC_VIDS = ["test_asc", "test_npu_triton", "test_npu_conv_update", "triton", "fake"]


@pytest.mark.parametrize("vid", SPEC_VIDS)
def test_verify_counts_outside_1_to_l_make_their_sequence_a_pad(accelerator, vid):
    if vid == "triton" and not accelerator.triton:
        pytest.skip("triton not installed")
    torch.manual_seed(1)
    length = 2
    idx = torch.tensor([2, N, PAD, 4, 0, 5], dtype=torch.int32)
    accepted = torch.tensor([1, 2, 1, length + 1, 0, 2], dtype=torch.int32)  # L+1 and 0: outside 1..L
    kwargs = dict(x=torch.randn(6, length, D).to(DT), conv_state=_pool(W - 1 + length - 1),
                  weight=torch.randn(D, W).to(DT), bias=torch.randn(D).to(DT), activation="silu",
                  conv_state_indices=idx, num_accepted_tokens=accepted, pad_slot_id=PAD)
    before = kwargs["conv_state"].clone()
    expected = _expect(UP, kwargs, conv_state_indices=torch.tensor([2, PAD, PAD, PAD, PAD, 5], dtype=torch.int32),
                       num_accepted_tokens=accepted.clamp(1, length))
    out = _run(UP, vid, kwargs)
    _assert_matches(out, kwargs["conv_state"], before, expected, live=[2, 5], dead_rows=[1, 2, 3, 4])
    _counted(SLOT=1, ACCEPTED=2)


FN_VIDS = ["test_asc", "test_pto", "test_dao", "triton", "fake"]


@pytest.mark.parametrize("vid", FN_VIDS)
def test_prefill_slots_outside_the_pool_are_pads_and_counted(accelerator, vid):
    if vid == "triton" and not accelerator.triton:
        pytest.skip("triton not installed")
    torch.manual_seed(2)
    idx = torch.tensor([2, N, PAD, -3, 4], dtype=torch.int64)
    kwargs = dict(x=torch.randn(5, 3, D).to(DT), weight=torch.randn(D, W).to(DT), bias=torch.randn(D).to(DT),
                  conv_states=_pool(W - 1), cache_indices=idx, has_initial_state=torch.ones(5, dtype=torch.bool),
                  activation="silu", pad_slot_id=PAD)
    before = kwargs["conv_states"].clone()
    expected = _expect(FN, kwargs, cache_indices=torch.tensor([2, PAD, PAD, PAD, 4]))
    out = _run(FN, vid, kwargs)
    _assert_matches(out, kwargs["conv_states"], before, expected, live=[2, 4], dead_rows=[1, 2, 3])
    _counted(SLOT=2)


VARLEN_VIDS = ["test_asc", "test_pto", "triton", "fake"]


@pytest.mark.parametrize("vid", VARLEN_VIDS)
def test_prefill_query_start_loc_out_of_order_is_repaired_and_its_sequences_are_pads(accelerator, vid):
    if vid == "triton" and not accelerator.triton:
        pytest.skip("triton not installed")
    torch.manual_seed(3)
    qsl = torch.tensor([0, 3, 2, 8, 10], dtype=torch.int32)  # 3 then 2: sequences 1 and 2 are malformed
    idx = torch.tensor([2, 0, 4, N], dtype=torch.int32)  # and sequence 3's slot is outside the pool
    kwargs = dict(x=torch.randn(10, D).to(DT), weight=torch.randn(D, W).to(DT), bias=torch.randn(D).to(DT),
                  conv_states=_pool(W - 1), cache_indices=idx, has_initial_state=torch.ones(4, dtype=torch.bool),
                  query_start_loc=qsl, activation="silu", pad_slot_id=PAD)
    before = kwargs["conv_states"].clone()
    expected = _expect(FN, kwargs, cache_indices=torch.tensor([2, PAD, PAD, PAD], dtype=torch.int32),
                       query_start_loc=torch.tensor([0, 3, 3, 8, 10], dtype=torch.int32))
    out = _run(FN, vid, kwargs)
    _assert_matches(out, kwargs["conv_states"], before, expected, live=[2], dead_rows=slice(3, 10))
    _counted(SLOT=1, QUERY_START=2)


def test_duplicate_live_slots_are_counted(accelerator):
    idx = torch.tensor([1, 1, 3, PAD, 3, 3, N], dtype=torch.int32)  # 1 extra use of slot 1, 2 of slot 3
    kwargs = dict(x=torch.randn(7, D), conv_state=torch.randn(N, W - 1, D), weight=torch.randn(D, W),
                  conv_state_indices=idx, pad_slot_id=PAD)
    _run(UP, "fake", kwargs)
    _counted(SLOT=1, DUPLICATE=3)


def test_a_slot_bounds_safe_variant_gets_the_callers_indices_and_the_values_are_still_counted(accelerator):
    idx = torch.tensor([0, N, 2], dtype=torch.int32)
    accepted = torch.tensor([1, 1, 5], dtype=torch.int32)
    args = (torch.randn(3, 2, D), torch.randn(N, W, D), torch.randn(D, W), None, None, idx, accepted, PAD)
    safe = ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, num_accepted_tokens=True, slot_bounds_safe=True)
    with NoHostSync():
        assert _checks.device_update_rule(safe, *args)(args) is args
        unsafe = _checks.device_update_rule(safe.model_copy(update={"slot_bounds_safe": False}), *args)(args)
    assert unsafe[5].tolist() == [0, PAD, PAD] and unsafe[6].tolist() == [1, 1, 1]
    _counted(SLOT=2, ACCEPTED=2)  # both calls counted


def test_without_indices_a_dropped_sequence_gets_a_pad_id_no_slot_can_equal(accelerator):
    """pad_slot_id=1 is legal, and without indices sequence 1 uses slot 1: the made-up indices
    mark the dropped sequence with -1 and hand the variant pad_slot_id=-1."""
    accepted = torch.tensor([1, 1, 0], dtype=torch.int32)
    kwargs = dict(x=torch.randn(3, 2, D), conv_state=torch.randn(N, W, D), weight=torch.randn(D, W),
                  num_accepted_tokens=accepted, pad_slot_id=1)
    before = kwargs["conv_state"].clone()
    out = _run(UP, "fake", kwargs)
    got = received[UP]["kwargs"]
    assert got["conv_state_indices"].tolist() == [0, 1, -1] and got["pad_slot_id"] == -1
    assert (out[2] == 0).all() and (out[1] != 0).any()
    assert torch.equal(kwargs["conv_state"][2:], before[2:]) and not torch.equal(kwargs["conv_state"][1], before[1])
    _counted(ACCEPTED=1)


def test_valid_calls_count_nothing_and_the_host_checks_catch_up_on_the_cpu(accelerator, monkeypatch):
    kwargs = dict(x=torch.randn(3, D), conv_state=torch.randn(N, W - 1, D), weight=torch.randn(D, W),
                  conv_state_indices=torch.tensor([5, PAD, 0], dtype=torch.int32), pad_slot_id=PAD)
    _run(UP, "fake", kwargs)
    kv.check_errors()  # nothing bad
    _run(UP, "fake", {**kwargs, "conv_state_indices": torch.tensor([5, 9, 0], dtype=torch.int32)})
    # The next call whose values are checked on the host (here: on the CPU) reports it first.
    monkeypatch.setattr(_op, "host_values", lambda t: True)
    with pytest.raises(ValueError, match=r"1 x slot index outside \[0, N\)"):
        kv.causal_conv1d_update(**kwargs)
    kv.causal_conv1d_update(**kwargs)  # reported once, then reset


def test_check_values_0_hands_the_variant_the_callers_tensors(accelerator, monkeypatch):
    monkeypatch.setattr(dispatcher(), "device_values", False)
    idx = torch.tensor([5, PAD, 0], dtype=torch.int32)
    kwargs = dict(x=torch.randn(3, D), conv_state=torch.randn(N, W - 1, D), weight=torch.randn(D, W),
                  conv_state_indices=idx, pad_slot_id=PAD)
    _run(UP, "fake", kwargs)
    assert received[UP]["kwargs"]["conv_state_indices"] is idx
    assert _device_errors._counters == {}, "nothing runs on the device for the checks"


def test_check_values_1_checks_on_the_host_off_the_cpu_too(monkeypatch):
    monkeypatch.setenv("KV_CHECK_VALUES", "1")
    kv.reload()
    monkeypatch.setattr(_op, "host_values", lambda t: False)
    kwargs = dict(x=torch.randn(3, D), conv_state=torch.randn(N, W - 1, D), weight=torch.randn(D, W),
                  conv_state_indices=torch.tensor([5, 9, 0], dtype=torch.int32), pad_slot_id=PAD)
    before = kwargs["conv_state"].clone()
    with pytest.raises(ValueError, match=r"conv_state_indices: expected slot indices in \[0, 6\) or pad_slot_id=-1, "
                                         r"got 9 at position 1"):
        kv.causal_conv1d_update(**kwargs)
    assert torch.equal(kwargs["conv_state"], before)


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_on_the_cpu_the_host_checks_still_raise_before_anything_is_written(monkeypatch, env):
    if env is not None:
        monkeypatch.setenv("KV_CHECK_VALUES", env)
    kv.reload()
    pool = torch.randn(N, W - 1 + 1, D)
    before = pool.clone()
    base = dict(x=torch.randn(3, 2, D), conv_state=pool, weight=torch.randn(D, W), pad_slot_id=PAD)
    cases = [
        (dict(conv_state_indices=torch.tensor([0, N, 1])), "conv_state_indices: expected slot indices in"),
        (dict(conv_state_indices=torch.tensor([0, 2, 2])), "conv_state_indices: expected distinct slots"),
        (dict(num_accepted_tokens=torch.tensor([1, 3, 1])), r"num_accepted_tokens: expected values in 1\.\.L=2"),
    ]
    for extra, match in cases:
        with pytest.raises(ValueError, match=match):
            kv.causal_conv1d_update(**base, **extra)
        assert torch.equal(pool, before)
    with pytest.raises(ValueError, match="query_start_loc: expected non-decreasing"):
        kv.causal_conv1d_fn(torch.randn(5, D), torch.randn(D, W), query_start_loc=torch.tensor([0, 3, 2, 5]))


def test_no_counter_is_made_inside_a_graph_capture(monkeypatch):
    """A counter made inside a capture would be zeroed again by every replay: none is made there
    (the first eager call, a warm-up, makes it), and counting is skipped until then."""
    monkeypatch.setattr(_device_errors, "_counters", {})
    monkeypatch.setattr(_device_errors, "capturing", lambda device_type: True)
    _device_errors.add(torch.device("cpu"), _device_errors.SLOT, torch.tensor(3))
    assert _device_errors._counters == {}
    monkeypatch.setattr(_device_errors, "capturing", lambda device_type: False)
    _device_errors.add(torch.device("cpu"), _device_errors.SLOT, torch.tensor(3))
    with pytest.raises(ValueError, match="3 x slot index"):
        kv.check_errors("cpu")
    kv.check_errors(torch.device("cuda", 0))  # a device never used: nothing to report


@pytest.mark.parametrize("with_out", [False, True])
def test_a_bound_op_applies_the_device_rule_on_every_call(accelerator, with_out):
    """kv.bind off the CPU: no host read per call, and a bad slot is a pad and counted, as in the
    dispatched op (the example is decided once; the values change from call to call)."""
    torch.manual_seed(0)
    good = torch.tensor([2, 4], dtype=torch.int32)
    kwargs = dict(x=torch.randn(2, D).to(DT), conv_state=_pool(W - 1), weight=torch.randn(D, W).to(DT),
                  bias=torch.randn(D).to(DT), activation="silu", conv_state_indices=good, pad_slot_id=PAD)
    with kv.force(**{UP: "fake"}):
        bound = kv.bind(UP, **kwargs)
    assert bound.variant == "fake"
    bad = torch.tensor([2, N + 5], dtype=torch.int32)
    before = kwargs["conv_state"].clone()
    expected = _expect(UP, kwargs, conv_state_indices=torch.tensor([2, PAD], dtype=torch.int32))
    out = torch.empty(2, D).to(DT) if with_out else None
    with NoHostSync():
        got = bound(**{**kwargs, "conv_state_indices": bad}, **({"out": out} if with_out else {}))
    assert got is out or not with_out
    _assert_matches(got, kwargs["conv_state"], before, expected, live=[2], dead_rows=[1])
    _counted(SLOT=1)
