"""The Triton kernels on the CPU, under the Triton interpreter, through the conformance suite.

Triton decides whether to interpret when ``triton.jit`` decorates a kernel (it reads
``TRITON_INTERPRET`` then, not at launch), and ``kernel_variants`` builds its kernels on first
use, per mode. So a test only needs the variable set before it first calls a kernel, and a
``reload()`` so that the variants re-declare their devices (the CPU only while interpreting).
"""

from __future__ import annotations

import pytest
import torch
from test_conformance import assert_conforms

import kernel_variants
from kernel_variants.dispatch import dispatcher
from kernel_variants.kernels import triton_conv
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.ops.causal_conv1d._cases import make_case

pytest.importorskip("triton", reason="triton not installed (the 'triton' extra)")
OPS = ("causal_conv1d_fn", "causal_conv1d_update")


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel_variants.reload()


def _verify_all(rv, keep=lambda label: True) -> int:
    return assert_conforms(rv, "cpu", keep)


@pytest.mark.parametrize("op", OPS)
def test_triton_matches_the_reference_on_every_claimed_case(interpreter, op):
    rv = dispatcher().registry.get(op, "triton")
    assert rv.unavailable_reason() is None
    assert rv.variant.capabilities.devices == {"cuda", "cpu"}
    assert _verify_all(rv) > 100


CONFIG_IDS = [(op, rv.id) for op, rv in
              [("causal_conv1d_fn", c) for c in triton_conv.FN_CONFIGS]
              + [("causal_conv1d_update", c) for c in triton_conv.UPDATE_CONFIGS]]


@pytest.mark.parametrize(("op", "vid"), CONFIG_IDS, ids=[v for _, v in CONFIG_IDS])
def test_each_block_configuration_on_the_width_4_cases(interpreter, op, vid):
    """Every registered block configuration is its own variant; a sample of the suite each."""
    rv = dispatcher().registry.get(op, vid)
    assert rv.unavailable_reason() is None
    _verify_all(rv, keep=lambda label: "W=4 float32" in label or "W=2 bfloat16" in label)


@pytest.mark.parametrize("op", OPS)
def test_a_dispatched_call_writes_into_the_callers_view(interpreter, op):
    case = make_case(op, batch=2, dim=24, seqlen=3, noncontig=True, width=4).fresh()
    before = case.pool_base.clone()
    expected_out, pools = case.run(getattr(reference, op))  # on a fresh copy
    expected_pool = next(iter(pools.values()))
    with kernel_variants.force(**{op: "triton"}):
        out = getattr(kernel_variants, op)(*case.args, **case.kwargs)
    assert not torch.equal(before, case.pool_base)
    assert torch.equal(case.pool_base, expected_pool)
    torch.testing.assert_close(out, expected_out)


def test_the_interpreter_never_outranks_a_native_cpu_variant(interpreter):
    x, w = torch.randn(2, 5, 8), torch.randn(8, 4)
    decision = kernel_variants.explain("causal_conv1d_fn", x, w, conv_states=torch.zeros(2, 3, 8))
    assert decision.chosen.id != "triton" and decision.source == "priority"
    assert any(r.variant == "triton" for r in decision.trace)


def test_the_calibrator_picks_among_block_configurations(monkeypatch, interpreter):
    from kernel_variants._builtins import BUILTIN_PLUGINS, ESSENTIAL_PLUGINS

    # Only the Triton configurations beside the references: no unmeasured native variant ranked above them.
    others = [n for n, _ in BUILTIN_PLUGINS if n not in ESSENTIAL_PLUGINS and n != "triton"]
    monkeypatch.setenv("KV_DISABLE_PLUGINS", ",".join(others))
    kernel_variants.reload()
    ids = ["triton"] + [c.id for c in triton_conv.UPDATE_CONFIGS]
    result = kernel_variants.calibrate("causal_conv1d_update", [(2, 64, 1)], dtype="float32", device="cpu",
                                       variants=ids, warmup=1, windows=1, iters=2)
    assert not result.rejected()
    winner = result.winners[(2, 64, 1)]
    assert winner is not None and winner.variant in ids
    x, pool, w = torch.randn(2, 64), torch.randn(4, 3, 64), torch.randn(64, 4)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    decision = kernel_variants.explain("causal_conv1d_update", x, pool, w, torch.randn(64), activation="silu",
                                       conv_state_indices=idx)
    assert decision.source == "table" and decision.chosen.id == winner.variant


def test_without_the_interpreter_or_a_gpu_the_probe_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernel_variants.reload()
    rv = dispatcher().registry.get("causal_conv1d_fn", "triton")
    assert rv.variant.capabilities.devices == {"cuda"}
    if not torch.cuda.is_available():
        assert rv.unavailable_reason() == "no CUDA device (set TRITON_INTERPRET=1 to run on CPU under the interpreter)"


@pytest.mark.parametrize("op", ["gemma_rms_norm", "add_gemma_rms_norm"])
def test_triton_rms_norm_matches_the_reference_on_every_claimed_case(interpreter, op):
    rv = dispatcher().registry.get(op, "triton")
    assert rv.unavailable_reason() is None
    assert rv.variant.capabilities.devices == {"cuda", "cpu"}
    assert _verify_all(rv) >= 20
