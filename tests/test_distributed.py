"""Calibration across torchrun ranks: two real processes under gloo on the CPU, each with its own
table directory, end with identical tables; ranks of different devices are refused by name."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from kernel_variants.dispatch._distributed import mismatches, rank_device, shard
from kernel_variants.dispatch._table import CalibrationTable, Measurement, Winner

WRAPPER = """
    import os, sys

    # Each rank its own table, as on separate machines of a fleet.
    rank = os.environ["LOCAL_RANK"]
    os.environ["KV_CACHE_DIR"] = os.path.join({base!r}, "rank" + rank)
    import torch

    # 1 thread per rank on a 2-core machine; with SKEW, rank 1 differs (threads are in the fingerprint).
    torch.set_num_threads(1 + (int(rank) if os.environ.get("KV_TEST_SKEW") else 0))
    from kernel_variants._cli import main

    sys.exit(main(sys.argv[1:]))
"""

ARGS = ["calibrate", "--distributed", "--sweep", "smoke", "--iters", "2", "--windows", "1", "--warmup", "1",
        "--dtype", "fp32", "--json"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wrapper(tmp_path):
    script = tmp_path / "rank_main.py"
    script.write_text(textwrap.dedent(WRAPPER.format(base=str(tmp_path))))
    return script


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KV_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", **extra)
    return env


def _torchrun(tmp_path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(_wrapper(tmp_path)), *ARGS]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120, check=False)


def _two_ranks_by_hand(tmp_path, **extra) -> list[tuple[int, str]]:
    """The two ranks as plain processes with torchrun's variables, so that each one's exit status
    and output can be read (torchrun stops the other ranks as soon as one exits non-zero)."""
    script, port = _wrapper(tmp_path), str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), *ARGS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                                  MASTER_PORT=port, **extra))
             for r in range(2)]
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=120)
        finally:
            p.kill()
        out.append((p.returncode, err))
    return out


def _entries(directory):
    """Every measurement and winner stored in a table directory, by storage key."""
    out = {}
    for key, raw in CalibrationTable(directory).store.items():
        if not key.startswith(("m|", "w|")):  # the write token and snapshots beside the rows
            continue
        model = Measurement if key.startswith("m|") else Winner
        out[key] = model.model_validate_json(raw)
    return out


@pytest.mark.slow
def test_two_ranks_share_the_work_and_end_with_identical_tables(tmp_path):
    proc = _torchrun(tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rank 1: imported rank 0's table" in proc.stderr
    rank0, rank1 = _entries(tmp_path / "rank0"), _entries(tmp_path / "rank1")
    winners0 = {k: w.variant for k, w in rank0.items() if isinstance(w, Winner)}
    winners1 = {k: w.variant for k, w in rank1.items() if isinstance(w, Winner)}
    assert len(winners0) == 4, "one winner per shape of the smoke sweep"
    assert winners0 == winners1
    assert {k: m.best_us for k, m in rank0.items() if isinstance(m, Measurement)} == {
        k: m.best_us for k, m in rank1.items() if isinstance(m, Measurement)}
    # Both ranks measured: rank 0's progress bar shows only its own share of the pairs.
    total = len([m for m in rank0.values() if isinstance(m, Measurement)])
    assert f"/{total}  " not in proc.stderr and "rank 0 share" in proc.stderr


@pytest.mark.slow
def test_ranks_with_different_fingerprints_all_exit_2_naming_the_rank(tmp_path):
    for rc, err in _two_ranks_by_hand(tmp_path, KV_TEST_SKEW="1"):
        assert rc == 2, err[-4000:]
        assert err.strip().splitlines() == [
            "kv calibrate: error: ranks must measure identical devices and variants: "
            "rank 1 device fingerprint differs from rank 0's: threads '2' vs '1'"]
    assert not (tmp_path / "rank0").exists() or _entries(tmp_path / "rank0") == {}


def test_every_pair_is_measured_by_exactly_one_rank():
    shapes = [(1, 8, 4), (2, 8, 4), (3, 8, 4)]
    variants = ["a", "b", "c"]
    for world in (1, 2, 4):
        got = [(s, v) for r in range(world) for s, vs in shard(shapes, variants, r, world) for v in vs]
        assert sorted(got) == sorted((s, v) for s in shapes for v in variants)
    # two ranks, two variants: neither rank measures only one of the variants
    shares = [{v for _, vs in shard(shapes, ["a", "b"], r, 2) for v in vs} for r in range(2)]
    assert shares == [{"a", "b"}, {"a", "b"}]


def test_mismatches_name_each_differing_rank_and_key():
    fps = [{"name": "H200", "driver": "560"}, {"name": "H200", "driver": "560"}, {"name": "H100", "driver": "560"}]
    assert mismatches(fps, "device fingerprint") == [
        "rank 2 device fingerprint differs from rank 0's: name 'H100' vs 'H200'"]
    assert mismatches(fps[:2], "device fingerprint") == []


def test_each_rank_takes_its_own_device():
    assert rank_device("cuda", 3) == "cuda:3"
    assert rank_device("cpu", 3) == "cpu"
    with pytest.raises(ValueError, match="give the device type"):
        rank_device("cuda:1", 0)
