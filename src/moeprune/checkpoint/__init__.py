"""Checkpoints in and out: loading with clear errors, saving atomically in a familiar layout.

- files.py      safetensors shards and index: validation from headers, sharded writing
- names.py      the tensor names a stock checkpoint of each family uses
- structure.py  moeprune's per-layer structure (format version 3, and reading versions 1-2)
- load.py       configs, tokenizers and models (stock or moeprune format), never running checkpoint code
- save.py       stock checkpoint when the config can express the result, moeprune's format otherwise
- atomic.py     the one atomic writer, the output lock, strict JSON
"""

from __future__ import annotations

from .atomic import atomic_write_dir, check_not_inside, check_output_dir, output_lock, write_json
from .load import (
    build_skeleton,
    check_model_path,
    check_not_offloaded,
    load_config,
    load_model,
    load_pretrained,
    load_tokenizer,
    resolve_dtype,
)
from .save import save_pretrained, stock_expressible, write_checkpoint
from .structure import FORMAT_VERSION, LEGACY_FILE, is_moeprune_format

__all__ = [
    "FORMAT_VERSION",
    "LEGACY_FILE",
    "atomic_write_dir",
    "build_skeleton",
    "check_model_path",
    "check_not_inside",
    "check_not_offloaded",
    "check_output_dir",
    "is_moeprune_format",
    "load_config",
    "load_model",
    "load_pretrained",
    "load_tokenizer",
    "output_lock",
    "resolve_dtype",
    "save_pretrained",
    "stock_expressible",
    "write_checkpoint",
    "write_json",
]
