"""Calibration helpers: the one quick timing configuration, table rows made by hand, and the
``kv`` command line run in-process."""

from __future__ import annotations

import dataclasses
import json
import time

import torch

import kernel_variants as kv
from kernel_variants._cli import main
from kernel_variants._table.fingerprint import fingerprint, fingerprint_id
from kernel_variants._table.rows import Group, Measurement

FN = "causal_conv1d_fn"

# The quickest timing that still measures: for tests of what calibration records and decides,
# never of how fast anything is. A test that needs more windows says so: ``quick(windows=3)``.
QUICK_TIMING = kv.TimingConfig(warmup=1, windows=1, iters=2)
QUICK = dict(dtype="float32", timing=QUICK_TIMING)


def quick(**timing) -> dict:
    """QUICK with the ``timing`` fields given changed."""
    return dict(dtype="float32", timing=dataclasses.replace(QUICK_TIMING, **timing))


def quick_argv(config: dict = QUICK) -> list[str]:
    """``config`` as ``kv calibrate``/``compare``/``gate`` flags."""
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[config["dtype"]]
    t = config["timing"]
    return ["--dtype", dtype, "--warmup", str(t.warmup), "--windows", str(t.windows), "--iters", str(t.iters)]


def conv_call(b: int = 2, d: int = 32, seq: int = 16):
    """(args, kwargs) of a causal_conv1d_fn call of shape (b, d, seq): bias, a state pool, silu."""
    return (torch.randn(b, seq, d), torch.randn(d, 4), torch.randn(d)), dict(
        conv_states=torch.randn(b, 3, d), activation="silu")


def fpid(device: str = "cpu") -> str:
    """The fingerprint id this machine's rows are stored under."""
    return fingerprint_id(fingerprint(device))


def group(**features) -> Group:
    """The causal_conv1d_fn group of the tests' usual call (width 4, bias, silu, states)."""
    base = dict(width=4, bias=True, activation="silu", states=True, varlen=False, spec=False)
    return Group(op=FN, dtype="float32", features=base | features)


def measurement(variant: str, us: float, version: str = "1", *, samples=None, shape=(1, 16, 8),
                fp: str | None = None) -> Measurement:
    """An ``ok`` row of ``variant`` at ``us``: five windows of no recorded samples by default, or
    one window per value of ``samples`` (with the noise they show)."""
    timing = dict(windows=5)
    median = us
    if samples is not None:
        samples = tuple(samples) or (us,)
        median = sorted(samples)[len(samples) // 2]
        timing = dict(windows=len(samples), samples_us=samples,
                      noise=(median - us) / us if len(samples) > 1 else None)
    return Measurement(fingerprint=fingerprint("cpu"), fingerprint_id=fp or fpid(), group=group(), shape=shape,
                       variant=variant, version=version, status="ok", best_us=us, median_us=median, spread=0.0,
                       iters=100, method="test", measured_at=time.time(), **timing)


def run(capsys, *argv):
    """(exit status, stdout, stderr) of one kv command."""
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *argv):
    """The JSON a kv command prints with ``--json``; fails unless it exits 0."""
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def assert_one_line_error(rc, err, command):
    """Exit status 2 and one line ``kv <command>: error: ...`` (``kv: error:`` for no command)."""
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"kv {command}: error: " if command else "kv: error: "), err
    assert "Traceback" not in err
