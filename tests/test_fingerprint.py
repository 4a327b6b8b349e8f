"""Each GPU of a process is itself: its fingerprint, and so the table rows its calls read and
write, come from the device the call's tensors are on, not from device 0: two GPU models in one
process must not read each other's timings.

No GPU here: the CUDA properties are faked per ordinal, and keys carry the ordinal a CUDA
tensor's device would give them."""

from __future__ import annotations

import types

import pytest
import torch

import kernel_variants as kv
from kernel_variants._registry.keys import device_index
from kernel_variants._runtime import dispatcher as _dispatcher
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table import fingerprint as _fingerprint
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
from kernel_variants._table.rows import key_text

FN = "causal_conv1d_fn"


@pytest.fixture
def two_gpus(monkeypatch):
    """cuda:0 an H200, cuda:1 an L4, cuda:2 another H200; device 1 current."""
    models = {0: "NVIDIA H200", 1: "NVIDIA L4", 2: "NVIDIA H200"}
    monkeypatch.setattr(_fingerprint, "_cuda", lambda index: {"name": models[index], "driver": "x"})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    _fingerprint._fingerprint.cache_clear()
    yield models
    _fingerprint._fingerprint.cache_clear()


def test_each_ordinal_is_fingerprinted_as_itself(two_gpus):
    fp0, fp1, fp2 = (fingerprint(f"cuda:{i}") for i in range(3))
    assert (fp0["name"], fp1["name"]) == ("NVIDIA H200", "NVIDIA L4")
    assert fingerprint_id(fp0) != fingerprint_id(fp1)  # two models: two sets of rows
    assert fingerprint_id(fp0) == fingerprint_id(fp2)  # one model on two ordinals: shared rows
    assert fingerprint("cuda") == fp1  # a bare "cuda" is the current device, as torch reads it


def test_a_key_carries_its_devices_ordinal_and_the_table_is_read_for_that_device(two_gpus, monkeypatch):
    assert device_index(types.SimpleNamespace(device=torch.device("cuda", 2))) == 2
    assert device_index(torch.zeros(1)) is None
    spec = dispatcher().registry.spec(FN)
    cpu_key = spec.key_of(torch.randn(1, 8, 16), torch.randn(16, 4))
    assert cpu_key.index is None and cpu_key.where == "cpu"
    key = cpu_key._replace(device="cuda", index=1)
    assert key.where == "cuda:1" and "on cuda:1 " in key.describe()
    assert key_text(key) == key_text(key._replace(index=0))  # rows keyed by type + fingerprint
    asked = []
    real = _dispatcher.fingerprint
    monkeypatch.setattr(_dispatcher, "fingerprint", lambda device: asked.append(device) or real(device))
    dispatcher().figures(key, ["reference"])
    dispatcher().figures(key._replace(index=0), ["reference"])
    assert asked == ["cuda:1", "cuda:0"]


def test_capabilities_compare_the_device_type_not_the_ordinal():
    spec = dispatcher().registry.spec(FN)
    key = spec.key_of(torch.randn(1, 8, 16), torch.randn(16, 4))._replace(device="cuda", index=1)
    triton = [rv for rv in kv.variants(FN) if rv.id == "triton"]
    assert triton, "the triton variant is registered on every machine (available or not)"
    for rv in triton:  # declared for "cuda": an ordinal does not make it "not in devices"
        why = rv.variant.capabilities.uncovered(key)
        assert why is None or "device" not in why


# ---- a CPU is named by its kind and ISA level, not by its marketing name

# Two KVM guests that both call their CPU "AMD EPYC": a Zen 3 (AVX2 only) and a Zen 4 (AVX-512
# with BF16). Only the fields the fingerprint reads, as /proc/cpuinfo writes them.
_AVX2 = "fpu sse sse2 avx fma f16c avx2 bmi2"
_AVX512 = _AVX2 + " avx512f avx512dq avx512cd avx512bw avx512vl"
ZEN3 = f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n" \
       f"stepping\t: 1\nflags\t\t: {_AVX2}\n\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\n"
ZEN4 = ZEN3.replace("model\t\t: 1\n", "model\t\t: 17\n").replace(_AVX2, _AVX512 + " avx512_bf16")


@pytest.fixture
def cpuinfo(monkeypatch):
    """Fingerprint an x86 CPU whose /proc/cpuinfo is the text given (no capability caps set)."""
    for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(_fingerprint.platform, "machine", lambda: "x86_64")

    def use(text: str) -> dict[str, str]:
        monkeypatch.setattr(_fingerprint, "_read_cpuinfo", lambda: text)
        _fingerprint._fingerprint.cache_clear()
        return fingerprint("cpu")

    yield use
    _fingerprint._fingerprint.cache_clear()


def test_two_cpus_of_one_name_have_two_fingerprints(cpuinfo):
    zen3, zen4 = cpuinfo(ZEN3), cpuinfo(ZEN4)
    assert zen3["name"] == zen4["name"] == "AMD EPYC"
    assert fingerprint_id(zen3) != fingerprint_id(zen4)
    assert (zen3["vendor"], zen3["family"], zen3["model"], zen3["stepping"], zen3["isa"]) == (
        "AuthenticAMD", "25", "1", "1", "avx2")
    assert (zen4["model"], zen4["isa"]) == ("17", "avx512-bf16")
    assert _fingerprint.describe_cpu(zen4) == "AuthenticAMD family 25 model 17 stepping 1 avx512-bf16"


def test_the_isa_level_is_capped_as_the_code_paths_are(cpuinfo, monkeypatch):
    """ATEN_CPU_CAPABILITY caps ATen's kernels and cpu_native's builds: rows timed under it are
    not the uncapped CPU's. AMX is oneDNN's, which ONEDNN_MAX_CPU_ISA caps instead."""
    amx = ZEN4.replace("avx512_bf16", "avx512_bf16 amx_bf16 amx_tile amx_int8")
    assert cpuinfo(amx)["isa"] == "avx512-bf16+amx"
    levels = {}
    for cap, want in (("avx512", "avx512+amx"), ("avx2", "avx2+amx"), ("default", "scalar+amx"),
                      ("AVX2", "avx2+amx"), ("sve256", "avx512-bf16+amx")):  # another ISA's value caps nothing
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
        levels[cap] = cpuinfo(amx)
        assert levels[cap]["isa"] == want, cap
    assert fingerprint_id(levels["avx2"]) != fingerprint_id(levels["avx512"])
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert cpuinfo(amx)["isa"] == "avx2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_amx")
    assert cpuinfo(amx)["isa"] == "avx2+amx"


def test_an_arm_cpu_is_named_by_its_implementer_part_and_revision():
    text = ("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n"
            "CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd40\nCPU revision\t: 1\n")
    got = _fingerprint.cpu_info(text, "aarch64")
    assert [got[k] for k in ("vendor", "family", "model", "stepping")] == ["0x41", "8", "0xd40", "0x1.1"]
    assert got["isa"] == str(torch.backends.cpu.get_cpu_capability()).lower()  # ATen's path there


def test_the_fingerprint_names_the_build_cpu_native_runs():
    """The fingerprint's ISA level (without AMX, which cpu_native does not use) is the one the
    compiled kernel reports choosing, capped or not: read from the same flags by the same rule."""
    from kernel_variants._native import build
    from kernel_variants.kernels.cpu_native import isa_path
    from kernel_variants.kernels.cpu_native._build import CONV

    if _fingerprint.platform.machine() not in ("x86_64", "AMD64") or build.toolchain_missing(CONV):
        pytest.skip("cpu_native's ISA builds are x86 builds, made with a compiler")
    mp = pytest.MonkeyPatch()
    try:
        for cap in (None, "default", "avx2", "avx512"):
            if cap is None:
                mp.delenv("ATEN_CPU_CAPABILITY", raising=False)
            else:
                mp.setenv("ATEN_CPU_CAPABILITY", cap)
            assert fingerprint("cpu")["isa"].split("+")[0] == isa_path(), cap
    finally:
        mp.undo()
