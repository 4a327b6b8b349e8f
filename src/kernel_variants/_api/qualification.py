"""The qualification API: qualify variants on a device ahead of time, read and forget verdicts."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernel_variants._policy import is_reference
from kernel_variants._registry.keys import CallKey
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
from kernel_variants._table.rows import Verdict

QUALIFY_DTYPES = ("float32", "bfloat16", "float16")


def qualify(
    op: str | None = None,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    variants: Sequence[str] | None = None,
    redo: bool = False,
    **features: object,
) -> list[Verdict]:
    """Qualify variants on ``device`` ahead of time, so that no call pays for it: each available
    variant (of ``op``, of ``variants``) that claims the device, for the class of ``features``
    (default: the op's, what a calibration measures) in ``dtype`` (default: each of fp32, bf16
    and fp16 it claims), runs the op's edge cases against the reference (see ``_tuning/qualify.py``). A
    stored verdict of the variant's current version is kept unless ``redo``. Returns the
    verdicts; a variant with a failed one is never chosen for that class here. With ``redo`` a
    stored failure is replaced only when its failing case (a check at a calibrated shape, say)
    passes when run again.
    """
    from kernel_variants._dtypes import dtype_name

    d = dispatcher()
    if features and op is None:
        raise TypeError(f"features: expected an op to apply {', '.join(features)} to, got op=None")
    specs = [d.registry.spec(op)] if op is not None else d.registry.ops()
    dev = torch.device(device)
    wanted = [dtype_name(dtype)] if dtype is not None else list(QUALIFY_DTYPES)
    if variants is not None:
        known = {rv.id for spec in specs for rv in d.registry.variants(spec.name)}
        missing = [v for v in variants if v not in known]
        if missing:
            raise ValueError(f"variants: {', '.join(missing)} not registered (registered: {', '.join(sorted(known))})")
    out: list[Verdict] = []
    try:
        for spec in specs:
            f = spec.features(**features)
            for rv in d.registry.variants(spec.name):
                if (variants is not None and rv.id not in variants) or is_reference(rv, spec):
                    continue
                caps = rv.variant.capabilities
                shape = caps.fit(spec.axes, (1,) * len(spec.axes))
                for dt in wanted:
                    key = CallKey(spec, dev.type, dt, f, shape or (1,) * len(spec.axes), index=dev.index)
                    if shape is None or rv.why_not(key) is not None:
                        continue  # does not claim this class here, or cannot run here
                    v = None if redo else d.qualifier.stored(rv, key)
                    out.append(v if v is not None else d.qualifier.qualify(rv, key, redo=redo))
    finally:
        d.invalidate()
    return out


def clear_verdicts(op: str | None = None, variant: str | None = None) -> int:
    """Forget the qualification verdicts (of ``op``, of ``variant``) of every device; returns how
    many went. Each variant qualifies again before it is next chosen."""
    d = dispatcher()
    try:
        return d.qualifier.clear(op, variant)
    finally:
        d.invalidate()


def verdicts(device: str = "cpu") -> list[Verdict]:
    """Every stored verdict of ``device`` whose variant is registered at that version now and
    that ran its op's current qualification suite."""
    from kernel_variants._table.rows import VERDICT_PREFIX, parse_verdict, verdict_fingerprint
    from kernel_variants._tuning.cases import suite_of

    d = dispatcher()
    fpid = fingerprint_id(verdict_fingerprint(fingerprint(str(torch.device(device)))))
    versions = d.versions()
    out = []
    for skey, raw in d.table.store.items():
        if not skey.startswith(f"{VERDICT_PREFIX}{fpid}|"):
            continue
        v = parse_verdict(raw)
        if v is not None and versions.get((v.group.op, v.variant)) == v.version \
                and v.suite == suite_of(d.registry.spec(v.group.op)):
            out.append(v)
    return sorted(out, key=lambda v: (v.group.slug(), v.variant))
