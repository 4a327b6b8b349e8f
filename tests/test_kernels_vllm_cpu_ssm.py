"""The vllm_cpu variants of the selective-scan ops (vLLM-CPU's own C++ kernels): which library
the probe picks (as vLLM-CPU does, never importing vLLM), what they declare, and, where vLLM-CPU
is installed, the real kernels: the known crash of the bf16-state decode kernel kept away by the
declaration and by qualification in a child process, the paths around the kernels (another
destination slot, several tokens, pads) against the reference. The conformance suite runs the
rest (``tests/test_conformance.py -k vllm_cpu``; tools/vllm_cpu_e2e.sh runs both)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import kernel_variants as kv
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants.kernels import vllm_cpu_ssm
from kernel_variants.ops.ssm import _reference

UPDATE, SCAN = "selective_state_update", "ssd_chunk_scan"
real = pytest.mark.skipif(vllm_cpu_ssm.probe() is not None,
                          reason=f"vLLM-CPU's SSM kernels unavailable: {vllm_cpu_ssm.probe()}")


@pytest.mark.parametrize(("machine", "avx512", "bf16", "name"), [
    ("x86_64", True, True, "_C"), ("x86_64", True, False, "_C_AVX512"), ("x86_64", False, False, "_C_AVX2"),
    ("aarch64", False, False, "_C"),
])
def test_library_is_the_one_vllm_cpu_loads(monkeypatch, machine, avx512, bf16, name):
    monkeypatch.setattr(vllm_cpu_ssm.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    assert vllm_cpu_ssm.library_name() == name


def test_probe_finds_the_avx2_build_without_importing_vllm(tmp_path, monkeypatch):
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('vllm was imported')\n")
    for name in ("_C", "_C_AVX2", "_C_AVX512"):
        (pkg / f"{name}.abi3.so").write_bytes(b"not a library")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(vllm_cpu_ssm, "library_name", lambda: "_C_AVX2")
    path, why = vllm_cpu_ssm._library()
    assert why is None and path == pkg / "_C_AVX2.abi3.so"
    if not hasattr(torch.ops._C, "selective_state_update_cpu"):
        why = vllm_cpu_ssm._Ops().probe()
        assert why is not None and why.startswith("loading _C_AVX2.abi3.so failed")
    assert "vllm" not in sys.modules


def test_declared_capabilities():
    reg = dispatcher().registry
    update, scan = (reg.get(op, "vllm_cpu").variant for op in (UPDATE, SCAN))
    assert dict(update.capabilities.dstate_multiple_of) == {"bfloat16": 8}  # the known crash
    assert not update.capabilities.dt_limit and scan.capabilities.dt_limit
    assert update.isolate is not False and scan.isolate is not False  # qualified in a child
    for v in (update, scan):
        assert v.capabilities.devices == {"cpu"} and v.capabilities.noncontiguous_states
        assert "none" not in v.capabilities.states or v is scan


def _decode(state_dtype, dstate, *, heads=4, headdim=8, groups=2, batch=3, tokens=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = (batch,) if tokens is None else (batch, tokens)
    pool = torch.randn(7, 2 * heads * headdim * dstate, generator=g)[:, : heads * headdim * dstate]
    state = pool.view(7, heads, headdim, dstate).to(state_dtype)
    return dict(
        state=state, x=torch.randn(*lead, heads, headdim, generator=g), dt=torch.randn(*lead, heads, generator=g),
        A=-torch.rand(heads, generator=g) * 4, B=torch.randn(*lead, groups, dstate, generator=g),
        C=torch.randn(*lead, groups, dstate, generator=g), D=torch.randn(heads, generator=g),
        z=torch.randn(*lead, heads, headdim, generator=g), dt_bias=torch.randn(heads, generator=g),
        dt_softplus=True, state_batch_indices=torch.tensor([3, 0, 5], dtype=torch.int32))


def _agree(fn, ref, kwargs):
    mine, theirs = ({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
                    for _ in range(2))
    got, want = fn(**mine), ref(**theirs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    pool = "state" if "state" in kwargs else "ssm_states"
    torch.testing.assert_close(mine[pool], theirs[pool], atol=1e-4, rtol=1e-4)
    return mine


@real
def test_bf16_state_dstate_not_a_multiple_of_8_is_never_sent_to_vllm_cpu():
    """The dispatcher leaves the class out by the declaration (vLLM-CPU 0.32 dies on it) and the
    fp32-state class of the same shape stays eligible."""
    bad = _decode(torch.bfloat16, 12)
    chosen = kv.explain(UPDATE, **bad)
    assert chosen.chosen.id != "vllm_cpu"
    assert "dstate=12 not a multiple of 8 with a bfloat16 state" in str(chosen)
    ok = _decode(torch.float32, 12)
    with kv.force(selective_state_update="vllm_cpu"):
        _agree(kv.selective_state_update, _reference.selective_state_update, ok)


@real
def test_qualification_in_a_child_keeps_the_crash_away(with_variants):
    """Undeclared, the crash is qualification's verdict: the forked child dies, this process
    lives on, the bf16 class fails and the fp32 class of the same dstate qualifies."""
    from kernel_variants.plugin import Variant

    declared = dispatcher().registry.get(UPDATE, "vllm_cpu").variant
    caps = declared.capabilities.model_copy(update={"dstate_multiple_of": {}})
    with_variants(Variant(id="vllm_cpu_undeclared", op=UPDATE, version="1", fn=declared.fn, probe=declared.probe,
                          capabilities=caps))
    (bf16,) = kv.qualify(UPDATE, dtype="bfloat16", variants=["vllm_cpu_undeclared"], state="bfloat16", dstate=12)
    assert not bf16.passed and bf16.where == "child" and "crashed" in bf16.reason, bf16  # SIGSEGV, say
    (fp32,) = kv.qualify(UPDATE, dtype="bfloat16", variants=["vllm_cpu_undeclared"], state="float32", dstate=12)
    assert fp32.passed, fp32
    verdicts = kv.qualify(UPDATE, dtype="bfloat16", variants=["vllm_cpu"], state="bfloat16", dstate=12)
    assert all(v.variant != "vllm_cpu" or not v.passed for v in verdicts)  # never run: not covered


@real
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode_paths_around_the_kernel(state_dtype):
    """One token in place; another destination slot and several tokens on an fp32 copy; a pad
    (the null block, 0) reads and writes nothing and gives zero rows."""
    fn = vllm_cpu_ssm.selective_state_update
    _agree(fn, _reference.selective_state_update, {**_decode(state_dtype, 16), "pad_slot_id": 0})
    moved = {**_decode(state_dtype, 16), "dst_state_batch_indices": torch.tensor([4, 0, 6], dtype=torch.int32),
             "pad_slot_id": 0}
    got = _agree(fn, _reference.selective_state_update, moved)
    assert torch.equal(got["state"][3], moved["state"][3])  # the source slot is only read
    _agree(fn, _reference.selective_state_update, {**_decode(state_dtype, 16, tokens=3), "pad_slot_id": 0})
    plain = _decode(state_dtype, 16)
    del plain["state_batch_indices"]
    _agree(fn, _reference.selective_state_update, plain)


@real
def test_scan_pads_and_initial_states():
    g = torch.Generator().manual_seed(1)
    heads, headdim, dstate, lengths = 4, 8, 16, [5, 0, 9, 3]
    total = sum(lengths)
    kwargs = dict(
        x=torch.randn(total, heads, headdim, generator=g), dt=torch.randn(total, heads, generator=g),
        A=-torch.rand(heads, generator=g), B=torch.randn(total, 1, dstate, generator=g),
        C=torch.randn(total, 1, dstate, generator=g), D=torch.randn(heads, generator=g),
        dt_bias=torch.randn(heads, generator=g), dt_softplus=True, dt_max=0.5,
        cu_seqlens=torch.tensor([0, 5, 5, 14, 17], dtype=torch.int32),
        ssm_states=torch.randn(6, heads, headdim, dstate, generator=g),
        state_indices=torch.tensor([2, 1, 0, 4]), has_initial_state=torch.tensor([True, True, False, True]),
        pad_slot_id=4)
    got = _agree(vllm_cpu_ssm.ssd_chunk_scan, _reference.ssd_chunk_scan, kwargs)
    assert got["x"].shape[0] == total and math.isfinite(float(got["ssm_states"].sum()))
