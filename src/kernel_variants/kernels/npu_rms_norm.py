"""Adapters of the Ascend providers of the Gemma RMSNorm ops (torch_npu kernels).

The contract (``kernel_variants`` ops)::

    gemma_rms_norm(x, weight, eps=1e-6) -> out
        x [..., D] fp32/bf16/fp16, weight [D];
        out = x * rsqrt(mean(x^2, -1) + eps) * (1 + weight), computed in fp32, in x's dtype.
    add_gemma_rms_norm(x, weight, residual, eps=1e-6) -> (out, residual_sum)
        s = x + residual, summed in x's dtype; residual_sum = s; out = gemma_rms_norm(s).
        No input is mutated.

The providers are the ones sgl-kernel-npu chooses per Ascend device family (open PR #638,
``python/sgl_kernel_npu/sgl_kernel_npu/norm/gemma_rmsnorm.py`` at 0b3d8e67)::

    310P, unknown   torch_npu.npu_rms_norm(x, 1 + w, eps)[0]          (add: x + r in torch first)
    A2, A3          torch_npu.npu_gemma_rms_norm(x, w, eps)[0]         (add: npu_add_rms_norm(r, x, 1 + w, eps))
    A5 (950)        a Triton kernel (not bound here)

Later commits of the PR (head 99421ab5, and PR #734) bind one provider per wheel at build time:
Ascend910 ``npu_gemma_rms_norm(x, w, eps)``, Ascend950 ``npu_rms_norm(x, 1 + w, eps)`` (the
Triton kernel dropped), and the add form ``npu_add_rms_norm(x, r, 1 + w, eps)`` everywhere.

torch_npu's schemas (Ascend/op-plugin ``op_plugin/config/op_plugin_functions.yaml``)::

    npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)        # (y, rstd)
    npu_gemma_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)  # (y, rstd)
    npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06)
        -> (Tensor, Tensor, Tensor)                                                         # (y, rstd, x1 + x2)

``y`` has x's dtype, ``rstd`` is fp32 ``[..., 1]``. ``npu_gemma_rms_norm`` applies ``1 + gamma``
itself (in fp32, inside the kernel); the other two scale by ``gamma`` as given, so they get
``1 + weight``. Where the kernels depart from the contract, and what the adapters do:

- ``npu_rms_norm`` takes 2-8 dims; the others 1-8: every adapter flattens x to ``[N, D]`` and
  restores the shape, so any rank works.
- empty tensors: ``npu_add_rms_norm`` and ``npu_gemma_rms_norm`` do not take them (torch_npu's
  documentation): the adapters answer an empty x themselves, without a kernel call.
- ``npu_gemma_rms_norm`` does not take non-contiguous tensors: the adapters pass contiguous ones.
- gamma's dtype must be x's (x1's): the adapters pass the weight in x's dtype. For the kernels
  that need ``1 + weight`` it is formed as sgl-kernel-npu does, in the tensors' dtype
  (``1.0 + weight`` with weight of x's dtype; here ``(1 + weight.float()).to(x.dtype)``, one
  rounding, the same values when weight already has x's dtype). That rounding (relative 2**-8 in
  bf16, 2**-11 in fp16) is the price of these paths; it stays inside the bf16/fp16 tolerances.
- ``npu_add_rms_norm`` (A2/A3 kernels) rounds the normalised row to x's dtype before multiplying
  by gamma (fp16: the product in fp16 too): within tolerance, but not bit-equal to the contract.
- 310P (Atlas inference series): no bf16 in ``npu_rms_norm``/``npu_add_rms_norm``, and
  ``npu_rms_norm`` needs rows of at least 32 bytes; ``npu_gemma_rms_norm`` has no kernel there.

torch_npu is looked up when an adapter is called (``torch_npu_module``), never when this module
is imported, so tests can put a CPU double under ``sys.modules["torch_npu"]``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

import torch

from kernel_variants.ops.rms_norm import NormCapabilities
from kernel_variants.plugin import Capabilities, Variant, hookimpl

__all__ = [
    "device_family",
    "npu_gemma_add_fn",
    "npu_gemma_rms_norm_fn",
    "npu_plain_add_fn",
    "npu_plain_rms_norm_fn",
    "npu_rms_add_fn",
    "npu_rms_norm_fn",
    "probe_npu_gemma_add",
    "probe_npu_gemma_rms_norm",
    "probe_npu_rms_norm",
    "torch_npu_module",
]

NOT_INSTALLED = "torch_npu not installed (pip install torch_npu)"

# The families the native Gemma kernel (aclnnGemmaRmsNorm) is built for in the torch_npu releases
# sgl-kernel-npu targets; it routes every other family elsewhere.
GEMMA_NATIVE_FAMILIES = frozenset({"a2", "a3"})


# --------------------------------------------------------------------------------------------
# Finding torch_npu
# --------------------------------------------------------------------------------------------


def torch_npu_module() -> ModuleType:
    """torch_npu as imported now (a module already in ``sys.modules`` wins: that is how tests
    install a double). Raises ImportError when there is none."""
    return importlib.import_module("torch_npu")


def _find() -> tuple[ModuleType | None, str | None]:
    """(torch_npu, None), or (None, why not); imports torch_npu only when its spec is found."""
    module = sys.modules.get("torch_npu")
    if module is not None:
        return module, None
    try:
        spec = importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError) as exc:
        return None, f"cannot look up torch_npu: {type(exc).__name__}: {exc}"
    if spec is None:
        return None, NOT_INSTALLED
    try:
        return importlib.import_module("torch_npu"), None
    except Exception as exc:  # a native extension that fails to load is a reason, not a crash
        return None, f"importing torch_npu failed: {type(exc).__name__}: {exc}"


def _soc_version(module: ModuleType) -> int | None:
    try:
        return int(module.npu.get_soc_version())
    except Exception:
        return None


def _family_of(soc: int | None) -> str:
    # sgl-kernel-npu's table (utils/npu_device.py, PR #638).
    if soc is None:
        return "unknown"
    if 200 <= soc <= 205:
        return "310p"
    if 220 <= soc <= 225:
        return "a2"
    if 250 <= soc <= 255:
        return "a3"
    if soc == 260:
        return "a5"
    return "unknown"


def device_family() -> str:
    """The Ascend family of the current device: ``"310p"``, ``"a2"``, ``"a3"``, ``"a5"`` or
    ``"unknown"`` (also when torch_npu is missing or the SoC version cannot be read)."""
    module, why = _find()
    return "unknown" if why is not None else _family_of(_soc_version(module))


def _probe(ops: tuple[str, ...], families: frozenset[str] | None = None) -> str | None:
    module, why = _find()
    if why is not None:
        return why
    for op in ops:
        if not callable(getattr(module, op, None)):
            version = getattr(module, "__version__", "?")
            return f"torch_npu {version} has no {op}"
    npu = getattr(module, "npu", None)
    try:
        visible = bool(npu.is_available())
    except Exception as exc:
        return f"cannot query the NPU: {type(exc).__name__}: {exc}"
    if not visible:
        return "no Ascend NPU visible (torch_npu.npu.is_available() is False)"
    if families is not None:
        soc = _soc_version(module)
        family = _family_of(soc)
        if family not in families:
            what = "the SoC version cannot be read" if soc is None else f"SoC version {soc}: {family}"
            return (f"{ops[0]} has no kernel for this device ({what}); it runs on "
                    f"{', '.join(sorted(f.upper() for f in families))} only")
    return None


def probe_npu_gemma_rms_norm() -> str | None:
    """For :func:`npu_gemma_rms_norm_fn`: None when torch_npu has npu_gemma_rms_norm, an NPU is
    visible and it is an A2 or A3, else why not."""
    return _probe(("npu_gemma_rms_norm",), GEMMA_NATIVE_FAMILIES)


def probe_npu_gemma_add() -> str | None:
    """For :func:`npu_gemma_add_fn`: None when torch_npu has npu_add_rms_norm and an NPU is
    visible (every family has the kernel; 310P without bf16), else why not."""
    return _probe(("npu_add_rms_norm",))


def probe_npu_rms_norm() -> str | None:
    """For :func:`npu_rms_norm_fn` and :func:`npu_rms_add_fn`: None when torch_npu has
    npu_rms_norm and an NPU is visible (every family; 310P without bf16), else why not."""
    return _probe(("npu_rms_norm",))


# --------------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------------


def _rows(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """x as contiguous ``[N, D]`` rows, after checking weight is ``[D]`` (or None)."""
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension")
    dim = x.shape[-1]
    if weight is not None and weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}] (x's last dimension), got {list(weight.shape)}")
    return x.reshape(-1, dim).contiguous()


def _plus_one(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``1 + weight`` as a gamma of ``dtype`` (the kernels want gamma in x's dtype); one rounding,
    equal to sgl-kernel-npu's ``1.0 + weight`` when weight already has that dtype."""
    return (1.0 + weight.float()).to(dtype).contiguous()


def _gamma(weight: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The plain ops' weight as a gamma of x's dtype (ones without one): an fp32 weight under a
    half x is rounded once, within the dtype's tolerance."""
    if weight is None:
        return torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return weight.to(x.dtype).contiguous()


def _residual_rows(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {list(x.shape)}, got {list(residual.shape)}")
    return residual.to(x.dtype).reshape(-1, x.shape[-1]).contiguous()


def _rms_kernel(x: torch.Tensor, rows: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch_npu.npu_rms_norm(rows, gamma, eps)[0]`` in x's shape (an empty x answered here)."""
    if rows.numel() == 0:
        return torch.empty_like(x)
    return torch_npu_module().npu_rms_norm(rows, gamma, float(eps))[0].reshape(x.shape)


def _add_kernel(x: torch.Tensor, rows: torch.Tensor, res: torch.Tensor, gamma: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_add_rms_norm(res, rows, gamma, eps)`` as ``(y, res + rows)`` in x's shape
    (its sum is exact and commutative: the order of the two is sgl-kernel-npu's)."""
    if rows.numel() == 0:
        return torch.empty_like(x), (rows + res).reshape(x.shape)
    y, _rstd, total = torch_npu_module().npu_add_rms_norm(res, rows, gamma, float(eps))
    return y.reshape(x.shape), total.reshape(x.shape)


def npu_gemma_rms_norm_fn(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """gemma_rms_norm through ``torch_npu.npu_gemma_rms_norm(x, weight, eps)[0]`` (A2/A3)."""
    rows = _rows(x, weight)
    if rows.numel() == 0:
        return torch.empty_like(x)
    gamma = weight.to(x.dtype).contiguous()  # the kernel adds 1 itself, in fp32
    y = torch_npu_module().npu_gemma_rms_norm(rows, gamma, float(eps))[0]
    return y.reshape(x.shape)


def npu_gemma_add_fn(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                     eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """add_gemma_rms_norm through ``torch_npu.npu_add_rms_norm(residual, x, 1 + weight, eps)``,
    whose outputs are ``(y, rstd, residual + x)`` (A2/A3 in sgl-kernel-npu; runs everywhere)."""
    return _add_kernel(x, _rows(x, weight), _residual_rows(x, residual), _plus_one(weight, x.dtype), eps)


def npu_rms_norm_fn(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """gemma_rms_norm through ``torch_npu.npu_rms_norm(x, 1 + weight, eps)[0]`` (sgl-kernel-npu's
    path for 310P and unknown devices)."""
    return _rms_kernel(x, _rows(x, weight), _plus_one(weight, x.dtype), eps)


def npu_rms_add_fn(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                   eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """add_gemma_rms_norm as sgl-kernel-npu does it on 310P and unknown devices: ``x + residual``
    in torch (x's dtype), then ``torch_npu.npu_rms_norm(sum, 1 + weight, eps)[0]``."""
    rows = _rows(x, weight)
    total = rows + _residual_rows(x, residual)
    return _rms_kernel(x, total, _plus_one(weight, x.dtype), eps), total.reshape(x.shape)


def npu_plain_rms_norm_fn(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                          variance_size: int | None = None) -> torch.Tensor:
    """rms_norm (vLLM IR's) through ``torch_npu.npu_rms_norm(x, weight, epsilon)[0]``; weight
    None is a gamma of ones. No variance_size (the capabilities say so)."""
    return _rms_kernel(x, _rows(x, weight), _gamma(weight, x), epsilon)


def npu_plain_add_fn(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                     variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm (vLLM IR's) through ``torch_npu.npu_add_rms_norm(x_residual, x, weight,
    epsilon)``: ``(y, x + x_residual)``, the norm of the sum as rounded to x's dtype."""
    return _add_kernel(x, _rows(x, weight), _residual_rows(x, x_residual), _gamma(weight, x), epsilon)


_CAPS = Capabilities(devices={"npu"}, dtypes={"float32", "bfloat16", "float16"})
_DEPENDS = ("torch_npu", "cann", "torch")  # the ops are torch_npu's, their kernels CANN's


# (id, op, function, probe, priority, what it runs): two torch_npu paths per op, as sgl-kernel-npu
# picks them by device (the Gemma kernel on A2/A3, npu_rms_norm on 310P and unknown devices).
_VARIANTS = (
    ("npu_gemma_rms_norm", "gemma_rms_norm", npu_gemma_rms_norm_fn, probe_npu_gemma_rms_norm, 20,
     "torch_npu.npu_gemma_rms_norm(x, w, eps)[0] (A2/A3)"),
    ("npu_gemma_rms_norm", "add_gemma_rms_norm", npu_gemma_add_fn, probe_npu_gemma_add, 20,
     "torch_npu.npu_add_rms_norm(residual, x, 1 + w, eps)"),
    ("npu_rms_norm", "gemma_rms_norm", npu_rms_norm_fn, probe_npu_rms_norm, 15,
     "torch_npu.npu_rms_norm(x, 1 + w, eps)[0] (310P and unknown devices)"),
    ("npu_rms_norm", "add_gemma_rms_norm", npu_rms_add_fn, probe_npu_rms_norm, 15,
     "x + residual in torch, then torch_npu.npu_rms_norm(s, 1 + w, eps)[0]"),
    # The plain ops (vLLM IR's rms_norm / fused_add_rms_norm): the scale is the weight itself.
    ("npu_rms_norm", "rms_norm", npu_plain_rms_norm_fn, probe_npu_rms_norm, 15,
     "torch_npu.npu_rms_norm(x, w, eps)[0]"),
    ("npu_rms_norm", "fused_add_rms_norm", npu_plain_add_fn, probe_npu_gemma_add, 15,
     "torch_npu.npu_add_rms_norm(x_residual, x, w, eps)"),
)
_PLAIN_CAPS = NormCapabilities(devices={"npu"}, dtypes={"float32", "bfloat16", "float16"})


@hookimpl
def kv_register_variants(register) -> None:
    for vid, op, fn, probe, priority, what in _VARIANTS:
        caps = _PLAIN_CAPS if op in ("rms_norm", "fused_add_rms_norm") else _CAPS
        register(Variant(id=vid, op=op, version="1", depends=_DEPENDS, fn=fn, probe=probe, priority=priority,
                         capabilities=caps, description=what))

