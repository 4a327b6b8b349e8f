"""The compiled call core and the Python call path: the same errors, for bad values, bad calls
and variants that raise, and the same arguments handed to a variant.

Shared calls and helpers: ``tests/helpers/call_core.py``; the ``path`` fixture: ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.call_core import (
    CORE_MARKS,
    FN,
    UP,
    B,
    D,
    L,
    N,
    S,
    _decode_call,
    _error,
    _fn_call,
    _recording,
    _update_call,
    _varlen_call,
)

import kernel_variants as kv
from kernel_variants._runtime import callcore as _callcore
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._runtime.errors import VariantFailed
from kernel_variants.ops.causal_conv1d import FN_SPEC

pytestmark = CORE_MARKS


def _bad_calls():
    """(op, a good call, the same signature with a problem only the values or memory show)."""
    good = _fn_call()
    pool = torch.randn(N, S, D)
    yield "slot out of range", FN, good, _fn_call(cache_indices=torch.tensor([4, 6, 2], dtype=torch.int32))
    yield "negative slot", FN, good, _fn_call(cache_indices=torch.tensor([4, -3, 2], dtype=torch.int32))
    yield "duplicate slot", FN, good, _fn_call(cache_indices=torch.tensor([2, 0, 2], dtype=torch.int32))
    yield "starts not from 0", FN, _varlen_call(), _varlen_call(query_start_loc=torch.tensor([1, 3, 3, 10]))
    yield "starts decreasing", FN, _varlen_call(), _varlen_call(query_start_loc=torch.tensor([0, 4, 3, 10]))
    yield "starts short of T", FN, _varlen_call(), _varlen_call(query_start_loc=torch.tensor([0, 3, 3, 9]))
    yield "accepted above L", UP, _update_call(), _update_call(
        num_accepted_tokens=torch.tensor([1, 3, 2], dtype=torch.int32))
    yield "decode slot out of range", UP, _decode_call(), _decode_call(
        conv_state_indices=torch.tensor([6], dtype=torch.int32))
    # x a view of the pool's own memory (same dtype and shapes: the signature of the good call)
    yield "x inside the pool", FN, _fn_call(conv_states=pool), _fn_call(
        conv_states=pool, x=pool.view(-1)[: B * L * D].view(B, L, D))
    # bias starting before the pool, in the same allocation, and reaching into it
    below, other = torch.randn(D + N * S * D), torch.randn(D + N * S * D)
    yield "bias reaching into the pool", FN, _fn_call(conv_states=other[D:].view(N, S, D)), _fn_call(
        conv_states=below[D:].view(N, S, D), bias=below[D // 2: D // 2 + D])


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_both_paths_raise_the_same_errors(reference_only, path, grad):
    outcomes = {}
    for on in (True, False):
        path(on)
        seen = []
        with torch.enable_grad() if grad else torch.no_grad():
            for what, op, good, bad in _bad_calls():
                getattr(kv, op)(**good)  # the signature is memoised: the core serves the next call
                if on:  # the core has the bad call's entry: it detected the problem and handed it over
                    spec = dispatcher().registry.spec(op)
                    assert _callcore.core_for(spec).lookup(spec.bind(**bad), None) == "reference", what
                seen.append((what, _error(op, bad)))
        outcomes[on] = seen
    assert outcomes[True] == outcomes[False]
    assert all(t is ValueError for _, (t, _) in outcomes[True])


def test_an_inference_state_is_refused_outside_inference_mode_on_both_paths(reference_only, path):
    errors = []
    for on in (True, False):
        path(on)
        with torch.inference_mode():
            pool = torch.randn(N, S, D)
            kv.causal_conv1d_fn(**_fn_call(conv_states=pool))  # learned inside inference mode
        call = _fn_call(conv_states=pool)
        if on:
            assert _callcore.core_for(FN_SPEC).lookup(FN_SPEC.bind(**call), None) == "reference"
        errors.append(_error(FN, call))
    assert errors[0] == errors[1] and "inference tensor" in errors[0][1]


def test_wrong_non_tensor_values_raise_the_same_errors(reference_only, path):
    errors = {}
    for on in (True, False):
        path(on)
        kv.causal_conv1d_fn(**_fn_call())
        errors[on] = [_error(FN, _fn_call(activation="relu")), _error(FN, _fn_call(pad_slot_id=1.5)),
                      _error(FN, _fn_call(pad_slot_id=[1]))]
    assert errors[True] == errors[False]
    assert [t for t, _ in errors[True]] == [ValueError, TypeError, TypeError]


def test_a_forced_variant_gets_the_same_arguments_on_both_paths(with_variants, path):
    seen: dict[bool, list] = {True: [], False: []}
    for on in (True, False):
        path(on)
        with_variants(_recording(FN, seen[on]), _recording(UP, seen[on]))
        with kv.force(causal_conv1d_fn="rec", causal_conv1d_update="rec"):
            for _ in range(2):
                kv.causal_conv1d_fn(**_fn_call(activation="swish"))
                kv.causal_conv1d_update(**_update_call())
    assert len(seen[True]) == 4
    assert [(n, {k: (type(v), v.shape if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
            for n, kw in seen[True]] == [(n, {k: (type(v), v.shape if isinstance(v, torch.Tensor) else v)
                                              for k, v in kw.items()}) for n, kw in seen[False]]
    assert seen[True][1][1]["activation"] == "silu", "normalised once per signature, on the core too"


def test_a_variant_that_raises_is_reported_the_same_on_both_paths(with_variants, path):
    errors = []
    for on in (True, False):
        path(on)
        with_variants(_recording(FN, [], fail=True))
        with kv.force(causal_conv1d_fn="rec"):
            for _ in range(2):  # the second call is the core's
                with pytest.raises(VariantFailed) as info:
                    kv.causal_conv1d_fn(**_fn_call())
                errors.append((str(info.value), type(info.value.__cause__), str(info.value.__cause__)))
    assert len(set(errors)) == 1
    assert errors[0] == ("variant 'rec' of causal_conv1d_fn failed: RuntimeError: kernel exploded", RuntimeError,
                         "kernel exploded")


@pytest.mark.parametrize("n", [0, 3, len(FN_SPEC.params) + 2])
def test_an_entry_called_without_the_op_s_arguments_raises_the_same_on_both_paths(reference_only, path, n):
    """The core hands a call of the wrong arity to the Python path, which says what is wrong."""
    raised = {}
    for on in (True, False):
        path(on)
        entry = _callcore.entry_of(FN_SPEC).call
        kv.causal_conv1d_fn(**_fn_call())  # the core found and serving
        with pytest.raises((TypeError, IndexError)) as err:
            entry(*([None] * n))
        raised[on] = (type(err.value), str(err.value))
    assert raised[True] == raised[False]
    if n:
        assert raised[True][0] is TypeError and "its entry (what make_op returns)" in raised[True][1]


def test_a_device_rule_count_on_the_cpu_is_reported_first_on_both_paths(reference_only, path, monkeypatch):
    from kernel_variants._runtime import device_errors as _device_errors

    errors = []
    for on in (True, False):
        path(on)
        kv.causal_conv1d_fn(**_fn_call())
        counter = torch.zeros(len(_device_errors.KINDS), dtype=torch.int64)
        counter[_device_errors.SLOT] = 2
        monkeypatch.setitem(_device_errors._counters, torch.device("cpu"), counter)
        errors.append(_error(FN, _fn_call()))
    assert errors[0] == errors[1] and "2 x slot index" in errors[0][1]


def test_learn_raises_what_a_field_s_truth_test_raises(reference_only, path):
    """A ``python_only`` whose truth test raises: learn raises it (never True with an error set)
    and files nothing."""
    from kernel_variants._runtime.core_specs import Learned, per_parameter

    class Unsure:
        def __bool__(self):
            raise RuntimeError("no truth here")

    path(True)
    core = _callcore.core_for(FN_SPEC)
    args = FN_SPEC.bind(**_fn_call())
    learned = Learned(args, None, lambda *a, **k: None, "reference", per_parameter(len(args), ()), None, None,
                      None, (), Unsure(), None)
    with pytest.raises(RuntimeError, match="no truth here"):
        core.learn(learned)
    assert len(core) == 0
