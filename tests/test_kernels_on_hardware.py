"""On real accelerators: the accelerator variants through the conformance checks, a smoke
calibration, and graph capture of decisions made beforehand. Marked ``npu`` / ``cuda``; the
conftest skips them where the device is absent. A variant that is unavailable on the machine
(say the PTO build is not installed beside the Ascend C one) is skipped with its reason.
"""

from __future__ import annotations

import pytest
import torch
from helpers.calibration import quick
from helpers.conformance import assert_conforms

import kernel_variants
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table.fingerprint import fingerprint
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.ops.causal_conv1d._cases import make_case

NPU = [("causal_conv1d_fn", "asc"), ("causal_conv1d_update", "asc"), ("causal_conv1d_fn", "pto"),
       ("causal_conv1d_update", "npu_triton_update"), ("causal_conv1d_update", "npu_conv_update")]
CUDA = [("causal_conv1d_fn", "triton"), ("causal_conv1d_update", "triton"), ("causal_conv1d_fn", "dao"),
        ("causal_conv1d_update", "dao")]


def _available(op, vid):
    rv = dispatcher().registry.get(op, vid)
    why = rv.unavailable_reason()
    if why is not None:
        pytest.skip(f"{vid} unavailable here: {why}")
    return rv


def _conformance(op, vid, device):
    assert_conforms(_available(op, vid), device)


def _smoke_calibration(op, candidates, device, dtype):
    ids = [vid for o, vid in candidates if o == op and dispatcher().registry.get(o, vid).unavailable_reason() is None]
    if not ids:
        pytest.skip(f"no accelerator variant of {op} available on {device}")
    shape = (4, 256, 1 if op == "causal_conv1d_update" else 64)
    result = kernel_variants.calibrate(op, [shape], device=device, variants=[*ids, "torch_shift"],
                                       **quick(warmup=2, windows=2, iters=10) | {"dtype": dtype})
    assert not result.rejected(), [(m.variant, m.reason) for m in result.rejected()]
    winner = result.winners[shape]
    assert winner is not None and winner.variant in [*ids, "torch_shift"]


def _captured_decode_matches_eager(device, graph_ctx, graph_cls, monkeypatch):
    monkeypatch.setenv("KV_CHECK_VALUES", "0")  # value checks read indices on the host: no sync in capture
    kernel_variants.reload()
    case = make_case("causal_conv1d_update", batch=4, dim=256, seqlen=1, dtype=torch.bfloat16, device=device)
    expected = case.fresh()
    ref_out = reference.causal_conv1d_update(*expected.args, **expected.kwargs)
    live = case.fresh()
    warm = case.fresh()
    kernel_variants.causal_conv1d_update(*warm.args, **warm.kwargs)  # the decision, before capture
    graph = graph_cls()
    with graph_ctx(graph):
        out = kernel_variants.causal_conv1d_update(*live.args, **live.kwargs)
    live.pool_base.copy_(case.fresh().pool_base)  # whatever capture did to the pool: start over
    graph.replay()
    torch.testing.assert_close(out.float().cpu(), ref_out.float().cpu(), atol=2e-2, rtol=1.6e-2)
    assert torch.equal(live.pool_base.cpu(), expected.pool_base.cpu())


@pytest.mark.npu
@pytest.mark.parametrize(("op", "vid"), NPU, ids=[f"{o}:{v}" for o, v in NPU])
def test_npu_variant_passes_the_conformance_checks(op, vid):
    _conformance(op, vid, "npu")


@pytest.mark.npu
@pytest.mark.parametrize("op", ["causal_conv1d_fn", "causal_conv1d_update"])
def test_npu_smoke_calibration(op):
    _smoke_calibration(op, NPU, "npu", "bfloat16")
    fp = fingerprint("npu")
    assert fp["name"] and fp["cann"]  # the SoC name and the CANN version key the table


@pytest.mark.npu
def test_npu_graph_replays_a_decision_made_before_capture(monkeypatch):
    if not hasattr(torch.npu, "graph"):
        pytest.skip("this torch_npu has no torch.npu.graph")
    _captured_decode_matches_eager("npu", torch.npu.graph, torch.npu.NPUGraph, monkeypatch)


@pytest.mark.cuda
@pytest.mark.parametrize(("op", "vid"), CUDA, ids=[f"{o}:{v}" for o, v in CUDA])
def test_cuda_variant_passes_the_conformance_checks(op, vid):
    _conformance(op, vid, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["causal_conv1d_fn", "causal_conv1d_update"])
def test_cuda_smoke_calibration(op):
    from kernel_variants.kernels import triton_conv

    configs = [("causal_conv1d_fn", c.id) for c in triton_conv.FN_CONFIGS]
    configs += [("causal_conv1d_update", c.id) for c in triton_conv.UPDATE_CONFIGS]
    _smoke_calibration(op, CUDA + configs, "cuda", "bfloat16")


@pytest.mark.cuda
def test_cuda_graph_replays_a_decision_made_before_capture(monkeypatch):
    _captured_decode_matches_eager("cuda", torch.cuda.graph, torch.cuda.CUDAGraph, monkeypatch)
