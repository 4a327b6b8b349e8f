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


def result_error(name: str, n_out: int, got: Any) -> TypeError:
    """A compiled graph's kernel of the op ``name`` handed something other than its ``n_out``
    outputs by the variant it ran (an eager call returns what the variant returns)."""
    expected = "a tensor" if n_out == 1 else f"a tuple or list of {n_out} tensors"
    if isinstance(got, tuple | list) and n_out > 1:
        kinds = ", ".join(type(o).__name__ for o in got)
        got_text = f"a {type(got).__name__} of {len(got)} ({kinds})"
    else:
        got_text = type(got).__name__
    return TypeError(f"{name}: expected its variant to return {expected} in a compiled graph, got {got_text}")


def rule_result_error(got: Any, n: int) -> TypeError:
    """An op's device rule that returned something other than the op's ``n`` arguments as a tuple."""
    got_text = f"a tuple of {len(got)}" if isinstance(got, tuple) else type(got).__name__
    return TypeError(f"the op's device rule: expected it to return a tuple of the op's {n} arguments, got {got_text}")


def inference_error(name: str) -> ValueError:
    return ValueError(f"{name}: an inference tensor (made under torch.inference_mode) cannot be "
                      "updated outside inference mode; allocate it outside, or call inside inference_mode")


def overlap_error(spec: OpSpec, i: int, written: str) -> ValueError:
    return ValueError(f"{spec.params[i]}: expected memory apart from {written}, which the op writes, got a view "
                      f"that overlaps it; pass a copy")


def self_overlap_error(name: str, stride: tuple[int, ...]) -> ValueError:
    return ValueError(f"{name}: expected a tensor whose elements are apart in memory, got one whose strides "
                      f"{list(stride)} make elements share memory (an expand()?)")


def out_overlap_error(name: str, param: str, *, in_place_allowed: bool) -> ValueError:
    """``out`` (or one of its tensors, ``name``) overlapping the argument ``param``; where ``out``
    may be exactly that argument, the overlap is a partial one."""
    if not in_place_allowed:
        return ValueError(f"{name}: expected memory apart from {param}, got a view that overlaps it; pass another tensor")
    return ValueError(f"{name}: expected exactly (in place) or memory apart from {param}, got a view that overlaps "
                      "it partially; pass another tensor")


def outs_overlap_error(name: str, other: str) -> ValueError:
    """Two of ``out``'s tensors overlapping each other."""
    return ValueError(f"{name}: expected memory apart from {other}, got a view that overlaps it")


def changed_error(names: list[str], expected: tuple[Any, ...], got: tuple[Any, ...]) -> ValueError:
    """A bound op called with other values than its example's."""
    which = [n for n, e, g in zip(names, expected, got, strict=True) if type(e) is not type(g) or e != g]
    return ValueError(f"{', '.join(which)}: a bound op runs with the example's values; expected "
                      f"{ {n: e for n, e in zip(names, expected, strict=True) if n in which} }, got "
                      f"{ {n: g for n, g in zip(names, got, strict=True) if n in which} }; "
                      "call kernel_variants.bind again for other values")


def unlike_error(name: str, expected: str, got: str, *, type_error: bool) -> TypeError | ValueError:
    """A bound op called with a tensor unlike its example's (``type_error``: a dtype, or None
    where a tensor was, or the other way)."""
    cls = TypeError if type_error else ValueError
    return cls(f"{name}: a bound op runs on tensors like its example's (its variant was chosen and qualified for "
               f"them); expected {expected}, got {got}; call kernel_variants.bind again for these, or call the op")


def capture_error(spec: OpSpec, vid: str, device: str) -> ValueError:
    """A bound variant not declared graph_safe, called while a graph is captured on its device."""
    return ValueError(f"{spec.name}: the bound variant {vid!r} is not declared graph_safe, and a {device} graph is "
                      "being captured; call kernel_variants.bind inside the capture (it then chooses a graph_safe "
                      "variant), or call the op")


def entry_error(spec: OpSpec, got: int) -> TypeError:
    """An op's entry called as the op: ``make_op`` returns the entry, which the op's public
    function calls with every parameter in signature order, then ``out``."""
    return TypeError(f"{spec.name}: its entry (what make_op returns) takes the op's {len(spec.params)} parameters "
                     f"in signature order, then out; got {got} before out. The op's public function calls it: "
                     "see docs/changes.md")
