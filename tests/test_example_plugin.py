"""The plugin package the README and docs/plugins.md show is real: it loads through its entry
points, bringing a variant of an existing op and a whole new op with its variant, and both pass
the conformance checks on every case they claim."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
from helpers.calibration import QUICK

import kernel_variants as kv
from kernel_variants._runtime.dispatcher import dispatcher

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "kv-my-conv"
tomllib = pytest.importorskip("tomllib")


def _file_blocks(page: Path) -> dict[str, str]:
    """The page's code blocks that open with a file name comment (``# kv_my_conv.py``), by name."""
    return dict((first.strip("# ").strip(), body) for first, body in
                re.findall(r"```(?:toml|python)\n(# [^\n]+)\n(.*?)```", page.read_text(), re.S))


def _assert_example_files(blocks: dict[str, str]) -> None:
    for name, body in blocks.items():
        if name == "pyproject.toml":
            assert (EXAMPLE / name).read_text().startswith(body)
        else:
            assert body == (EXAMPLE / name).read_text(), name


def test_docs_show_the_example_files_verbatim():
    blocks = _file_blocks(ROOT / "docs" / "plugins.md")
    assert set(blocks) == {"pyproject.toml", "kv_my_conv.py", "kv_silu_and_mul.py"}
    _assert_example_files(blocks)


def test_readme_shows_the_short_plugin_verbatim():
    blocks = _file_blocks(ROOT / "README.md")
    assert {"pyproject.toml", "kv_my_conv.py"} <= set(blocks)
    _assert_example_files(blocks)


def test_example_plugin_loads_through_its_entry_point_and_conforms(monkeypatch):
    meta = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    eps = [importlib.metadata.EntryPoint(name, value, "kernel_variants")
           for name, value in meta["project"]["entry-points"]["kernel_variants"].items()]

    class Dist:
        entry_points = eps
        metadata = {"name": meta["project"]["name"]}
        version = meta["project"]["version"]

    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [Dist()])
    kv.reload()
    registry = dispatcher().registry
    assert registry.get("causal_conv1d_fn", "my_conv").plugin == "my_conv"
    assert registry.op_plugin("silu_and_mul") == "silu_and_mul"
    assert {rv.id for rv in registry.variants("silu_and_mul")} == {"reference", "fused"}
    from helpers.conformance import assert_conforms

    assert_conforms(registry.get("causal_conv1d_fn", "my_conv"), "cpu")
    assert_conforms(registry.get("silu_and_mul", "fused"), "cpu")

    # The new op dispatches, explains and calibrates like a built-in one.
    import kv_silu_and_mul
    import torch

    x = torch.randn(3, 16)
    expected = torch.nn.functional.silu(x[:, :8]) * x[:, 8:]
    torch.testing.assert_close(kv_silu_and_mul.silu_and_mul(x), expected)
    assert kv.explain("silu_and_mul", x).chosen.id == "fused"
    # It qualified first, from the new op's own conformance list, as a built-in op's variants do.
    (verdict,) = [v for v in kv.verdicts() if v.group.op == "silu_and_mul"]
    assert verdict.variant == "fused" and verdict.passed and verdict.cases > 0
    result = kv.calibrate("silu_and_mul", [(4, 64)], **QUICK)
    assert {m.variant for m in result.measurements} == {"reference", "fused"}
    assert kv.table("silu_and_mul")[0].shape == (4, 64)
