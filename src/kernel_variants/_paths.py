"""Where kernel_variants keeps files on this machine: one root, two environment overrides."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache() -> Path:
    """``$XDG_CACHE_HOME/kernel_variants``, or ``~/.cache/kernel_variants``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kernel_variants"


def table_dir() -> Path:
    """The calibration table: ``KV_CACHE_DIR``, else the user cache."""
    env = os.environ.get("KV_CACHE_DIR")
    return Path(env) if env else user_cache()


def build_dir() -> Path:
    """Compiled extensions: ``KV_BUILD_DIR``, else ``build`` in the user cache."""
    env = os.environ.get("KV_BUILD_DIR")
    return Path(env) if env else user_cache() / "build"
