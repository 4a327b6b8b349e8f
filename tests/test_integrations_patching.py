"""``patch()``: which engine bindings it replaces and how it undoes them, what it leaves alone,
the vLLM general plugin, and that the drop-ins never import an engine.

How the inputs are built and checked: ``tests/helpers/engines.py``.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers.engines import (
    N_SLOTS,
    D,
    W,
    _cpu_standins,
    _ints,
    _module,
    _oracle,
    _vllm_utils,
)

import kernel_variants
from kernel_variants.integrations import _common
from kernel_variants.integrations import sglang as kv_sglang
from kernel_variants.integrations import vllm as kv_vllm

pytestmark = pytest.mark.usefixtures("reference_variant")


def test_vllm_patch_replaces_every_binding_and_undoes(monkeypatch, reference_only):
    def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None,
                         has_initial_state=None, activation="silu", pad_slot_id=-1,
                         null_block_id=0):
        raise AssertionError("the engine's kernel ran")

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None,
                             conv_state_indices=None, num_accepted_tokens=None,
                             query_start_loc=None, max_query_len=-1, null_block_id=0):
        raise AssertionError("the engine's kernel ran")

    _vllm_utils(monkeypatch)
    ops = _module(monkeypatch, kv_vllm.MODULE, causal_conv1d_fn=causal_conv1d_fn,
                  causal_conv1d_update=causal_conv1d_update, PAD_SLOT_ID=-1)
    mixer = _module(monkeypatch, "vllm.model_executor.layers.mamba.mamba_mixer2",
                    causal_conv1d_fn=causal_conv1d_fn, causal_conv1d_update=causal_conv1d_update)
    plugin = _module(monkeypatch, "some_vllm_plugin.gdn", conv_update=causal_conv1d_update,
                     unrelated=print)

    handle = kv_vllm.patch(also=["some_vllm_plugin"])
    assert handle.convention.null_block
    assert ops.causal_conv1d_fn is kv_vllm.causal_conv1d_fn
    assert mixer.causal_conv1d_update is kv_vllm.causal_conv1d_update
    assert plugin.conv_update is kv_vllm.causal_conv1d_update and plugin.unrelated is print
    assert f"{kv_vllm.MODULE}.causal_conv1d_fn" in handle.replaced
    assert "some_vllm_plugin.gdn.conv_update" in handle.replaced
    with pytest.raises(RuntimeError, match="already patched"):
        kv_vllm.patch()

    # the patched binding runs kernel_variants, with vLLM's layouts
    cache = torch.zeros(N_SLOTS, W - 1, D)
    out = mixer.causal_conv1d_update(torch.randn(2, D), cache.transpose(-1, -2), torch.randn(D, W),
                                     conv_state_indices=_ints([0, 3]))
    assert out[0].abs().sum() == 0 and cache[3].abs().sum() > 0  # slot 0: the null block

    handle.undo()
    assert ops.causal_conv1d_fn is causal_conv1d_fn
    assert mixer.causal_conv1d_update is causal_conv1d_update
    assert plugin.conv_update is causal_conv1d_update
    handle.undo()  # harmless twice
    with kv_vllm.patch() as again:
        assert again.active and mixer.causal_conv1d_fn is kv_vllm.causal_conv1d_fn
    assert mixer.causal_conv1d_fn is causal_conv1d_fn and not again.active


def test_vllm_patch_picks_the_legacy_rule_for_an_old_vllm(monkeypatch, reference_only):
    def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None,
                         has_initial_state=None, activation="silu", pad_slot_id=-1):
        raise AssertionError("the engine's kernel ran")

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None,
                             conv_state_indices=None, num_accepted_tokens=None,
                             query_start_loc=None, max_query_len=-1, pad_slot_id=-1):
        raise AssertionError("the engine's kernel ran")

    _vllm_utils(monkeypatch, null_block=False)
    _module(monkeypatch, kv_vllm.MODULE, causal_conv1d_fn=causal_conv1d_fn,
            causal_conv1d_update=causal_conv1d_update)
    user = _module(monkeypatch, "vllm.model_executor.layers.mamba.mamba_mixer2",
                   update=causal_conv1d_update)
    with kv_vllm.patch() as handle:
        assert not handle.convention.null_block and "no NULL_BLOCK_ID" in str(handle.convention)
        assert user.update is kv_vllm.causal_conv1d_update_legacy
        cache = torch.zeros(N_SLOTS, W - 1, D)
        user.update(torch.randn(2, D), cache.transpose(-1, -2), torch.randn(D, W),
                    conv_state_indices=_ints([0, -1]))
        assert cache[0].abs().sum() > 0  # before the null block, slot 0 is a slot


def test_patch_without_the_engine_raises(monkeypatch):
    engine_modules = (kv_vllm.MODULE, kv_sglang.TRITON_MODULE, kv_sglang.CUDA_MODULE,
                      kv_sglang.NPU_MODULE)
    for name in engine_modules:
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(RuntimeError, match="import vllm"):
        kv_vllm.patch()
    with pytest.raises(RuntimeError, match="import sglang"):
        kv_sglang.patch()


def test_sglang_patch_leaves_sgl_kernel_npu_alone(monkeypatch, reference_only):
    def causal_conv1d_fn_npu(*args, **kwargs):
        raise AssertionError("the engine's kernel ran")

    def causal_conv1d_update_v2(*args, **kwargs):
        raise AssertionError("the engine's kernel ran")

    def causal_conv1d_fn(*args, **kwargs):
        raise AssertionError("the engine's kernel ran")

    npu = _module(monkeypatch, kv_sglang.NPU_MODULE, causal_conv1d_fn_npu=causal_conv1d_fn_npu,
                  causal_conv1d_update_v2=causal_conv1d_update_v2)
    triton_mod = _module(monkeypatch, kv_sglang.TRITON_MODULE, causal_conv1d_fn=causal_conv1d_fn)
    backend = _module(monkeypatch, "sglang.srt.hardware_backend.npu.attention.ascend_gdn_backend",
                      causal_conv1d_fn=causal_conv1d_fn_npu,  # the backend's alias
                      causal_conv1d_update_v2=causal_conv1d_update_v2)
    gdn = _module(monkeypatch, "sglang.srt.layers.attention.linear.gdn_backend",
                  causal_conv1d_fn=causal_conv1d_fn)
    handle = kv_sglang.patch()
    try:
        assert backend.causal_conv1d_fn is kv_sglang.causal_conv1d_fn_npu
        assert backend.causal_conv1d_update_v2 is kv_sglang.causal_conv1d_update_v2
        assert gdn.causal_conv1d_fn is kv_sglang.causal_conv1d_fn
        assert triton_mod.causal_conv1d_fn is kv_sglang.causal_conv1d_fn
        assert npu.causal_conv1d_fn_npu is causal_conv1d_fn_npu  # kernel_variants calls these
        assert npu.causal_conv1d_update_v2 is causal_conv1d_update_v2
    finally:
        handle.undo()
    assert backend.causal_conv1d_fn is causal_conv1d_fn_npu
    assert gdn.causal_conv1d_fn is causal_conv1d_fn


def test_integrations_never_import_an_engine():
    engines = {"vllm", "sglang", "sgl_kernel_npu", "sgl_kernel", "torch_npu"}
    folder = Path(kv_vllm.__file__).parent
    sources = sorted(folder.glob("*.py"))
    assert len(sources) >= 2, sources  # at least the vLLM and the sglang drop-ins
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not {n.split(".")[0] for n in names} & engines, f"{path.name} imports {names}"


def test_vllm_convention_is_read_from_declarations(monkeypatch):
    _vllm_utils(monkeypatch)
    monkeypatch.setattr(kv_vllm, "_vllm_version", lambda: "0.32.0")
    rule = kv_vllm.convention()
    assert rule.null_block and "vLLM 0.32.0" in str(rule) and "NULL_BLOCK_ID = 0" in str(rule)
    monkeypatch.delitem(sys.modules, kv_vllm.UTILS_MODULE)
    assert not kv_vllm.convention().null_block  # a conv module that never loaded it predates it
    _module(monkeypatch, kv_vllm.UTILS_MODULE, PAD_SLOT_ID=-1, NULL_BLOCK_ID=7)
    with pytest.raises(RuntimeError, match="NULL_BLOCK_ID = 7"):
        kv_vllm.convention()


def test_patch_leaves_main_and_user_modules_alone(monkeypatch, reference_only):
    _vllm_utils(monkeypatch)
    fn_cpu, update_cpu = _cpu_standins(monkeypatch)
    _module(monkeypatch, kv_vllm.MODULE, causal_conv1d_fn=fn_cpu, causal_conv1d_update=update_cpu)
    main = _module(monkeypatch, "__main__", causal_conv1d_update=update_cpu, mine=fn_cpu)
    app = _module(monkeypatch, "my_app.model", conv=fn_cpu)
    lookalike = _module(monkeypatch, "vllm_lookalike", conv=fn_cpu)  # a prefix, not a package
    with kv_vllm.patch() as handle:
        assert main.causal_conv1d_update is update_cpu and main.mine is fn_cpu
        assert app.conv is fn_cpu and lookalike.conv is fn_cpu
        assert not [name for name in handle.replaced if not name.startswith("vllm.")]
    with kv_vllm.patch(also=("my_app",)) as handle:
        assert app.conv is kv_vllm.causal_conv1d_fn_cpu and main.mine is fn_cpu
        assert "my_app.model.conv" in handle.replaced
    assert app.conv is fn_cpu
    with pytest.raises(TypeError, match="also: expected a tuple or list of module names, got str"):
        kv_vllm.patch(also="my_app")
    with pytest.raises(ValueError, match="also: expected module names"):
        kv_vllm.patch(also=[""])
    with pytest.raises(TypeError, match="build: expected True or False"):
        kv_vllm.patch(build="yes")


def test_patch_undo_restores_exactly_what_it_changed(monkeypatch, reference_only):
    _vllm_utils(monkeypatch)
    fn_cpu, update_cpu = _cpu_standins(monkeypatch)
    ops = _module(monkeypatch, kv_vllm.MODULE, causal_conv1d_fn=fn_cpu,
                  causal_conv1d_update=update_cpu)
    before = {name: dict(vars(m)) for name, m in sys.modules.items()
              if isinstance(m, types.ModuleType) and name.startswith("vllm")}
    handle = kv_vllm.patch()

    def theirs(*args, **kwargs):
        raise AssertionError("not called")

    ops.causal_conv1d_update = theirs  # someone patches after us: undo leaves theirs standing
    handle.undo()
    assert ops.causal_conv1d_update is theirs
    ops.causal_conv1d_update = update_cpu
    after = {name: dict(vars(sys.modules[name])) for name in before}
    assert after == before


def _needs_build_variant(log: list[str]):
    from kernel_variants.ops.causal_conv1d import ConvCapabilities
    from kernel_variants.plugin import Variant

    return Variant(
        id="needs_build", op="causal_conv1d_update", version="1", priority=50,
        fn=_oracle().causal_conv1d_update,
        capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, num_accepted_tokens=True,
                                      noncontiguous_states=True),
        build=lambda: log.append("build") or "here", is_built=lambda: "build" in log,
    )


def test_patch_never_builds_inside_the_engine(monkeypatch, reference_only, with_variants, capsys):
    _vllm_utils(monkeypatch)
    _cpu_standins(monkeypatch)
    log: list[str] = []
    with_variants(_needs_build_variant(log))
    rv = kernel_variants._runtime.dispatcher.dispatcher().registry.get("causal_conv1d_update", "needs_build")
    cache = torch.zeros(N_SLOTS, W - 1, D)
    with pytest.warns(_common.IntegrationWarning, match=r"needs_build.*`kv build`") as caught:
        handle = kv_vllm.patch()
    assert len(caught) == 1 and handle.left_out == ("causal_conv1d_update:needs_build",)
    update = sys.modules[kv_vllm.CPU_MODULE].causal_conv1d_update_cpu
    with kernel_variants.force(causal_conv1d_update="needs_build"), \
            pytest.raises(kernel_variants.NoVariantError, match="kv build"):
        update(torch.randn(2, D), cache.transpose(-1, -2), torch.randn(D, W),
               conv_state_indices=_ints([1, 2]))
    update(torch.randn(2, D), cache.transpose(-1, -2), torch.randn(D, W),
           conv_state_indices=_ints([1, 2]))  # the reference serves it
    assert log == []
    handle.undo()
    assert rv.unavailable_reason() is None and rv.needs_build()

    handle = kv_vllm.patch(build=True)
    assert log == ["build"] and handle.left_out == ()
    assert "building needs_build (causal_conv1d_update)" in capsys.readouterr().err
    with kernel_variants.force(causal_conv1d_update="needs_build"):
        update(torch.randn(2, D), cache.transpose(-1, -2), torch.randn(D, W),
               conv_state_indices=_ints([1, 2]))
    handle.undo()
    assert log == ["build"]


def test_vllm_general_plugin_is_opt_in(monkeypatch, reference_only, capsys):
    _vllm_utils(monkeypatch)
    fn_cpu, _ = _cpu_standins(monkeypatch)
    ops = _module(monkeypatch, kv_vllm.MODULE, causal_conv1d_fn=fn_cpu)
    monkeypatch.setattr(kv_vllm, "_plugin_patch", None)
    monkeypatch.delenv(kv_vllm.PLUGIN_ENV, raising=False)
    assert kv_vllm.plugin() is None and ops.causal_conv1d_fn is fn_cpu
    monkeypatch.setenv(kv_vllm.PLUGIN_ENV, "1")
    handle = kv_vllm.plugin()
    try:
        assert ops.causal_conv1d_fn is kv_vllm.causal_conv1d_fn_cpu
        assert kv_vllm.plugin() is handle  # vLLM may load its plugins more than once per process
        assert "kernel_variants: patched vLLM's conv functions" in capsys.readouterr().err
    finally:
        handle.undo()
    monkeypatch.setenv(kv_vllm.PLUGIN_ENV, "maybe")
    with pytest.raises(ValueError, match="KV_VLLM_PATCH: expected 1 .* got 'maybe'"):
        kv_vllm.plugin()


def test_vllm_plugin_entry_point_is_declared():
    """vLLM finds its general plugins through this entry point group (vllm/plugins/__init__.py)."""
    import importlib.metadata

    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert [ep.value for ep in eps if ep.name == "kernel_variants"] == [
        "kernel_variants.integrations.vllm:plugin"]
    assert next(ep for ep in eps if ep.name == "kernel_variants").load() is kv_vllm.plugin
