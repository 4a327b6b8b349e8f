"""The engine adapters' fast steps on the compiled call core: served below the entry, with the
Python path's results, and the views they keep.

Shared calls and helpers: ``tests/helpers/call_core.py``; the ``path`` fixture: ``tests/conftest.py``.
"""

from __future__ import annotations

import torch
from helpers.call_core import (
    CORE_MARKS,
    D,
    N,
    W,
    _same,
)

pytestmark = CORE_MARKS


def test_the_engine_adapters_fast_steps_call_the_core_below_the_entry(reference_only, path, python_calls,
                                                                      monkeypatch):
    """vLLM's and sglang's everyday calls in their layouts (slot lists and vLLM's slot table, a
    prefill with and without a pool): once each signature has been seen, the op's core serves
    them from C (neither the entry nor the Python path runs); both paths give the same outputs
    and states."""
    from kernel_variants.integrations import _fast
    from kernel_variants.integrations import sglang as kv_sglang
    from kernel_variants.integrations import vllm as kv_vllm

    entered = []
    for name in ("_FN", "_UPDATE"):
        real = getattr(_fast, name)
        monkeypatch.setattr(_fast, name, lambda *a, _real=real: entered.append(1) or _real(*a))

    def calls(seed: int):
        g = torch.Generator().manual_seed(seed)
        pool = torch.randn(N, W - 1, D, generator=g)
        weight, bias = torch.randn(D, W, generator=g), torch.randn(D, generator=g)
        slots = torch.tensor([4, 1, 2], dtype=torch.int32)
        table = torch.tensor([[5, 0], [1, 0], [3, 0]], dtype=torch.int32)  # vLLM reads column 0
        qsl, init = torch.tensor([0, 3, 4, 10], dtype=torch.int32), torch.tensor([True, False, True])
        x = torch.randn(10, D, generator=g)
        tokens = torch.randn(3, D, generator=g)
        return [
            kv_vllm.causal_conv1d_fn(x.t(), weight, bias, pool.transpose(1, 2), qsl, slots, init, "silu").clone(),
            kv_vllm.causal_conv1d_fn(x.t(), weight, bias, None, qsl, None, None, "silu").clone(),
            kv_vllm.causal_conv1d_update(tokens, pool.transpose(1, 2), weight, bias, "silu", slots),
            kv_vllm.causal_conv1d_update(tokens, pool.transpose(1, 2), weight, bias, "silu", table),
            kv_sglang.causal_conv1d_fn(x.t(), weight, bias, pool.transpose(1, 2), qsl, [3, 1, 6], slots, init,
                                       "silu").clone(),
            kv_sglang.causal_conv1d_update(tokens, pool.transpose(1, 2), weight, bias, "silu",
                                           conv_state_indices=slots),
            pool,
        ]

    results = {}
    for on in (True, False):
        path(on)
        with torch.no_grad():
            first = calls(0)  # each signature decides once (the entry, the Python path)
            entered.clear()
            python_calls[0] = 0
            results[on] = [first, calls(1)]
        assert (len(entered), python_calls[0]) == ((0, 0) if on else (6, 6))
    _same(results[True], results[False])


def test_sglang_prefill_s_host_lengths_are_checked_in_the_core_as_in_python(reference_only, path, monkeypatch):
    """sglang hands its host lengths: the core serves the call where they hold no zero and sum
    to T, as a list or a tuple, with a plain int pad id; anything else (an empty sequence,
    padding tokens past the lengths, an int subclass) takes the general path. Both paths agree
    on which, and on the results."""
    from kernel_variants.integrations import _sglang_adapters
    from kernel_variants.integrations import sglang as kv_sglang

    class Slot(int):
        pass

    general = []
    real = _sglang_adapters.prefill
    monkeypatch.setattr(_sglang_adapters, "prefill", lambda *a, **k: general.append(1) or real(*a, **k))
    forms = {  # name: (query_start_loc, host lengths, pad id, served by the step)
        "list": ([0, 3, 4, 10], [3, 1, 6], -1, True),
        "tuple": ([0, 3, 4, 10], (3, 1, 6), -1, True),
        "an empty sequence": ([0, 3, 3, 10], [3, 0, 7], -1, False),
        "padding tokens": ([0, 3, 4, 9], [3, 1, 5], -1, False),
        "an int subclass": ([0, 3, 4, 10], [3, 1, 6], Slot(-1), False),
        "a non-int length": ([0, 3, 4, 10], [3, 1.0, 6], -1, False),
    }

    def run(qsl, lengths, pad):
        g = torch.Generator().manual_seed(0)
        pool = torch.randn(N, W - 1, D, generator=g)
        weight, bias = torch.randn(D, W, generator=g), torch.randn(D, generator=g)
        x = torch.randn(10, D, generator=g)
        y = kv_sglang.causal_conv1d_fn(x.t(), weight, bias, pool.transpose(1, 2), torch.tensor(qsl, dtype=torch.int32),
                                       lengths, torch.tensor([4, 1, 2], dtype=torch.int32),
                                       torch.tensor([True, False, True]), "silu", pad)
        return [y.clone(), pool]

    results = {}
    for on in (True, False):
        path(on)
        with torch.no_grad():
            for name, (qsl, lengths, pad, _) in forms.items():
                run(qsl, lengths, pad)  # the signature decides once
                general.clear()
                results[on, name] = run(qsl, lengths, pad)
                assert (not general) == forms[name][3], (name, on)
    for name in forms:
        _same(results[True, name], results[False, name])


def test_a_step_s_views_are_reused_only_where_nothing_holds_them(path):
    """The views a fast step hands the op (the pool, a prefill's x, a slot table's column) are
    kept after the call and re-pointed at the next step's tensors, unless something holds one:
    a tensor the variant kept, weak-referenced, tagged or gave another class is never changed
    afterwards; a kept view holds none of the engine's storage and is out of the GC's reach; each step's view has its own tensor's sizes, strides,
    data, dtype, version counter and inference state."""
    import gc
    import weakref

    import kernel_variants.integrations._fast  # noqa: F401  (provides the steps)
    from kernel_variants._runtime.callcore import FUNCTIONS

    path(True)
    seen, held, refs, seen_types = [], [], [], []

    class Sub(torch.Tensor):
        pass

    def entry(*args):  # the op's entry, as a step calls it where no core serves
        state = args[1]
        seen.append((id(state), getattr(state, "tag", None)))
        state[0, 0, 0] += 1  # the variant writes the pool through its view
        what = behaviour[0]
        if what == "keep":
            held.append((state, state.shape, state.clone()))
        elif what == "weak":
            refs.append((weakref.ref(state), state.shape))
        elif what == "tag":
            state.tag = "mine"
        elif what == "subclass":
            state.__class__ = Sub
        seen_types.append(type(state))
        return args[0]

    def step(pool: torch.Tensor) -> None:
        x, weight = torch.zeros(2, pool.shape[1], dtype=pool.dtype), torch.zeros(pool.shape[1], W, dtype=pool.dtype)
        uses = torch._C._storage_Use_Count(pool.untyped_storage()._cdata)
        version = None if pool.is_inference() else pool._version
        assert FUNCTIONS.decode_step(None, entry, x, pool, weight, None, "silu", None, -1, True) is x
        if behaviour[0] != "keep":
            assert torch._C._storage_Use_Count(pool.untyped_storage()._cdata) == uses, "nothing keeps the pool"
        if version is not None:
            assert pool._version > version, "a write through the view counts on the pool"

    behaviour = ["plain"]
    with torch.no_grad():
        pools = [torch.zeros(N, D + k, W - 1) for k in range(3)]
        for pool in pools:
            step(pool)
        assert all(p[0, 0, 0] == 1 for p in pools)
        assert len({i for i, _ in seen}) == 1, "a view nothing holds is reused"
        step(torch.zeros(N, D, W - 1, dtype=torch.bfloat16))
        assert seen[-1][0] == seen[0][0], "for another dtype too"

        assert seen[-1][0] not in {id(o) for o in gc.get_objects()}, "a kept view is out of the GC's reach"
        for what in ("keep", "weak", "tag", "subclass"):
            behaviour[0] = what
            for k in range(3):
                step(torch.full((N, D + k, W - 1), float(k)))
            behaviour[0] = "plain"
            step(torch.zeros(N, D, W - 1))
            assert seen[-1][1] is None, "a reused view carries no attribute of an earlier call"
            assert seen_types[-1] is torch.Tensor, "nor the class an earlier call gave it"
        for k, (state, shape, values) in enumerate(held):
            assert state.shape == shape and torch.equal(state, values) and state[1, 1, 1] == k
        for ref, shape in refs:
            assert ref() is None or ref().shape == shape, "a weak reference never sees another tensor"

    with torch.inference_mode():
        frozen = torch.zeros(N, D, W - 1)
        step(frozen)
    inference = seen[-1][0]
    with torch.inference_mode():
        step(torch.zeros(N, D, W - 1))
        assert seen[-1][0] == inference, "an inference tensor's view is reused for the next one"
    with torch.no_grad():
        step(torch.zeros(N, D, W - 1))  # a normal pool: a normal view, never the inference one
        assert seen[-1][0] != inference

    def fn_entry(x, weight, bias, pool, slots, init, qsl, act, pad, out):
        got.append((x.shape, x.stride(), x.data_ptr(), pool.shape, pool.data_ptr(), slots.tolist()))
        return x

    got = []
    table = torch.tensor([[4, 0], [1, 0]], dtype=torch.int32)
    qsl, init = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([True, False])
    with torch.no_grad():
        for k in range(3):
            x, pool = torch.randn(7, D + k), torch.randn(N, W - 1, D + k)
            y = FUNCTIONS.prefill_step(None, fn_entry, x.t(), torch.zeros(D + k, W), None, pool.transpose(1, 2), qsl,
                                       table, init, "silu", 0, True, None)
            assert got[-1] == (x.shape, x.stride(), x.data_ptr(), pool.shape, pool.data_ptr(), [4, 1])
            assert y.shape == (D + k, 7) and y.data_ptr() == x.data_ptr()

    # The op's result as the engine's (dim, T): a fresh output is restrided in place, one the
    # variant also holds (or weak-references) is left as it is and aliased.
    cache, values = torch.zeros(7, D), torch.randn(7, D)

    made = []

    def fresh(*args):
        y = torch.empty(7, D)
        made.append(id(y))
        return y.copy_(values)

    watched = []

    def watched_fresh(*args):  # a fresh output the variant keeps a weak reference to
        y = torch.empty(7, D).copy_(values)
        watched.append(weakref.ref(y))
        return y

    for entry_, holder in ((fresh, None), (lambda *a: cache, cache), (watched_fresh, watched)):
        with torch.no_grad():
            y = FUNCTIONS.prefill_step(None, entry_, torch.randn(7, D).t(), torch.zeros(D, W), None, None, qsl, None,
                                       None, "silu", 0, True, None)
        assert y.shape == (D, 7) and y.stride() == (1, D)
        if holder is None:
            assert torch.equal(y, values.t()) and id(y) == made[-1], "the variant's own output, no alias"
        elif holder is watched:
            # Not restrided: the watched object died with the step, y is an alias of its data.
            assert watched[-1]() is None and torch.equal(y, values.t())
        else:
            assert holder.shape == (7, D) and y.data_ptr() == holder.data_ptr()


def test_the_engine_adapters_under_a_non_strict_export_record_the_ops(reference_only, path):
    """torch.export without Dynamo runs the adapters on fake tensors: their fast steps make
    ordinary views, read no host data, and the ops record their custom ops; the exported
    program computes what the eager calls do, pools included."""
    from kernel_variants.integrations import sglang as kv_sglang
    from kernel_variants.integrations import vllm as kv_vllm

    path(True)

    class Step(torch.nn.Module):
        def forward(self, x, weight, pool, qsl, slots, init, tokens):
            return (kv_vllm.causal_conv1d_fn(x.t(), weight, None, pool.transpose(1, 2), qsl, slots, init, "silu"),
                    kv_vllm.causal_conv1d_update(tokens, pool.transpose(1, 2), weight, None, "silu", slots),
                    kv_sglang.causal_conv1d_fn(x.t(), weight, None, pool.transpose(1, 2), qsl, [3, 4], slots, init,
                                               "silu"),
                    kv_sglang.causal_conv1d_update(tokens, pool.transpose(1, 2), weight, None, "silu",
                                                   conv_state_indices=slots))

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(7, D, generator=g), torch.randn(D, W, generator=g), torch.randn(N, W - 1, D, generator=g),
            torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([1, 4], dtype=torch.int32),
            torch.tensor([True, False]), torch.randn(2, D, generator=g))
    program = torch.export.export(Step(), tuple(a.clone() for a in args), strict=False)
    assert "causal_conv1d" in str(program.graph)
    exported, eager = [a.clone() for a in args], [a.clone() for a in args]
    _same([*program.module()(*exported), exported[2]], [*Step()(*eager), eager[2]])


def test_kept_views_survive_dispatch_keys_that_come_and_go(path):
    """Views of tensors with several dispatch key sets (inference or not, a conjugate bit) in
    turn, three at once from a prefill step: every place is taken, the oldest view is let go
    for a new key set, and each step's writes land in its own pool."""
    import kernel_variants.integrations._fast  # noqa: F401  (provides the steps)
    from kernel_variants._runtime.callcore import FUNCTIONS

    path(True)

    def decode_entry(*args):
        args[1][0, 0, 0] += 1
        return args[0]

    def prefill_entry(x, weight, bias, pool, slots, init, qsl, act, pad, out):
        pool[int(slots[0]), 0, 0] += 1
        return x

    def pool(inference: bool, conj: bool) -> torch.Tensor:
        with torch.inference_mode(inference):
            p = torch.zeros(N, D, W - 1, dtype=torch.complex64 if conj else torch.float32)
            return p.conj() if conj else p

    qsl, table = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([[2, 0]], dtype=torch.int32)
    for _ in range(5):
        for inference in (True, False):
            for conj in (False, True):
                with torch.inference_mode(inference):
                    p = pool(inference, conj)
                    x, w = torch.zeros(3, D, dtype=p.dtype), torch.zeros(D, W, dtype=p.dtype)
                    FUNCTIONS.decode_step(None, decode_entry, x[:1], p, w, None, "silu", None, -1, True)
                    FUNCTIONS.prefill_step(None, prefill_entry, x.t(), w, None, p, qsl, table, None, "silu", -1,
                                           True, None)
                assert p[0, 0, 0] == 1 and p[2, 0, 0] == 1 and int((p != 0).sum()) == 2
