"""cpu_native's gated delta rule (kernels/cpu_gdn.py) where the conformance suite cannot see:
every ISA build (a child process per ATEN_CPU_CAPABILITY) against the reference, results that
do not depend on the thread count, a bf16 pool holding exactly the fp32 state rounded once, the
running decay scale folded back when it leaves its range, and pool views (gaps between slots,
slots that are not dense) updated in place, nothing else written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernel_variants._native import build
from kernel_variants._tolerances import mismatch
from kernel_variants.kernels import cpu_gdn
from kernel_variants.kernels.cpu_native._build import GDN
from kernel_variants.ops.gdn import _reference

pytestmark = pytest.mark.skipif(build.toolchain_missing() is not None, reason="no C++ toolchain")

# An empty sequence, a one-token one and one of a block (64 tokens) and one more among them.
CU = [0, 5, 5, 70, 71, 100]
SLOTS = [3, 0, -1, 6, 5]  # sequence 2 is padding
INIT = [True, False, True, True, False]


def _scan_args(dtype: torch.dtype, pool_dtype: torch.dtype, Hk=2, Hv=4, K=24, V=40, seed=0, decay=1.0):
    """(q, k, v, g, beta, cu_seqlens), and the pool keywords. V = 40: a partial vector on every ISA."""
    gen = torch.Generator().manual_seed(seed)
    T = CU[-1]

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    g = -torch.rand(T, Hv, generator=gen) * decay
    args = [rnd(T, Hk, K), rnd(T, Hk, K), rnd(T, Hv, V), g, torch.rand(T, Hv, generator=gen),
            torch.tensor(CU, dtype=torch.int32)]
    kw = dict(ssm_states=rnd(8, Hv, K, V, dt=pool_dtype), state_indices=torch.tensor(SLOTS),
              has_initial_state=torch.tensor(INIT))
    return args, kw


def _update_args(dtype: torch.dtype, pool_dtype: torch.dtype, T: int, Hk=2, Hv=4, K=24, V=40, seed=1):
    """Positional args of gated_delta_rule_update (B = 4 sequences of T tokens, one padded) and keywords."""
    gen = torch.Generator().manual_seed(seed)
    Bn = 4

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    args = [rnd(Bn * T, Hk, K), rnd(Bn * T, Hk, K), rnd(Bn * T, Hv, V), rnd(Bn * T, Hv), rnd(Bn * T, Hv),
            torch.rand(Hv, generator=gen).log1p(), torch.randn(Hv, generator=gen) - 2,
            rnd(8, Hv, K, V, dt=pool_dtype), torch.tensor([1, 6, -1, 4], dtype=torch.int32),
            torch.arange(0, Bn * T + 1, T, dtype=torch.int32)]
    return args, dict(softplus_beta=1.5, scale=0.3)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


_CHILD = r"""
import sys, torch
from kernel_variants._native import build
from kernel_variants.kernels.cpu_native._build import GDN
from kernel_variants.kernels import cpu_gdn
args, kw, uargs, ukw = torch.load(sys.argv[1])
y = cpu_gdn.chunk_gated_delta_rule(*args, **kw)
u = cpu_gdn.gated_delta_rule_update(*uargs, **ukw)
torch.save((build.load_extension(GDN).gdn_isa(), y, kw["ssm_states"], u, uargs[7]), sys.argv[1])
"""


def _capabilities() -> list[str]:
    caps = ["avx2", "default"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16"):  # the plain AVX-512 build
        caps.insert(0, "avx512")
    return caps


@pytest.mark.parametrize("capability", _capabilities())
def test_every_isa_build_matches_the_reference(tmp_path, capability):
    build.load_extension(GDN)  # built once here; the child loads that build
    args, kw = _scan_args(torch.bfloat16, torch.float32)
    uargs, ukw = _update_args(torch.float16, torch.bfloat16, T=2)
    path = tmp_path / "io.pt"
    torch.save((args, kw, uargs, ukw), path)
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    subprocess.run([sys.executable, "-c", _CHILD, str(path)], check=True, env=env, timeout=600)
    isa, y, pool, u, upool = torch.load(path)
    assert set(isa) == {capability}
    want_pool = kw["ssm_states"].clone()
    want = _reference.chunk_gated_delta_rule(*args, **{**kw, "ssm_states": want_pool})
    assert mismatch(y, want, f"scan {capability}") is None
    assert mismatch(pool, want_pool, f"scan state {capability}") is None
    want_upool = uargs[7].clone()
    want_u = _reference.gated_delta_rule_update(*uargs[:7], want_upool, *uargs[8:], **ukw)
    assert mismatch(u, want_u, f"update {capability}") is None
    assert mismatch(upool, want_upool, f"update state {capability}") is None


def _with_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_results_do_not_depend_on_the_thread_count(dtype):
    # Wide enough to be split across threads (the kernel stays on one below ~64K state updates).
    args, kw = _scan_args(dtype, torch.float32, Hk=4, Hv=8, K=64, V=64)
    runs = []
    for n in (1, 2):
        pool = kw["ssm_states"].clone()
        y = _with_threads(n, lambda pool=pool: cpu_gdn.chunk_gated_delta_rule(*args, **{**kw, "ssm_states": pool}))
        runs.append((y, pool))
    assert torch.equal(_bits(runs[0][0]), _bits(runs[1][0]))
    assert torch.equal(runs[0][1], runs[1][1])
    uargs, ukw = _update_args(dtype, torch.float32, T=3, Hk=4, Hv=8, K=64, V=64)
    uruns = []
    for n in (1, 2):
        pool = uargs[7].clone()
        y = _with_threads(n, lambda pool=pool: cpu_gdn.gated_delta_rule_update(*uargs[:7], pool, *uargs[8:], **ukw))
        uruns.append((y, pool))
    assert torch.equal(_bits(uruns[0][0]), _bits(uruns[1][0]))
    assert torch.equal(uruns[0][1], uruns[1][1])


@pytest.mark.parametrize("V", [40, 128])
@pytest.mark.parametrize("op", ["scan", "update1", "update3"])
def test_a_bf16_pool_holds_the_fp32_state_rounded_once(op, V):
    """The same call on an fp32 pool holding the bf16 pool's values: the bf16 pool ends as that
    fp32 result rounded to nearest even (torch's .to), bit for bit, and o is identical, whether
    the state is kept whole (a sequence past one block), tile by tile (one block) or, for an fp32
    pool, worked on in place (one token)."""
    if op == "scan":
        args, kw = _scan_args(torch.bfloat16, torch.bfloat16, V=V)
        pool16 = kw["ssm_states"]
        pool32 = pool16.float()
        y16 = cpu_gdn.chunk_gated_delta_rule(*args, **kw)
        y32 = cpu_gdn.chunk_gated_delta_rule(*args, **{**kw, "ssm_states": pool32})
    else:
        args, kw = _update_args(torch.bfloat16, torch.bfloat16, T=int(op[-1]), V=V)
        pool16 = args[7]
        pool32 = pool16.float()
        y16 = cpu_gdn.gated_delta_rule_update(*args, **kw)
        y32 = cpu_gdn.gated_delta_rule_update(*args[:7], pool32, *args[8:], **kw)
    assert torch.equal(_bits(y16), _bits(y32))
    assert torch.equal(_bits(pool16), _bits(pool32.to(torch.bfloat16)))


def test_steep_decay_folds_the_running_scale_back():
    """g down to -40 per token: the product of the decays leaves the kernel's [1e-18, 1e18]
    within a few tokens, so the state is rescaled mid-block, and a g of -inf wipes it."""
    args, kw = _scan_args(torch.float32, torch.float32, decay=40.0)
    args[3][7::11] = float("-inf")
    pool = kw["ssm_states"].clone()
    y = cpu_gdn.chunk_gated_delta_rule(*args, **{**kw, "ssm_states": pool})
    want_pool = kw["ssm_states"].clone()
    want = _reference.chunk_gated_delta_rule(*args, **{**kw, "ssm_states": want_pool})
    assert mismatch(y, want, "o") is None
    assert mismatch(pool, want_pool, "state") is None


@pytest.mark.parametrize("layout", ["slot_gaps", "slot_not_dense"])
def test_pool_views_are_updated_in_place_and_nothing_else(layout):
    args, kw = _scan_args(torch.float32, torch.float32)
    dense = kw["ssm_states"]
    N, Hv, K, V = dense.shape
    if layout == "slot_gaps":  # vLLM's pool: a view with a slot stride past Hv * K * V
        big = torch.full((N, Hv * K * V + 13), float("nan"))
        view = big[:, 5 : 5 + Hv * K * V].view(N, Hv, K, V)
    else:  # each slot [Hv, V, K] in memory: taken through a dense copy written back
        big = torch.full((N, Hv, V, K), float("nan"))
        view = big.transpose(2, 3)
    view.copy_(dense)
    orig, before = dense.clone(), big.clone()
    y = cpu_gdn.chunk_gated_delta_rule(*args, **{**kw, "ssm_states": view})
    want = cpu_gdn.chunk_gated_delta_rule(*args, **kw)
    assert torch.equal(y, want)
    assert torch.equal(view, dense)
    if layout == "slot_gaps":  # the gaps and the padded sequence's slot are untouched
        gaps = torch.ones_like(big, dtype=torch.bool)
        gaps[:, 5 : 5 + Hv * K * V] = False
        assert torch.equal(big[gaps].isnan(), before[gaps].isnan())
    untouched = [s for s in range(N) if s not in SLOTS]
    assert torch.equal(view[untouched], orig[untouched])
