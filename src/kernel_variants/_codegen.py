"""Every function the package generates from an op's signature, made in one place.

A few per-signature functions (the memo key, a variant's invocation, ``bind``'s fast path, the
``torch.library`` adapters) are generated so that a call pays neither a loop over parameters nor
``*args`` packing. Each source is registered with :mod:`linecache` under its own name, so a
traceback, ``inspect.getsource`` and a debugger show the generated line, not ``<string>``.
"""

from __future__ import annotations

import itertools
import linecache
from collections.abc import Callable
from typing import Any

_serial = itertools.count()


def define(name: str, source: str, namespace: dict[str, Any], *, what: str = "") -> Callable[..., Any]:
    """Run ``source`` (which defines the function ``name``) in ``namespace`` and return that
    function; ``what`` says in the file name what it was made for (an op's name)."""
    filename = f"<kernel_variants: {name}{' for ' + what if what else ''} #{next(_serial)}>"
    # mtime None: linecache.checkcache keeps the entry (there is no file to compare with).
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - source made from a signature here
    return namespace[name]
