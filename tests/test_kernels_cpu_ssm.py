"""cpu_native's state-space scan (kernels/cpu_ssm.py) where the conformance suite cannot see:
every ISA build (a child process per ATEN_CPU_CAPABILITY) against the reference, results that
do not depend on the thread count, a 16-bit pool holding exactly the fp32 state rounded once,
and pool views (gaps between slots, slots that are not dense) updated in place, nothing else
written; each for the token-by-token scan and the chunked one (``chunk`` > 0), the latter also
at chunk boundaries, with strong decays, and past its cache of C Bᵀ."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernel_variants._native import build
from kernel_variants._tolerances import mismatch
from kernel_variants.kernels import cpu_ssm
from kernel_variants.kernels.cpu_native._build import SSM
from kernel_variants.ops.ssm import _reference

pytestmark = pytest.mark.skipif(build.toolchain_missing() is not None, reason="no C++ toolchain")

CU = [0, 5, 5, 40, 41, 70]  # an empty sequence and a one-token one among them
SLOTS = [3, 0, -1, 6, 5]  # sequence 2 is padding
INIT = [True, False, True, True, False]


def _scan_args(dtype: torch.dtype, pool_dtype: torch.dtype, H=4, P=24, S=40, G=2, seed=0) -> tuple[list, dict]:
    g = torch.Generator().manual_seed(seed)
    T = CU[-1]

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dt)

    args = [rnd(T, H, P), rnd(T, H), -torch.rand(H, generator=g) * 2, rnd(T, G, S), rnd(T, G, S),
            torch.tensor(CU, dtype=torch.int32), torch.randn(H, generator=g), rnd(T, H, P), torch.rand(H, generator=g),
            True]
    kw = dict(ssm_states=rnd(8, H, P, S, dt=pool_dtype), state_indices=torch.tensor(SLOTS),
              has_initial_state=torch.tensor(INIT))
    return args, kw


def _update_args(dtype: torch.dtype, pool_dtype: torch.dtype, T: int, H=4, P=24, S=40, G=2, seed=1):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dt)

    Bn = 4
    args = [rnd(8, H, P, S, dt=pool_dtype), rnd(Bn, T, H, P), rnd(Bn, T, H), -torch.rand(H, generator=g) * 2,
            rnd(Bn, T, G, S), rnd(Bn, T, G, S), torch.randn(H, generator=g), rnd(Bn, T, H, P),
            torch.rand(H, generator=g), True]
    kw = dict(state_batch_indices=torch.tensor([1, 2, -1, 4], dtype=torch.int32),
              dst_state_batch_indices=torch.tensor([1, 6, 7, 0], dtype=torch.int32))
    return args, kw


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


_CHILD = r"""
import sys, torch
from kernel_variants._native import build
from kernel_variants.kernels.cpu_native._build import SSM
from kernel_variants.kernels import cpu_ssm
args, kw, uargs, ukw = torch.load(sys.argv[1])
pool = kw["ssm_states"].clone()
y = cpu_ssm.ssd_chunk_scan(*args, **kw)
yc = cpu_ssm.ssd_chunk_scan(*args, **{**kw, "ssm_states": pool}, chunk=16)
u = cpu_ssm.selective_state_update(*uargs, **ukw)
torch.save((build.load_extension(SSM).ssm_scan_isa(), y, kw["ssm_states"], yc, pool, u, uargs[0]), sys.argv[1])
"""


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_every_isa_build_matches_the_reference(tmp_path, capability):
    build.load_extension(SSM)  # built once here; the child loads that build
    args, kw = _scan_args(torch.bfloat16, torch.float32)
    uargs, ukw = _update_args(torch.float16, torch.bfloat16, T=2)
    path = tmp_path / "io.pt"
    torch.save((args, kw, uargs, ukw), path)
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    subprocess.run([sys.executable, "-c", _CHILD, str(path)], check=True, env=env, timeout=600)
    isa, y, pool, yc, cpool, u, upool = torch.load(path)
    assert set(isa) == {capability}
    want_pool = kw["ssm_states"].clone()
    want = _reference.ssd_chunk_scan(*args, **{**kw, "ssm_states": want_pool})
    assert mismatch(y, want, f"scan {capability}") is None
    assert mismatch(pool, want_pool, f"scan state {capability}") is None
    assert mismatch(yc, want, f"chunked scan {capability}") is None
    assert mismatch(cpool, want_pool, f"chunked scan state {capability}") is None
    want_upool = uargs[0].clone()
    want_u = _reference.selective_state_update(want_upool, *uargs[1:], **ukw)
    assert mismatch(u, want_u, f"update {capability}") is None
    assert mismatch(upool, want_upool, f"update state {capability}") is None


def _with_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_results_do_not_depend_on_the_thread_count(dtype, chunk):
    # Wide enough to be split across threads (the kernel stays on one below ~64K state updates);
    # G = 2 over 8 heads: a thread's range may start inside a group (its C Bᵀ formed again).
    args, kw = _scan_args(dtype, torch.float32, H=8, P=64, S=128, G=2)
    runs = []
    for n in (1, 2):
        pool = kw["ssm_states"].clone()
        y = _with_threads(n, lambda pool=pool: cpu_ssm.ssd_chunk_scan(*args, **{**kw, "ssm_states": pool},
                                                                      chunk=chunk))
        runs.append((y, pool))
    assert torch.equal(_bits(runs[0][0]), _bits(runs[1][0]))
    assert torch.equal(runs[0][1], runs[1][1])
    uargs, ukw = _update_args(dtype, torch.float32, T=3, H=8, P=64, S=128, G=1)
    uruns = []
    for n in (1, 2):
        pool = uargs[0].clone()
        y = _with_threads(n, lambda pool=pool: cpu_ssm.selective_state_update(pool, *uargs[1:], **ukw))
        uruns.append((y, pool))
    assert torch.equal(_bits(uruns[0][0]), _bits(uruns[1][0]))
    assert torch.equal(uruns[0][1], uruns[1][1])


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", ["scan", "scan_chunked", "update1", "update3"])
def test_a_16_bit_pool_holds_the_fp32_state_rounded_once(op, pool_dtype):
    """The same call on an fp32 pool holding the 16-bit pool's values: the 16-bit pool ends as
    that fp32 result rounded to nearest even (torch's .to), bit for bit, and y is identical. The
    one-token update reads, updates and rounds in one pass; the others keep fp32 in between."""
    if op.startswith("scan"):
        chunk = 16 if op == "scan_chunked" else 0
        args, kw = _scan_args(torch.bfloat16, pool_dtype)
        pool16 = kw["ssm_states"]
        pool32 = pool16.float()
        y16 = cpu_ssm.ssd_chunk_scan(*args, **kw, chunk=chunk)
        y32 = cpu_ssm.ssd_chunk_scan(*args, **{**kw, "ssm_states": pool32}, chunk=chunk)
    else:
        args, kw = _update_args(torch.bfloat16, pool_dtype, T=int(op[-1]))
        pool16 = args[0]
        pool32 = pool16.float()
        y16 = cpu_ssm.selective_state_update(*args, **kw)
        y32 = cpu_ssm.selective_state_update(pool32, *args[1:], **kw)
    assert torch.equal(_bits(y16), _bits(y32))
    assert torch.equal(_bits(pool16), _bits(pool32.to(pool_dtype)))


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("layout", ["slot_gaps", "slot_not_dense"])
def test_pool_views_are_updated_in_place_and_nothing_else(layout, chunk):
    args, kw = _scan_args(torch.float32, torch.float32)
    dense = kw["ssm_states"]
    N, H, P, S = dense.shape
    if layout == "slot_gaps":  # vLLM's pool: a view with a slot stride past H * P * S
        big = torch.full((N, H * P * S + 13), float("nan"))
        view = big[:, 5 : 5 + H * P * S].view(N, H, P, S)
    else:  # each slot [H, S, P] in memory: taken through a dense copy written back
        big = torch.full((N, H, S, P), float("nan"))
        view = big.transpose(2, 3)
    view.copy_(dense)
    orig, before = dense.clone(), big.clone()
    y = cpu_ssm.ssd_chunk_scan(*args, **{**kw, "ssm_states": view}, chunk=chunk)
    want = cpu_ssm.ssd_chunk_scan(*args, **kw, chunk=chunk)
    assert torch.equal(y, want)
    assert torch.equal(view, dense)
    if layout == "slot_gaps":  # the gaps and the padded sequence's slot are untouched
        gaps = torch.ones_like(big, dtype=torch.bool)
        gaps[:, 5 : 5 + H * P * S] = False
        assert torch.equal(big[gaps].isnan(), before[gaps].isnan())
    untouched = [s for s in range(N) if s not in SLOTS]
    assert torch.equal(view[untouched], orig[untouched])


def _chunk_args(lengths: list[int], dtype=torch.float32, H=3, P=20, S=24, G=1, decay=2.0, seed=2):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dt)

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    n = len(lengths)
    args = [rnd(T, H, P), rnd(T, H), -torch.rand(H, generator=g) * decay, rnd(T, G, S), rnd(T, G, S), cu,
            torch.randn(H, generator=g), None, None, True]
    kw = dict(ssm_states=rnd(n, H, P, S, dt=torch.float32), state_indices=torch.arange(n),
              has_initial_state=torch.arange(n) % 2 == 0)
    return args, kw


@pytest.mark.parametrize("chunk", [8, 16, 64])
def test_the_chunked_scan_matches_the_reference_across_chunk_boundaries(chunk):
    """Sequences of 1, 11, Q - 1, Q, Q + 1, 2Q + 3, 4 and 3 tokens (a partial last chunk, a
    chunk boundary at the end), every other one with an initial state (short ones with one go
    token by token, from zeros the chunked form starts at 3 tokens); P and S not multiples of a
    vector; strong decays (A down to -30) whose products underflow inside a chunk. The state is
    judged at fp32's tolerance."""
    args, kw = _chunk_args([1, 11, chunk - 1, chunk, chunk + 1, 2 * chunk + 3, 4, 3], decay=30.0)
    want_pool = kw["ssm_states"].clone()
    want = _reference.ssd_chunk_scan(*args, **{**kw, "ssm_states": want_pool})
    pool = kw["ssm_states"].clone()
    y = cpu_ssm.ssd_chunk_scan(*args, **{**kw, "ssm_states": pool}, chunk=chunk)
    assert mismatch(y, want, f"chunk{chunk} y") is None
    assert mismatch(pool, want_pool, f"chunk{chunk} state") is None


@pytest.mark.parametrize("length", [25000, 36000], ids=["c_bt_cached_alone", "nothing_cached"])
def test_the_chunked_scan_past_its_cache_computes_the_same(length):
    """The kernel keeps each (sequence, group)'s C Bᵀ, B and C per chunk in 8 MiB a thread: at
    Q = 64 and S = 16 (384 bytes a token) 20000 tokens keep all three, 25000 C Bᵀ alone (256
    bytes a token; each head converts B and C) and 36000 nothing (each head forms C Bᵀ chunk by
    chunk). The same arithmetic either way: the long sequence's first 20000 outputs are the short
    one's bit for bit, and its final state is the token-by-token one's at fp32's tolerance."""
    args, kw = _chunk_args([length], H=2, P=8, S=16, decay=0.5)
    short = [t[:20000] if isinstance(t, torch.Tensor) and t.dim() >= 2 else t for t in args]
    short[5] = torch.tensor([0, 20000], dtype=torch.int32)
    y_short = cpu_ssm.ssd_chunk_scan(*short, **{**kw, "ssm_states": kw["ssm_states"].clone()}, chunk=64)
    want_pool = kw["ssm_states"].clone()
    cpu_ssm.ssd_chunk_scan(*args, **{**kw, "ssm_states": want_pool})
    pool = kw["ssm_states"].clone()
    y = cpu_ssm.ssd_chunk_scan(*args, **{**kw, "ssm_states": pool}, chunk=64)
    assert torch.equal(y[:20000], y_short)
    assert mismatch(pool, want_pool, "state") is None
