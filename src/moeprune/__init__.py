"""moeprune: compress Mixture-of-Experts language models after training.

    import moeprune
    result = moeprune.prune(model, moeprune.PruneConfig(criterion="reap", sparsity=0.5), data="calib.jsonl",
                            tokenizer=tokenizer)
    moeprune.save_pretrained(result.model, "out", tokenizer)

The names below are imported on first use, so `import moeprune` (the vLLM plugin does it at
start-up) loads neither torch nor transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "prune": "moeprune.api",
    "prune_checkpoint": "moeprune.job",
    "PruneRequest": "moeprune.job",
    "PruneResult": "moeprune.api",
    "PruneConfig": "moeprune.config",
    "SearchConfig": "moeprune.config",
    "RepairConfig": "moeprune.config",
    "DataOptions": "moeprune.config",
    "SaveOptions": "moeprune.config",
    "RunOptions": "moeprune.config",
    "MoePruneError": "moeprune.errors",
}

__all__ = ["__version__", "load_pretrained", "save_pretrained", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moeprune' has no attribute {name!r}")


def load_pretrained(path, dtype=None, device=None):
    """Reload any moeprune output (stock or moeprune format); see moeprune.checkpoint."""
    from moeprune.checkpoint import load_pretrained as load
    from moeprune.runtime.device import resolve_dtype

    return load(path, dtype=resolve_dtype(dtype), device=device)


def save_pretrained(
    model, directory, tokenizer=None, *, dtype=None, max_shard_size="5GB", overwrite=False
) -> str:
    """Save a (pruned) model atomically: a stock checkpoint when its config can express it,
    moeprune's format otherwise (docs/checkpoint-format.md); returns "stock" or "moeprune"."""
    from moeprune.checkpoint import save_pretrained as save

    return save(model, directory, tokenizer, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite)
