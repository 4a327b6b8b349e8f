from __future__ import annotations

import os

import pytest
import torch

import kernel_variants

# The KV_* variables a test session keeps from the shell that started it. Every other one
# changes what is chosen, checked, recorded, patched or how a call runs (KV_QUALIFY, KV_FORCE,
# KV_CALL_CORE, KV_RECORD, KV_STRICT_PLUGINS, ...), so all of them are cleared, by prefix: one
# added later is cleared without being listed here.
KEPT_ENV = frozenset({
    # Where the extensions `kv build` made live. It moves the builds, not what they compute
    # (a build is keyed by its sources, flags and torch, and checked against its stamp); cleared,
    # each session would compile all three into the default cache (minutes on a small machine)
    # or load builds other than those the developer made.
    "KV_BUILD_DIR",
})


def leaked_env() -> list[str]:
    """The KV_* variables set now that a test must not see."""
    return sorted(name for name in os.environ if name.startswith("KV_") and name not in KEPT_ENV)


# Cleared for the whole session now, before any test module is imported: some settings are read
# once, at an import (the compiled-graph kernel reads KV_CALL_CORE when custom_ops is imported),
# and the processes tests start inherit this environment.
CLEARED_AT_START = leaked_env()
for _name in CLEARED_AT_START:
    del os.environ[_name]


def pytest_report_header(config):
    if CLEARED_AT_START:
        return f"kernel_variants: cleared from the environment: {', '.join(CLEARED_AT_START)}"
    return None

_DEVICES = ["cpu"]
if torch.cuda.is_available():
    _DEVICES.append(pytest.param("cuda", marks=pytest.mark.cuda))


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return torch.npu.is_available()


if _npu_available():
    _DEVICES.append(pytest.param("npu", marks=pytest.mark.npu))


def pytest_collection_modifyitems(config, items):
    # Device tests are skipped centrally, so no test hard-codes a device check.
    skips = {
        "cuda": (torch.cuda.is_available(), "needs an NVIDIA GPU"),
        "npu": (_npu_available(), "needs an Ascend NPU with torch_npu"),
    }
    for item in items:
        for mark, (have, why) in skips.items():
            if mark in item.keywords and not have:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(params=_DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch, tmp_path):
    """Each test gets its own environment, plugins and table, never the user's: what an earlier
    test set in os.environ itself (not through monkeypatch) is cleared too."""
    for var in leaked_env():
        monkeypatch.delenv(var)
    monkeypatch.setenv("KV_CACHE_DIR", str(tmp_path / "kv-cache"))
    kernel_variants.reload()
    yield
    kernel_variants.reload()


@pytest.fixture
def with_variants():
    """Reset the dispatcher with the built-ins plus the given variants, as one test plugin."""
    from kernel_variants._registry.registry import Registry, make_plugin_manager
    from kernel_variants._runtime.dispatcher import reset
    from kernel_variants.plugin import hookimpl

    def install(*variants, builtins: bool = True):
        class TestPlugin:
            @hookimpl
            def kv_register_variants(self, register):
                for v in variants:
                    register(v)

        return reset(Registry(make_plugin_manager(builtins=builtins, entry_points=False,
                                                  extra_plugins=[("test", TestPlugin())])))

    return install


@pytest.fixture
def reference_only(monkeypatch):
    """Only the ops' references among the built-ins (test plugins come on top): a table of the
    variants a test measures, with no unmeasured built-in ranked above them."""
    from kernel_variants._builtins import BUILTIN_PLUGINS, ESSENTIAL_PLUGINS

    blocked = [name for name, _ in BUILTIN_PLUGINS if name not in ESSENTIAL_PLUGINS]
    monkeypatch.setenv("KV_DISABLE_PLUGINS", ",".join(blocked))
    kernel_variants.reload()


@pytest.fixture
def python_calls(monkeypatch):
    """How many calls the Python path served (each reads the memo once; a call the compiled
    call core serves reads none)."""
    from kernel_variants._runtime import dispatcher as _dispatcher

    count = [0]
    get = _dispatcher.Memo.get

    def counting(self, key, default=None):
        count[0] += 1
        return get(self, key, default)

    monkeypatch.setattr(_dispatcher.Memo, "get", counting)
    return count


@pytest.fixture(scope="session")
def call_core_built():
    """The compiled call core, built (as ``kv build`` does) where it is not: the call-core test
    files use it (``helpers.call_core.CORE_MARKS``)."""
    from kernel_variants._native import build
    from kernel_variants._runtime.core_build import CORE

    build.build(CORE)


@pytest.fixture
def path(monkeypatch):
    """``path(on)``: put the ops on the core (or the Python path), in a fresh dispatcher."""
    from kernel_variants._runtime import callcore as _callcore

    def use(on: bool) -> None:
        monkeypatch.setenv(_callcore.ENV, "1" if on else "0")
        kernel_variants.reload()

    return use


@pytest.fixture
def reference_variant():
    """Run the ops on the reference variant: fast, and the same on every machine (the engine
    drop-in test files use it)."""
    with kernel_variants.force(causal_conv1d_fn="reference", causal_conv1d_update="reference"):
        yield
