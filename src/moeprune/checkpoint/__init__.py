"""Checkpoints in and out: loading with clear errors, saving atomically (runtime/atomic.py) in a
familiar layout.

- files.py      safetensors shards and index: validation from headers, sharded writing
- names.py      the tensor names a stock checkpoint of each family uses
- structure.py  moeprune's per-layer structure (format version 3, and reading versions 1-2)
- load.py       configs, tokenizers and models (stock or moeprune format), never running checkpoint code
- save.py       stock checkpoint when the config can express the result, moeprune's format otherwise

The names below are imported on first use: importing the package loads neither torch nor
transformers.

- quantized.py  A quantized checkpoint's tensors, read as the full-precision weights they stand for
- sparsity_metadata.py  `moe_sparsity_config`: the metadata standard for MoE checkpoints with fewer
  experts
- zero_rows.py  Rows a model holds that a release does not store: LongCat-Flash's zero experts'
  gate/up rows
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load": (
        "build_skeleton",
        "check_model_path",
        "check_not_offloaded",
        "load_config",
        "load_model",
        "load_placed",
        "load_pretrained",
        "load_tokenizer",
        "require_tokenizer",
    ),
    "save": ("save_pretrained", "stock_expressible", "write_checkpoint"),
    "structure": ("FORMAT_VERSION", "LEGACY_FILE", "is_moeprune_format"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
