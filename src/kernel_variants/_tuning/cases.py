"""A variant's edge cases for one class of calls, each judged by the one verify: what a
qualification runs (``run_cases``), and the check a calibration runs at each shape it times
(``check_at``); and the fingerprint of that suite (``suite_of``), which every verdict records."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from kernel_variants._registry.case import Case
from kernel_variants._registry.keys import Features
from kernel_variants._registry.registry import RegisteredVariant
from kernel_variants._registry.spec import OpSpec, Shape
from kernel_variants._tolerances import gradient_mismatch
from kernel_variants._tuning.verify import copy_case, out_forms, reference_result, verify

# The modules whose code decides what a qualification runs and how it judges: a change to any of
# them is a new suite, and every verdict of the old one qualifies again.
_JUDGES = ("_tuning/cases.py", "_tuning/verify.py", "_tolerances.py")
_SUITES: dict[int, tuple[OpSpec, str]] = {}


def suite_of(spec: OpSpec) -> str:
    """A hash of everything that decides what qualifying for ``spec`` checks: its named edge
    cases and check options, the source of its case builder and of its reference, and this
    package's judging code. A verdict is valid for the suite it ran; a stronger suite (a new
    trap, a tighter tolerance, a corrected reference) re-qualifies every variant once."""
    known = _SUITES.get(id(spec))
    if known is not None and known[0] is spec:
        return known[1]
    h = hashlib.sha256()
    h.update(repr(sorted((k, sorted(v.items())) for k, v in spec.edge_cases.items())).encode())
    h.update(repr(sorted(spec.check_options.items())).encode())
    package = Path(__file__).resolve().parent.parent
    files = {package / p for p in _JUDGES}
    for fn in (spec.make_case, spec.reference.fn, spec.conformance):
        try:
            files.add(Path(inspect.getsourcefile(inspect.unwrap(fn)) or ""))
        except TypeError:  # a builtin: no source of its own
            continue
    for path in sorted(files):
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    suite = h.hexdigest()[:12]
    _SUITES[id(spec)] = (spec, suite)
    return suite


def class_cases(spec: OpSpec, caps: Any, features: Features, *, dtype: Any, device: str) -> Iterator[tuple[str, Case]]:
    """Each named edge case of ``spec`` built for the class ``features`` at ``dtype``: its own
    options with the class's features over them, at the nearest sizes ``caps`` takes; a case
    that is no call of this class (an empty decode, which the contract refuses) is left out."""
    named: Mapping[str, Mapping[str, Any]] = spec.edge_cases or dict(spec.conformance(caps))
    want = features.model_dump()
    seen: set[str] = set()
    for label, options in named.items():
        opts = {**options, **want}
        shape = caps.fit(spec.axes, tuple(opts.pop("shape")))
        if shape is None:
            continue
        ident = repr((shape, sorted(opts.items(), key=lambda kv: kv[0])))
        if ident in seen:  # the class's features made it another case's twin
            continue
        try:
            case = spec.make_case(shape, dtype=dtype, device=device, **opts)
            key = spec.key_of_case(case)
        except (ValueError, TypeError):
            continue
        if key.features != features or caps.uncovered(key) is not None:
            continue
        seen.add(ident)
        yield label, case


def run_cases(spec: OpSpec, rv: RegisteredVariant, features: Features, dtype: Any, device: str) -> dict[str, Any]:
    """Every case of the class on ``rv``: how many ran, the first failure, the largest sizes."""
    caps = rv.variant.capabilities
    ran, largest = 0, [0] * len(spec.axes)
    seen: list[Case] = []
    for label, case in class_cases(spec, caps, features, dtype=dtype, device=device):
        seen.append(case)
        expected = reference_result(case)
        for form in (None, *out_forms(spec, caps, case)):
            ran += 1
            why = verify(rv.variant.fn, case, expected, out=form)
            if why is not None:
                name = label if form is None else f"{label}, out= {form.replace('_', ' ')}"
                return {"cases": ran, "failed_case": f"{name} ({str(dtype)[6:]})", "reason": why}
        if caps.autograd:  # it may be handed calls whose inputs require grad: its gradients count too
            ran += 1
            why = gradient_problem(rv.variant.fn, case)
            if why is not None:
                return {"cases": ran, "failed_case": f"{label}, gradients ({str(dtype)[6:]})", "reason": why}
        largest = [max(a, b) for a, b in zip(largest, spec.key_of_case(case).shape, strict=True)]
    if ran == 0:
        return failed("no edge case of this class fits its declared limits")
    if len(seen) > 1:
        ran += 1
        why = _reused_output(rv.variant.fn, seen[0], seen[1])
        if why is not None:
            return {"cases": ran, "failed_case": f"two calls in a row ({str(dtype)[6:]})", "reason": why}
    return {"cases": ran, "failed_case": "", "reason": "", "largest": largest}


class _Detached(Exception):
    """An output of a variant handed inputs that require grad has no gradient function."""


def gradients(fn: Callable[..., Any], case: Case) -> dict[str, torch.Tensor]:
    """``fn``'s gradients on ``case``, by parameter: every floating input the op does not write
    requires grad, and a fixed cotangent (-1..1 over each output's elements) weighs the outputs.
    Raises what ``fn`` raises, and ``_Detached`` where an output left the graph."""
    spec = case.spec
    names = [n for n in spec.params if isinstance(case.get(n), torch.Tensor) and case.get(n).is_floating_point()
             and n not in spec.mutates]
    if not names:
        return {}
    mine = case.fresh()
    args = [mine.get(n) for n in spec.params]
    inputs = [args[spec.params.index(n)].detach().clone().requires_grad_() for n in names]
    for n, t in zip(names, inputs, strict=True):
        args[spec.params.index(n)] = t
    with torch.enable_grad():
        got = spec.invoke(fn, args)
        outs = [o for o in (got if isinstance(got, tuple | list) else (got,)) if isinstance(o, torch.Tensor)]
        if any(o.numel() and o.grad_fn is None for o in outs):
            raise _Detached
        weights = [torch.linspace(-1, 1, o.numel(), device=o.device).view_as(o).to(o.dtype) for o in outs]
        loss = sum(((o * w).float().sum() for o, w in zip(outs, weights, strict=True) if o.numel()),
                   torch.zeros((), device=inputs[0].device))
        if not loss.requires_grad:
            return {n: torch.zeros_like(t) for n, t in zip(names, inputs, strict=True)}
        got_grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return {n: torch.zeros_like(t) if g is None else g for n, t, g in zip(names, inputs, got_grads, strict=True)}


def gradient_problem(fn: Callable[..., Any], case: Case) -> str | None:
    """Why ``fn``'s gradients on ``case`` (``gradients``) are not the reference's, or None: each
    input's gradient is held to the dtype's gradient tolerance (``_tolerances``)."""
    want = gradients(case.spec.reference.fn, case)
    try:
        have = gradients(fn, case)
    except _Detached:
        return "an output is detached from the graph (its inputs require grad)"
    except Exception as exc:  # as in verify: a raising variant is a verdict
        return f"raised {type(exc).__name__} with inputs that require grad: {exc}".splitlines()[0]
    for n, w in want.items():
        why = gradient_mismatch(have[n], w, f"d/d{n}")
        if why is not None:
            return why
    return None


def _reused_output(fn: Callable[..., Any], first: Case, second: Case) -> str | None:
    """Why the result of one call changes when ``fn`` is called again (it hands out a buffer it
    reuses: the caller's first result would be overwritten), or None."""
    def tensors(out: Any) -> list[torch.Tensor]:
        return [t for t in (out if isinstance(out, tuple | list) else (out,)) if isinstance(t, torch.Tensor)]

    outs = tensors(copy_case(first).call(fn))
    kept = [t.clone() for t in outs]
    copy_case(second).call(fn)
    for t, k in zip(outs, kept, strict=True):
        # NaN-aware and bit-exact where it matters: the same call's own result, before and after
        if not torch.equal(torch.nan_to_num(t, 1.5, 2.5, 3.5), torch.nan_to_num(k, 1.5, 2.5, 3.5)):
            return "an output changed when it was called again (it returns a buffer it reuses)"
    return None


def check_at(spec: OpSpec, rv: RegisteredVariant, shape: Shape, features: Features, *, dtype: Any,
             device: str, seed: int = 0) -> str | None:
    """One check at ``shape`` with the op's traps in it (``check_options``): None when right."""
    case = spec.make_case(tuple(shape), dtype=dtype, device=device, seed=seed,
                          **{**features.model_dump(), **spec.check_options})
    return verify(rv.variant.fn, case)


def failed(reason: str) -> dict[str, Any]:
    return {"cases": 0, "failed_case": "", "reason": reason}


def error(reason: str) -> dict[str, Any]:
    """An outcome that says nothing about the variant (the machine, the runtime, the check
    itself failed): it bars the variant in this process only, and is never stored."""
    return {**failed(reason), "error": True}
