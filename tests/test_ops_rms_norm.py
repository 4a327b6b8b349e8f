"""The second op family, gemma_rms_norm and add_gemma_rms_norm (and the plain family's bad input), through everything the conv ops
go through: the dispatched ops, explain, force, calibration, every kv command, torch.compile and
bad input. (Conformance of every variant is tests/test_conformance.py, which knows no op.)"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.calibration import quick_argv

import kernel_variants as kv
from kernel_variants._cli import main
from kernel_variants.ops.gemma_rms_norm import _spec

FN, ADD = "gemma_rms_norm", "add_gemma_rms_norm"
QUICK = [*quick_argv(), "-q"]


def _inputs(shape=(3, 5, 64), dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    w = (torch.randn(shape[-1], generator=gen) * 0.5).to(dtype)
    r = torch.randn(*shape, generator=gen).to(dtype)
    return x, w, r


def test_the_ops_follow_the_contract_and_write_nothing():
    x, w, r = _inputs()
    before = [t.clone() for t in (x, w, r)]
    s = x + r
    f = s.float()
    expected = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.float())).to(x.dtype)
    out, total = kv.add_gemma_rms_norm(x, w, r)
    assert torch.equal(total, s), "residual_sum is x + residual in x's dtype, exactly"
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(kv.gemma_rms_norm(s, w), expected, atol=2e-2, rtol=1.6e-2)
    assert all(torch.equal(a, b) for a, b in zip(before, (x, w, r), strict=True)), "an input was written"
    empty = kv.gemma_rms_norm(torch.zeros(0, 64, dtype=torch.bfloat16), w)
    assert empty.shape == (0, 64)


def test_explain_and_force_work_per_op():
    x, w, r = _inputs(dtype=torch.float32)
    decision = kv.explain(FN, x, w)
    assert decision.key.shape == (15, 64) and decision.key.op == FN
    assert {row.variant for row in decision.trace} == {rv.id for rv in kv.variants(FN)}
    with kv.force(gemma_rms_norm="reference", add_gemma_rms_norm="aten"):
        assert kv.explain(FN, x, w).chosen.id == "reference"
        assert kv.explain(ADD, x, w, r).chosen.id == "aten"
        out, _ = kv.add_gemma_rms_norm(x, w, r)
    torch.testing.assert_close(out, _spec.reference_add(x, w, r)[0])


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda x, w, r: kv.gemma_rms_norm(x, w[:-1]), "weight: expected shape [D=64]"),
        (lambda x, w, r: kv.gemma_rms_norm(x, w.float()), "weight: expected dtype bfloat16"),
        (lambda x, w, r: kv.gemma_rms_norm(x.int(), w), "x: expected dtype float32, bfloat16 or float16"),
        (lambda x, w, r: kv.gemma_rms_norm(x, w, -1.0), "eps: expected a finite number >= 0"),
        (lambda x, w, r: kv.gemma_rms_norm(x, w, "1e-6"), "eps: expected a float, got str"),
        (lambda x, w, r: kv.add_gemma_rms_norm(x, w, r[:, :1]), "residual: expected shape [3, 5, 64]"),
        (lambda x, w, r: kv.add_gemma_rms_norm(x, w, r.half()), "residual: expected dtype bfloat16"),
        (lambda x, w, r: kv.add_gemma_rms_norm(x, w, None), "residual: expected a torch.Tensor"),
        # the plain family (vLLM IR's rms_norm / fused_add_rms_norm)
        (lambda x, w, r: kv.rms_norm(x, w[:-1], 1e-6), "weight: expected None or shape [D=64]"),
        (lambda x, w, r: kv.rms_norm(x, w.half(), 1e-6), "weight: expected x's dtype bfloat16 or float32, got float16"),
        (lambda x, w, r: kv.rms_norm(x, w, 1e-6, 65), "variance_size: expected None or 1 <= variance_size <= D=64, got 65"),
        (lambda x, w, r: kv.rms_norm(x, w, 1e-6, 0), "variance_size: expected None or 1 <= variance_size"),
        (lambda x, w, r: kv.rms_norm(x, w, 1e-6, 2.0), "variance_size: expected None or an int, got float"),
        (lambda x, w, r: kv.rms_norm(x, w, -1.0), "epsilon: expected a finite number >= 0"),
        (lambda x, w, r: kv.fused_add_rms_norm(x, r[:, :1], w, 1e-6), "x_residual: expected shape [3, 5, 64]"),
        (lambda x, w, r: kv.fused_add_rms_norm(x, r.half(), w, 1e-6), "x_residual: expected dtype bfloat16"),
        (lambda x, w, r: kv.fused_add_rms_norm(x, r, w, 1e-6, out=(x, x)), "out"),
    ],
)
def test_bad_input_is_named_and_nothing_is_written(call, says):
    x, w, r = _inputs()
    before = [t.clone() for t in (x, w, r)]
    with pytest.raises((TypeError, ValueError), match=says.replace("[", r"\[").replace("]", r"\]")):
        call(x, w, r)
    assert all(torch.equal(a, b) for a, b in zip(before, (x, w, r), strict=True))


def test_calibration_picks_per_shape_and_the_table_drives_dispatch():
    result = kv.calibrate(FN, [(4, 256), (64, 1024)], dtype="float32", timing=kv.TimingConfig(warmup=1, windows=1, iters=3))
    assert {m.shape for m in result.measurements} == {(4, 256), (64, 1024)}
    rows = {r.shape: r for r in kv.table(FN)}
    assert set(rows) == {(4, 256), (64, 1024)}
    assert all({"reference", "aten", "cpu_native"} <= set(r.times_us) and not r.missing for r in rows.values())
    x = torch.randn(4, 256)
    decision = kv.explain(FN, x, torch.zeros(256))
    assert decision.source == "table" and decision.chosen.id == rows[(4, 256)].winner


def test_every_kv_command_takes_the_op(capsys, tmp_path):
    def run(*argv):
        rc = main(list(argv))
        out, err = capsys.readouterr()
        assert rc == 0, err
        return out

    got = json.loads(run("calibrate", "--op", FN, "--shapes", "4,256", "16,512", *QUICK, "--json"))
    assert got["op"] == FN and [s["shape"] for s in got["shapes"]] == [[4, 256], [16, 512]]
    table = run("table", "--op", "rms")
    assert "T" in table.split() and "gemma_rms_norm|float32|-" in table
    listing = run("list", "--op", "rms", "--shape", "4,256", "--dtype", "fp32")
    assert listing.startswith(f"{FN} on cpu float32 (T=4, D=256)") and "by table" in listing
    assert "T" in run("compare", "--incumbent", "aten", "--candidate", "reference", "--op", ADD, "--shapes", "2,64", *QUICK).split()
    run("gate", "--incumbent", "aten", "--candidate", "reference", "--op", ADD,
        "--shapes", "2,64", "--tolerance", "1000", *QUICK)
    run("export", str(tmp_path / "t.json"))
    assert any(m["group"]["op"] == FN for m in json.loads((tmp_path / "t.json").read_text())["measurements"])
    run("import", str(tmp_path / "t.json"))
    info = json.loads(run("info", "--json"))
    assert info["ops"][FN]["axes"] == ["T", "D"] and "rms" in info["ops"][FN]["sweeps"]
    smoke = json.loads(run("calibrate", "--sweep", "add-rms-smoke", *QUICK, "--variants", "aten", "--json"))
    assert smoke["op"] == ADD and len(smoke["shapes"]) == 3


def test_a_conv_feature_option_is_refused_for_the_rms_op(capsys):
    rc = main(["calibrate", "--op", FN, "--shapes", "4,256", "--width", "3", *QUICK])
    err = capsys.readouterr().err
    assert rc == 2 and "--width: not a feature of gemma_rms_norm" in err


def test_compiled_model_calls_the_custom_ops_and_matches_eager():
    x, w, r = _inputs(dtype=torch.float32)

    def block(x, w, r):
        out, s = kv.add_gemma_rms_norm(x, w, r)
        return kv.gemma_rms_norm(out * 2, w), s

    eager = block(x, w, r)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x, w, r)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b)
