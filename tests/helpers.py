"""Assertions shared by tests that compare two models' logits.

Two fp32 models holding bit-identical weights need not give bit-identical logits: BLAS and
oneDNN pick their vectorised code path (and so the order of a dot product's partial sums)
by CPU feature set and by the alignment of each buffer, and a reloaded or re-sliced model
holds its weights in other allocations than the model it came from. Measured differences
reached 2.9e-6 on logits of order 1 (qwen3_next, one CPU model of the CI pool), i.e. a few
ulps of every term summed over the hidden width. The tolerance below is 1e-5 relative to the
logits' scale: above any reordering noise, and an order of magnitude under what the smallest
real change measured in these tests produces (pruning one neuron moves logits by > 1e-4).

Bit-exact comparisons remain where the very same tensors run the very same code (a mask
undone on the same model, two calls of one function): there, any difference is a bug.
"""

from __future__ import annotations

import torch

REORDER_RTOL = 1e-5  # see the module docstring


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = REORDER_RTOL) -> None:
    """Equal up to fp32 summation order: |a - b| <= rtol * max(1, max |b|)."""
    assert actual.shape == expected.shape, f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}"
    scale = max(1.0, float(expected.detach().abs().max()))
    diff = float((actual.detach().float() - expected.detach().float()).abs().max())
    assert diff <= rtol * scale, f"logits differ by {diff:.3g} (allowed {rtol * scale:.3g})"


def stock_from_pretrained(path, **kwargs):
    """Stock transformers' own class for a saved folder (a causal LM, or the multimodal wrapper its
    config.json names), loaded by transformers alone, as a user of the family would."""
    from transformers import AutoConfig

    from moeprune.models.classes import model_class

    return model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, **kwargs).eval()
