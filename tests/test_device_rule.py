"""The conv ops' device rule is one op per call, ``kernel_variants::conv_device_rule``, and does
what the rule as separate aten ops does.

- The Triton kernel (one launch on CUDA) equals the composite of aten ops, under the Triton
  interpreter on the CPU (and compiled where there is a GPU), on edge cases and random inputs.
- The rules that ``device_fn_rule`` / ``device_update_rule`` plan hand on the same arguments
  and count the same as the oracle below: the rule written as separate aten ops, as the docstrings
  specify it. A call with nothing to check, or for a variant whose kernel counts, gets no rule.
- A dispatched call, with the accelerator path forced on CPU tensors, issues at most one aten
  op outside the variant's own body (counted with a ``TorchDispatchMode``).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from helpers import sm90
from torch.utils._python_dispatch import TorchDispatchMode

import kernel_variants as kv
from kernel_variants._runtime import call as _op
from kernel_variants._runtime import callcore as _callcore
from kernel_variants._runtime import device_errors as _device_errors
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants.ops.causal_conv1d import ConvCapabilities, _checks, _device_rule
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.plugin import Variant, bad_value_counter

FN, UP = "causal_conv1d_fn", "causal_conv1d_update"
D, W = 8, 3
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------
# The oracle: the rule as separate aten ops, counts as a list of four ints
# ------------------------------------------------------------------------------------------


def _oracle_slots(idx, n_slots, pad_slot_id, counts):
    info = torch.iinfo(idx.dtype)
    pad = pad_slot_id if info.min <= pad_slot_id <= info.max else -1
    fixed = torch.where((idx >= 0) & (idx < n_slots), idx, pad)
    bad = fixed != idx if pad == pad_slot_id else (idx < 0) | (idx >= n_slots)
    counts[_device_errors.SLOT] += int(bad.sum())
    if idx.shape[0] > 1:
        ordered = fixed.sort().values
        counts[_device_errors.DUPLICATE] += int(((ordered[1:] == ordered[:-1]) & (ordered[1:] != pad)).sum())
    return fixed, pad


def _oracle_pads(idx, drop, pad_slot_id, batch):
    if idx is None:
        return torch.where(drop, -1, torch.arange(batch, dtype=torch.int32)), -1
    info = torch.iinfo(idx.dtype)
    pad = pad_slot_id if info.min <= pad_slot_id <= info.max else -1
    return torch.where(drop, pad, idx), pad


def _oracle_fn(args, safe):
    x, _, _, states, idx_in, _, qsl_in, _, pad = args
    counts = [0] * 4
    drop = None
    qsl = qsl_in
    if qsl is not None:
        fixed = qsl.clamp(0, x.shape[0])
        fixed[0], fixed[-1] = 0, x.shape[0]
        qsl = fixed.cummax(0).values
        moved = qsl != qsl_in
        drop = moved[:-1] | moved[1:]
        counts[_device_errors.QUERY_START] += int(drop.sum())
    idx = idx_in
    if states is not None and idx_in is not None:
        fixed, fixed_pad = _oracle_slots(idx_in, states.shape[0], pad, counts)
        if not safe:
            idx, pad = fixed, fixed_pad
    if qsl is qsl_in and idx is idx_in:
        return args, counts
    out = list(args)
    out[6] = qsl
    if drop is not None and states is not None:
        idx, pad = _oracle_pads(idx, drop, pad, drop.shape[0])
    out[4], out[8] = idx, pad
    return tuple(out), counts


def _oracle_update(args, safe):
    x, pool, _, _, _, idx_in, accepted, pad = args
    counts = [0] * 4
    idx, bad = idx_in, None
    if idx_in is not None:
        idx, pad = _oracle_slots(idx_in, pool.shape[0], pad, counts)
    if accepted is not None:
        bad = (accepted < 1) | (accepted > (x.shape[1] if x.ndim == 3 else 1))
        counts[_device_errors.ACCEPTED] += int(bad.sum())
    if safe or (idx_in is None and bad is None):
        return args, counts
    out = list(args)
    if bad is not None:
        idx, pad = _oracle_pads(idx, bad, pad, bad.shape[0])
        out[6] = torch.where(bad, 1, accepted)
    out[5], out[7] = idx, pad
    return tuple(out), counts


# ------------------------------------------------------------------------------------------
# Inputs: pads, slots outside the pool, duplicates, counts outside 1..L, bounds out of order
# ------------------------------------------------------------------------------------------


def _slots(g, batch, n_slots, dtype, pad):
    choices = torch.tensor([-3, -1, n_slots, n_slots + 7, pad if abs(pad) < 2**31 else -1])
    live = torch.randint(0, n_slots, (batch,), generator=g)
    odd = choices[torch.randint(0, len(choices), (batch,), generator=g)]
    return torch.where(torch.rand(batch, generator=g) < 0.3, odd, live).to(dtype)


def _qsl(g, batch, total, dtype):
    cuts = torch.randint(0, total + 1, (batch + 1,), generator=g).sort().values
    cuts[0], cuts[-1] = 0, total
    for _ in range(int(torch.randint(0, 3, (), generator=g))):
        cuts[int(torch.randint(0, batch + 1, (), generator=g))] = int(torch.randint(-3, total + 4, (), generator=g))
    return cuts.to(dtype)


def _accepted(g, batch, length, dtype):
    return torch.randint(-1, length + 2, (batch,), generator=g).to(dtype)


PADS = [-1, 0, 2**40]  # a pad id outside the pool, one inside it, one int32 cannot hold


def _random_call(op, seed):
    """(args in signature order, a description) of a random call of ``op`` on the CPU."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda n: int(torch.randint(0, n, (), generator=g))  # noqa: E731
    batch = [1, 2, 5, 17][pick(4)]
    n_slots = [1, 4, 40][pick(3)]
    dtype = [torch.int32, torch.int64][pick(2)]
    pad = PADS[pick(3)]
    idx = _slots(g, batch, n_slots, dtype, pad) if pick(4) else None
    if op == FN:
        states = None  # cache_indices needs conv_states; without cache_indices, sequence b uses slot b
        if idx is not None or pick(2):
            states = torch.randn(n_slots if idx is not None else max(n_slots, batch), W - 1, D)
        varlen = pick(3) > 0
        total = batch * pick(4)
        x = torch.randn(total, D) if varlen else torch.randn(batch, 2, D)
        qsl = _qsl(g, batch, total, [torch.int32, torch.int64][pick(2)]) if varlen else None
        return (x, torch.randn(D, W), None, states, idx, None, qsl, None, pad)
    length = [1, 3][pick(2)]
    x = torch.randn(batch, length, D) if length > 1 or pick(2) else torch.randn(batch, D)
    accepted = _accepted(g, batch, length, [torch.int32, torch.int64][pick(2)]) if pick(3) else None
    pool = torch.randn(n_slots if idx is not None else max(n_slots, batch), W - 1 + length, D)
    return (x, pool, torch.randn(D, W), None, None, idx, accepted, pad)


def _same(got, want) -> str | None:
    """Why two argument tuples differ (tensors by dtype and value), or None."""
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        if isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)):
                return f"argument {k}: {a} != {b}"
        elif a != b or type(a) is not type(b):
            return f"argument {k}: {a!r} != {b!r}"
    return None


@pytest.fixture
def counters(monkeypatch):
    monkeypatch.setattr(_device_errors, "_counters", {})

    def read():
        c = _device_errors._counters.get(CPU)
        return [0] * 4 if c is None else c.tolist()

    return read


# ------------------------------------------------------------------------------------------
# The Triton kernel against the composite
# ------------------------------------------------------------------------------------------


@pytest.fixture
def triton_rule(monkeypatch, device):
    pytest.importorskip("triton", reason="triton not installed (the 'triton' extra)")
    interpret = device == "cpu"
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return _device_rule.triton_module(interpret)


def _both(module, device, slots, accepted, qsl, *, batch, pad_slot_id, n_slots=0, length=0, total=0, rewrite=True):
    pad = _device_rule.pad_value(slots, pad_slot_id) if slots is not None else -1
    results = []
    for impl in (module.launch, _device_rule.composite):
        counter = torch.zeros(4, dtype=torch.int64, device=device)
        moved = [t.to(device) if t is not None else None for t in (slots, accepted, qsl)]
        outs = impl(*moved, counter, batch, n_slots, pad, pad == pad_slot_id, length, total, rewrite)
        results.append(([o.cpu() for o in outs], counter.tolist()))
    (got, got_counts), (want, want_counts) = results
    assert got_counts == want_counts
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), (k, a, b)
    return want_counts


def _i32(*v):
    return torch.tensor(v, dtype=torch.int32)


def _i64(*v):
    return torch.tensor(v, dtype=torch.int64)


N = 6
EDGES = {
    "pads and slots outside the pool": dict(slots=_i32(2, N, -1, -3, 4), batch=5, pad_slot_id=-1, n_slots=N),
    "duplicates": dict(slots=_i32(1, 1, 3, -1, 3, 3, N), batch=7, pad_slot_id=-1, n_slots=N),
    "a pad id inside the pool": dict(slots=_i64(0, 0, 3, 3, 9, -1), batch=6, pad_slot_id=0, n_slots=N),
    "a pad id int32 cannot hold": dict(slots=_i32(-1, 2, 2**31 - 1, 5, -2**31), batch=5, pad_slot_id=2**40,
                                       n_slots=N),
    "an int64 pad id beyond int32": dict(slots=_i64(2**40, 2, 2**40, 7), batch=4, pad_slot_id=2**40, n_slots=N),
    "counts outside 1..L": dict(slots=_i32(0, 1, 2, 3, 4), accepted=_i64(1, 0, 3, -5, 2), batch=5, pad_slot_id=-1,
                                n_slots=N, length=2),
    "counts without slot ids": dict(accepted=_i32(1, 0, 2), batch=3, pad_slot_id=1, length=2),
    "bounds out of order and outside [0, T]": dict(qsl=_i32(0, 3, 2, 8, 10), batch=4, pad_slot_id=-1, total=10),
    "bounds beyond both ends": dict(qsl=_i64(-4, 3, 12, 9, 2), slots=_i64(0, 1, 2, N), batch=4, pad_slot_id=-1,
                                    n_slots=N, total=9),
    "B = 1": dict(slots=_i32(N), accepted=_i32(0), batch=1, pad_slot_id=-1, n_slots=N, length=1),
    "B = 1, one bound wrong": dict(qsl=_i32(1, 5), slots=_i32(0), batch=1, pad_slot_id=-1, n_slots=N, total=5),
    # vLLM's [B, k] slot table is read at column 0: a view with the table's row stride.
    "strided slots, counts and bounds": dict(
        slots=_i32(3, 9, 1, 9, N, 9, 3, 9).view(4, 2)[:, 0], accepted=_i64(1, 7, 0, 7, 2, 7, 1, 7).view(4, 2)[:, 0],
        qsl=_i32(0, 7, 2, 7, 1, 7, 5, 7, 6, 7).view(5, 2)[:, 0], batch=4, pad_slot_id=-1, n_slots=N, length=2,
        total=6),
}


@pytest.mark.parametrize("rewrite", [True, False], ids=["rewrite", "count_only"])
@pytest.mark.parametrize("case", list(EDGES))
def test_the_triton_kernel_equals_the_composite_on_edge_cases(triton_rule, device, case, rewrite):
    kw = dict(EDGES[case])
    counts = _both(triton_rule, device, kw.pop("slots", None), kw.pop("accepted", None), kw.pop("qsl", None),
                   rewrite=rewrite, **kw)
    assert any(counts), "every edge case has something to count"


def test_the_triton_kernel_equals_the_composite_without_sequences(triton_rule, device):
    """B = 0 with tokens: the end bound is set last in both (nothing to count)."""
    assert _both(triton_rule, device, None, None, _i32(3), batch=0, pad_slot_id=-1, total=4) == [0, 0, 0, 0]


@pytest.mark.parametrize("batch", [1, 16, 63, 64, 65, 130])
def test_the_triton_kernel_equals_the_composite_on_random_inputs(triton_rule, device, batch):
    """Batches within one block and over several (the duplicates compare block pairs)."""
    g = torch.Generator().manual_seed(batch)
    for dtype in (torch.int32, torch.int64):
        pad = PADS[batch % 3]
        slots = _slots(g, batch, 24, dtype, pad)
        total = 3 * batch
        _both(triton_rule, device, slots, _accepted(g, batch, 2, dtype), None, batch=batch, pad_slot_id=pad,
              n_slots=24, length=2, rewrite=dtype == torch.int32)
        _both(triton_rule, device, slots, None, _qsl(g, batch, total, dtype), batch=batch, pad_slot_id=pad,
              n_slots=24, total=total, rewrite=dtype == torch.int64)
        _both(triton_rule, device, None, None, _qsl(g, batch, total, dtype), batch=batch, pad_slot_id=pad,
              total=total)


@pytest.mark.parametrize("batch", [1, 5, 64, 65, 130])
def test_the_triton_decode_kernel_counts_what_the_rule_counts_and_no_rule_is_launched(counters, monkeypatch, device,
                                                                                        batch):
    """``triton``'s decode declares ``counts_bad_values``: its own kernel counts, as the oracle
    does (past one block of 64 earlier slots too), and the dispatched call launches no rule."""
    pytest.importorskip("triton", reason="triton not installed (the 'triton' extra)")
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(_op, "host_values", lambda t: False)  # as on an accelerator
    monkeypatch.setattr(_device_rule, "op", lambda: pytest.fail("the rule was launched"))
    kv.reload()  # the Triton variants claim the CPU under the interpreter
    g = torch.Generator().manual_seed(batch)

    def counted() -> list[int]:
        c = _device_errors._counters.get(torch.device(device) if device == "cpu" else torch.device("cuda", 0))
        return [0] * 4 if c is None else c.tolist()

    for dtype, pad, length in ((torch.int32, PADS[0], 1), (torch.int64, PADS[1], 2), (torch.int32, PADS[2], 2)):
        idx = _slots(g, batch, 24, dtype, pad)
        accepted = _accepted(g, batch, length, dtype) if length > 1 else None
        x, pool = torch.randn(batch, length, D), torch.randn(24, W - 1 + length - 1, D)
        w = torch.randn(D, W)
        _, want = _oracle_update((x, pool, w, None, None, idx, accepted, pad), True)
        on = [t.to(device) if t is not None else None for t in (x, pool, w, idx, accepted)]
        before = counted()
        with kv.force(causal_conv1d_update="triton"):
            kv.causal_conv1d_update(*on[:3], conv_state_indices=on[3], num_accepted_tokens=on[4], pad_slot_id=pad)
        assert [a - b for a, b in zip(counted(), before, strict=True)] == want, (dtype, pad)


# ------------------------------------------------------------------------------------------
# The rule against the oracle, through the op (composite on the CPU) and through the kernel
# ------------------------------------------------------------------------------------------


@pytest.fixture(params=["op", "triton"])
def rule_impl(request, monkeypatch):
    if request.param == "triton":
        pytest.importorskip("triton", reason="triton not installed (the 'triton' extra)")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(_device_rule, "op", lambda: _device_rule.triton_module(True).launch)
    return request.param


@pytest.mark.parametrize("op", [FN, UP])
def test_the_rule_hands_on_and_counts_what_the_oracle_does(counters, rule_impl, op):
    plan, oracle = ((_checks.device_fn_rule, _oracle_fn) if op == FN
                    else (_checks.device_update_rule, _oracle_update))
    caps = ConvCapabilities(devices={"cpu"}, dtypes={"float32"})
    total = [0] * 4
    for seed in range(60 if rule_impl == "op" else 25):
        args = _random_call(op, seed)
        for safe in (False, True):
            c = caps.model_copy(update={"slot_bounds_safe": safe})
            want, counts = oracle(args, safe)
            rule = plan(c, *args)  # planned from the call's metadata, as the dispatcher does
            got = args if rule is None else rule(args)
            assert (got is args) == (want is args), (seed, safe)
            assert _same(got, want) is None, (seed, safe, _same(got, want))
            total = [a + b for a, b in zip(total, counts, strict=True)]
            assert counters() == total, (seed, safe)
    kinds = [0, 1, 3] if op == FN else [0, 1, 2]
    assert all(total[k] for k in kinds), f"the random calls meet every kind: {total}"


def test_the_op_registers_a_schema_a_fake_kernel_and_traces(counters):
    op = _device_rule.op()
    assert op is torch.ops.kernel_variants.conv_device_rule.default
    counter = torch.zeros(4, dtype=torch.int64)
    args = (_i32(2, N, -1, 2), _i64(1, 0, 2, 1), None, counter, 4, N, -1, True, 2, 0, True)
    torch.library.opcheck(op, args)
    torch.library.opcheck(op, (_i32(2, N, -1, 2), None, None, counter, 4, N, -1, True, 0, 0, False))
    torch.library.opcheck(op, (None, None, _i32(0, 3, 2, 5), counter, 3, 0, -1, False, 0, 5, True))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    real = _device_rule.composite(*args)
    assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real]


# ------------------------------------------------------------------------------------------
# A dispatched call: at most one aten op outside the variant
# ------------------------------------------------------------------------------------------


class _Ops(TorchDispatchMode):
    """Every aten op issued outside a variant's body (``inside`` > 0 there)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


_MODE: list[_Ops] = []
_RECEIVED: dict[str, tuple] = {}


def _marked(op: str, safe: bool, counts: bool = False) -> Variant:
    """The reference, its body marked for :class:`_Ops`, remembering the arguments it got (in
    the op's signature order). ``counts``: a decode kernel that also counts the bad values it
    masks into ``bad_value_counter(x)``, as ``triton``'s does (``counts_bad_values``)."""
    ref = getattr(reference, op)
    sig = inspect.signature(ref)
    params = dispatcher().registry.spec(op).params

    def run(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        got = _RECEIVED[op] = tuple(bound.arguments[p] for p in params)
        mode = _MODE[-1] if _MODE else None
        if mode is not None:
            mode.inside += 1
        try:
            if safe:  # a slot_bounds_safe kernel masks bad values itself (the reference would raise)
                got, met = (_oracle_fn if op == FN else _oracle_update)(got, False)
                counter = bad_value_counter(got[0]) if counts else None
                if counter is not None:
                    counter.add_(torch.tensor(met))
            return ref(**dict(zip(params, got, strict=True)))
        finally:
            if mode is not None:
                mode.inside -= 1

    caps = ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, width=(1, None), varlen=op == FN,
                            num_accepted_tokens=op == UP, noncontiguous_states=True, slot_bounds_safe=safe,
                            counts_bad_values=counts)
    vid = "counting" if counts else "safe" if safe else "rewritten"
    return Variant(id=vid, op=op, version="1", fn=run, capabilities=caps)


@pytest.fixture
def accelerator(monkeypatch, with_variants, counters):
    with_variants(*[_marked(op, safe) for op in (FN, UP) for safe in (False, True)], _marked(UP, True, counts=True))
    monkeypatch.setattr(_op, "host_values", lambda t: False)
    assert dispatcher().device_values, "KV_CHECK_VALUES unset: the device rule runs off the CPU"
    _RECEIVED.clear()
    return SimpleNamespace(counters=counters)


def _forms():
    """(name, op, kwargs): each call form with and without its index tensors, with bad values."""
    n, batch = 6, 4
    idx = _i32(2, n, 2, -1)  # one slot outside the pool, one used twice, one pad
    qsl = _i64(0, 3, 2, 6, 8)  # sequences 1 and 2 malformed
    x3 = torch.randn(batch, 2, D)
    yield "fn", FN, dict(x=x3, weight=torch.randn(D, W))
    yield "fn states", FN, dict(x=x3, weight=torch.randn(D, W), conv_states=torch.randn(n, W - 1, D))
    yield "fn states idx", FN, dict(x=x3, weight=torch.randn(D, W), conv_states=torch.randn(n, W - 1, D),
                                    cache_indices=idx)
    yield "fn varlen", FN, dict(x=torch.randn(8, D), weight=torch.randn(D, W), query_start_loc=qsl)
    yield "fn varlen states", FN, dict(x=torch.randn(8, D), weight=torch.randn(D, W), query_start_loc=qsl,
                                       conv_states=torch.randn(n, W - 1, D))
    yield "fn varlen states idx", FN, dict(x=torch.randn(8, D), weight=torch.randn(D, W), query_start_loc=qsl,
                                           conv_states=torch.randn(n, W - 1, D), cache_indices=idx)
    yield "update", UP, dict(x=torch.randn(batch, D), conv_state=torch.randn(n, W - 1, D), weight=torch.randn(D, W))
    yield "update idx", UP, dict(x=torch.randn(batch, D), conv_state=torch.randn(n, W - 1, D),
                                 weight=torch.randn(D, W), conv_state_indices=idx)
    yield "update accepted", UP, dict(x=torch.randn(batch, 2, D), conv_state=torch.randn(n, W, D),
                                      weight=torch.randn(D, W), num_accepted_tokens=_i32(1, 0, 2, 3))
    yield "update idx accepted", UP, dict(x=torch.randn(batch, 2, D), conv_state=torch.randn(n, W, D),
                                          weight=torch.randn(D, W), conv_state_indices=idx,
                                          num_accepted_tokens=_i32(1, 0, 2, 3))


FORMS = list(_forms())
INDEX_PARAMS = {"cache_indices", "query_start_loc", "conv_state_indices", "num_accepted_tokens"}


def _watched(call) -> _Ops:
    """``call()`` under a fresh op counter (the ops it issued outside the variant), returned."""
    mode = _Ops()
    _MODE.append(mode)
    try:
        with mode:
            call()
    finally:
        _MODE.pop()
    return mode


def _ran_the_rule_once(accelerator, op, kwargs, mode, want, counts) -> None:
    """The repeated call (seen by ``mode``) ran the rule's one op and nothing else outside the
    variant (none without index tensors), the variant got the oracle's index values, and both
    calls were counted as the oracle counts, reported by ``check_errors`` once."""
    spec = dispatcher().registry.spec(op)
    assert mode.seen == (["kernel_variants.conv_device_rule.default"] if INDEX_PARAMS & set(kwargs) else []), mode.seen
    indices = [i for i, p in enumerate(spec.params) if p in INDEX_PARAMS | {"pad_slot_id"}]
    assert _same([_RECEIVED[op][i] for i in indices], [want[i] for i in indices]) is None
    assert accelerator.counters() == [2 * n for n in counts], "both calls counted, as the oracle counts"
    if any(counts):
        with pytest.raises(ValueError, match="bad index values"):
            kv.check_errors()
    kv.check_errors()


@pytest.mark.parametrize("vid", ["rewritten", "safe"])
@pytest.mark.parametrize(("name", "op", "kwargs"), FORMS, ids=[f[0] for f in FORMS])
def test_a_dispatched_call_issues_at_most_one_op_outside_the_variant(accelerator, name, op, kwargs, vid,
                                                                    python_calls):
    """Where the call core is built it serves the repeated call (the rule run from it)."""
    spec = dispatcher().registry.spec(op)
    args = tuple(kwargs.get(p, inspect.signature(spec.signature).parameters[p].default) for p in spec.params)
    want, counts = (_oracle_fn if op == FN else _oracle_update)(args, vid == "safe")
    with kv.force(**{op: vid}):
        getattr(kv, op)(**kwargs)  # decides and memoises: the calls after it are what a server repeats
        decided = python_calls[0]
        mode = _watched(lambda: getattr(kv, op)(**kwargs))
    assert (python_calls[0] == decided) == _callcore.status()[0], "the core serves the repeated call where it is on"
    _ran_the_rule_once(accelerator, op, kwargs, mode, want, counts)


@pytest.mark.parametrize("vid", ["rewritten", "safe"])
@pytest.mark.parametrize(("name", "op", "kwargs"), FORMS, ids=[f[0] for f in FORMS])
def test_a_bound_call_runs_the_rule_as_the_dispatched_call_does(accelerator, name, op, kwargs, vid):
    """``kv.bind`` is the C object also where a rule runs (the core built): the variant gets what
    the rule hands on, each call is counted, and nothing but the rule's op runs outside it."""
    spec = dispatcher().registry.spec(op)
    args = tuple(kwargs.get(p, inspect.signature(spec.signature).parameters[p].default) for p in spec.params)
    want, counts = (_oracle_fn if op == FN else _oracle_update)(args, vid == "safe")
    with kv.force(**{op: vid}):
        bound = kv.bind(op, **kwargs)
    assert (type(bound).__name__ == "BoundCore") is _callcore.status()[0]
    bound(**kwargs)  # the device's counter made: the calls after it are what a server repeats
    mode = _watched(lambda: bound(**kwargs))
    _ran_the_rule_once(accelerator, op, kwargs, mode, want, counts)


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("name", ["fn varlen states idx", "update idx"])
def test_a_failing_device_rule_is_not_blamed_on_the_variant(accelerator, monkeypatch, name, core):
    """The rule is the op's: its error comes out as raised, from the dispatched call and from
    ``kv.bind`` alike, whichever object serves the bound call (the C one or the Python one)."""
    monkeypatch.setenv(_callcore.ENV, "1" if core else "0")
    _callcore.rearm()  # KV_CALL_CORE is read where the cores are bound (a new dispatcher binds them)
    _, op, kwargs = next(f for f in FORMS if f[0] == name)

    def broken(*args, **kw):
        raise RuntimeError("device rule failed")

    monkeypatch.setattr(_device_rule, "apply", broken)
    with kv.force(**{op: "rewritten"}):
        bound = kv.bind(op, **kwargs)
        assert (type(bound).__name__ == "BoundCore") is (core and _callcore.status()[0])
        for call in (lambda: getattr(kv, op)(**kwargs), lambda: bound(**kwargs)):
            with pytest.raises(RuntimeError, match="device rule failed") as err:
                call()
            assert type(err.value) is RuntimeError, err.value
    assert not _RECEIVED, "the variant never ran"


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
@pytest.mark.parametrize("result", ["list", "longer", "shorter"])
def test_a_rule_that_returns_other_than_the_op_s_arguments_raises_the_same_everywhere(
        accelerator, monkeypatch, python_calls, result, core):
    """A device rule hands on the op's arguments as a tuple of as many; anything else is the
    rule's TypeError, one message, before the variant runs: from the first call (the Python
    path), the repeated one (the core, where it is on) and ``kv.bind``'s object alike."""
    monkeypatch.setenv(_callcore.ENV, "1" if core else "0")
    _callcore.rearm()  # KV_CALL_CORE is read where the cores are bound (a new dispatcher binds them)
    _, op, kwargs = next(f for f in FORMS if f[0] == "update idx")
    spec = dispatcher().registry.spec(op)
    planned = spec.device_rule
    bend = {"list": list, "longer": lambda a: (*a, None), "shorter": lambda a: a[:-1]}[result]

    def rule(caps, *args):
        made = planned(caps, *args)
        return None if made is None else (lambda a: bend(made(a)))

    object.__setattr__(spec, "device_rule", rule)  # a frozen dataclass: restored below
    messages = set()
    try:
        with kv.force(**{op: "rewritten"}):
            bound = kv.bind(op, **kwargs)
            for call in (lambda: getattr(kv, op)(**kwargs), lambda: getattr(kv, op)(**kwargs),
                         lambda: bound(**kwargs)):
                with pytest.raises(TypeError) as err:
                    call()
                messages.add(str(err.value))
            served = python_calls[0]
    finally:
        object.__setattr__(spec, "device_rule", planned)
    got = "list" if result == "list" else f"a tuple of {len(spec.params) + (1 if result == 'longer' else -1)}"
    assert messages == {f"the op's device rule: expected it to return a tuple of the op's {len(spec.params)} "
                        f"arguments, got {got}"}
    on = _callcore.status()[0]
    assert (served == 1) is on, "the core served the repeated call where it is on"
    assert not _RECEIVED, "the variant never ran"


@pytest.mark.parametrize("name", ["update idx", "update idx accepted"])
def test_a_variant_that_counts_in_its_kernel_gets_no_rule_and_a_c_level_bind(accelerator, name, python_calls):
    """``counts_bad_values``: no rule is planned for its calls, so nothing runs between the call
    and its kernel (not even a Python function), and ``kv.bind`` serves it from C."""
    _, op, kwargs = next(f for f in FORMS if f[0] == name)
    spec = dispatcher().registry.spec(op)
    args = tuple(kwargs.get(p, inspect.signature(spec.signature).parameters[p].default) for p in spec.params)
    _, counts = _oracle_update(args, True)
    assert any(counts), "the form has bad values for the kernel to count"
    with kv.force(**{op: "counting"}):
        getattr(kv, op)(**kwargs)
        decided = python_calls[0]
        mode = _watched(lambda: getattr(kv, op)(**kwargs))
        bound = kv.bind(op, **kwargs)
    assert mode.seen == [], mode.seen
    on = _callcore.status()[0]
    assert (python_calls[0] == decided) == on, "the core serves the repeated call where it is on"
    assert (type(bound).__name__ == "BoundCore") is on
    assert _same(list(_RECEIVED[op]), list(args)) is None, "the caller's indices, as they came"
    bound(**kwargs)
    assert accelerator.counters() == [3 * n for n in counts], "each call counted, by the variant"
    with pytest.raises(ValueError, match="bad index values"):
        kv.check_errors()


def test_the_kernel_compiles_for_sm_90_without_a_gpu(monkeypatch, tmp_path):
    """Compiled for sm_90 with Triton's compiler and the ptxas it ships (the interpreter does not
    check what only the compiler does: constexpr globals, loop-carried types): every flag
    combination compiles, and each block size fits in registers with the warps launch uses."""
    import itertools

    compile_ = sm90.compiler(monkeypatch)
    module = _device_rule.triton_module(False)
    fn = module._rule
    flags = ("HAS_SLOTS", "HAS_ACC", "HAS_QSL", "PAD_GIVEN", "REWRITE")
    signature = {"slots_ptr": "*i64", "acc_ptr": "*i32", "qsl_ptr": "*i32", "counter_ptr": "*i64",
                 "slots_out_ptr": "*i64", "acc_out_ptr": "*i32", "qsl_out_ptr": "*i32", "B": "i32", "N": "i32",
                 "pad": "i64", "length": "i32", "total": "i32", "slots_stride": "i32", "acc_stride": "i32",
                 "qsl_stride": "i32", **dict.fromkeys((*flags, "BLOCK"), "constexpr")}
    for values in itertools.product([True, False], repeat=len(flags)):
        compile_(fn, signature, {**dict(zip(flags, values, strict=True)), "BLOCK": 16}, 4)
    for batch in (8, 24, 200):
        block, warps = module.config(batch)
        sm90.assemble(compile_(fn, signature, {**dict.fromkeys(flags, True), "BLOCK": block}, warps), tmp_path,
                      f"rule{block}")
