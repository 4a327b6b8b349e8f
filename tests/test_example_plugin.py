"""The plugin package the README shows is real: it loads through its entry point and passes the
conformance checks on every case it claims."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import kernel_variants as kv
from kernel_variants.dispatch import dispatcher
from kernel_variants.dispatch._verify import verify

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "kv-my-conv"
tomllib = pytest.importorskip("tomllib")


def test_readme_shows_the_example_files_verbatim():
    readme = (ROOT / "README.md").read_text()
    blocks = dict((first.strip("# ").strip(), body) for first, body in
                  re.findall(r"```(?:toml|python)\n(# [^\n]+)\n(.*?)```", readme, re.S))
    assert blocks["kv_my_conv.py"] == (EXAMPLE / "kv_my_conv.py").read_text()
    assert (EXAMPLE / "pyproject.toml").read_text().startswith(blocks["pyproject.toml"])


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
    rv = dispatcher().registry.get("causal_conv1d_fn", "my_conv")
    assert rv.plugin == "my_conv"
    from test_conformance import _claimed_cases

    cases = list(_claimed_cases(rv, "cpu"))
    assert cases, "the example claims no case of the conformance suite"
    failures = [f"{label}: {why}" for label, case in cases if (why := verify(rv.variant.fn, case))]
    assert not failures, "\n".join(failures)
