"""Plugins: entry points, duplicates, blocking, misspelled hooks, bad registrations."""

from __future__ import annotations

import importlib.metadata
import textwrap

import pluggy
import pytest
from helpers.variants import variant

import kernel_variants
from kernel_variants._registry.registry import (
    DuplicateVariantError,
    PluginWarning,
    Registry,
    make_plugin_manager,
)
from kernel_variants.ops.causal_conv1d import ConvCapabilities
from kernel_variants.ops.causal_conv1d import _reference as reference
from kernel_variants.plugin import Variant, hookimpl

CAPS = ConvCapabilities(devices={"cpu"}, dtypes={"float32"})


class _Plugin:
    def __init__(self, *variants: Variant) -> None:
        self._variants = variants

    @hookimpl
    def kv_register_variants(self, register):
        for v in self._variants:
            register(v)


def _registry(*plugins: tuple[str, object], strict: bool = True, **kw) -> Registry:
    """Strict by default, so that a test sees the error a broken plugin raises (KV_STRICT_PLUGINS=1)."""
    return Registry(make_plugin_manager(extra_plugins=plugins, entry_points=False, strict=strict, **kw),
                    strict=strict)


def test_builtins_register_through_the_hook():
    reg = _registry()
    assert {(rv.op, rv.id) for rv in reg.variants()} >= {
        ("causal_conv1d_fn", "reference"), ("causal_conv1d_update", "reference"),
    }
    assert reg.get("causal_conv1d_fn", "reference").plugin == "causal_conv1d"  # the op brings its reference
    assert [spec.name for spec in reg.ops()][:2] == ["causal_conv1d_fn", "causal_conv1d_update"]


class _FakeDist:
    """What pluggy reads from an installed distribution, without installing anything."""

    def __init__(self, name: str, eps: list[importlib.metadata.EntryPoint]) -> None:
        self.entry_points = eps
        self.metadata = {"name": name}
        self.version = "0.0.1"

    @property
    def name(self) -> str:
        return self.metadata["name"]


def test_entry_point_plugin_is_loaded_and_its_variant_dispatched(tmp_path, monkeypatch):
    (tmp_path / "kv_demo_plugin.py").write_text(textwrap.dedent("""
        from kernel_variants.ops.causal_conv1d import ConvCapabilities
        from kernel_variants.plugin import Variant, hookimpl
        from kernel_variants.ops.causal_conv1d import _reference as reference

        def copied(x, weight, bias=None, **kw):
            return reference.causal_conv1d_fn(x.clone(), weight, bias, **kw)

        @hookimpl
        def kv_register_variants(register):
            register(Variant(id="copied", op="causal_conv1d_fn", version="1", priority=50,
                             capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"}),
                             fn=copied))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = importlib.metadata.EntryPoint("demo", "kv_demo_plugin", "kernel_variants")
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [_FakeDist("kv-demo", [ep])])
    kernel_variants.reload()
    rv = next(rv for rv in kernel_variants.variants("causal_conv1d_fn") if rv.id == "copied")
    assert rv.plugin == "demo"
    import torch

    x, w = torch.ones(1, 2, 1), torch.ones(1, 2)
    assert kernel_variants.causal_conv1d_fn(x, w).flatten().tolist() == [1.0, 2.0]
    # It qualified on this device (in a child process: it does not say it is pure), then ran.
    assert kernel_variants.explain("causal_conv1d_fn", x, w).chosen.id == "copied"
    assert [v.where for v in kernel_variants.verdicts() if v.variant == "copied"] == ["child"]


def test_duplicate_id_names_both_plugins():
    with pytest.raises(DuplicateVariantError, match="'first'.*'second'"):
        _registry(("first", _Plugin(variant("mine"))), ("second", _Plugin(variant("mine"))))


def test_same_id_for_two_ops_is_fine():
    reg = _registry(("p", _Plugin(variant("mine"), variant("mine", "causal_conv1d_update"))))
    assert reg.get("causal_conv1d_update", "mine").id == "mine"


def test_duplicate_of_a_builtin_names_the_builtin():
    with pytest.raises(DuplicateVariantError, match="'reference'.*'intruder'"):
        _registry(("intruder", _Plugin(variant("reference"))))


def test_blocked_plugins_are_not_loaded(monkeypatch):
    monkeypatch.setenv("KV_DISABLE_PLUGINS", "torch_shift, other")
    kernel_variants.reload()
    ids = {rv.id for rv in kernel_variants.variants()}
    assert "torch_shift" not in ids and "reference" in ids


def test_misspelled_hook_is_an_error():
    class Typo:
        @hookimpl
        def kv_register_variant(self, register):  # missing the final "s"
            pass

    with pytest.raises(pluggy.PluginValidationError, match="kv_register_variant"):
        _registry(("typo", Typo()))


def test_register_refuses_anything_but_a_variant():
    class Bad:
        @hookimpl
        def kv_register_variants(self, register):
            register({"id": "x"})

    with pytest.raises(TypeError, match="plugin 'bad'.*expects a kernel_variants.Variant, got dict"):
        _registry(("bad", Bad()))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("id", "Not Stable", "variant id must be"),
        ("op", "Conv 2D", "op must be"),
        ("bogus", 1, "Extra inputs are not permitted"),
    ],
)
def test_variant_model_is_strict(field, value, match):
    kw = dict(id="ok", op="causal_conv1d_fn", version="1", capabilities=CAPS, fn=reference.causal_conv1d_fn)
    kw[field] = value
    with pytest.raises(ValueError, match=match):
        Variant(**kw)


def test_capabilities_are_frozen_and_checked():
    with pytest.raises(ValueError, match="range"):
        ConvCapabilities(devices={"cpu"}, dtypes={"float32"}, width=(4, 2))
    with pytest.raises(ValueError):
        ConvCapabilities(devices={"tpu"}, dtypes={"float32"})
    with pytest.raises(ValueError, match="frozen"):
        CAPS.varlen = True


def test_version_carries_a_source_hash():
    reg = _registry()
    version = reg.get("causal_conv1d_fn", "reference").version
    assert version.startswith("1+") and len(version) == len("1+") + 10


def test_a_crashing_probe_makes_the_variant_unavailable_with_the_reason():
    def probe():
        raise OSError("driver missing")

    reg = _registry(("p", _Plugin(variant("flaky", probe=probe))))
    assert reg.get("causal_conv1d_fn", "flaky").unavailable_reason() == "availability probe raised OSError: driver missing"


def test_a_declared_source_that_cannot_be_read_is_an_error():
    with pytest.raises(ValueError, match="declares source 'missing.cpp', which cannot be read"):
        _registry(("p", _Plugin(variant("with_src", sources=("missing.cpp",)))))


def test_a_broken_plugin_is_left_out_with_one_warning_and_the_rest_works():
    """One bad declaration costs its whole plugin (nothing of it, not half), never the library."""
    class Typo:
        @hookimpl
        def kv_register_variant(self, register):
            pass

    good = _Plugin(variant("good"))
    half = _Plugin(variant("half_ok"), variant("with_src", sources=("missing.cpp",)))
    with pytest.warns(PluginWarning) as caught:
        reg = _registry(("typo", Typo()), ("half", half), ("good", good), ("dup", _Plugin(variant("good"))),
                        strict=False)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "'typo'" in text and "'half'" in text and "'dup'" in text and "missing.cpp" in text
    assert set(reg.broken) == {"typo", "half", "dup"}
    assert "kv_register_variant" in reg.broken["typo"]
    ids = {rv.id for rv in reg.variants("causal_conv1d_fn")}
    assert "good" in ids and "reference" in ids
    assert "half_ok" not in ids, "a broken plugin contributes nothing, not half of its variants"


def test_an_entry_point_that_fails_to_import_leaves_the_others(monkeypatch, tmp_path):
    (tmp_path / "kv_fine_plugin.py").write_text(textwrap.dedent("""
        from kernel_variants.ops.causal_conv1d import ConvCapabilities
        from kernel_variants.plugin import Variant, hookimpl
        from kernel_variants.ops.causal_conv1d import _reference as reference

        @hookimpl
        def kv_register_variants(register):
            register(Variant(id="fine", op="causal_conv1d_fn", version="1", fn=reference.causal_conv1d_fn,
                             capabilities=ConvCapabilities(devices={"cpu"}, dtypes={"float32"})))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [importlib.metadata.EntryPoint("gone", "kv_no_such_module", "kernel_variants"),
           importlib.metadata.EntryPoint("fine", "kv_fine_plugin", "kernel_variants")]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [_FakeDist("kv-mixed", eps)])
    with pytest.warns(PluginWarning, match="'gone'.*ModuleNotFoundError"):
        kernel_variants.reload()
        ids = {rv.id for rv in kernel_variants.variants("causal_conv1d_fn")}
    assert "fine" in ids and "reference" in ids
    monkeypatch.setenv("KV_STRICT_PLUGINS", "1")
    kernel_variants.reload()
    with pytest.raises(ModuleNotFoundError, match="kv_no_such_module"):
        kernel_variants.variants()


def test_a_variant_for_an_unregistered_op_or_with_another_ops_capabilities_is_refused():
    from kernel_variants.plugin import Capabilities

    with pytest.raises(ValueError, match="op 'conv2d', which is not registered"):
        _registry(("p", _Plugin(variant("mine", "conv2d", fn=reference.causal_conv1d_update))))
    plain = Variant(id="plain", op="causal_conv1d_fn", version="1", fn=reference.causal_conv1d_fn,
                    capabilities=Capabilities(devices={"cpu"}, dtypes={"float32"}))
    with pytest.raises(TypeError, match="capabilities must be a kernel_variants.ops.causal_conv1d.ConvCapabilities"):
        _registry(("p", _Plugin(plain)))


def test_the_builtin_ops_and_their_references_cannot_be_blocked(monkeypatch):
    monkeypatch.setenv("KV_DISABLE_PLUGINS", "causal_conv1d,torch_shift")
    kernel_variants.reload()
    ids = {(rv.op, rv.id) for rv in kernel_variants.variants()}
    assert ("causal_conv1d_fn", "reference") in ids and ("causal_conv1d_update", "reference") in ids
    assert not any(vid == "torch_shift" for _, vid in ids)


def test_multiple_of_limits_a_size_and_cases_fit_it():
    """Vendor kernels take D only in whole blocks: a call off the step is not covered, and
    ``fit`` moves a case's shape to the nearest size the variant takes."""
    import torch

    caps = ConvCapabilities(devices={"cpu"}, dtypes={"bfloat16"}, limits={"D": (32, 4096)},
                            multiple_of={"D": 32})
    spec = kernel_variants._runtime.dispatcher.dispatcher().registry.spec("causal_conv1d_fn")
    key = spec.key_of_case(spec.make_case((2, 48, 5), dtype=torch.bfloat16))
    assert caps.uncovered(key) == "D=48 not a multiple of 32"
    assert caps.fit(spec.axes, (2, 48, 5)) == (2, 64, 5)
    assert caps.fit(spec.axes, (2, 5000, 5)) == (2, 4096, 5)
    assert caps.fit(spec.axes, (0, 7, 5)) == (0, 32, 5)
    assert "D%32" in caps.summary()
    with pytest.raises(ValueError, match="positive int"):
        ConvCapabilities(devices={"cpu"}, dtypes={"bfloat16"}, multiple_of={"D": 0})
