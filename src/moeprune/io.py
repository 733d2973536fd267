"""Former home of loading and atomic writing; everything now lives in moeprune.checkpoint.

Kept so that `from moeprune.io import load_model` in users' scripts keeps working.
"""

from __future__ import annotations

from .checkpoint import (
    atomic_write_dir,
    check_model_path,
    check_not_offloaded,
    check_output_dir,
    load_config,
    load_model,
    load_tokenizer,
    resolve_dtype,
    stock_expressible,
    write_json,
)
from .checkpoint.structure import LEGACY_FILE as MOEPRUNE_CONFIG

__all__ = [
    "MOEPRUNE_CONFIG",
    "atomic_write_dir",
    "check_model_path",
    "check_not_offloaded",
    "check_output_dir",
    "load_config",
    "load_model",
    "load_tokenizer",
    "resolve_dtype",
    "stock_expressible",
    "write_json",
]
