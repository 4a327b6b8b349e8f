import torch
import torch.nn.functional as F

from kernel_variants.plugin import Capabilities, Case, Features, OpSpec, Variant, hookimpl, make_op


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[..., :D]) * x[..., D:]. x: [..., 2D] float; returns [..., D] in x's dtype."""
    return _entry(x, out)  # the dispatcher: the variant measured fastest for this shape here


def _check(x, *, values):
    """Validate a call; return the key: device, dtype, features, shape (T, D), extra."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point torch.Tensor, got {type(x).__name__}")
    if x.ndim < 1 or x.shape[-1] % 2:
        raise ValueError(f"x: expected shape [..., 2D], got {list(x.shape)}")
    d = x.shape[-1] // 2
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.device.type, str(x.dtype).removeprefix("torch."), Features(), (rows, d), frozenset()


def reference(x):
    a, b = x.float().chunk(2, dim=-1)
    return (F.silu(a) * b).to(x.dtype)


def _case(shape, *, dtype, device, seed=0):
    rows, d = shape
    x = torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(seed))
    return Case(SPEC, (x.to(dtype=dtype, device=device),), {})


def _conformance(caps):
    yield from (("T=1", {"shape": (1, 8)}), ("odd-D", {"shape": (5, 33)}), ("T=64", {"shape": (64, 256)}))


ANY = dict(devices={"cpu", "cuda", "npu"}, dtypes={"float32", "bfloat16", "float16", "float64"})
SPEC = OpSpec(
    name="silu_and_mul", signature=silu_and_mul, axes=("T", "D"), features=Features,
    capabilities=Capabilities, check=_check,
    reference=Variant(id="reference", op="silu_and_mul", version="1", fn=reference,
                      capabilities=Capabilities(**ANY), priority=-100),
    make_case=_case, conformance=_conformance,
)
_entry = make_op(SPEC)


def fused(x):
    """One fp32 pass with an in-place multiply."""
    a, b = x.float().chunk(2, dim=-1)
    return F.silu(a).mul_(b).to(x.dtype)


@hookimpl
def kv_register_ops(register):
    register(SPEC)


@hookimpl
def kv_register_variants(register):
    register(Variant(id="fused", op="silu_and_mul", version="1", fn=fused,
                     capabilities=Capabilities(devices={"cpu", "cuda"}, dtypes={"float32", "bfloat16"})))
