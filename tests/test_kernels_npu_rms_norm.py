"""The Ascend Gemma RMSNorm adapters (``kernels/npu_rms_norm.py``) against a CPU double of
torch_npu (``helpers.torch_npu_double``): numbers within the dtype's tolerance of a plain fp32
reference of the contract, the kernels called as sgl-kernel-npu calls them, the kernels'
constraints (ranks, empty and non-contiguous tensors, gamma's dtype) handled by the adapters,
inputs untouched, and probes that say why, without importing torch_npu at module import.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.torch_npu_double import SOC, TorchNpuDouble, installed

from kernel_variants.kernels import npu_rms_norm as rms
from kernel_variants.kernels.npu_rms_norm import (
    npu_gemma_add_fn,
    npu_gemma_rms_norm_fn,
    npu_rms_add_fn,
    npu_rms_norm_fn,
    probe_npu_gemma_add,
    probe_npu_gemma_rms_norm,
    probe_npu_rms_norm,
)

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
DTYPES = list(TOL)
SHAPES = [(7, 64), (2, 3, 96), (5, 33), (3, 4, 17), (1, 128), (0, 64), (2, 0, 32), (40,)]
NORMS = [npu_gemma_rms_norm_fn, npu_rms_norm_fn]
ADDS = [npu_gemma_add_fn, npu_rms_add_fn]


def reference(s: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The contract, in fp32, returned in s's dtype."""
    sf = s.float()
    return (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(s.dtype)


def inputs(shape, dtype, seed=0, weight_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype)
    weight = torch.randn(shape[-1], generator=g).to(weight_dtype or dtype)
    return x, weight, residual


def assert_matches(actual, expected):
    atol, rtol = TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.fixture
def npu():
    with installed() as double:
        yield double


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fn", NORMS, ids=lambda f: f.__name__)
def test_norm_matches_reference(npu, fn, dtype, shape):
    x, weight, _ = inputs(shape, dtype)
    before = x.clone(), weight.clone()
    out = fn(x, weight)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_matches(out, reference(x, weight))
    assert torch.equal(x, before[0]) and torch.equal(weight, before[1])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fn", ADDS, ids=lambda f: f.__name__)
def test_add_matches_reference(npu, fn, dtype, shape):
    x, weight, residual = inputs(shape, dtype)
    before = x.clone(), weight.clone(), residual.clone()
    out, residual_sum = fn(x, weight, residual)
    s = x + residual
    assert residual_sum.dtype == x.dtype and torch.equal(residual_sum, s)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_matches(out, reference(s, weight))
    assert all(torch.equal(a, b) for a, b in zip((x, weight, residual), before, strict=True))
    assert residual_sum.data_ptr() not in (x.data_ptr(), residual.data_ptr()) or x.numel() == 0


@pytest.mark.parametrize("fn", NORMS, ids=lambda f: f.__name__)
def test_eps_is_passed(npu, fn):
    x, weight, _ = inputs((4, 32), torch.float32)
    x = x * 1e-3  # eps matters at this scale
    assert_matches(fn(x, weight, eps=1e-5), reference(x, weight, 1e-5))
    assert npu.calls[-1][1][2] == 1e-5


def test_empty_inputs_never_reach_the_kernels(npu):
    """npu_add_rms_norm and npu_gemma_rms_norm refuse empty tensors: the adapters answer them."""
    x, weight, residual = inputs((0, 64), torch.bfloat16)
    for fn in NORMS:
        assert fn(x, weight).shape == (0, 64)
    for fn in ADDS:
        out, total = fn(x, weight, residual)
        assert out.shape == total.shape == (0, 64)
    assert npu.calls == []
    with pytest.raises(RuntimeError, match="empty"):
        npu.module.npu_gemma_rms_norm(x, weight)
    with pytest.raises(RuntimeError, match="empty"):
        npu.module.npu_add_rms_norm(residual, x, weight)


def test_calls_are_sgl_kernel_npus(npu):
    """npu_gemma_rms_norm gets w (it adds 1 itself); npu_rms_norm and npu_add_rms_norm get 1 + w
    in x's dtype; npu_add_rms_norm gets (residual, x) and its x1 + x2 output is the sum."""
    x, weight, residual = inputs((3, 5, 48), torch.bfloat16)
    plus_one = (1.0 + weight.float()).to(torch.bfloat16)
    assert torch.equal(plus_one, 1.0 + weight)  # the same values as sgl-kernel-npu's `1.0 + weight`

    npu_gemma_rms_norm_fn(x, weight, 1e-6)
    name, (xa, gamma, eps) = npu.calls[-1]
    assert name == "npu_gemma_rms_norm" and xa.shape == (15, 48) and torch.equal(gamma, weight) and eps == 1e-6

    npu_gemma_add_fn(x, weight, residual)
    name, (x1, x2, gamma, eps) = npu.calls[-1]
    assert name == "npu_add_rms_norm"
    assert torch.equal(x1, residual.reshape(15, 48)) and torch.equal(x2, x.reshape(15, 48))
    assert torch.equal(gamma, plus_one) and gamma.dtype == torch.bfloat16

    for fn, args in ((npu_rms_norm_fn, (x, weight)), (npu_rms_add_fn, (x, weight, residual))):
        fn(*args)
        name, (xa, gamma, _) = npu.calls[-1]
        assert name == "npu_rms_norm" and torch.equal(gamma, plus_one)
    assert torch.equal(npu.calls[-1][1][0], (x + residual).reshape(15, 48))  # the sum composed in torch


def test_double_returns_like_torch_npu(npu):
    x, weight, residual = inputs((6, 40), torch.float16)
    for out in (npu.module.npu_rms_norm(x, weight), npu.module.npu_gemma_rms_norm(x, weight)):
        y, rstd = out
        assert y.dtype == torch.float16 and y.shape == x.shape
        assert rstd.dtype == torch.float32 and rstd.shape == (6, 1)
    y, rstd, total = npu.module.npu_add_rms_norm(x, residual, weight)
    assert (y.dtype, rstd.dtype, total.dtype) == (torch.float16, torch.float32, torch.float16)
    assert rstd.shape == (6, 1) and torch.equal(total, x + residual)
    # keyword names of the schemas
    npu.module.npu_rms_norm(self=x, gamma=weight, epsilon=1e-5)
    npu.module.npu_add_rms_norm(x1=x, x2=residual, gamma=weight, epsilon=1e-5)


def test_double_enforces_the_kernels_constraints(npu):
    x, weight, residual = inputs((4, 32), torch.bfloat16)
    m = npu.module
    with pytest.raises(RuntimeError, match="2-8 dims"):
        m.npu_rms_norm(x[0], weight)  # the adapters flatten to [N, D]
    with pytest.raises(RuntimeError, match="non-contiguous"):
        m.npu_gemma_rms_norm(x.t().contiguous().t(), weight)
    with pytest.raises(RuntimeError, match="does not match"):
        m.npu_gemma_rms_norm(x, weight.float())
    with pytest.raises(RuntimeError, match="does not match"):
        m.npu_add_rms_norm(x, residual, weight.float())
    m.npu_rms_norm(x, weight.float())  # A2/A3: fp32 gamma with bf16 x is allowed
    with pytest.raises(RuntimeError, match="trailing dims"):
        m.npu_rms_norm(x, weight[:-1])


def test_noncontiguous_and_mixed_dtype_inputs(npu):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 128, generator=g).to(torch.bfloat16)
    x = base[:, ::2]  # not contiguous
    residual = torch.randn(6, 64, generator=g).to(torch.bfloat16).t().contiguous().t()
    weight = torch.randn(64, generator=g) * 0.5  # fp32 weight, bf16 x
    for fn in NORMS:
        assert_matches(fn(x, weight), reference(x, weight))
    for fn in ADDS:
        out, total = fn(x, weight, residual)
        assert torch.equal(total, x + residual)
        assert_matches(out, reference(x + residual, weight))


def test_bad_weight_shape_is_refused(npu):
    x, weight, residual = inputs((4, 32), torch.float32)
    for fn in NORMS:
        with pytest.raises(ValueError, match="weight"):
            fn(x, weight[:-1])
    for fn in ADDS:
        with pytest.raises(ValueError, match="residual"):
            fn(x, weight, residual[:-1])


def test_310p_family():
    """sgl-kernel-npu runs npu_rms_norm there: fp16/fp32 only; no Gemma kernel."""
    with installed(soc_version=SOC["310p"]) as npu:
        assert rms.device_family() == "310p"
        why = probe_npu_gemma_rms_norm()
        assert why is not None and "SoC version 202: 310p" in why
        assert probe_npu_rms_norm() is None and probe_npu_gemma_add() is None
        for dtype in (torch.float16, torch.float32):
            x, weight, residual = inputs((5, 48), dtype)
            assert_matches(npu_rms_norm_fn(x, weight), reference(x, weight))
            out, total = npu_rms_add_fn(x, weight, residual)
            assert torch.equal(total, x + residual)
            assert_matches(out, reference(total, weight))
        x, weight, _ = inputs((5, 48), torch.bfloat16)
        with pytest.raises(RuntimeError, match="bfloat16"):
            npu_rms_norm_fn(x, weight)
        with pytest.raises(RuntimeError, match="no kernel"):
            npu_gemma_rms_norm_fn(x, weight)
        assert [name for name, _ in npu.calls] == ["npu_rms_norm"] * 5 + ["npu_gemma_rms_norm"]


@pytest.mark.parametrize("family", ["a2", "a3"])
def test_probes_none_with_the_double(family):
    with installed(soc_version=SOC[family]):
        assert rms.device_family() == family
        assert probe_npu_gemma_rms_norm() is None
        assert probe_npu_gemma_add() is None
        assert probe_npu_rms_norm() is None


def test_probe_reasons_with_the_double():
    with installed(soc_version=SOC["a5"]):
        why = probe_npu_gemma_rms_norm()
        assert why is not None and "a5" in why and "A2, A3 only" in why
    with installed(without=("npu_gemma_rms_norm", "npu_add_rms_norm")):
        assert probe_npu_gemma_rms_norm() == "torch_npu 0.0+cpu.double has no npu_gemma_rms_norm"
        assert probe_npu_gemma_add() == "torch_npu 0.0+cpu.double has no npu_add_rms_norm"
        assert probe_npu_rms_norm() is None
    with installed(npu_available=False):
        for probe in (probe_npu_gemma_rms_norm, probe_npu_gemma_add, probe_npu_rms_norm):
            assert probe() == "no Ascend NPU visible (torch_npu.npu.is_available() is False)"
    double = TorchNpuDouble()
    del double.module.npu.get_soc_version
    with installed(double):
        assert rms.device_family() == "unknown"
        assert "cannot be read" in probe_npu_gemma_rms_norm()


def test_probes_without_torch_npu(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "torch_npu" else real_find_spec(name, *a, **k))
    for probe in (probe_npu_gemma_rms_norm, probe_npu_gemma_add, probe_npu_rms_norm):
        assert probe() == "torch_npu not installed (pip install torch_npu)"
    assert rms.device_family() == "unknown"
    assert "torch_npu" not in sys.modules
    x, weight, _ = inputs((2, 16), torch.float32)
    with pytest.raises(ImportError):
        npu_gemma_rms_norm_fn(x, weight)


def test_import_does_not_import_torch_npu(tmp_path):
    """With a torch_npu importable, importing the adapters leaves it alone; a probe imports it
    (its spec is found) and says what it lacks."""
    fake = tmp_path / "torch_npu"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = 'fake'\n")
    code = textwrap.dedent("""
        import sys
        from kernel_variants.kernels import npu_rms_norm as m
        assert "torch_npu" not in sys.modules, "imported at module import"
        assert m.probe_npu_rms_norm() == "torch_npu fake has no npu_rms_norm", m.probe_npu_rms_norm()
        assert "torch_npu" in sys.modules
    """)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={**os.environ, "PYTHONPATH": path})


@pytest.mark.parametrize(("op", "vid"), [
    *((op, vid) for vid in ("npu_gemma_rms_norm", "npu_rms_norm") for op in ("gemma_rms_norm", "add_gemma_rms_norm")),
    ("rms_norm", "npu_rms_norm"), ("fused_add_rms_norm", "npu_rms_norm"),
])
def test_registered_variants_pass_the_conformance_cases_on_the_double(npu, op, vid):
    """The variants as registered, with the double as torch_npu: available, and matching the
    reference on every case of the op's conformance list that they claim (on the NPU, which the
    double's CPU tensors stand for), in every dtype they declare."""
    import kernel_variants
    from kernel_variants._runtime.dispatcher import dispatcher
    from kernel_variants._tuning.verify import verify

    kernel_variants.reload()
    registry = dispatcher().registry
    rv, spec = registry.get(op, vid), registry.spec(op)
    assert rv.unavailable_reason() is None
    failures, ran = [], 0
    for label, options in spec.conformance(rv.variant.capabilities):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            case = spec.make_case(dtype=dtype, device="cpu", **options)
            if rv.variant.capabilities.uncovered(spec.key_of_case(case)._replace(device="npu")) is not None:
                continue
            ran += 1
            why = verify(rv.variant.fn, case)
            if why is not None:
                failures.append(f"{label} {dtype}: {why}")
    assert ran > 20 and not failures, "\n".join(failures)
