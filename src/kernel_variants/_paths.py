"""Where kernel_variants keeps files on this machine: one root, two environment overrides. The
root and the build folder are defined by ``_native``, which stands below the rest of the package
and so may import none of it."""

from __future__ import annotations

import os
from pathlib import Path

from kernel_variants._native.build import build_root as build_dir
from kernel_variants._native.build import user_cache

__all__ = ["build_dir", "table_dir", "user_cache"]


def table_dir() -> Path:
    """The calibration table: ``KV_CACHE_DIR``, else the user cache."""
    env = os.environ.get("KV_CACHE_DIR")
    return Path(env) if env else user_cache()
