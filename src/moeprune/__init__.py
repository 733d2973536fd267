"""moeprune: compress Mixture-of-Experts language models after training."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load_pretrained", "save_pretrained"]


def load_pretrained(path, dtype=None, device=None):
    """Reload any moeprune output (stock or moeprune format); see moeprune.checkpoint."""
    from moeprune.checkpoint import load_pretrained as _load
    from moeprune.checkpoint import resolve_dtype

    return _load(path, dtype=resolve_dtype(dtype), device=device)


def save_pretrained(model, directory, tokenizer=None, *, dtype=None, max_shard_size="5GB", overwrite=False) -> str:
    """Save a (pruned) model atomically: a stock checkpoint when its config can express it,
    moeprune's format otherwise (docs/checkpoint-format.md); returns "stock" or "moeprune"."""
    from moeprune.checkpoint import save_pretrained as _save

    return _save(model, directory, tokenizer, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite)
