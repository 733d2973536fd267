"""ESAP, KL, NLL and perplexity of a model against a reference on one data set.

Why streaming: the search caches the reference's answer-position log-probs once for many
candidates, but an evaluation scores one candidate, and caching a long evaluation set would
cost positions x vocab x 4 bytes. So each batch runs both models, fills a one-batch
:class:`TeacherCache` and is scored by fitness.py's own code, then dropped.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch import nn

from moeprune.allocate.fitness import FitnessAccumulator, TeacherCache
from moeprune.data.loading import Batch, CalibrationData
from moeprune.errors import DataError
from moeprune.runtime.device import input_device
from moeprune.runtime.finite import check_finite_logits

DIVERGENCE_METRICS = ("esap", "kl", "nll", "ppl")
_SCORED = ("esap", "kl", "nll")  # computed by fitness.py; ppl follows from nll
_LABELS = ("the model", "the reference")


def batch_logits(model: nn.Module, batch: Batch, label: str | None = None) -> torch.Tensor:
    """Logits [B, S, V] of one padded batch, without a KV cache.

    With a `label` ("the reference ref/"), NaN or infinite logits at a non-padding position raise
    NonFiniteError naming that model, the sample and the first layer whose output went non-finite.
    """
    batch = batch.to(input_device(model))
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    if label is not None:
        check_finite_logits(
            logits,
            label,
            attention_mask=batch.attention_mask,
            model=model,
            input_ids=batch.input_ids,
            sample_ids=batch.sample_index.tolist(),
        )
    return logits


@dataclass
class _Totals:
    """Per-sample means and answer-token counts gathered over all batches."""

    # keyed by sample id (the batches' sample_index)
    per_sample: dict[str, dict[Hashable, float]] = field(default_factory=lambda: {k: {} for k in _SCORED})
    reference_nll: dict[Hashable, float] = field(default_factory=dict)
    tokens: dict[Hashable, int] = field(default_factory=dict)
    skipped: int = 0

    def add_batch(
        self,
        batch: Batch,
        model_logits: torch.Tensor,
        ref_logits: torch.Tensor,
        labels: tuple[str, str] = _LABELS,
    ) -> None:
        ids = batch.sample_index.tolist()
        # one batch: the teacher stays on the logits' device, no trip through the host
        teacher = TeacherCache(device=ref_logits.device, label=labels[1])
        teacher.add(ids, ref_logits, batch.input_ids, batch.answer_mask, batch.attention_mask)
        self.skipped += len(teacher.skipped)
        for name in _SCORED:
            acc = FitnessAccumulator(teacher, name, label=labels[0])
            acc.add(ids, model_logits)
            self.per_sample[name].update(acc.per_sample)
        own = FitnessAccumulator(teacher, "nll", label=labels[1])  # the reference's NLL, for context
        own.add(ids, ref_logits)
        self.reference_nll.update(own.per_sample)
        self.tokens.update({s.sample_id: int(s.targets.numel()) for s in teacher.per_sample})

    def result(self) -> dict[str, float | int | None]:
        if not self.tokens:
            raise DataError("no evaluation sample has an answer token: nothing to score")
        out: dict[str, float | int | None] = {k: _mean(v) for k, v in self.per_sample.items()}
        out["ppl"] = _exp(_token_mean(self.per_sample["nll"], self.tokens))
        out["reference_nll"] = _mean(self.reference_nll)
        out["reference_ppl"] = _exp(_token_mean(self.reference_nll, self.tokens))
        out.update(samples=len(self.tokens), answer_tokens=sum(self.tokens.values()), skipped=self.skipped)
        return out


def _exp(nll: float) -> float | None:
    """Perplexity from a mean NLL; None (JSON null) past the largest float (a mean NLL above ~709)."""
    try:
        return math.exp(nll)
    except OverflowError:
        return None


def _mean(values: dict[Hashable, float]) -> float:
    """Each sample weighs the same, as in the search fitnesses."""
    return math.fsum(values.values()) / len(values)


def _token_mean(per_sample: dict[Hashable, float], tokens: dict[Hashable, int]) -> float:
    """Token-weighted mean: perplexity is exp of the mean NLL over all answer tokens."""
    total = math.fsum(per_sample[i] * n for i, n in tokens.items())
    return total / sum(tokens.values())


def divergence(
    model: nn.Module,
    reference: nn.Module,
    data: CalibrationData,
    *,
    batch_size: int = 8,
    pad_token_id: int | None = None,
    labels: tuple[str, str] = _LABELS,
) -> dict[str, float | int | None]:
    """esap, kl, nll, ppl of `model` against `reference` (plus the reference's own nll and ppl).

    `labels` name the two models in errors: NaN or infinite logits from either stop with
    NonFiniteError (a NaN reference would otherwise score KL 0). A perplexity too large for a
    float is None.
    """
    totals = _Totals()
    for batch in data.batches(batch_size, pad_token_id):
        ref_logits = batch_logits(reference, batch, labels[1])
        totals.add_batch(batch, batch_logits(model, batch, labels[0]), ref_logits, labels)
    return totals.result()
