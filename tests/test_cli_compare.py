"""kv compare and kv gate: head-to-head on measured variants and on CSVs measured elsewhere,
including the figures of a 910B2 report measured elsewhere."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.calibration import assert_one_line_error, quick_argv, run
from helpers.variants import off_by_one, slow, variant

import kernel_variants as kv
from kernel_variants import types

FN = "causal_conv1d_fn"
QUICK = [*quick_argv(), "-q"]
SHAPES = ["--shapes", "1,16,8", "2,32,16"]
SEED = Path(__file__).resolve().parents[2] / "shared" / "data" / "seed_910b2_fp16.csv"
SEED_SUMMARY = "pto faster on 69 of 69 shapes, median asc/pto 1.49x (range 1.03x\N{EN DASH}1.90x)"


@pytest.fixture
def contenders(with_variants):
    # sleepy: right and far slower than the reference on these tiny shapes; off_by_one: wrong
    with_variants(variant("sleepy", fn=slow(0.002)), variant("off_by_one", fn=off_by_one))


needs_seed = pytest.mark.skipif(not SEED.exists(), reason=f"shared data not beside the checkout ({SEED})")


# the 910B2 report's figures


@needs_seed
def test_compare_reproduces_the_910b2_report_from_its_csv(capsys):
    rc, out, _ = run(capsys, "compare", "--from-csv", str(SEED), "--incumbent", "pto_us", "--candidate", "asc_us")
    assert rc == 0
    lines = out.strip().splitlines()
    assert lines[-1] == SEED_SUMMARY
    assert lines[1].split() == ["B", "dim", "seq", "elements", "pto", "µs", "asc", "µs", "asc/pto"]
    assert lines[3].split() == ["64", "1024", "512", "33554432", "358.6", "408.6", "1.14x"]
    rc, out, _ = run(capsys, "compare", "--from-csv", str(SEED), "--incumbent", "pto_us", "--candidate", "asc_us",
                     "--json")
    got = json.loads(out)
    assert (got["incumbent_faster"], got["compared"], got["shapes"]) == (69, 69, 69)
    assert (round(got["median"], 2), round(got["min"], 2), round(got["max"], 2)) == (1.49, 1.03, 1.90)
    assert got["summary"] == SEED_SUMMARY


@needs_seed
def test_the_gate_stops_the_ascend_c_kernel_on_all_69_shapes(capsys):
    argv = ["gate", "--from-csv", str(SEED), "--incumbent", "pto_us", "--candidate", "asc_us"]
    rc, out, _ = run(capsys, *argv)
    assert rc == 1
    lines = out.strip().splitlines()
    assert lines[0] == "gate failed: asc loses to pto (beyond 2.0%) on 69 of 69 shapes"
    listed = [line for line in lines[3:-1]]
    assert len(listed) == 69 and all("slower by +" in line for line in listed)
    assert listed[0].split()[-1] == "+13.9%"  # 408.6 / 358.6
    rc, out, _ = run(capsys, *argv, "--json")
    got = json.loads(out)
    assert rc == 1 and got["passed"] is False and len(got["failures"]) == 69
    # The other way round the PTO kernel replaces the Ascend C one everywhere.
    rc, out, _ = run(capsys, "gate", "--from-csv", str(SEED), "--incumbent", "asc_us", "--candidate", "pto_us")
    assert rc == 0 and out.startswith("gate passed: pto within 2.0% of asc or faster on all 69 shapes")


# measured head-to-head


def test_compare_times_both_variants_on_every_shape_without_writing_the_table(capsys, contenders):
    rc, out, err = run(capsys, "compare", "--incumbent", "reference", "--candidate", "sleepy", *SHAPES, *QUICK)
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert lines[0] == "sleepy vs reference, measured on cpu float32"
    assert [line.split()[:4] for line in lines[3:5]] == [["1", "16", "8", "128"], ["2", "32", "16", "1024"]]
    assert lines[-1].startswith("reference faster on 2 of 2 shapes, median sleepy/reference ")
    assert kv.table() == [], "compare must not write the table"


def test_compare_reports_a_wrong_variant_instead_of_timing_it(capsys, contenders):
    rc, out, _ = run(capsys, "compare", "--incumbent", "reference", "--candidate", "off_by_one", *SHAPES, *QUICK,
                     "--json")
    got = json.loads(out)
    assert rc == 0 and got["compared"] == 0
    assert all(p["candidate_us"] is None and p["candidate_note"].startswith("rejected: failed qualification: ")
               and "output:" in p["candidate_note"] for p in got["pairs"])
    assert all(p["incumbent_us"] > 0 for p in got["pairs"])
    rc, out, _ = run(capsys, "compare", "--incumbent", "reference", "--candidate", "off_by_one", *SHAPES, *QUICK)
    assert "rejected" in out.splitlines()[3]
    assert out.strip().splitlines()[-1] == "reference and off_by_one were not both timed on any of 2 shapes"


def test_compare_says_why_a_variant_cannot_run_a_shape(capsys, contenders):
    # torch_shift declares no varlen: it is not timed there, and the reason is shown.
    _, out, _ = run(capsys, "compare", "--incumbent", "reference", "--candidate", "torch_shift", "--shapes", "3,16,8",
                     "--varlen", *QUICK, "--json")
    (pair,) = json.loads(out)["pairs"]
    assert (pair["candidate_us"] is None and pair["candidate_note"].startswith("cannot run: ")
            and "varlen" in pair["candidate_note"])


def test_gate_fails_a_slower_candidate_and_passes_a_faster_one(capsys, contenders):
    rc, out, _ = run(capsys, "gate", "--incumbent", "reference", "--candidate", "sleepy", *SHAPES, *QUICK)
    assert rc == 1
    assert out.startswith("gate failed: sleepy loses to reference (beyond 2.0%) on 2 of 2 shapes")
    assert out.count("slower by +") == 2
    rc, out, _ = run(capsys, "gate", "--incumbent", "sleepy", "--candidate", "reference", *SHAPES, *QUICK)
    assert rc == 0 and out.startswith("gate passed: reference within 2.0% of sleepy or faster on all 2 shapes")


def test_gate_fails_a_candidate_that_is_wrong_anywhere(capsys, contenders):
    rc, out, _ = run(capsys, "gate", "--incumbent", "reference", "--candidate", "off_by_one", *SHAPES, *QUICK,
                     "--json")
    got = json.loads(out)
    assert rc == 1 and not got["passed"]
    assert [f["reason"].split(":")[0] for f in got["failures"]] == ["rejected", "rejected"]


def test_gate_cannot_pass_a_candidate_it_never_compared(capsys, contenders):
    """A wrong incumbent is never timed: the gate has nothing to vouch with and must not pass."""
    rc, out, _ = run(capsys, "gate", "--incumbent", "off_by_one", "--candidate", "reference", *SHAPES, *QUICK,
                     "--json")
    got = json.loads(out)
    assert rc == 1 and not got["passed"]
    assert all(f["reason"].startswith("not compared: incumbent rejected") for f in got["failures"])


def _csv(tmp_path, text, name="m.csv"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_gate_tolerance_is_a_fraction_of_the_incumbent(capsys, tmp_path):
    path = _csv(tmp_path, "B,dim,seq,old_us,new_us\n1,64,16,100,101\n2,64,16,100,90\n")
    argv = ["gate", "--from-csv", path, "--incumbent", "old_us", "--candidate", "new_us"]
    assert run(capsys, *argv)[0] == 0  # 1% slower is within the default 2%
    rc, out, _ = run(capsys, *argv, "--tolerance", "0.005")
    assert rc == 1 and "on 1 of 2 shapes" in out and "slower by +1.0%" in out
    rc, out, _ = run(capsys, *argv, "--tolerance", "0.005", "--json")
    assert [f["shape"] for f in json.loads(out)["failures"]] == [[1, 64, 16]]


def test_compare_from_csv_computes_ratios_from_the_times_not_a_ratio_column(capsys, tmp_path):
    path = _csv(tmp_path, "B,dim,seq,a_us,b_us,b_over_a\n1,2,3,10,20,9.99\n4,5,6,10,5,9.99\n")
    rc, out, _ = run(capsys, "compare", "--incumbent", "a_us", "--candidate", "b_us", "--from-csv", path)
    assert rc == 0
    assert out.strip().splitlines()[-1] == "a faster on 1 of 2 shapes, median b/a 1.25x (range 0.50x\N{EN DASH}2.00x)"
    assert out.splitlines()[3].split()[3] == "6"  # elements computed as B*dim*seq without that column


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (None, "No such file or directory"),
        ("", "empty"),
        ("B,dim,seq,pto_us\n1,2,3,4\n", "no column 'asc_us'"),
        ("B,seq,pto_us,asc_us\n1,3,4,5\n", "no column dim or D"),
        ("B,dim,seq,pto_us,asc_us\n", "no rows"),
        ("B,dim,seq,pto_us,asc_us\n1,2,3,4,fast\n", "line 2: column asc_us: expected a positive time"),
        ("B,dim,seq,pto_us,asc_us\n1,2,3,4,5\n1,2,3,-4,5\n", "line 3: column pto_us"),
        ("B,dim,seq,pto_us,asc_us\n1,2,3,nan,5\n", "column pto_us"),
        ("B,dim,seq,pto_us,asc_us\n1,two,3,4,5\n", "line 2: expected integer"),
        ("B,dim,seq,pto_us,asc_us\n1,2\n", "line 2"),
        (b"\xff\xfe\x00garbage\x00", "not a CSV file"),
    ],
)
@pytest.mark.parametrize("command", ["compare", "gate"])
def test_a_bad_csv_is_one_line(capsys, tmp_path, command, text, says):
    path = tmp_path / "m.csv"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    rc, out, err = run(capsys, command, "--incumbent", "pto_us", "--candidate", "asc_us", "--from-csv", str(path))
    assert_one_line_error(rc, err, command)
    assert says in err and out == ""


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["compare", "--incumbent", "reference"], "the following arguments are required: --candidate"),
        (["compare", "--incumbent", "reference", "--candidate", "reference"], "two different variants"),
        (["compare", "--incumbent", "reference", "--candidate", "ghost", "--shapes", "1,8,4"],
         "no variant 'ghost' registered"),
        (["compare", "--from-csv", "x.csv"], "the following arguments are required: --incumbent, --candidate"),
        (["compare", "--incumbent", "a", "--candidate", "b", "--from-csv", "x.csv", "--shapes", "1,2,3"],
         "drop --sweep/--shapes"),
        (["gate", "--candidate", "reference"], "the following arguments are required: --incumbent"),
        (["gate", "--incumbent", "reference", "--candidate", "torch_shift", "--tolerance", "-2"], "--tolerance"),
        (["gate", "--incumbent", "reference", "--candidate", "torch_shift", "--tolerance", "nan"], "--tolerance"),
    ],
)
def test_compare_and_gate_argument_mistakes(capsys, argv, says):
    rc, out, err = run(capsys, *argv)
    assert_one_line_error(rc, err, argv[0])
    assert says in err and out == ""


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["compare", "reference", "sleepy"], "--incumbent A --candidate B"),
        (["compare", "--from-csv", "x.csv", "--a-col", "a_us", "--b-col", "b_us"], "--a-col is now --incumbent"),
        (["gate", "--from-csv", "x.csv", "--incumbent", "a_us", "--b-col", "b_us"], "--b-col is now --candidate"),
        (["gate", "reference", "sleepy"], "--incumbent A --candidate B"),
    ],
)
def test_the_old_spellings_of_the_two_sides_name_the_new_ones(capsys, argv, says):
    """compare and gate name the sides alike: compare's positional A B and --a-col/--b-col are gone."""
    rc, out, err = run(capsys, *argv)
    assert_one_line_error(rc, err, argv[0])
    assert says in err and out == ""


# --plot


def test_plot_draws_the_ratio_per_shape(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = _csv(tmp_path, "B,dim,seq,a_us,b_us\n1,2,3,10,20\n4,5,6,10,5\n")
    png = tmp_path / "ratio.png"
    rc, out, _ = run(capsys, "compare", "--from-csv", path, "--incumbent", "a_us", "--candidate", "b_us", "--plot",
                       str(png))
    assert rc == 0 and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_one_clear_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    path = _csv(tmp_path, "B,dim,seq,a_us,b_us\n1,2,3,10,20\n")
    png = tmp_path / "ratio.png"
    rc, out, err = run(capsys, "compare", "--from-csv", path, "--incumbent", "a_us", "--candidate", "b_us", "--plot",
                       str(png))
    assert_one_line_error(rc, err, "compare")
    assert "matplotlib" in err and "pip install" in err
    assert not png.exists() and out == ""


def test_the_head_to_head_is_public(contenders, tmp_path):
    got = kv.compare(FN, "reference", "sleepy", [(1, 16, 8)], dtype="fp32",
                     timing=kv.TimingConfig(warmup=1, windows=1, iters=2))
    assert (got.incumbent, got.candidate, got.axes) == ("reference", "sleepy", ("B", "D", "L"))
    (pair,) = got.pairs
    assert pair.ratio is not None and pair.ratio > 1 and got.stats()["incumbent_faster"] == 1
    assert kv.table() == []
    path = _csv(tmp_path, "B,dim,seq,old_us,new_us\n1,64,16,100,150\n")
    csv = types.HeadToHead.from_csv(path, "old_us", "new_us")
    assert (csv.incumbent, csv.candidate, csv.pairs[0].ratio) == ("old", "new", 1.5)
