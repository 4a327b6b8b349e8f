"""cpu_native's own surface: ``out=`` (a preallocated output, or x itself) gives bit for bit
the result of the plain call, with the same state write-back, for every dtype, both ops,
batched / varlen / decode / speculative shapes, strided inputs and outputs, one and several
threads; and the extension says which ISA build it runs."""

from __future__ import annotations

import pytest
import torch

from kernel_variants._native import build
from kernel_variants._tolerances import TOLERANCES, mismatch
from kernel_variants.kernels import cpu_native
from kernel_variants.ops.causal_conv1d import _reference

pytestmark = pytest.mark.skipif(build.toolchain_missing() is not None, reason="no C++ toolchain")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _filter(dim: int, width: int, dtype: torch.dtype, g: torch.Generator):
    w = (torch.randn(dim, width, generator=g) / width).to(dtype)
    b = torch.randn(dim, generator=g).to(dtype)
    return w, b


def _row_strided(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` with unit channel stride but padded rows (not contiguous)."""
    big = torch.full((*shape[:-1], shape[-1] + 8), float("nan"), dtype=dtype)
    return big[..., 3 : 3 + shape[-1]]


def _chan_strided(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    big = torch.full((*shape[:-1], 2 * shape[-1]), float("nan"), dtype=dtype)
    return big[..., ::2]


def _fwd_call(case: str, dtype: torch.dtype, seed: int):
    g = _gen(seed)
    dim, width = (70, 4) if case != "wide" else (4200, 4)
    w, b = _filter(dim, width, dtype, g)
    pool = torch.randn(6, width - 1 + 1, dim, generator=g).to(dtype)
    kw = dict(activation="silu" if seed % 2 else None, conv_states=pool)
    if case == "varlen":
        lengths = [5, 0, 1, 300]
        x = torch.randn(sum(lengths) + 2, dim, generator=g).to(dtype)  # rows past the last sequence
        kw.update(query_start_loc=torch.tensor([0, 5, 5, 6, 306], dtype=torch.int32),
                  cache_indices=torch.tensor([3, -1, 0, 5], dtype=torch.int32),
                  has_initial_state=torch.tensor([True, False, True, False]))
    else:
        x = torch.randn(3, 300 if case != "short" else 2, dim, generator=g).to(dtype)
        kw.update(cache_indices=torch.tensor([4, 1, 2], dtype=torch.int32),
                  has_initial_state=torch.tensor([True, False, True]))
    return x, w, b, kw


def _update_call(case: str, dtype: torch.dtype, seed: int):
    g = _gen(seed)
    dim, width = 70, 4
    w, b = _filter(dim, width, dtype, g)
    kw = dict(activation="silu" if seed % 2 else None)
    if case == "decode":
        x = torch.randn(5, dim, generator=g).to(dtype)
        pool = torch.randn(7, width - 1, dim, generator=g).to(dtype)
        kw.update(conv_state_indices=torch.tensor([6, 0, -1, 3, 2], dtype=torch.int32))
    else:  # speculative verify: L tokens, accepted counts
        x = torch.randn(4, 3, dim, generator=g).to(dtype)
        pool = torch.randn(5, width - 1 + 2, dim, generator=g).to(dtype)
        kw.update(conv_state_indices=torch.tensor([1, 4, 0, 2], dtype=torch.int32),
                  num_accepted_tokens=torch.tensor([1, 3, 2, 3], dtype=torch.int32))
    return x, pool, w, b, kw


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                       b.view(torch.int16 if b.element_size() == 2 else torch.int32))


def _clone_kw(kw: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["batched", "short", "varlen", "wide"])
@pytest.mark.parametrize("where", ["fresh", "strided", "chan_strided", "alias"])
def test_fwd_out_is_bit_exact(dtype, case, where, threads):
    x, w, b, kw = _fwd_call(case, dtype, seed=len(case) + len(where))
    want_kw = _clone_kw(kw)
    want = cpu_native.causal_conv1d_fn(x.clone(), w, b, **want_kw)
    if where == "alias":
        out = x.clone()
        got = cpu_native.causal_conv1d_fn(out, w, b, out=out, **kw)
    else:
        out = {"fresh": torch.empty_like(x), "strided": _row_strided(x.shape, dtype),
               "chan_strided": _chan_strided(x.shape, dtype)}[where]
        got = cpu_native.causal_conv1d_fn(x, w, b, out=out, **kw)
    assert got is out
    _same(got, want)
    _same(kw["conv_states"], want_kw["conv_states"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fwd_alias_of_strided_x(dtype):
    """x with padded rows, overwritten in place; and x with a channel stride (copied first)."""
    for make in (_row_strided, _chan_strided):
        x0, w, b, kw = _fwd_call("batched", dtype, seed=7)
        want_kw = _clone_kw(kw)
        want = cpu_native.causal_conv1d_fn(x0, w, b, **want_kw)
        x = make(x0.shape, dtype)
        x.copy_(x0)
        got = cpu_native.causal_conv1d_fn(x, w, b, out=x, **kw)
        assert got is x
        _same(got, want)
        _same(kw["conv_states"], want_kw["conv_states"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["decode", "spec"])
@pytest.mark.parametrize("where", ["fresh", "strided", "alias", "alias_strided"])
def test_update_out_is_bit_exact(dtype, case, where, threads):
    x, pool, w, b, kw = _update_call(case, dtype, seed=len(case) + len(where))
    want_pool = pool.clone()
    want = cpu_native.causal_conv1d_update(x.clone(), want_pool, w, b, **kw)
    if where == "alias":
        out = x.clone()
        got = cpu_native.causal_conv1d_update(out, pool, w, b, out=out, **kw)
    elif where == "alias_strided":
        out = _row_strided(x.shape, dtype)
        out.copy_(x)
        got = cpu_native.causal_conv1d_update(out, pool, w, b, out=out, **kw)
    else:
        out = torch.empty_like(x) if where == "fresh" else _row_strided(x.shape, dtype)
        got = cpu_native.causal_conv1d_update(x, pool, w, b, out=out, **kw)
    assert got is out
    _same(got, want)
    _same(pool, want_pool)


def test_big_decode_in_place_matches(threads):
    """Enough rows for the parallel path, with a ragged channel tail."""
    g = _gen(3)
    x = torch.randn(64, 4100, generator=g).to(torch.bfloat16)
    pool = torch.randn(64, 3, 4100, generator=g).to(torch.bfloat16)
    w, b = _filter(4100, 4, torch.bfloat16, g)
    want_pool = pool.clone()
    want = cpu_native.causal_conv1d_update(x.clone(), want_pool, w, b, activation="silu")
    got = cpu_native.causal_conv1d_update(x, pool, w, b, activation="silu", out=x)
    assert got is x
    _same(got, want)
    _same(pool, want_pool)


@pytest.mark.parametrize("op", ["fwd", "fwd_tiles", "fwd_rows", "update", "update_tiles", "update_spec",
                                "rms_norm", "add_rms_norm"])
def test_any_team_writes_every_item_once(op):
    """However the items are shared out (more threads than cores included), every output and
    state row is written once, exactly as one thread writes it: bit for bit the same at 1, 2, 3
    and 5 threads. The sizes make the item counts ragged at every team size (the kernels' own
    splitting rules: tiles of at most 2048 channels made equal, time chunks halved to 4 items per
    thread, update rows in up to 4 chunks per thread), with a ragged channel tail too."""
    g = _gen(11)
    d = 1999  # one channel tile
    want = want_state = None
    if op.startswith("fwd"):  # varlen 333 + 301 + 95 rows: with one tile 13 items at 2 and 3 threads, 24 at 5
        # fwd_tiles: D=4160 as three equal tiles (1408, 1408, 1344 channels), not 2048 + 2048 + 64,
        # numbered tile-major (x fits the block path's 8 MiB). fwd_rows: the same tiles past it,
        # numbered chunk-major, each thread keeping every tile's taps; a pad sequence comes first,
        # so a range can start on items that convert no taps.
        d = 4160 if op in ("fwd_tiles", "fwd_rows") else d
        lens = [200, 333, 301, 95, 400] if op == "fwd_rows" else [333, 301, 95]
        slots = [3, 4, 0, 2, 1] if op == "fwd_rows" else [4, 0, 2]
        if op == "fwd_rows":
            slots[0] = -1
        x = torch.randn(sum(lens), d, generator=g).to(torch.bfloat16)
        assert (op == "fwd_rows") == (x.nbytes > 8 << 20)
        w, b = _filter(d, 4, torch.bfloat16, g)
        state = torch.randn(5, 3, d, generator=g).to(torch.bfloat16)
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        initial = torch.tensor([True, False, True, True, False][: len(lens)])

        def call(st, fn=cpu_native.causal_conv1d_fn):
            return fn(x, w, b, activation="silu", conv_states=st, query_start_loc=starts,
                      cache_indices=torch.tensor(slots, dtype=torch.int32), has_initial_state=initial)

        want_state = state.clone()
        want = call(want_state, _reference.causal_conv1d_fn)
    elif op.startswith("update"):
        # 41 rows, a few of them pads (so some items start on a pad: the taps, kept while the
        # tile stays, are converted at the first real row). One tile: 7, 11 and 14 items at 2,
        # 3 and 5 threads; seven tiles (D=13000): 7, 7 and 14, a thread's items changing tile.
        # The speculative case (3 tokens, accepted counts) takes the general path, whose
        # window is refilled per row.
        d = 13000 if op == "update_tiles" else d
        spec = op == "update_spec"
        x = torch.randn(41, 3, d, generator=g).to(torch.bfloat16) if spec else \
            torch.randn(41, d, generator=g).to(torch.bfloat16)
        w, b = _filter(d, 4, torch.bfloat16, g)
        state = torch.randn(45, 5 if spec else 3, d, generator=g).to(torch.bfloat16)
        slots = torch.randperm(45, generator=_gen(5))[:41].int()
        slots[[0, 1, 9, 20, 40]] = -1
        extra = {"num_accepted_tokens": torch.randint(1, 4, (41,), generator=_gen(6)).int()} if spec else {}

        def call(st):
            return cpu_native.causal_conv1d_update(x, st, w, b, activation="silu", conv_state_indices=slots,
                                                   **extra)

        want_state = state.clone()
        want = _reference.causal_conv1d_update(x, want_state, w, b, activation="silu", conv_state_indices=slots,
                                               **extra)
    else:  # 1031 rows (a prime) in grains of 8 (4 with the residual) rows
        x = torch.randn(1031, 2048, generator=g).to(torch.bfloat16)
        w = torch.randn(2048, generator=g).to(torch.bfloat16)
        state = torch.randn(1031, 2048, generator=g).to(torch.bfloat16)  # the residual

        def call(st):
            if op == "rms_norm":
                return cpu_native.gemma_rms_norm(x, w, 1e-6)
            return torch.cat(cpu_native.add_gemma_rms_norm(x, w, st, 1e-6))

    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            st = state.clone()
            results.append((call(st), st))
    finally:
        torch.set_num_threads(before)
    for got, st in results[1:]:
        _same(got, results[0][0])
        _same(st, results[0][1])
    if want is not None:  # and one thread's items are the reference's rows
        atol, rtol = TOLERANCES[torch.bfloat16]
        torch.testing.assert_close(results[0][0], want, atol=atol, rtol=rtol)
        _same(results[0][1], want_state)


def test_partial_overlap_is_refused():
    w = torch.randn(16, 4)
    flat = torch.randn(2 * 9 * 16 + 16)
    x = flat[:-16].view(2, 9, 16)
    with pytest.raises(RuntimeError, match="overlap|single memory location"):
        cpu_native.causal_conv1d_fn(x, w, out=flat[16:].view(2, 9, 16))
    # Strided views, which torch's partial-overlap test does not judge: any shared byte is refused.
    buf = torch.randn(2, 10, 32)
    with pytest.raises(RuntimeError, match="overlap"):
        cpu_native.causal_conv1d_fn(buf[:, :9, :16], w, out=buf[:, 1:, :16])
    apart = torch.empty(2, 9, 32)[:, :, :16]
    torch.testing.assert_close(cpu_native.causal_conv1d_fn(buf[:, :9, :16], w, out=apart),
                               cpu_native.causal_conv1d_fn(buf[:, :9, :16].clone(), w))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_writes_into_out_and_over_its_inputs_bit_for_bit(dtype, threads):
    """The RMSNorm kernels write a given out (no copy) with the same bits as a fresh result, also
    over their inputs: gemma_rms_norm(x, out=x) and sglang's add in place, out=(x, residual).
    Enough rows for the parallel path and a ragged channel tail."""
    g = _gen(4)
    x = torch.randn(3, 40, 1000, generator=g).to(dtype)
    residual = torch.randn(3, 40, 1000, generator=g).to(dtype)
    w = torch.randn(1000, generator=g).to(dtype)
    want = cpu_native.gemma_rms_norm(x, w)
    out = torch.empty_like(x)
    assert cpu_native.gemma_rms_norm(x, w, out=out) is out
    _same(out, want)
    xi = x.clone()
    assert cpu_native.gemma_rms_norm(xi, w, out=xi) is xi
    _same(xi, want)
    want_o, want_s = cpu_native.add_gemma_rms_norm(x, w, residual)
    xi, ri = x.clone(), residual.clone()
    got = cpu_native.add_gemma_rms_norm(xi, w, ri, out=(xi, ri))
    assert got[0] is xi and got[1] is ri
    _same(xi, want_o)
    _same(ri, want_s)


def test_what_the_kernels_write_is_marked_for_autograd():
    """Writes through data pointers bump the version counters, as torch's in-place ops do, so a
    graph that saved a written tensor fails at backward instead of using the new values."""
    a = torch.randn(4, 64, requires_grad=True)
    buf = torch.randn(4, 64)
    (a * buf).sum().backward(retain_graph=False)  # a graph that saves buf works before the write
    h = (a * buf).sum()
    cpu_native.gemma_rms_norm(torch.randn(4, 64), torch.randn(64), out=buf)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.backward()
    x, r, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    before = (x._version, r._version)
    cpu_native.add_gemma_rms_norm(x, w, r, out=(x, r))
    assert x._version > before[0] and r._version > before[1]
    pool, xs, wc = torch.randn(3, 3, 16), torch.randn(2, 16), torch.randn(16, 4)
    before = (pool._version, xs._version)
    cpu_native.causal_conv1d_update(xs, pool, wc, out=xs)
    assert pool._version > before[0] and xs._version > before[1]
    states, xf = torch.zeros(2, 3, 16), torch.randn(2, 5, 16)
    before = states._version
    cpu_native.causal_conv1d_fn(xf, wc, conv_states=states)
    assert states._version > before
    with torch.inference_mode():  # inference tensors have no counter: nothing to bump, no error
        xi = torch.randn(4, 64)
    cpu_native.gemma_rms_norm(xi, torch.randn(64), out=torch.empty(4, 64))


def test_a_one_channel_out_that_torch_calls_contiguous_is_written():
    # [4, 1] with stride (1, 4): contiguous by torch's rule (a size-1 dim's stride is ignored)
    x, r, w = torch.randn(4, 1), torch.randn(4, 1), torch.randn(1)
    out = torch.full((1, 4), 7.0).t()
    assert out.is_contiguous() and out.stride(-1) != 1
    assert cpu_native.gemma_rms_norm(x, w, out=out) is out
    torch.testing.assert_close(out, cpu_native.gemma_rms_norm(x, w))
    o, s = torch.full((1, 4), 7.0).t(), torch.full((1, 4), 7.0).t()
    cpu_native.add_gemma_rms_norm(x, w, r, out=(o, s))
    want = cpu_native.add_gemma_rms_norm(x, w, r)
    torch.testing.assert_close(o, want[0])
    torch.testing.assert_close(s, want[1])


def test_rms_norm_refuses_outputs_that_share_bytes_with_other_operands():
    x, residual, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    with pytest.raises(RuntimeError, match="out must not overlap"):
        cpu_native.add_gemma_rms_norm(x, w, residual, out=(residual, torch.empty(4, 64)))
    with pytest.raises(RuntimeError, match="residual_sum must not overlap"):
        cpu_native.add_gemma_rms_norm(x, w, residual, out=(torch.empty(4, 64), x))
    flat = torch.randn(5 * 64)
    with pytest.raises(RuntimeError, match="out may be the input it replaces but must not partly overlap it"):
        cpu_native.gemma_rms_norm(flat[:256].view(4, 64), w, out=flat[64:].view(4, 64))
    with pytest.raises(ValueError, match=r"out: expected x's shape \[4, 64\], got \[2, 2, 64\]"):
        cpu_native.gemma_rms_norm(x, w, out=torch.empty(2, 2, 64))


def test_isa_path_is_named():
    assert cpu_native.isa_path() in {"avx512-bf16", "avx512", "avx2", "scalar"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset_bytes", [0, 64, 1024, 2048, 3072, 4032])
def test_out_at_any_page_offset(dtype, offset_bytes, threads):
    """The block path picks its channel order and tap placement from (out - x) mod 4 KiB: every
    placement gives the plain call's bits and the reference's values, state write-back included."""
    g = _gen(offset_bytes)
    B, L, D, W = 2, 300, 2048 + 64, 4
    x = torch.randn(B, L, D, generator=g).to(dtype)
    w, b = _filter(D, W, dtype, g)
    states = torch.randn(B, W - 1, D, generator=g).to(dtype)
    init = torch.tensor([True, False])
    st_plain = states.clone()
    ref = cpu_native.causal_conv1d_fn(x, w, b, conv_states=st_plain, has_initial_state=init, activation="silu")
    buf = torch.empty(x.numel() + 4096, dtype=dtype)
    out = buf[offset_bytes // x.element_size():][: x.numel()].view_as(x)
    st_out = states.clone()
    res = cpu_native.causal_conv1d_fn(x, w, b, conv_states=st_out, has_initial_state=init, activation="silu",
                                      out=out)
    assert res.data_ptr() == out.data_ptr()
    _same(out, ref)
    _same(st_out, st_plain)
    # Against a float64 depthwise conv.
    hist = torch.where(init[:, None, None], states, torch.zeros_like(states)).double()
    xp = torch.cat([hist, x.double()], dim=1).transpose(1, 2)
    y = torch.nn.functional.conv1d(xp, w.double().unsqueeze(1), b.double(), groups=D).transpose(1, 2)
    y = torch.nn.functional.silu(y)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), y, rtol=rtol, atol=atol)
    torch.testing.assert_close(st_out, x[:, -(W - 1):])


@pytest.mark.parametrize("x_offset_bytes", [0, 64, 2048, 4032])
def test_fresh_output_sits_half_a_page_from_x(x_offset_bytes):
    """A new output (large enough) starts 2 KiB from x modulo 4 KiB, on a cache line, whatever
    x's page offset: a plain, contiguous tensor with the result of an ``out=`` call."""
    g = _gen(x_offset_bytes)
    B, L, D, W = 1, 64, 1024, 4
    buf = torch.randn(B * L * D + 4096, generator=g)
    x = buf[x_offset_bytes // 4:][: B * L * D].view(B, L, D)
    w, b = _filter(D, W, torch.float32, g)
    got = cpu_native.causal_conv1d_fn(x, w, b, activation="silu")
    assert got.shape == x.shape and got.is_contiguous()
    assert got.data_ptr() % 64 == 0
    assert (got.data_ptr() - (x.data_ptr() & ~63)) % 4096 == 2048
    _same(got, cpu_native.causal_conv1d_fn(x, w, b, activation="silu", out=torch.empty_like(x)))


# Conv outputs far out on both sides of SiLU, where its exponential over- and underflows: |y| from
# 20 to past fp32's range, the boundaries of the kernels' clamps (about -88.7 and 87), +-inf, NaN.
OUTLIERS = (float("-inf"), float("inf"), float("nan"), -3.3e38, 3.3e38, -1e30, 1e30, -1e4, 1e4, -100.0, 100.0,
            -89.5, -88.7, -88.5, -88.4, -88.0, -87.5, -87.0, 87.0, 88.0, -40.0, 40.0, -25.0, 25.0, -20.5, 20.5,
            -0.5, 0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [128, 136], ids=["whole_groups", "ragged"])
def test_silu_outliers_match_the_reference(dtype, dim):
    """SiLU of outlying conv outputs on the prefill paths (window and block, ragged last group)
    and decode: the reference's values within the dtype's tolerance, with NaN, +-inf and -0 where
    it has them (silu(-inf) is NaN, silu(y) for y far below zero -0, never x * e^-87)."""
    vals = torch.tensor(OUTLIERS, dtype=torch.float64)
    L, W = 64, 4
    # Runs of 8 equal rows: most outputs are the outlier itself (w = 1 sums four quarters); the
    # rows where runs meet mix neighbours (inf + -inf, a huge value + a small one).
    idx = (torch.arange(dim)[None, :] + torch.arange(L)[:, None] // 8) % len(OUTLIERS)
    x = (vals[idx] / 4).to(dtype).unsqueeze(0).repeat(2, 1, 1)
    w = torch.ones(dim, W, dtype=dtype)
    b = torch.zeros(dim, dtype=dtype)
    got = cpu_native.causal_conv1d_fn(x, w, b, activation="silu")
    want = _reference.causal_conv1d_fn(x, w, b, activation="silu")
    assert mismatch(got, want, f"fwd {cpu_native.isa_path()}") is None
    state = (vals[idx[:W - 1]] / 4).to(dtype).unsqueeze(0).repeat(L, 1, 1)  # one slot per token
    xd = x[0]
    got = cpu_native.causal_conv1d_update(xd, state.clone(), w, b, activation="silu")
    want = _reference.causal_conv1d_update(xd, state.clone(), w, b, activation="silu")
    assert mismatch(got, want, f"update {cpu_native.isa_path()}") is None


@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16], ids=str)
def test_a_nan_tap_of_any_payload_gives_nan_in_bf16(wdtype):
    """bf16 outputs of fp32 / fp16 taps that are NaN with payload bits in the low half (fp32
    0x7fffffff, fp16 0x7fff): NaN, never -0 or inf from the rounding's carry (the AVX2 store
    rounds without a NaN test and relies on the taps' NaNs being made canonical)."""
    g = _gen(5)
    D, W = 48, 4
    x = torch.randn(1, 40, D, generator=g).to(torch.bfloat16)
    w, b = _filter(D, W, wdtype, g)
    bits = torch.int32 if wdtype == torch.float32 else torch.int16
    nan = torch.tensor([0x7FFFFFFF if wdtype == torch.float32 else 0x7FFF], dtype=bits).view(wdtype)
    w[5, 1], b[20] = nan[0], nan[0]
    for act in (None, "silu"):
        got = cpu_native.causal_conv1d_fn(x, w, b, activation=act)
        assert got[0, :, 5].isnan()[1:-1].all() and got[0, :, 20].isnan().all()
        assert mismatch(got, _reference.causal_conv1d_fn(x, w, b, activation=act), "bf16 out") is None
