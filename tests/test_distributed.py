"""Calibration across torchrun ranks: two real processes under gloo on the CPU, each with its own
table directory, end with identical tables; ranks of different devices are refused by name. At
run time, ranks that tune online (KV_TUNE=1) run rank 0's choice, and check_agreement() says
where they do not."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from helpers.calibration import quick_argv
from helpers.processes import free_port, rank_env, two_ranks

from kernel_variants._table.rows import Measurement, Winner
from kernel_variants._table.table import CalibrationTable
from kernel_variants._tuning.distributed import mismatches, rank_device, shard

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

ARGS = ["calibrate", "--distributed", "--sweep", "smoke", *quick_argv(), "--json"]


def _wrapper(tmp_path):
    script = tmp_path / "rank_main.py"
    script.write_text(textwrap.dedent(WRAPPER.format(base=str(tmp_path))))
    return script


def _torchrun(tmp_path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(_wrapper(tmp_path)), *ARGS]
    return subprocess.run(cmd, capture_output=True, text=True, env=rank_env(), timeout=120, check=False)


def _two_ranks_by_hand(tmp_path, **extra) -> list[tuple[int, str]]:
    """The two ranks as plain processes with torchrun's variables, so that each one's exit status
    and output can be read (torchrun stops the other ranks as soon as one exits non-zero)."""
    script, port = _wrapper(tmp_path), str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), *ARGS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=rank_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
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


AGREE = """
    import os, sys, json

    rank = int(os.environ["RANK"])
    os.environ["KV_CACHE_DIR"] = os.path.join({base!r}, "rank" + str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import kernel_variants as kv
    from kernel_variants._tuning import calibrate as _calibrate
    from kernel_variants._runtime.dispatcher import dispatcher

    dist.init_process_group("gloo")
    measured = []
    real = _calibrate.run_calibration
    _calibrate.run_calibration = lambda *a, **k: measured.append(list(a[3][0])) or real(*a, **k)

    def call(b, d, seq):
        g = torch.Generator().manual_seed(b * d * seq)
        x = torch.randn(b, seq, d, generator=g)
        return kv.causal_conv1d_fn(x, torch.randn(d, 4, generator=g), torch.randn(d, generator=g), activation="silu")

    for shape in [(1, 16, 8), (2, 32, 16), (1, 16, 8)]:
        call(*shape)
    agreed = kv.check_agreement()
    table = {{str(r.shape): r.winner for r in kv.table("causal_conv1d_fn")}}
    chosen = {{text: vid for text, (_, vid) in dispatcher().decided.items()}}
    # rank 1 now runs another variant for one key than rank 0 does
    key = next(t for t in chosen if "|2,32,16|" in t)
    other = next(v for v in ("torch_shift", "aten", "reference") if v != chosen[key])
    if rank == 1:
        with kv.force(causal_conv1d_fn=other):
            call(2, 32, 16)
    differ = [(d.key, d.choices) for d in kv.check_agreement()]
    print(json.dumps({{"measured": measured, "agreed": [str(a) for a in agreed], "table": table, "chosen": chosen,
                      "differ": differ, "key": key, "other": other}}))
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_online_tuning_measures_on_rank_0_and_every_rank_runs_its_choice(tmp_path):
    """KV_TUNE=1 under torch.distributed: rank 0 measures a key no rank has, the others take its
    choice (and its rows); check_agreement() is empty until a rank runs something else."""
    rank0, rank1 = two_ranks(tmp_path, AGREE, KV_TUNE="1", KV_DISABLE_PLUGINS="cpu_native")
    assert rank0["measured"] == [[1, 16, 8], [2, 32, 16]] and rank1["measured"] == []
    assert rank0["agreed"] == rank1["agreed"] == []
    assert rank0["chosen"] == rank1["chosen"] and len(rank0["chosen"]) == 2
    assert rank0["table"] == rank1["table"] == {"(1, 16, 8)": rank0["table"]["(1, 16, 8)"],
                                                "(2, 32, 16)": rank0["table"]["(2, 32, 16)"]}
    expected = [[rank0["key"], {"0": rank0["chosen"][rank0["key"]], "1": rank1["other"]}]]
    assert rank0["differ"] == rank1["differ"] == expected


QUALIFIED_EVERYWHERE = """
    import os, sys, json

    rank = int(os.environ["RANK"])
    os.environ["KV_CACHE_DIR"] = os.path.join({base!r}, "rank" + str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import kernel_variants as kv
    from kernel_variants._runtime.dispatcher import dispatcher, reset
    from kernel_variants.kernels import cpu_native
    from kernel_variants.ops.causal_conv1d import ConvCapabilities
    from kernel_variants.plugin import Variant, hookimpl
    from kernel_variants._registry.registry import Registry, make_plugin_manager

    def fast(*args, **kwargs):  # right on rank 0's device, wrong on rank 1's
        y = cpu_native.causal_conv1d_fn(*args, **kwargs)
        return y * 1.5 if rank == 1 else y

    class Plugin:
        @hookimpl
        def kv_register_variants(self, register):
            register(Variant(id="fast", op="causal_conv1d_fn", version="1", fn=fast, priority=100, isolate=False,
                             capabilities=ConvCapabilities(devices={{"cpu"}}, dtypes={{"float32"}})))

    reset(Registry(make_plugin_manager(entry_points=False, extra_plugins=[("rank-plugin", Plugin())])))
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 256, 64, generator=g), torch.randn(64, 4, generator=g)
    y = kv.causal_conv1d_fn(x, w, None, activation="silu")
    times = [r.times_us for r in kv.table("causal_conv1d_fn")]
    ok = torch.allclose(y, kv.explain("causal_conv1d_fn", x, w).key.spec.reference.fn(x, w, None, activation="silu"))
    chosen = {{text: vid for text, (_, vid) in dispatcher().decided.items()}}
    print(json.dumps({{"chosen": chosen, "ok": ok, "times": times,
                      "verdicts": [[v.variant, v.passed] for v in kv.verdicts()]}}))
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_rank_0_chooses_only_among_variants_qualified_on_every_rank(tmp_path):
    """A variant right on rank 0's device and wrong on rank 1's (faster than anything else there):
    rank 0 measures it fastest, but it failed qualification on rank 1, so rank 0 chooses among
    the others and every rank runs that, right on each."""
    rank0, rank1 = two_ranks(tmp_path, QUALIFIED_EVERYWHERE, KV_TUNE="1",
                              KV_DISABLE_PLUGINS="cpu_native,aten,torch_shift")
    assert ["fast", True] in rank0["verdicts"] and ["fast", False] in rank1["verdicts"]
    (times,) = rank0["times"]
    assert times["fast"] < times["reference"], "rank 0 would have chosen it"
    assert rank0["chosen"] == rank1["chosen"] and set(rank0["chosen"].values()) == {"reference"}
    assert rank0["ok"] and rank1["ok"]
