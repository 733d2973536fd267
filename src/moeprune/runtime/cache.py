"""Where moeprune keeps what it reuses across runs: trained demo models, and the record of the
quantization environment `moeprune setup quantize` made (so `prune --quantize` finds it from any
folder)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$MOEPRUNE_CACHE``, else ``$XDG_CACHE_HOME/moeprune`` or ``~/.cache/moeprune``."""
    if cache_dir:
        return Path(cache_dir)
    if os.environ.get("MOEPRUNE_CACHE"):
        return Path(os.environ["MOEPRUNE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moeprune"
