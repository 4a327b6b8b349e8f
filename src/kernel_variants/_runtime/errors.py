"""The errors the call path raises, each message written in one place (the compiled call core
detects; these say what went wrong)."""

from __future__ import annotations

from typing import Any

from kernel_variants._registry.spec import OpSpec


class VariantFailed(RuntimeError):
    """A variant raised during a real call; the message names it, ``__cause__`` is the original."""


def variant_failed(spec: OpSpec, vid: str, exc: BaseException) -> VariantFailed:
    """What a variant's exception becomes, on every call path (``__cause__``: the original)."""
    return VariantFailed(f"variant {vid!r} of {spec.name} failed: {type(exc).__name__}: {exc}")


def inference_error(name: str) -> ValueError:
    return ValueError(f"{name}: an inference tensor (made under torch.inference_mode) cannot be "
                      "updated outside inference mode; allocate it outside, or call inside inference_mode")


def overlap_error(spec: OpSpec, i: int, written: str) -> ValueError:
    return ValueError(f"{spec.params[i]}: expected memory apart from {written}, which the op writes, got a view "
                      f"that overlaps it; pass a copy")


def changed_error(names: list[str], expected: tuple[Any, ...], got: tuple[Any, ...]) -> ValueError:
    """A bound op called with other values than its example's."""
    which = [n for n, e, g in zip(names, expected, got, strict=True) if e != g]
    return ValueError(f"{', '.join(which)}: a bound op runs with the example's values; expected "
                      f"{ {n: e for n, e in zip(names, expected, strict=True) if n in which} }, got "
                      f"{ {n: g for n, g in zip(names, got, strict=True) if n in which} }; "
                      "call kernel_variants.bind again for other values")
