"""The package's shape: layers import downwards only, modules stay small, the CLI stands on the
public API. Read from the source with ``ast`` (nothing is imported), so a circle is caught even
where a lazy import inside a function would hide it at run time.

The import graph is what running the code imports, not only the ``import`` statements:

- importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first: an edge to each package
  above what is imported, except the importer's own packages (they ran before it);
- the top package ``kernel_variants/__init__`` imports only ``_version`` when it runs, and hands
  the built-in plugins it declares (``_builtins``) to the registry (``_registry.declared``); its
  other names are made on first use (``__getattr__`` over ``_LAZY``, and its functions' own imports):
  a module that uses such a name (``from kernel_variants import force``, ``kv.force``) has an
  edge to the module the name comes from, read from the ``__init__``'s source;
- modules loaded by a name in a string (the CLI's commands, the Triton device rule loaded from
  its file) are edges of the module that names them (``STRING_IMPORTS``): where they are loaded,
  or, for a loader that loads what it is given (``LOADS_GIVEN``: the plugin manager, the built-in
  plugins), where the names are declared; every other run-time import names something outside
  the package (``LOADS_OUTSIDE``), which ``test_every_run_time_import_is_declared`` holds to.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "kernel_variants"
TOP = "kernel_variants"
MAX_LINES = 400
# What a module outside the package's own private parts may import: the callers' and the
# authors' namespaces (and the engines' adapters).
PUBLIC = ("kernel_variants", "kernel_variants.plugin", "kernel_variants.types", "kernel_variants.integrations")

# Every part of the package, lowest first: a module imports its own tier and those below, never
# one above; the parts of one tier import each other without a circle. A module's part is the
# longest entry naming it or a package above it.
LAYERS: tuple[tuple[str, ...], ...] = (
    # Leaves: import nothing of the package.
    ("kernel_variants._version", "kernel_variants._dtypes", "kernel_variants._tolerances",
     "kernel_variants._codegen", "kernel_variants._capture"),
    ("kernel_variants._validate",),  # dtype names
    # The C++ extensions built and loaded, for the runtime's call core and the kernels alike.
    ("kernel_variants._native",),
    ("kernel_variants._paths",),  # where the cache and the builds live
    # The private layers: what a variant and an op are; which variant may serve; the measured
    # table; measuring and qualifying; calling.
    ("kernel_variants._registry",),
    ("kernel_variants._policy", "kernel_variants._decide"),
    ("kernel_variants._table",),
    ("kernel_variants._tuning",),
    ("kernel_variants._runtime",),
    # The ops (each op's spec, reference and plugin), the plugin authors' API that re-exports
    # their capabilities, the kernels registered through it.
    ("kernel_variants.ops",),
    ("kernel_variants.plugin",),
    ("kernel_variants.kernels",),
    # The engines' drop-ins, the callers' functions, their result types, the command line.
    ("kernel_variants.integrations",),
    ("kernel_variants._api",),
    ("kernel_variants.types",),
    ("kernel_variants._cli",),
    # The namespace: the top package (its names made on first use), the built-in plugins it
    # declares (handed to the registry when it runs), ``python -m``, and the old packages that
    # only raise, naming their replacements.
    ("kernel_variants", "kernel_variants._builtins", "kernel_variants.__main__", "kernel_variants.dispatch",
     "kernel_variants.registry"),
)

# Run-time imports of modules outside the package (engines, torch_npu, built shared objects) or
# of the top package's lazy names (modelled from ``_LAZY``): nothing of the package's graph.
LOADS_OUTSIDE = {
    "kernel_variants": "its lazy names, from _LAZY (edges of the modules that use them)",
    "kernel_variants._native.stamp": "a built extension's shared object",
    "kernel_variants.kernels._adapters": "the kernels' own packages (torch_npu, sgl_kernel_npu, ...)",
    "kernel_variants.kernels.npu_rms_norm": "torch_npu",
    "kernel_variants.kernels.vllm_ir": "vLLM's IR ops and kernels",
    "kernel_variants.integrations._shadow": "the engine function a shadow spec names",
    "kernel_variants.integrations._vllm_ir": "vLLM's IR ops",
    "kernel_variants.integrations._vllm_gated": "vLLM's layer modules and its CustomOp registry",
    "kernel_variants.integrations._common": "an engine function's defining module (Originals: a replay's fallback)",
    "kernel_variants.integrations.vllm": "vLLM's ops module",
}
# Loaders of the names they are given, each with the module that declares those names: the string
# imports are that module's edges (the loader, below them, names none of them).
LOADS_GIVEN = {
    # make_plugin_manager: the built-ins kernel_variants/__init__ hands over (_registry.declared).
    "kernel_variants._registry.registry": "kernel_variants._builtins",
}
_LOADERS = ("import_module", "spec_from_file_location", "__import__")


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def _above(module: str) -> list[str]:
    """The packages whose ``__init__`` importing ``module`` runs first, outermost first."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in PACKAGES]


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name | ast.Attribute) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def _literal(path: Path, name: str) -> object:
    """The value of the module-level assignment ``name = <literal>`` in ``path``."""
    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == name and node.value is not None:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path.name} assigns no literal {name}")


def _statements(me: str, node: ast.AST, top_names: Mapping[str, set[str]]) -> set[str]:
    """Every kernel_variants module the code under ``node`` (a module of name ``me``) imports
    when it runs, at any depth (function-level imports included; ``if TYPE_CHECKING:`` blocks
    left out: they never run), with the top package's names it uses resolved (``top_names``)."""
    package = me if MODULES[me].name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    top_aliases: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for a in child.names:
                    found.add(a.name)
                    if a.name.split(".")[0] == TOP and (a.asname is None or a.name == TOP):
                        top_aliases.add(a.asname or TOP)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*up, base] if base else up)
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    found.add(sub if sub in MODULES else base)
                    if base == TOP:
                        found.update(top_names.get(a.name, ()))
            elif isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name) \
                    and child.value.id in top_aliases:
                found.update(top_names.get(child.attr, ()))
            visit(child)

    visit(node)
    return {m for m in found if m in MODULES and m != me}


def _top_names() -> dict[str, set[str]]:
    """What each name of the top package imports when it is first used: a lazy name its module
    (``_LAZY``), a function the modules its body imports, a name the ``__init__`` imports when it
    runs the module it comes from."""
    path = MODULES[TOP]
    names: dict[str, set[str]] = {name: {module} for name, module in _literal(path, "_LAZY").items()}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            names[node.name] = _statements(TOP, node, {})
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(TOP + "."):
            names.update({a.asname or a.name: {node.module} for a in node.names})
    return names


TOP_NAMES = _top_names()


def _string_imports() -> dict[str, set[str]]:
    """The modules each module names in a string that a loader imports."""
    plugins = _literal(MODULES["kernel_variants._builtins"], "BUILTIN_PLUGINS")
    commands = _literal(MODULES["kernel_variants._cli"], "COMMANDS")
    return {
        # The built-in plugins, declared here; make_plugin_manager imports each (LOADS_GIVEN).
        "kernel_variants._builtins": {module for _, module in plugins},
        # the parser: importlib.import_module(f"{__name__}.{module}") for each command it loads.
        "kernel_variants._cli": {f"kernel_variants._cli.{module}" for module, _ in commands.values()},
        # triton_module: the Triton rule loaded from its file, as a module of its own per mode.
        "kernel_variants.ops.causal_conv1d._device_rule": {"kernel_variants.ops.causal_conv1d._rule_triton"},
    }


STRING_IMPORTS = _string_imports()


def _imports(module: str, strings: bool = True) -> set[str]:
    """What importing (and running) ``module`` imports: its statements' and its string imports,
    each with the packages above it that ``module`` is not itself inside."""
    direct = _statements(module, ast.parse(MODULES[module].read_text()), TOP_NAMES)
    if strings:
        direct |= STRING_IMPORTS.get(module, set())
    own = set(_above(module))
    return {m for d in direct for m in (*_above(d), d)} - own - {module}


GRAPH = {m: _imports(m) for m in MODULES}
# The same without the string imports: what the import statements alone tie together.
STATEMENTS = {m: _imports(m, strings=False) for m in MODULES}
# What each module's statements name (the top package's names left unresolved): whom it calls.
NAMED = {m: _statements(m, ast.parse(p.read_text()), {}) for m, p in MODULES.items()}


def _unit(module: str) -> str:
    """The package ``module`` belongs to: its own for a package, its parent's for a module; a
    module of the top package is a unit of its own (the top package is the namespace)."""
    if module in PACKAGES:
        return module
    parent = module.rpartition(".")[0]
    return module if parent == TOP else parent


def _units(graph: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    """``graph`` between packages (``_unit``)."""
    units: dict[str, set[str]] = {}
    for m, deps in graph.items():
        units.setdefault(_unit(m), set()).update(_unit(d) for d in deps if _unit(d) != _unit(m))
    return units


UNITS = _units(GRAPH)


def _cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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

    for m in sorted(graph):
        if m not in index:
            strong(m)
    return sorted(out)


def _layer(module: str) -> int | None:
    """The tier of ``module``'s part in LAYERS (its longest entry); None where it has none."""
    best = max((p for tier in LAYERS for p in tier if module == p or module.startswith(p + ".")),
               key=len, default=None)
    return None if best is None else next(i for i, tier in enumerate(LAYERS) if best in tier)


def _upward(graph: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
    """Per node: what it imports of a higher tier."""
    wrong = {m: sorted(d for d in deps if (_layer(d) or 0) > (_layer(m) or 0)) for m, deps in graph.items()}
    return {m: d for m, d in sorted(wrong.items()) if d}


def test_the_layout_is_read():
    assert len(MODULES) > 50
    assert GRAPH["kernel_variants._runtime.dispatcher"], "the dispatcher imports something of the package"
    # The edges this graph adds to the import statements: packages above, lazy names, strings.
    aten = GRAPH["kernel_variants.kernels.aten"]  # imports kernel_variants.ops.causal_conv1d
    assert {"kernel_variants.ops", "kernel_variants.ops.causal_conv1d"} <= aten
    assert "kernel_variants.kernels" not in aten, "its own package ran before it"
    assert TOP_NAMES["force"] == {"kernel_variants._runtime.dispatcher"}
    assert "kernel_variants._runtime.dispatcher" in TOP_NAMES["reload"]
    assert "kernel_variants.kernels.cpu_native" in GRAPH["kernel_variants._builtins"]
    assert {"kernel_variants._builtins", "kernel_variants._registry.declared"} <= GRAPH[TOP]
    assert "kernel_variants._cli.calibrate" in GRAPH["kernel_variants._cli"]


def test_every_run_time_import_is_declared():
    """A module that imports by a name in a string (``importlib.import_module``, a spec from a
    file) is one whose string imports are declared (``STRING_IMPORTS``), one that loads what it
    is given (``LOADS_GIVEN``, the names' module declaring them) or one that loads only what lies
    outside the package (``LOADS_OUTSIDE``)."""
    loaders = set()
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).rpartition(".")[2] in _LOADERS:
                loaders.add(m)
    assert sorted(loaders - set(STRING_IMPORTS) - set(LOADS_OUTSIDE) - set(LOADS_GIVEN)) == []
    assert set(STRING_IMPORTS) <= loaders | set(LOADS_GIVEN.values()), "a declared loader imports nothing by name"
    assert set(LOADS_GIVEN.values()) <= set(STRING_IMPORTS), "a declaring module's names are read"
    missing = {m: sorted(d - set(MODULES)) for m, d in STRING_IMPORTS.items() if d - set(MODULES)}
    assert missing == {}, "a string names no module of the package"


def test_every_module_has_a_layer():
    assert [m for m in MODULES if _layer(m) is None] == []


def test_the_built_in_plugins_are_handed_over_from_the_top():
    """The registry loads the built-ins it is given: only the top package names their declaration
    (``_builtins``), and what the registry holds when the package has run is that declaration."""
    from kernel_variants._builtins import BUILTIN_PLUGINS, ESSENTIAL_PLUGINS
    from kernel_variants._registry.declared import declared

    assert [m for m in MODULES if "kernel_variants._builtins" in NAMED[m]] == [TOP]
    assert declared() == (BUILTIN_PLUGINS, frozenset(ESSENTIAL_PLUGINS))


@pytest.mark.parametrize(("graph", "level"), [(g, lv) for g in ("statements", "strings") for lv in ("modules", "packages")])
def test_no_import_circle(graph, level):
    """No circle between modules, nor between packages (``_unit``), whether the string imports
    count (``strings``) or only the statements."""
    edges = STATEMENTS if graph == "statements" else GRAPH
    assert _cycles(edges if level == "modules" else _units(edges)) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_no_higher_layer(module):
    """LAYERS, lowest first: a module imports nothing of a higher tier (string imports included)."""
    assert _upward({module: GRAPH[module]}) == {}


@pytest.mark.parametrize("package", sorted(UNITS))
def test_a_package_imports_no_higher_layer(package):
    """The same per package: none of its modules imports a package of a higher tier."""
    assert _upward({package: UNITS[package]}) == {}


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
    private = {m: sorted(d for d in NAMED[m] if not d.startswith("kernel_variants._cli")
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
