"""``kv.bind`` on the compiled call core (its C object) and on the Python path: the same results,
refusals and errors.

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
    W,
    _decode_call,
    _fn_call,
    _recording,
    _same,
)

import kernel_variants as kv
from kernel_variants._runtime import callcore as _callcore
from kernel_variants._runtime.errors import VariantFailed
from kernel_variants.ops.causal_conv1d import FN_SPEC, ConvCapabilities, _reference
from kernel_variants.plugin import Variant

pytestmark = CORE_MARKS


def _bound_outcomes(bound, calls):
    """Per call: ("ok", result) or (the error's type, its message)."""
    out = []
    for args, kwargs in calls:
        try:
            out.append(("ok", bound(*args, **kwargs)))
        except Exception as exc:
            out.append((type(exc), str(exc)))
    return out


def _bind_calls():
    """(the example, calls of the bound op): fresh tensors each time (the pool is written)."""
    example = _fn_call()
    x, w, b = example.pop("x"), example.pop("weight"), example.pop("bias")
    pool = example["conv_states"]
    calls = [
        ((x, w, b), example),
        ((x, w), {**example, "bias": b}),
        ((x, w, b), {**example, "cache_indices": torch.tensor([1, 0, 3], dtype=torch.int64)}),  # not int32: refused
        ((x, w, b), {**example, "activation": "swish"}),  # another value: refused
        ((x, w, b), {**example, "pad_slot_id": 0}),
        ((x, w, b), {**example, "cache_indices": torch.tensor([1, 6, 3], dtype=torch.int32)}),
        ((x, w, b), {**example, "cache_indices": torch.tensor([1, 1, 3], dtype=torch.int32)}),
        ((x, w, b), {**example, "cache_indices": None}),  # not what the example had: refused
        ((x, w, b), {**example, "out": torch.zeros(B, L, D)}),
        ((x, w, b), {**example, "out": pool}),  # overlaps the written pool
        ((x, w, b, pool), {}),  # too many positional arguments
        ((x,), example),  # weight missing
        ((x, w, b), {**example, "nonsense": 1}),
    ]
    return ((x, w, b), example), calls


def test_kv_bind_is_c_level_on_the_core_and_behaves_as_the_python_bound_function(reference_only, path):
    import inspect

    outcomes = {}
    for on in (True, False):
        path(on)
        (args, kwargs), calls = _bind_calls()
        bound = kv.bind(kv.causal_conv1d_fn, *args, **kwargs)
        assert (type(bound).__name__ == "BoundCore") is on
        assert (bound.op, bound.variant, bound.__name__) == (FN, "reference", "causal_conv1d_fn_bound")
        assert inspect.signature(bound) == FN_SPEC.py_signature
        outcomes[on] = [*_bound_outcomes(bound, calls), ("pool after", calls[0][1]["conv_states"].clone())]
    _same(outcomes[True], outcomes[False])
    assert [o[0] for o in outcomes[True][:-1]] == ["ok", "ok", TypeError, ValueError, ValueError, ValueError, ValueError,
                                                   TypeError, "ok", ValueError, TypeError, TypeError, TypeError]


def test_a_bound_variant_that_raises_is_reported_the_same_on_both_paths(with_variants, path):
    errors = []
    for on in (True, False):
        path(on)
        with_variants(_recording(UP, [], fail=True))
        with kv.force(causal_conv1d_update="rec"):
            call = _decode_call()
            bound = kv.bind(UP, **call)
        with pytest.raises(VariantFailed) as info:
            bound(**call)
        errors.append((str(info.value), type(info.value.__cause__)))
    assert errors == [("variant 'rec' of causal_conv1d_update failed: RuntimeError: kernel exploded",
                       RuntimeError)] * 2


UNLIKE = {  # a bound call's change to its example -> the error
    "another dtype": ({"x": lambda c: c["x"].bfloat16(), "weight": lambda c: c["weight"].bfloat16(),
                       "bias": lambda c: c["bias"].bfloat16(), "conv_states": lambda c: c["conv_states"].bfloat16()},
                      TypeError, r"x: .* expected a \[3, 4, 8\] float32 tensor on cpu, got a \[3, 4, 8\] bfloat16"),
    "another length": ({"x": lambda c: c["x"][:, :2]}, ValueError, r"x: .* got a \[3, 2, 8\] float32"),
    "None for a tensor": ({"bias": lambda c: None}, TypeError, r"bias: .* got None"),
    "a smaller pool": ({"conv_states": lambda c: c["conv_states"][:5]}, ValueError,
                       r"conv_states: .* with strides \[24, 8, 1\], got a \[5, 3, 8\]"),
    "a transposed pool": ({"conv_states": lambda c: c["conv_states"].transpose(1, 2).contiguous().transpose(1, 2)},
                          ValueError, r"conv_states: .* got a \[6, 3, 8\] float32 tensor on cpu with strides \[24, 1, 3\]"),
    "a gradient": ({"weight": lambda c: c["weight"].clone().requires_grad_()}, ValueError,
                   r"weight: .* expected no tensor that requires grad in grad mode"),
}


@pytest.mark.parametrize("change", list(UNLIKE))
def test_a_bound_call_unlike_its_example_is_refused_and_runs_nothing(with_variants, path, change):
    """The bound variant qualified and was chosen for the example's class and shapes (here one
    that supports fp32 only): a call with other tensors is refused with the same error on both
    paths, before the variant runs or the pool is written."""
    changes, error, message = UNLIKE[change]
    calls = [0]

    def fp32_only(*args, **kwargs):
        calls[0] += 1
        return _reference.causal_conv1d_fn(*args, **kwargs)

    errors = []
    for on in (True, False):
        path(on)
        with_variants(Variant(id="fp32_only", op=FN, version="1", fn=fp32_only, capabilities=ConvCapabilities(
            devices={"cpu"}, dtypes={"float32"}, noncontiguous_states=True, autograd=False)))
        example = _fn_call()
        with torch.no_grad(), kv.force(causal_conv1d_fn="fp32_only"):
            bound = kv.bind(FN, **example)
        assert bound.variant == "fp32_only" and (type(bound).__name__ == "BoundCore") is on
        call = {**example, **{k: f(example) for k, f in changes.items()}}
        before, ran = call["conv_states"].clone() if call["conv_states"] is not None else None, calls[0]
        with pytest.raises(error, match=message) as info:
            bound(**call)
        errors.append(str(info.value))
        assert calls[0] == ran, "the variant ran"
        assert torch.equal(call["conv_states"], before), "the pool was written"
        with torch.no_grad():
            bound(**_fn_call())  # a call like the example runs
        assert calls[0] == ran + 1
    assert errors[0] == errors[1]


def test_a_bound_call_with_inference_tensors_is_served_in_c(reference_only, path, monkeypatch):
    """A serving loop runs under inference_mode, its tensors inference tensors (no autograd
    dispatch keys) where the example was made outside it: the C object still serves the call,
    never its Python fallback. Outside inference_mode the same pool cannot be written."""
    path(True)
    fallbacks = [0]
    made = _callcore.bound

    def counting(spec, python, *rest):
        def counted(*args, **kwargs):
            fallbacks[0] += 1
            return python(*args, **kwargs)
        return made(spec, counted, *rest)

    monkeypatch.setattr(_callcore, "bound", counting)
    bound = kv.bind(FN, **_fn_call())
    assert type(bound).__name__ == "BoundCore"
    expected = _fn_call(seed=1)
    want = _reference.causal_conv1d_fn(**expected)
    with torch.inference_mode():
        call = _fn_call(seed=1)
        got = bound(**call)
    assert call["x"].is_inference() and fallbacks[0] == 0
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(call["conv_states"], expected["conv_states"])
    with pytest.raises(ValueError, match="conv_states: an inference tensor"):
        bound(**call)
    assert fallbacks[0] == 1


def test_a_bind_with_a_parameter_in_its_example_is_c_level_and_keeps_no_tensor_of_it(reference_only, path):
    """Module weights are Parameters: the C object serves such a bind; the bound op keeps the
    example's metadata, not its tensors (a throw-away example's pool is freed)."""
    import gc
    import weakref

    path(True)
    example = _fn_call(weight=torch.nn.Parameter(torch.randn(D, W), requires_grad=False))
    bound = kv.bind(FN, **example)
    assert type(bound).__name__ == "BoundCore"
    pool = weakref.ref(example["conv_states"])
    call = _fn_call(seed=1, weight=example["weight"])
    del example
    gc.collect()
    assert pool() is None, "the bound op keeps the example's pool"
    torch.testing.assert_close(bound(**call), _reference.causal_conv1d_fn(**_fn_call(seed=1, weight=call["weight"])))


def test_a_bound_call_with_a_value_of_another_type_is_refused_on_both_paths(reference_only, path):
    """The memo key holds each value's type: -1.0 is not -1, and a bound op says so before its
    variant sees a float where it was chosen for an int."""
    errors = []
    for on in (True, False):
        path(on)
        bound = kv.bind(FN, **_fn_call(pad_slot_id=-1))
        assert (type(bound).__name__ == "BoundCore") is on
        with pytest.raises(ValueError, match=r"pad_slot_id: a bound op runs with the example's values; "
                                             r"expected \{'pad_slot_id': -1\}, got \{'pad_slot_id': -1\.0\}") as info:
            bound(**_fn_call(pad_slot_id=-1.0))
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def test_a_bound_variant_not_graph_safe_refuses_a_call_in_a_capture(with_variants, path, monkeypatch):
    """Captured into a CUDA/NPU graph the op chooses among graph_safe variants only: a bound
    variant that is not one refuses a call made while a graph is captured, and the bound op is
    then the Python function (the C object does not read the capture state). Simulated on the
    CPU: its calls counted as capturable."""
    import gc
    import weakref

    from kernel_variants._runtime import bind as _bind

    path(True)
    monkeypatch.setattr(_bind, "_capturable", lambda device: True)
    capture = [False]
    monkeypatch.setattr(_bind, "capturing", lambda device: capture[0])
    for vid, graph_safe in (("unsafe", False), ("safe", True)):
        with_variants(Variant(id=vid, op=FN, version="1", fn=_reference.causal_conv1d_fn, capabilities=ConvCapabilities(
            devices={"cpu"}, dtypes={"float32"}, noncontiguous_states=True, graph_safe=graph_safe)))
        with kv.force(causal_conv1d_fn=vid):
            bound = kv.bind(FN, **_fn_call())
        assert (type(bound).__name__ == "BoundCore") is graph_safe
        capture[0] = True
        if graph_safe:
            bound(**_fn_call())
        else:
            refused = _fn_call()
            with pytest.raises(ValueError, match="the bound variant 'unsafe' is not declared graph_safe, and a cpu graph "
                                                 "is being captured"):
                bound(**refused)
            x = weakref.ref(refused.pop("x"))
            gc.collect()
            assert x() is None, "the error keeps a refused call's tensors"
        capture[0] = False
        bound(**_fn_call())
