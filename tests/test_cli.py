"""The kv command line through ``main(argv)``: list, calibrate, table, info, export and import,
and the one-line errors a user's mistake gets."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import time
import warnings

import pytest
from helpers.calibration import assert_one_line_error, quick_argv, run, run_json
from helpers.variants import off_by_one, variant

import kernel_variants as kv
from kernel_variants._runtime.dispatcher import dispatcher
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id

FN = "causal_conv1d_fn"
QUICK = quick_argv()
SHAPES = ["--shapes", "1,16,8", "2,32,16"]


def calibrate(capsys, *extra):
    # Fully timed (no pruning), so that every figure is in times_us whatever the two's ratio.
    rc, out, err = run(capsys, "calibrate", *SHAPES, *QUICK, "--variants", "reference,torch_shift", "--no-prune", *extra)
    assert rc == 0, err
    return out, err


# list


def test_list_shows_every_variant_with_plugin_version_and_why_unavailable(capsys, with_variants):
    with_variants(variant("unicorn", probe=lambda: "needs a unicorn accelerator"))
    rc, out, _ = run(capsys, "list", "--wide")
    assert rc == 0
    lines = {tuple(line.split()[:2]): line for line in out.splitlines()[2:] if line[:1].strip()}
    assert "no: needs a unicorn accelerator" in lines[(FN, "unicorn")]
    ref = lines[(FN, "reference")]
    assert ref.split()[2] == "causal_conv1d" and " oracle " in ref and ref.endswith("yes")
    records = run_json(capsys, "list", "--op", "fn")
    by_id = {r["id"]: r for r in records}
    assert set(by_id) == {rv.id for rv in kv.variants(FN) if rv.tactic is None}  # tactics: on their variant's row
    assert by_id["triton"]["tactics"] == ["d32_t64", "d64_t32", "d128_t16", "d256_t8"]
    assert by_id["unicorn"]["plugin"] == "test"
    assert (by_id["unicorn"]["available"], by_id["unicorn"]["reason"]) == (False, "needs a unicorn accelerator")
    assert by_id["reference"]["version"] == next(rv.version for rv in kv.variants(FN) if rv.id == "reference")
    assert all(r["op"] == FN for r in records)


def test_list_with_a_shape_gives_the_decision_trace(capsys):
    rc, out, _ = run(capsys, "list", "--shape", "2,32,16", "--dtype", "fp32")
    assert rc == 0
    assert out.startswith(f"{FN} on cpu float32 (B=2, D=32, L=16) width=4")
    assert "(by priority; no measurements for this key; not qualified on this device yet" in out
    calibrate(capsys)  # reference and torch_shift only: an incomplete row
    got = run_json(capsys, "list", "--shape", "2,32,16", "--dtype", "fp32")
    assert (got["source"], got["chosen"]) == ("priority", "cpu_native") and "incomplete row" in got["note"]
    assert {t["variant"] for t in got["trace"]} >= {"reference", "torch_shift"}
    table = run_json(capsys, "table")
    assert "cpu_native" in {r["shape"][0]: r for r in table}[2]["missing"]
    rc, _, err = run(capsys, "calibrate", *SHAPES, *QUICK, "--missing", "-q")
    assert rc == 0, err
    got = run_json(capsys, "list", "--shape", "2,32,16", "--dtype", "fp32")
    assert got["source"] == "table"
    assert got["chosen"] == {r.shape: r.winner for r in kv.table(FN)}[(2, 32, 16)]
    assert all(not r["missing"] for r in run_json(capsys, "table"))


def test_list_feature_flags_shape_the_call(capsys):
    got = run_json(capsys, "list", "--op", "update", "--shape", "2,32,4", "--spec", "--width", "3",
                   "--no-bias", "--activation", "none")
    key = got["key"]
    assert (key["op"], key["spec"], key["width"], key["bias"], key["activation"]) == (
        "causal_conv1d_update", True, 3, False, "none")
    got = run_json(capsys, "list", "--shape", "3,16,8", "--varlen", "--dtype", "fp32")
    assert got["key"]["varlen"] and got["chosen"] not in ("torch_shift", "aten")  # they declare no varlen
    varlen_reason = {t["variant"]: t["reason"] for t in got["trace"]}["torch_shift"]
    assert "varlen" in varlen_reason


# calibrate


def test_calibrate_prints_winners_and_rejected_variants(capsys, with_variants):
    with_variants(variant("off_by_one", fn=off_by_one))
    rc, out, err = run(capsys, "calibrate", *SHAPES, *QUICK, "--variants", "reference,off_by_one")
    assert rc == 0, err
    head, _, rejected = out.partition("\nrejected (2):\n")
    lines = head.splitlines()
    assert lines[0] == f"{FN} on cpu float32, sweep --shapes: 2 shapes"
    assert lines[1].split() == ["B", "D", "L", "winner", "winner", "µs", "runner-up", "runner-up", "µs", "margin",
                                "noise", "sure", "pruned"]
    assert [line.split()[:4] for line in lines[3:]] == [["1", "16", "8", "reference"], ["2", "32", "16", "reference"]]
    assert rejected.count("off_by_one") == 2 and "output:" in rejected
    # the progress bar: every measured (shape, variant), with the shape and the time left
    assert "4/4  B=2 D=32 L=16" in err and "left" in err
    assert [r.winner for r in kv.table(FN)] == ["reference", "reference"]


def test_calibrate_json_and_the_table_agree(capsys):
    got = run_json(capsys, "calibrate", *SHAPES, *QUICK, "--variants", "reference,torch_shift", "-q")
    assert (got["op"], got["dtype"], got["sweep"]) == (FN, "float32", "--shapes")
    assert [s["shape"] for s in got["shapes"]] == [[1, 16, 8], [2, 32, 16]]
    rows = {r.shape: r for r in kv.table(FN)}
    for s in got["shapes"]:
        row = rows[tuple(s["shape"])]
        assert s["winner"] == row.winner and s["winner_us"] == row.times_us[row.winner]
        assert s["runner_up"] in {"reference", "torch_shift"} - {row.winner}
    assert len(got["measurements"]) == 4 and got["rejected"] == []


def test_calibrate_takes_a_sweep_file_and_the_update_sweeps(capsys, tmp_path):
    sweep = tmp_path / "mine.csv"
    sweep.write_text("B,dim,seq\n1,16,4\n2,8,2\n")
    got = run_json(capsys, "calibrate", "--sweep", str(sweep), *QUICK, "--variants", "reference", "-q")
    assert [s["shape"] for s in got["shapes"]] == [[1, 16, 4], [2, 8, 2]] and got["sweep"] == "mine"
    got = run_json(capsys, "calibrate", "--op", "update", "--shapes", "2,16,3", "--spec", *QUICK, "-q")
    assert got["op"] == "causal_conv1d_update"
    assert {dict(m["group"]["features"])["spec"] for m in got["measurements"]} == {True}


def test_without_a_sweep_each_op_gets_its_own_default():
    from argparse import Namespace

    from kernel_variants._cli._options import work

    assert work(Namespace(op=None, sweep=None, shapes=None)).source == "smoke"
    got = work(Namespace(op="update", sweep=None, shapes=None))  # measuring it takes seconds
    assert (got.op, got.source, got.features.spec) == ("causal_conv1d_update", "decode", False)


@pytest.mark.parametrize(
    ("argv", "command", "says"),
    [
        (["calibrate", "--dtype", "int8"], "calibrate", "--dtype: expected one of bf16"),
        (["calibrate", "--shapes", "1,2"], "calibrate", "expected B,D,L"),
        (["calibrate", "--shapes", "1,0,4"], "calibrate", "expected B,D,L"),
        (["calibrate", "--sweep", "nope"], "calibrate", "sweep: expected one of seed69"),
        (["calibrate", "--sweep", "missing.csv"], "calibrate", "cannot be read"),
        (["calibrate", "--variants", "ghost", "--shapes", "1,8,4"], "calibrate", "ghost not registered"),
        (["calibrate", "--margin", "2"], "calibrate", "margin: expected a fraction"),
        (["calibrate", "--iters", "0"], "calibrate", "--iters: expected a positive count"),
        (["calibrate", "--iters", "many"], "calibrate", "invalid int value"),
        (["calibrate", "--sweep", "smoke", "--shapes", "1,2,3"], "calibrate", "not both"),
        (["calibrate", "--op", "update", "--sweep", "smoke"], "calibrate", "a sweep of causal_conv1d_fn"),
        (["calibrate", "--op", "conv2d"], "calibrate", "--op: expected one of"),
        (["calibrate", "--device", "warp9"], "calibrate", "--device"),
        (["calibrate", "--spec", "--shapes", "1,8,4"], "calibrate", "only for causal_conv1d_update"),
        (["calibrate", "--activation", "relu"], "calibrate", "--activation"),
        (["calibrate", "--distributed", "--shapes", "1,8,4"], "calibrate", "run under torchrun"),
        (["calibrate", "--bogus"], "calibrate", "unrecognized arguments: --bogus"),
        (["list", "--shape", "2,x,4"], "list", "expected B,D,L"),
        (["table", "--format", "xml"], "table", "invalid choice"),
        (["frobnicate"], "", "invalid choice"),
    ],
)
def test_a_user_mistake_is_one_line_and_status_2(capsys, monkeypatch, argv, command, says):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    rc, out, err = run(capsys, *argv)
    assert_one_line_error(rc, err, command)
    assert says in err
    assert out == ""


def test_help_version_and_no_command(capsys):
    assert run(capsys, "--help")[0] == 0
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and kv.__version__ in out
    rc, _, err = run(capsys)
    assert rc == 2 and "COMMAND" in err


# table


def test_table_in_every_format(capsys):
    calibrate(capsys)
    rows = kv.table(FN)
    rc, text, _ = run(capsys, "table")
    assert rc == 0 and text.splitlines()[0].split()[:5] == ["features", "B", "D", "L", "winner"]
    assert "reference µs" in text and "torch_shift µs" in text and "margin" in text
    rc, md, _ = run(capsys, "table", "--format", "md")
    assert all(line.startswith("| ") and line.endswith(" |") for line in md.splitlines())
    assert "causal_conv1d_fn\\|float32" in md  # a pipe in a cell is escaped
    rc, out, _ = run(capsys, "table", "--format", "csv")
    parsed = list(csv.DictReader(io.StringIO(out)))
    assert [(int(r["B"]), int(r["D"]), int(r["L"]), r["winner"]) for r in parsed] == [
        (*r.shape, r.winner) for r in rows]
    got = run_json(capsys, "table")
    assert [(tuple(g["shape"]), g["winner"], g["times_us"]) for g in got] == [
        (r.shape, r.winner, r.times_us) for r in rows]
    assert run_json(capsys, "table", "--op", "update") == []


def test_table_without_calibration_says_so(capsys):
    rc, out, err = run(capsys, "table")
    assert (rc, out) == (0, "") and "run kv calibrate" in err


# info


def test_info_names_fingerprint_cache_and_plugins(capsys):
    got = run_json(capsys, "info")
    fp = fingerprint("cpu")
    assert got["fingerprint"] == fp and got["fingerprint_id"] == fingerprint_id(fp)
    assert got["cache_dir"] == os.environ["KV_CACHE_DIR"] and got["in_memory"] is False
    assert got["table_entries"] == 0 and "causal_conv1d" in got["plugins"] and "aten" in got["plugins"]
    rc, out, _ = run(capsys, "info")
    assert rc == 0 and fingerprint_id(fp) in out and os.environ["KV_CACHE_DIR"] in out


def test_a_variant_that_picks_its_code_path_says_which_without_being_built_for_it(capsys, with_variants):
    """`kv list --wide` and `kv info` name the path (cpu_native: its ISA build); a variant whose
    build is pending is "not built", and is not built to answer."""
    asked = []

    def unbuilt_path():
        asked.append("unbuilt")
        return "avx512"

    with_variants(variant("pathy", code_path=lambda: "avx2"),
                  variant("unbuilt", code_path=unbuilt_path, build=lambda: asked.append("build") or "",
                          is_built=lambda: False))
    rc, out, _ = run(capsys, "list", "--wide")
    assert rc == 0 and "code path" in out.splitlines()[0]
    lines = {tuple(line.split()[:2]): line for line in out.splitlines()[2:] if line[:1].strip()}
    assert " avx2 " in lines[(FN, "pathy")] and " not built " in lines[(FN, "unbuilt")]
    assert " - " in lines[(FN, "reference")]  # one path only: nothing to say
    info = run_json(capsys, "info")
    paths = info["ops"][FN]["code_paths"]
    assert (paths["pathy"], paths["unbuilt"]) == ("avx2", "not built") and "reference" not in paths
    rc, out, _ = run(capsys, "info")
    assert "pathy avx2, unbuilt not built" in out
    assert asked == []


def test_python_dash_m_runs_the_cli(tmp_path):
    env = {**os.environ, "KV_CACHE_DIR": str(tmp_path / "c")}
    proc = subprocess.run([sys.executable, "-m", "kernel_variants", "info", "--json"], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cache_dir"] == str(tmp_path / "c")


# export / import


def _switch_table(monkeypatch, path):
    """Another machine of the same fleet: same fingerprint, its own empty table."""
    monkeypatch.setenv("KV_CACHE_DIR", str(path))
    kv.reload()


def _winners():
    return {r.shape: r.winner for r in kv.table(FN)}


def test_export_then_import_on_an_identical_machine(capsys, monkeypatch, tmp_path):
    calibrate(capsys)
    before = _winners()
    doc_path = tmp_path / "table.json"
    rc, out, _ = run(capsys, "export", str(doc_path))
    assert rc == 0 and "wrote 4 measurements and 2 winners" in out
    doc = json.loads(doc_path.read_text())
    assert (doc["format"], doc["schema_version"]) == ("kernel_variants.table", 2)
    assert doc["fingerprint_id"] == fingerprint_id(fingerprint("cpu"))
    assert len(doc["measurements"]) == 4 and len(doc["winners"]) == 2

    _switch_table(monkeypatch, tmp_path / "other-machine")
    assert _winners() == {}
    got = run_json(capsys, "import", str(doc_path))
    # measurements are merged; winners are re-decided from them, never copied
    assert (got["added"], got["updated"], got["kept"], got["forced"]) == (4, 0, 0, False)
    assert _winners() == before
    assert kv.table(FN)[0].times_us == {k: v for k, v in (
        (m["variant"], m["best_us"]) for m in doc["measurements"] if tuple(m["shape"]) == (1, 16, 8))}
    rc, out, _ = run(capsys, "import", str(doc_path))  # again: nothing newer
    assert rc == 0 and "0 added, 0 updated, 4 kept" in out


def test_export_to_stdout_is_the_document(capsys):
    calibrate(capsys)
    rc, out, _ = run(capsys, "export", "-")
    assert rc == 0 and len(json.loads(out)["measurements"]) == 4


def test_import_keeps_the_newer_entry_per_key(capsys, monkeypatch, tmp_path):
    calibrate(capsys)
    doc_path = tmp_path / "t.json"
    run(capsys, "export", str(doc_path))
    doc = json.loads(doc_path.read_text())
    # One entry measured later elsewhere, one earlier: only the later replaces the local one.
    newer, older = doc["measurements"][0], doc["measurements"][1]
    newer.update(best_us=1234.5, measured_at=time.time() + 5)
    older.update(best_us=9999.0, measured_at=older["measured_at"] - 100)
    doc_path.write_text(json.dumps(doc))
    got = run_json(capsys, "import", str(doc_path))
    assert (got["added"], got["updated"], got["kept"]) == (0, 1, 3)
    rows = {r.shape: r.times_us for r in kv.table(FN)}
    assert rows[tuple(newer["shape"])][newer["variant"]] == 1234.5
    assert rows[tuple(older["shape"])][older["variant"]] != 9999.0


def _refingerprint(doc, **changes):
    fp = {**doc["fingerprint"], **changes}
    fpid = fingerprint_id(fp)
    doc.update(fingerprint=fp, fingerprint_id=fpid)
    for m in doc["measurements"]:
        m.update(fingerprint=fp, fingerprint_id=fpid)
    for w in doc["winners"]:
        w["fingerprint_id"] = fpid
    vfp = {k: v for k, v in fp.items() if k != "threads"}  # verdicts hold for any thread count
    for v in doc.get("verdicts", []):
        v.update(fingerprint=vfp, fingerprint_id=fingerprint_id(vfp))
    return doc


def test_a_document_from_another_fingerprint_needs_force(capsys, monkeypatch, tmp_path):
    calibrate(capsys)
    before = _winners()
    doc_path = tmp_path / "t.json"
    run(capsys, "export", str(doc_path))
    doc_path.write_text(json.dumps(_refingerprint(json.loads(doc_path.read_text()), threads="96")))
    _switch_table(monkeypatch, tmp_path / "other")
    rc, _, err = run(capsys, "import", str(doc_path))
    assert_one_line_error(rc, err, "import")
    assert "threads '96' in the document" in err and "--force" in err
    assert len(dispatcher().table) == 0
    got = run_json(capsys, "import", str(doc_path), "--force")
    assert got["forced"] is True and got["added"] == 4
    assert _winners() == before  # filed under this machine's fingerprint, so dispatch uses it


def test_a_document_from_another_cpu_is_refused_forced_or_not_and_never_used_here(capsys, monkeypatch, tmp_path):
    """A VM calls a Zen 3 and a Zen 4 both "AMD EPYC": the fingerprint's CPU kind tells them
    apart. A document edited to say another ISA level or model (its id recomputed) is refused,
    --force or not; its rows put in the store all the same are never chosen from. The unedited
    document imports and is used; one whose fingerprint was edited without its id is refused."""
    from helpers.calibration import conv_call

    from kernel_variants._table.fingerprint import describe_cpu
    from kernel_variants._table.rows import Measurement, Winner
    from kernel_variants._table.store import CalibrationWarning

    calibrate(capsys)
    before = _winners()
    doc_path = tmp_path / "t.json"
    run(capsys, "export", str(doc_path))
    doc = json.loads(doc_path.read_text())
    here = fingerprint("cpu")
    _switch_table(monkeypatch, tmp_path / "other")
    for changes in ({"isa": "avx2" if here["isa"] != "avx2" else "avx512"}, {"model": here["model"] + "7"}):
        edited = _refingerprint(json.loads(json.dumps(doc)), **changes)
        path = tmp_path / "edited.json"
        path.write_text(json.dumps(edited))
        for force in ((), ("--force",)):
            rc, _, err = run(capsys, "import", str(path), *force)
            assert_one_line_error(rc, err, "import")
            assert f"measured on another CPU ({describe_cpu(edited['fingerprint'])}; this CPU is " \
                   f"{describe_cpu(here)})" in err
        assert len(dispatcher().table) == 0
    # Forced into the store all the same (a shared cache directory, say): filed under its own
    # fingerprint, nothing is chosen from it, and the one warning names both CPUs.
    table = dispatcher().table
    for m in edited["measurements"]:
        table.record(Measurement.model_validate(m))
    for w in edited["winners"]:
        table.store.set(Winner.model_validate(w).storage_key(), json.dumps(w))
    kv.reload()
    args, kw = conv_call(1, 16, 8)
    with pytest.warns(CalibrationWarning, match=f"rows measured on another CPU .*this CPU is {re.escape(describe_cpu(here))}"):
        assert _timed(kv.explain(FN, *args, **kw)) == {}
    assert _winners() == {}
    stale_id = tmp_path / "stale-id.json"
    stale_id.write_text(json.dumps({**doc, "fingerprint": {**doc["fingerprint"], "model": "17"}}))
    rc, _, err = run(capsys, "import", str(stale_id))
    assert_one_line_error(rc, err, "import")
    assert f"fingerprint_id {doc['fingerprint_id']} does not match the fingerprint, whose id is" in err
    with warnings.catch_warnings():  # shown on stderr, as kv shows warnings, not raised
        warnings.simplefilter("always", CalibrationWarning)
        rc, out, err = run(capsys, "import", str(doc_path), "--json")
    assert rc == 0, err
    assert (json.loads(out)["added"], json.loads(out)["forced"]) == (4, False)
    assert "rows measured on another CPU" in err  # the forced-in rows, still ignored
    assert _winners() == before
    assert _timed(kv.explain(FN, *args, **kw)) == {m["variant"]: m["best_us"] for m in doc["measurements"]
                                                   if tuple(m["shape"]) == (1, 16, 8)}


def _timed(decision):
    """The figures a decision weighed: the table's, for the variants it has rows of."""
    return {r.variant: r.time_us for r in decision.trace if r.time_us is not None}


def _valid_doc(capsys, tmp_path):
    calibrate(capsys)
    p = tmp_path / "good.json"
    run(capsys, "export", str(p))
    return json.loads(p.read_text())


def _first_m(**kw):
    def edit(doc):
        doc["measurements"][-1].update(kw)  # the last entry: earlier ones must not be written either
        return doc
    return edit


HOSTILE = {
    "not json": lambda doc: "{this is not json",
    "empty": lambda doc: "",
    "a list": lambda doc: [doc],
    "schema 3": lambda doc: doc | {"schema_version": 3},
    "an earlier release's schema": lambda doc: doc | {"schema_version": 1},
    "wrong format": lambda doc: doc | {"format": "something.else"},
    "extra field": lambda doc: doc | {"payload": "__import__('os')"},
    "extra field in a measurement": _first_m(extra=1),
    "negative time": _first_m(best_us=-3.0),
    "huge time": _first_m(best_us=1e300),
    "infinite time": _first_m(best_us=float("inf")),
    "huge shape": _first_m(shape=[10**30, 16, 8]),
    "zero shape": _first_m(shape=[0, 16, 8]),
    "future timestamp": _first_m(measured_at=1e15),
    "variant id with a separator": _first_m(variant="a|b"),
    "forged fingerprint id": lambda doc: doc | {"fingerprint_id": "0123456789abcdef"},
    "fingerprint edited, its id not": lambda doc: doc | {"fingerprint": {**doc["fingerprint"], "isa": "avx2"}},
    "measurement of another fingerprint": _first_m(fingerprint_id="0123456789abcdef"),
    "duplicate entry": lambda doc: doc | {"measurements": doc["measurements"] + doc["measurements"][:1]},
    "10 MB of garbage": lambda doc: "x" * (10 << 20),
    "binary": lambda doc: b"\x89PNG\r\n\x1a\n\xff\xfe" * 1000,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_malformed_or_hostile_document_changes_nothing(capsys, monkeypatch, tmp_path, name):
    doc = _valid_doc(capsys, tmp_path)
    bad = HOSTILE[name](json.loads(json.dumps(doc)))
    path = tmp_path / "bad.json"
    if isinstance(bad, bytes):
        path.write_bytes(bad)
    else:
        path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    _switch_table(monkeypatch, tmp_path / "target")
    rc, out, err = run(capsys, "import", str(path))
    assert_one_line_error(rc, err, "import")
    assert str(path) in err and out == ""
    assert len(dispatcher().table) == 0, "nothing may be written from a rejected document"


def test_import_of_a_missing_file_and_export_to_a_missing_directory(capsys, tmp_path):
    rc, _, err = run(capsys, "import", str(tmp_path / "nope.json"))
    assert_one_line_error(rc, err, "import")
    assert "No such file or directory" in err
    rc, _, err = run(capsys, "export", str(tmp_path / "no" / "such" / "dir.json"))
    assert_one_line_error(rc, err, "export")


def test_an_unavailable_device_is_a_user_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc, _, err = run(capsys, "table", "--device", "cuda")
    assert_one_line_error(rc, err, "table")
    assert "no CUDA device" in err


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_help_and_version_do_not_import_torch(argv):
    code = ("import sys\nfrom kernel_variants._cli import main\nimport kernel_variants\n"
            f"rc = main({argv!r})\nassert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == (2 if not argv else 0), proc.stderr
    assert "torch was imported" not in proc.stderr
    text = proc.stdout + proc.stderr
    assert ("kernel-variants" in text) if argv == ["--version"] else ("calibrate" in text and "build" in text)


def test_kv_list_fits_120_columns_and_wide_shows_everything(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    rc, out, _ = run(capsys, "list")
    assert rc == 0
    assert max(len(line) for line in out.splitlines()) <= 120
    rc, wide, _ = run(capsys, "list", "--wide")
    assert rc == 0
    assert "capabilities" in wide.splitlines()[0] and "version" in wide.splitlines()[0]


# what the CLI stands on: the public API


def test_the_planning_behind_missing_is_public(reference_only):
    """kv calibrate --missing is kv.plan_calibration("missing", ...) measured by plan.run()."""
    timing = kv.TimingConfig(warmup=1, windows=1, iters=2)
    kv.calibrate(FN, [(1, 16, 8)], dtype="float32", timing=timing)
    plan = kv.plan_calibration("missing", FN, [(1, 16, 8), (2, 32, 16)], dtype="fp32")
    (job,) = plan.jobs
    assert (job.op, job.dtype, job.device) == (FN, "float32", "cpu")
    assert job.variants == {(1, 16, 8): (), (2, 32, 16): ("reference",)}
    assert kv.plan_calibration("all", FN, [(1, 16, 8)], dtype="fp32").jobs[0].variants == {(1, 16, 8): ("reference",)}
    (done,) = plan.run(timing=timing)
    assert [m.shape for m in done.result.measurements] == [(2, 32, 16)]
    assert set(done.rows) == {(2, 32, 16)} and done.rows[(2, 32, 16)].winner == "reference"
    assert kv.plan_calibration("missing", FN, [(1, 16, 8), (2, 32, 16)], dtype="fp32").jobs[0].variants == {
        (1, 16, 8): (), (2, 32, 16): ()}
    assert kv.plan_calibration("stale").jobs == [] and kv.plan_calibration("recorded").jobs == []
    with pytest.raises(ValueError, match="brings its own shapes"):
        kv.plan_calibration("stale", FN, [(1, 16, 8)])
    with pytest.raises(ValueError, match="select: expected one of all, missing, stale, recorded"):
        kv.plan_calibration("everything", FN, [(1, 16, 8)])


def test_info_build_and_ops_are_public():
    info = kv.info()
    assert info.fingerprint_id and info.fingerprint["device"] == "cpu" and info.call_path
    assert FN in {s.name for s in kv.op_specs()} and set(info.op_plugins) == {s.name for s in kv.op_specs()}
    assert kv.dtype_name("bf16") == "bfloat16" and kv.dtype_name("float32") == "float32"
    with pytest.raises(ValueError, match="expected one of"):
        kv.dtype_name("half-ish")
