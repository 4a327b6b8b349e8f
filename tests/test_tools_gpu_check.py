"""tools/gpu_check.py, run as a user runs it (in a subprocess, on this CPU, ``--device cpu
--tiny``): every step runs, the report says what each found, and the CUDA-only parts say they
were skipped. So the script that goes to a GPU machine is never untested."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernel_variants as kv
from kernel_variants._runtime import callcore
from kernel_variants._runtime.dispatcher import dispatcher

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.py"
STEPS = ["environment", "qualify", "calibrate", "graphs", "overhead"]


def _run(outdir: Path, *extra: str, tmp: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    # TMPDIR: the script's state directory (tables, Triton's cache) lands in the test's folder.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KV_")}
    env["TMPDIR"] = str(tmp)
    return subprocess.run([sys.executable, str(SCRIPT), str(outdir), *extra], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-check")
    outdir = tmp / "out"
    done = _run(outdir, "--device", "cpu", "--tiny", tmp=tmp)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return outdir, json.loads((outdir / "report.json").read_text()), tmp


def test_every_step_runs_in_order_and_each_writes_its_file(cpu_run):
    outdir, report, _ = cpu_run
    assert list(report["steps"]) == STEPS and report["ran"] == STEPS
    assert report["exit_status"] == 0 and report["device"] == "cpu" and report["tiny"] is True
    for name in STEPS:
        step = report["steps"][name]
        assert step["status"] == "ok", (name, step.get("error"), step.get("log_tail"))
        assert json.loads((outdir / f"{name}.json").read_text())["status"] == "ok"
    # What the device tool brings back: at most 8 files, none in a folder
    assert sorted(p.name for p in outdir.iterdir()) == sorted([*(f"{s}.json" for s in STEPS), "report.json",
                                                                "summary.md"])


def test_environment_names_this_interpreter_and_its_call_path(cpu_run):
    env = cpu_run[1]["steps"]["environment"]["result"]
    assert env["torch"] == torch.__version__
    assert env["python"] == ".".join(map(str, sys.version_info[:3]))
    assert env["call_core"] == callcore.status()[1]  # the child's environment is this one's
    assert env["variants"]["causal_conv1d_fn"]["aten"] == "available"
    assert "gpu" not in env and env["cpu"]


# The ops tools/gpu_check.py qualifies (the conv and the RMSNorm families; the scans' GPU check is
# issue work still to come).
GPU_CHECK_OPS = {"causal_conv1d_fn", "causal_conv1d_update", "gemma_rms_norm", "add_gemma_rms_norm", "rms_norm",
                 "fused_add_rms_norm"}


def _cpu_builtins() -> set[tuple[str, str, str]]:
    """(op, variant, dtype) of every available non-reference variant of the checked ops that
    claims the CPU."""
    out = set()
    for spec in dispatcher().registry.ops():
        if spec.name not in GPU_CHECK_OPS:
            continue
        for rv in kv.variants(spec.name):
            caps = rv.variant.capabilities
            if rv.variant.fn is spec.reference.fn or "cpu" not in caps.devices or rv.unavailable_reason():
                continue
            out |= {(spec.name, rv.id, dt) for dt in ("bfloat16", "float16", "float32") if dt in caps.dtypes}
    return out


def test_qualification_covers_every_cpu_builtin_in_three_dtypes_and_all_pass(cpu_run):
    q = cpu_run[1]["steps"]["qualify"]["result"]
    got = {(v["op"], v["variant"], v["dtype"]) for v in q["verdicts"]}
    assert got == _cpu_builtins()
    assert {op for op, _, _ in got} == GPU_CHECK_OPS
    assert q["passed"] == len(got) > 0 and q["failed"] == 0 and q["failures"] == [] and q["skipped"] == 0
    assert all(v["passed"] and v["cases"] > 0 for v in q["verdicts"])
    assert q["triton_compilations"] == 0  # no Triton kernel compiles on a CPU without the interpreter
    assert q["tactics"] is False  # tactics only with --tactics


def test_calibration_decides_every_shape_and_times_a_copy_beside_each_variant(cpu_run):
    c = cpu_run[1]["steps"]["calibrate"]["result"]
    assert [s["sweep"] for s in c["sweeps"]] == ["seed69 subset", "decode", "decode-spec"]
    assert c["prequalified"]["failed"] == 0
    for sw in c["sweeps"]:
        assert sw["shapes"] and not sw["skipped"]
        assert set(sw["winners"]) == {",".join(map(str, s)) for s in sw["shapes"]}
        assert all(w is not None for w in sw["winners"].values()), sw["winners"]
        assert all("perf_counter" in m["method"] for m in sw["measurements"] if m["status"] == "ok")
    assert c["sweeps"][2]["features"] == {"spec": True}
    table = {(r["op"], tuple(r["shape"])) for r in c["table"] if r["winner"]}
    assert table >= {(sw["op"], tuple(s)) for sw in c["sweeps"] for s in sw["shapes"]}
    assert len(c["bandwidth"]) == sum(len(sw["shapes"]) for sw in c["sweeps"])
    for row in c["bandwidth"]:
        assert row["copy_gbps"] > 0 and row["x_bytes"] > 0 and row["variants"]
        assert all(v["gbps"] > 0 and v["share_of_copy"] > 0 for v in row["variants"].values())
    assert c["triton_share_above_64MB"] == {} and "--tiny" in c["triton_share_note"]


def test_graph_capture_is_skipped_without_cuda_and_the_compiled_block_matches_eager(cpu_run):
    g = cpu_run[1]["steps"]["graphs"]["result"]
    assert g["cuda_graph"] == {"status": "skipped: needs CUDA"}
    assert g["compile"]["status"] == "ok", g["compile"]
    assert g["compile"]["fullgraph"] is True and g["compile"]["state_equal_exactly"] is True
    assert g["compile"]["second_call_matches"] is True


def test_overhead_times_the_dispatched_op_and_the_chosen_variant_at_decode_sizes(cpu_run):
    o = cpu_run[1]["steps"]["overhead"]["result"]
    assert [r["B"] for r in o["rows"]] == [1, 8]
    for r in o["rows"]:
        assert r["dispatched_us"] > 0 and r["direct_us"] > 0
        assert r["added_us"] == pytest.approx(r["dispatched_us"] - r["direct_us"])
        assert r["variant"] in {rv.id for rv in kv.variants("causal_conv1d_update")}
        assert r["aten_ops_in_variant"] > 0  # the CPU variants are torch code: their ops are seen
        assert r["aten_ops_outside_total"] == sum(r["aten_ops_outside"].values())
        assert set(r["host_us"]) == {"dispatched", "forced", "bind", "direct"}
        assert all(t > 0 for t in r["host_us"].values())
        assert r["host_added_us"]["bind"] == pytest.approx(r["host_us"]["bind"] - r["host_us"]["direct"])
        assert set(r["device_us"]) == set(r["host_us"])
        # On the CPU the core serves each form: no aten op outside the variant in any of them.
        assert r["aten_ops_outside_by_form"] == {"dispatched": 0, "forced": 0, "bind": 0}
        # The rule's launch and the profiler's kernel count are CUDA's alone.
        assert r["rule_host_us"] is None and r["kernels_per_call"] == dict.fromkeys(("dispatched", "bind", "direct"))


def test_the_summary_has_a_section_per_step(cpu_run):
    text = (cpu_run[0] / "summary.md").read_text()
    for head in ("# GPU check:", "## Qualification", "## Calibration (fp16)", "## CUDA graph and torch.compile",
                 "## Dispatch overhead"):
        assert head in text
    assert "skipped: needs CUDA" in text


def test_only_reruns_one_step_and_the_report_keeps_the_others(cpu_run):
    outdir, before, tmp = cpu_run
    done = _run(outdir, "--device", "cpu", "--tiny", "--only", "environment", tmp=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((outdir / "report.json").read_text())
    assert report["ran"] == ["environment"] and list(report["steps"]) == STEPS
    assert report["steps"]["qualify"] == before["steps"]["qualify"]  # not rerun: the earlier result
    assert report["steps"]["environment"]["status"] == "ok"
    assert report["steps"]["environment"]["finished_at"] >= before["steps"]["environment"]["finished_at"]


def test_a_step_past_its_timeout_is_killed_and_reported_and_the_next_still_runs(tmp_path):
    # No step can import torch in 0.2 s: both are killed at their timeout, each reported.
    done = _run(tmp_path / "out", "--device", "cpu", "--tiny", "--only", "environment,overhead",
                "--step-timeout", "0.2", tmp=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["ran"] == ["environment", "overhead"]
    for name in ("environment", "overhead"):
        assert report["steps"][name]["status"] == "timed out"
        assert "killed after" in report["steps"][name]["error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    done = _run(tmp_path / "out", tmp=tmp_path, timeout=120)
    assert done.returncode == 0
    assert done.stdout.strip() == "no CUDA device: nothing to check here"
    assert not (tmp_path / "out").exists()


def test_unknown_steps_are_refused(tmp_path):
    done = _run(tmp_path / "out", "--only", "calibrat", tmp=tmp_path, timeout=120)
    assert done.returncode == 2 and "--only: expected steps among environment" in done.stderr
