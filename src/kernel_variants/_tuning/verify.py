"""Correctness before speed: one verdict on a variant's call of a case, against the reference's.

The verdict sees everything a kernel can get wrong on its own storage: every output within the
dtype's tolerance, of the reference's dtype, shape and strides, with no NaN or Inf where the
reference has none; every tensor the op writes equal to the reference's bit for bit over its
whole allocation (a write outside the view shows up); every other tensor argument unchanged bit
for bit (an input written in place shows up). Each run gets its own copy of every allocation
the call touches, so a variant that writes its inputs cannot spoil the next run's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernel_variants._registry.case import Case
from kernel_variants._registry.spec import OpSpec
from kernel_variants._tolerances import TOLERANCES, mismatch


def allocation_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A whole allocation as one uint8 tensor (bit-for-bit comparisons, NaN payloads included)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def clone_views(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[int, torch.UntypedStorage]]:
    """``values`` with each tensor a view (its strides and offset kept) of a clone of the whole
    allocation it views, each allocation cloned once (two tensors sharing one share its clone);
    and those clones, by the original allocation's data pointer."""
    clones: dict[int, torch.UntypedStorage] = {}
    out: dict[str, Any] = {}
    for name, v in values.items():
        if isinstance(v, torch.Tensor):
            src = v.untyped_storage()
            clone = clones.get(src.data_ptr())
            if clone is None:
                clone = clones[src.data_ptr()] = src.clone()
            v = torch.empty(0, dtype=v.dtype, device=v.device).set_(clone, v.storage_offset(), v.size(), v.stride())
        out[name] = v
    return out, clones


@dataclass
class _Copy:
    """A case on copies of every allocation its tensors view (strides and offsets kept)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    storages: dict[str, torch.UntypedStorage]  # parameter -> the allocation its tensor views
    devices: dict[str, torch.device]

    def call(self, fn: Callable[..., Any], **extra: Any) -> Any:
        return fn(*self.args, **self.kwargs, **extra)

    def tensor(self, spec: OpSpec, name: str) -> Any:
        pos = spec.positional
        if name in pos and pos.index(name) < len(self.args):
            return self.args[pos.index(name)]
        return self.kwargs.get(name)

    def allocation(self, name: str) -> torch.Tensor:
        return allocation_bytes(self.storages[name], self.devices[name])


def copy_case(case: Case) -> _Copy:
    """``case`` with each allocation its tensor arguments view cloned once (two arguments that
    share an allocation still share the copy)."""
    names = case.spec.positional
    positional = [names[i] if i < len(names) else f"#{i}" for i in range(len(case.args))]
    copied, _ = clone_views({**dict(zip(positional, case.args, strict=True)), **case.kwargs})
    tensors = {n: v for n, v in copied.items() if isinstance(v, torch.Tensor)}
    return _Copy(tuple(copied[n] for n in positional), {k: copied[k] for k in case.kwargs},
                 {n: t.untyped_storage() for n, t in tensors.items()}, {n: t.device for n, t in tensors.items()})


# Same-size integers, to compare a written view bit for bit (isclose calls -0.0 and 0.0 equal).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Expected = tuple[Any, dict[str, torch.Tensor]]  # the reference's result, each written allocation after


def reference_result(case: Case, fn: Callable[..., Any] | None = None) -> Expected:
    """The reference's result on a copy of ``case`` (``fn``: the reference, wrapped), and each
    allocation it writes, after."""
    spec = case.spec
    mine = copy_case(case)
    out = mine.call(fn if fn is not None else spec.reference.fn)
    return out, {n: mine.allocation(n) for n in spec.mutates if n in mine.storages}


def _strides_match(a: torch.Tensor, e: torch.Tensor) -> bool:
    """The same memory layout: strides equal wherever a dimension has more than one element."""
    return all(sa == se for n, sa, se in zip(e.shape, a.stride(), e.stride(), strict=True) if n > 1)


def _close(a: torch.Tensor, e: torch.Tensor) -> bool:
    """Within the dtype's tolerance everywhere, by a margin float32 rounding cannot eat; False
    also means "not sure", and the exact check (in float64, with its message) decides."""
    if e.dtype not in TOLERANCES or e.dtype == torch.float64:
        return False
    atol, rtol = TOLERANCES[e.dtype]
    a, e = a.reshape(-1), e.reshape(-1)
    step = 1 << 18  # in pieces that stay in cache: no temporaries the size of a large output
    for i in range(0, e.numel(), step):
        a32 = a[i:i + step].to(torch.float32, copy=True)
        e32 = e[i:i + step].float()
        # NaN or Inf compares False here, so the exact check judges it.
        if not bool(a32.sub_(e32).abs_().le_(e32.abs().mul_(rtol * 0.999).add_(atol * 0.999)).all()):
            return False
    return True


def _output_problem(name: str, a: object, e: torch.Tensor, out: torch.Tensor | None, layout: bool) -> str | None:
    if not isinstance(a, torch.Tensor):
        return f"returned {type(a).__name__} for {name}, expected a tensor"
    if out is not None and (a.data_ptr() != out.data_ptr() or a.shape != out.shape):
        return f"{name}: returned another tensor than the out= it was given"
    if a.dtype != e.dtype:
        return f"{name}: dtype {str(a.dtype)[6:]}, expected {str(e.dtype)[6:]}"
    if a.shape != e.shape:
        return f"{name}: shape {list(a.shape)}, expected {list(e.shape)}"
    if a.device != e.device:
        return f"{name}: on {a.device}, expected {e.device}"
    if out is None and layout and not _strides_match(a, e):
        return f"{name}: strides {list(a.stride())}, expected {list(e.stride())} (the reference's layout)"
    return None if a.numel() == 0 or _close(a, e) else mismatch(a, e, name)


def verify(fn: Callable[..., Any], case: Case, expected: Expected | None = None, *,
           out: str | None = None, layout: bool = True) -> str | None:
    """None when ``fn`` is right on ``case``, else the first thing it got wrong, in one line
    (:func:`judge`'s verdict)."""
    return judge(fn, case, expected, out=out, layout=layout).why


@dataclass
class Judged:
    """What :func:`judge` found: ``why`` (None: right), what ``fn`` returned (None where it
    raised) and the copies it ran on, as it left them (its written tensors among them)."""

    why: str | None
    got: Any
    ran_on: _Copy


def judge(fn: Callable[..., Any], case: Case, expected: Expected | None = None, *,
          out: str | None = None, layout: bool = True) -> Judged:
    """Run ``fn`` on a copy of ``case`` and judge it against the reference's result.

    ``out`` calls it with ``out=``: ``"dense"`` hands it fresh contiguous tensors filled with
    NaN, each starting inside a larger allocation (so rows it leaves unwritten, and writes
    outside it, show up), ``"in_place"`` the inputs the op lets ``out`` be
    (``x``: in place). ``layout=False`` leaves the outputs' strides to ``fn`` (a caller's own
    ``out=`` comes back with its own). A raising variant is a verdict, not a crash."""
    spec = case.spec
    ref_out, ref_written = expected if expected is not None else reference_result(case)
    mine = copy_case(case)
    untouched = {n: mine.allocation(n).clone() for n in mine.storages if n not in spec.mutates}
    # Computed states are judged at the tolerance, the elements the reference leaves alone bit
    # for bit: those need the allocations as they were.
    was = ({n: mine.allocation(n).clone() for n in spec.mutates if n in mine.storages}
           if spec.written_within_tolerance else {})
    outs: tuple[torch.Tensor, ...] | None = None
    guards: list[tuple[torch.Tensor, int, int, torch.Tensor]] = []
    extra: dict[str, Any] = {}
    if out is not None:
        outs, guards = _outs(spec, mine, out)
        extra["out"] = outs[0] if len(outs) == 1 else outs
        written_by_out = {n for n in spec.out_aliases.values()} if out == "in_place" else set()
        untouched = {n: b for n, b in untouched.items() if n not in written_by_out}
    try:
        got = mine.call(fn, **extra)
    except Exception as exc:  # any failure of the candidate is a verdict on it
        return Judged(f"raised {type(exc).__name__}: {exc}".splitlines()[0], None, mine)
    return Judged(_problem(spec, got, ref_out, ref_written, mine, outs, guards, untouched, layout, was), got, mine)


def _problem(spec: OpSpec, got: Any, ref_out: Any, ref_written: dict[str, torch.Tensor], mine: _Copy,
             outs: tuple[torch.Tensor, ...] | None, guards: list[tuple[torch.Tensor, int, int, torch.Tensor]],
             untouched: dict[str, torch.Tensor], layout: bool,
             was: dict[str, torch.Tensor] | None = None) -> str | None:
    """The first thing a variant's call on ``mine`` got wrong (None: nothing). ``was``: each
    written allocation as it was, for an op whose written values are computed (judged within
    the tolerance; see ``OpSpec.written_within_tolerance``)."""
    names = spec.outputs
    if len(names) == 1:
        got_t, want = (got,), (ref_out,)
    elif not isinstance(got, tuple | list) or len(got) != len(names):
        return f"returned {type(got).__name__}, expected a tuple of {len(names)} tensors ({', '.join(names)})"
    else:
        got_t, want = tuple(got), tuple(ref_out)
    for k, (name, a, e) in enumerate(zip(names, got_t, want, strict=True)):
        why = _output_problem("output" if len(names) == 1 else name, a, e, outs[k] if outs else None, layout)
        if why is not None:
            return why
    for allocation, start, stop, before in guards:
        if not torch.equal(_around(allocation, start, stop), before):
            return "out: wrote outside the out= tensor it was given (bytes of its allocation around it changed)"
    for name, after in ref_written.items():
        view = mine.tensor(spec, name)
        ref_view = _typed(after, view)
        if was:
            why = _computed_problem(name, view, ref_view, _typed(was[name], view), mine.allocation(name), after)
            if why is not None:
                return why
            continue
        bits = _BITS.get(view.element_size())
        # Bit-equal is the common verdict and one pass; the element-wise message only when not.
        if bits is None or not torch.equal(view.view(bits), ref_view.view(bits)):
            why = mismatch(view, ref_view, name, exact=True)
            if why is not None:
                return why
            if bits is not None:
                return f"{name}: bits differ inside its view (a signed zero or another NaN payload)"
        if not torch.equal(mine.allocation(name), after):
            return f"{name}: wrote outside its view (bytes of its allocation beyond the view changed)"
    for name, before in untouched.items():
        if not torch.equal(mine.allocation(name), before):
            return f"{name}: written, but the op does not write it (its input must stay as it was)"
    return None


def _typed(allocation: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The bytes ``allocation`` seen as ``like`` sees its own: dtype, offset, sizes, strides."""
    return torch.empty(0, dtype=like.dtype, device=like.device).set_(
        allocation.untyped_storage(), like.storage_offset(), like.size(), like.stride())


def _computed_problem(name: str, view: torch.Tensor, ref_view: torch.Tensor, old_view: torch.Tensor,
                      mine: torch.Tensor, after: torch.Tensor) -> str | None:
    """A computed state: every slot (index along the first dim) the reference left as it was
    still bit for bit as it was, the rest within the dtype's tolerance, and no byte outside the
    view changed. By slot, not by element: inside a written slot an element may come out equal
    to its old value by rounding (a decay of 1 and an input below the state's last bit), and a
    variant that rounds it the other way is right."""
    bits = _BITS[view.element_size()]
    old = old_view.view(bits).reshape(old_view.shape[0], -1) if view.ndim else old_view.view(bits).reshape(1, -1)
    kept = (ref_view.view(bits).reshape(old.shape) == old).all(1)
    if not torch.equal(view.view(bits).reshape(old.shape)[kept], old[kept]):
        return f"{name}: changed a slot the reference leaves as it was (one no sequence may write)"
    why = mismatch(view, ref_view, name)
    if why is not None:
        return why
    outside = mine.clone()
    _typed(outside, view).copy_(ref_view)  # the view as the reference wrote it: the rest must agree
    if not torch.equal(outside, after):
        return f"{name}: wrote outside its view (bytes of its allocation beyond the view changed)"
    return None


# A fresh out= starts this many elements into an allocation of NaN: odd, so that a kernel that
# writes at the allocation's start, or assumes an aligned one, shows up.
_OUT_OFFSET = 3


def _outs(spec: OpSpec, mine: _Copy,
          form: str) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, int, int, torch.Tensor]]]:
    """The out tensors of one ``out=`` form for the copied call ``mine``, and for each fresh one
    its whole allocation as bytes, the out tensor's byte range in it and a copy of the bytes
    around that range, taken before the call (they may not change)."""
    like = mine.tensor(spec, spec.params[spec.out_like_index])
    outs, guards = [], []
    for name in spec.outputs:
        alias = spec.out_aliases.get(name) if form == "in_place" else None
        if alias is not None:
            outs.append(mine.tensor(spec, alias))
        else:
            fill = float("nan") if like.is_floating_point() else 0
            n = like.numel()
            whole = torch.full((n + 2 * _OUT_OFFSET,), fill, dtype=like.dtype, device=like.device)
            outs.append(whole[_OUT_OFFSET:_OUT_OFFSET + n].view(like.shape))
            allocation = allocation_bytes(whole.untyped_storage(), whole.device)
            start = _OUT_OFFSET * whole.element_size()
            stop = start + n * whole.element_size()
            guards.append((allocation, start, stop, _around(allocation, start, stop)))
    return tuple(outs), guards


def _around(allocation: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The bytes of ``allocation`` outside ``[start, stop)``, copied."""
    return torch.cat([allocation[:start], allocation[stop:]])


def out_forms(spec: OpSpec, caps: Any, case: Case) -> Sequence[str]:
    """The ``out=`` forms a variant with capabilities ``caps`` declares, that the dispatcher
    would hand it for ``case``: a dense out, and exactly the aliased inputs where they are dense
    (a strided out is always written by copy, never handed to a variant)."""
    if not caps.takes_out:
        return ()
    aliases = [case.get(n) for n in spec.out_aliases.values()]
    if caps.in_place and aliases and all(isinstance(a, torch.Tensor) and a.is_contiguous() for a in aliases):
        return ("dense", "in_place")
    return ("dense",)


def load_call(path: str) -> dict[str, Any]:
    """A live call saved by shadow verification (``_runtime.shadow.save_mismatch``): its op,
    variant, oracle, what was found, and ``args`` in signature order. Plain data and tensors
    only (``weights_only``): a shared cache directory must not run code when read."""
    # A call saved on a GPU is still readable on a host without one (a shared cache directory).
    doc = torch.load(path, weights_only=True, map_location=None if torch.cuda.is_available() else "cpu")
    if not isinstance(doc, dict) or not {"op", "variant", "args"} <= doc.keys():
        raise ValueError(f"{path}: not a call saved by kernel_variants' shadow verification")
    return doc


def case_of(spec: OpSpec, args: Sequence[Any]) -> Case:
    """A call given in signature order as a ``Case`` (keyword-only parameters by name)."""
    n = len(spec.positional)
    return Case(spec, tuple(args[:n]), dict(zip(spec.params[n:], args[n:], strict=True)))


def replay(path: str, rv: Any, spec: OpSpec) -> str | None:
    """``rv`` (a registered variant of ``spec``) judged again on the live call saved at
    ``path``, against the reference: None when it is right there now, else what it gets wrong."""
    try:
        doc = load_call(path)
    except (OSError, ValueError, RuntimeError) as exc:
        return f"cannot read the saved call ({type(exc).__name__}: {exc})"
    return judge_saved(doc, rv, spec)


def judge_saved(doc: dict[str, Any], rv: Any, spec: OpSpec) -> str | None:
    """``rv`` judged on a saved call's inputs (``load_call``), against the reference."""
    if doc["op"] != rv.op:
        return f"the saved call is of {doc['op']}, not {rv.op}"
    return verify(rv.variant.fn, case_of(spec, doc["args"]))
