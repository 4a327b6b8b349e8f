"""The package's shape: layers import downwards only, modules stay small, the CLI stands on the
public API. Read from the source with ``ast`` (nothing is imported), so a circle is caught even
where a lazy import inside a function would hide it at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "kernel_variants"
MAX_LINES = 400
# What a module outside the package's own private parts may import: the callers' and the
# authors' namespaces (and the engines' adapters).
PUBLIC = ("kernel_variants", "kernel_variants.plugin", "kernel_variants.types", "kernel_variants.integrations")


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name | ast.Attribute) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def _imports(path: Path) -> set[str]:
    """Every kernel_variants module ``path`` imports at run time, at any depth (function-level
    imports included; ``if TYPE_CHECKING:`` blocks left out: they never run)."""
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*up, base] if base else up)
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    found.add(sub if sub in MODULES else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in MODULES and m != me}


GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm). Importing a
    module runs its package's ``__init__`` first, which is not an edge of its own here: the top
    package's lazy names would otherwise tie everything to everything."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def edges(m: str) -> set[str]:
        return {d for d in GRAPH[m] if d != "kernel_variants"}

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges(v):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in GRAPH:
        if m not in index:
            strong(m)
    return out


def test_the_layout_is_read():
    assert len(MODULES) > 50
    assert GRAPH["kernel_variants._runtime.dispatcher"], "the dispatcher imports something of the package"


def test_no_import_circle():
    assert _cycles() == []


def test_private_packages_import_downwards():
    """registry <- policy <- table <- tuning <- runtime <- api: a lower layer never imports a higher one."""
    layers = ["kernel_variants._registry", "kernel_variants._policy", "kernel_variants._table",
              "kernel_variants._tuning", "kernel_variants._runtime", "kernel_variants._api"]

    def layer(m: str) -> int | None:
        return next((i for i, p in enumerate(layers) if m == p or m.startswith(p + ".")), None)

    wrong = [(m, d) for m, deps in GRAPH.items() if layer(m) is not None
             for d in deps if layer(d) is not None and layer(d) > layer(m)]
    assert wrong == []


def test_native_builds_stand_below_everything():
    """``_native`` builds and loads the C++ extensions of the runtime and of the kernels: it imports
    nothing else of the package, and the runtime none of the kernels (whose package init imports
    the plugin API, which imports the runtime: a circle at run time)."""
    native = {m: sorted(d for d in GRAPH[m] if not d.startswith("kernel_variants._native"))
              for m in MODULES if m.startswith("kernel_variants._native")}
    assert native and {m: d for m, d in native.items() if d} == {}
    runtime = {m: sorted(d for d in GRAPH[m] if d.startswith("kernel_variants.kernels"))
               for m in MODULES if m.startswith("kernel_variants._runtime")}
    assert {m: d for m, d in runtime.items() if d} == {}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module}: {lines} lines; split it along a seam"


def test_cli_uses_only_the_public_api():
    cli = [m for m in MODULES if m.startswith("kernel_variants._cli")]
    assert cli
    private = {m: sorted(d for d in GRAPH[m] if not d.startswith("kernel_variants._cli")
                         and not d.startswith(PUBLIC[3]) and d not in PUBLIC[:3])
               for m in cli}
    assert {m: d for m, d in private.items() if d} == {}


@pytest.mark.parametrize(("old", "new"), [("kernel_variants.dispatch", "kernel_variants (explain, force"),
                                          ("kernel_variants.registry", "kernel_variants.plugin")])
def test_an_old_package_fails_naming_its_replacement(old, new):
    import importlib
    import re
    import sys

    sys.modules.pop(old, None)
    with pytest.raises(ImportError, match=rf"{re.escape(old)} is gone: .*{re.escape(new)}.*docs/changes.md"):
        importlib.import_module(old)


def test_an_old_name_fails_naming_its_replacement():
    import kernel_variants as kv

    with pytest.raises(AttributeError, match=r"kernel_variants.Variant is gone: use kernel_variants.plugin.Variant"):
        kv.Variant  # noqa: B018
    with pytest.raises(AttributeError, match=r"use kernel_variants.types.Decision"):
        kv.Decision  # noqa: B018
    with pytest.raises(AttributeError, match=r"use kernel_variants.calibrate\(..., distributed=True\)"):
        kv.calibrate_distributed  # noqa: B018
    with pytest.raises(TypeError, match=r"warmup, iters moved into timing=kernel_variants.TimingConfig"):
        kv.calibrate("causal_conv1d_fn", [(1, 16, 8)], warmup=1, iters=2)
