"""How far correct gradients land from the reference's: what ``GRADIENT_TOLERANCES`` is set from.

For each op, each available variant that declares ``autograd`` (the reference aside), each
class of calls the op's conformance list reaches at every width the variant claims, and each
edge case qualification builds for that class (``class_cases``), in fp32, fp16 and bf16: the
variant's gradients and the reference's
(``_tuning.cases.gradients``: every floating input the op does not write requires grad, a fixed
cotangent weighs the outputs), and the largest difference relative to the reference gradient's
largest magnitude (at least 1), the measure the qualification holds to the tolerance. Prints
the worst per variant and dtype, and per dtype beside its tolerance with the margin left.

    python tools/gradient_spread.py
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from _report import cpu_model  # a sibling module: tools/ is sys.path[0]

from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._tolerances import GRADIENT_TOLERANCES
from kernel_variants._tuning.cases import class_cases, gradients

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def spread(want: dict[str, torch.Tensor], have: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest relative difference over the gradients, and of which input."""
    worst, where = 0.0, ""
    for name, w in want.items():
        if not w.numel():
            continue
        scale = max(float(w.double().abs().max()), 1.0)
        rel = float((have[name].double() - w.double()).abs().max()) / scale
        if rel > worst:
            worst, where = rel, name
    return worst, where


def _classes(spec: Any, caps: Any, dtype: torch.dtype) -> list[Any]:
    """The classes (features) of the calls in the op's conformance list that ``caps`` cover."""
    seen: dict[str, Any] = {}
    for _, options in spec.conformance(caps):
        opts = dict(options)
        shape = caps.fit(spec.axes, tuple(opts.pop("shape")))
        if shape is None:
            continue
        try:
            key = spec.key_of_case(spec.make_case(shape, dtype=dtype, device="cpu", **opts))
        except (ValueError, TypeError):
            continue  # no call of the contract (an empty decode)
        if caps.uncovered(key) is None:
            seen.setdefault(key.features.model_dump_json(), key.features)
    return list(seen.values())


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(1)
    d = dispatcher()
    per_dtype: dict[torch.dtype, tuple[float, str]] = {}
    print(f"gradient spread against the reference, {cpu_model()}")
    print(f"{'op':22s} {'variant':12s} {'dtype':9s} {'cases':>5s} {'worst':>9s}  where")
    for spec in d.registry.ops():
        for rv in d.registry.variants(spec.name):
            caps = rv.variant.capabilities
            if not caps.autograd or rv.variant.fn is spec.reference.fn or rv.unavailable_reason() is not None:
                continue
            if "cpu" not in caps.devices:
                continue
            for dtype in DTYPES:
                if str(dtype)[6:] not in caps.dtypes:
                    continue
                worst, where, calls = 0.0, "", 0
                for features in _classes(spec, caps, dtype):
                    for label, case in class_cases(spec, caps, features, dtype=dtype, device="cpu"):
                        rel, name = spread(gradients(spec.reference.fn, case), gradients(rv.variant.fn, case))
                        calls += 1
                        if rel >= worst:
                            flags = ",".join(f"{k}={v}" for k, v in features.model_dump().items())
                            worst, where = rel, f"{label} [{flags}], d/d{name}"
                print(f"{spec.name:22s} {rv.id:12s} {str(dtype)[6:]:9s} {calls:5d} {worst:9.3g}  {where}")
                if worst >= per_dtype.get(dtype, (0.0, ""))[0]:
                    per_dtype[dtype] = (worst, f"{spec.name} {rv.id} {where}")
    print()
    for dtype, (worst, where) in per_dtype.items():
        tol = GRADIENT_TOLERANCES[dtype]
        margin = tol / worst if worst else float("inf")
        print(f"{str(dtype)[6:]:9s} worst {worst:.3g} ({where}); tolerance {tol:g}: {margin:.1f}x left")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
