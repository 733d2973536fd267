"""The full model's distributions `--repair` learns from and is checked against, computed once
before surgery (the model is pruned in place afterwards, so it is the only chance).

- Training: at every calibration position whose next token is a real token, the full model's k most
  likely tokens and their log-probabilities renormalised over them (k = `kl_top_k`; 0 keeps the
  whole vocabulary). k = 64 keeps 768 bytes a position instead of 4 x vocabulary.
- Held-out: the search data's answer positions (or those of the calibration samples held back when
  there is no search data) in the searches' own `TeacherCache`, scored with their fitness
  (`FitnessAccumulator`): the number the plan was chosen by, so "repair helped" means the same
  thing as "this plan is better".
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch

from moeprune.allocate.fitness import FitnessAccumulator, TeacherCache, answer_positions
from moeprune.data.loading import Batch, CalibrationData
from moeprune.errors import DataError
from moeprune.models import MoEModel
from moeprune.runtime.device import Placement, input_device


@dataclass
class TrainBatch:
    """One calibration batch on the model's device and the full model's top-k at its positions."""

    batch: Batch
    flat_index: torch.Tensor  # [n] positions in the flattened [B * S] whose next token is real
    log_probs: torch.Tensor  # [n, k] fp32, renormalised over the k tokens
    index: torch.Tensor | None  # [n, k] the tokens; None: the whole vocabulary

    def loss(self, logits: torch.Tensor) -> torch.Tensor:
        """Mean over positions of KL(p_k || q_k), q renormalised over the teacher's k tokens (0 when
        the pruned model matches the full one on them)."""
        rows = logits.flatten(0, 1)[self.flat_index.to(logits.device)].float()
        p = self.log_probs.to(rows.device)
        q = rows if self.index is None else rows.gather(-1, self.index.to(rows.device))
        q = torch.log_softmax(q, dim=-1)
        return (p.exp() * (p - q)).sum(-1).mean()


@dataclass
class HeldOut:
    """Held-out batches with their sample ids and the full model's distributions there."""

    source: str  # "search data" or "held-back calibration samples"
    batches: list[tuple[list[Hashable], Batch]]
    teacher: TeacherCache
    samples: int


def split_held_out(
    sets: Sequence[CalibrationData], search: CalibrationData | None, share: float
) -> tuple[list[CalibrationData], list[CalibrationData], str]:
    """(training sets, held-out sets, what the held-out tokens are): the search data when given,
    else the last `share` of every calibration set's samples (at least one; one must be left)."""
    if search is not None:
        return list(sets), [search], "search data"
    train, held = [], []
    for data in sets:
        n = len(data.samples)
        keep = n - max(1, round(share * n))
        if keep < 1:
            raise DataError(
                f"repair without search data holds back {share:g} of the calibration samples and needs at "
                f"least 2 ({', '.join(data.sources) or 'given'} has {n}): give more samples or search data",
                options=("data", "search_data"),
            )
        train.append(replace(data, samples=data.samples[:keep]))
        held.append(replace(data, samples=data.samples[keep:]))
    return train, held, "held-back calibration samples"


@torch.no_grad()
def training_teacher(
    moe: MoEModel, sets: Sequence[CalibrationData], top_k: int, batch_size: int, pad: int
) -> list[TrainBatch]:
    """The full model's top-k at every calibration position (stored where the placement says)."""
    device = input_device(moe.model)
    batches = [b.to(device) for data in sets for b in data.batches(batch_size, pad)]
    vocab = int(moe.config.vocab_size)
    k = top_k if 0 < top_k < vocab else vocab
    positions = sum(int(b.attention_mask.sum()) for b in batches)
    home = Placement.of(moe.model).cache_device(positions * k * 12, what="the repair teacher")
    out = []
    for b in batches:
        flat = answer_positions(b.attention_mask.bool(), b.attention_mask).flatten().nonzero().squeeze(-1)
        logits = moe.model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False).logits
        rows = torch.log_softmax(logits.flatten(0, 1)[flat].float(), dim=-1)
        index = None
        if k < rows.shape[-1]:
            rows, index = rows.topk(k, dim=-1)
            rows = rows - torch.logsumexp(rows, dim=-1, keepdim=True)
            index = index.to(home)
        out.append(TrainBatch(b, flat, rows.to(home), index))
    return out


@torch.no_grad()
def held_out_teacher(
    moe: MoEModel, sets: Sequence[CalibrationData], source: str, batch_size: int, pad: int
) -> HeldOut:
    """The full model's distributions at the held-out answer positions (ids: set and sample)."""
    device = input_device(moe.model)
    batches: list[tuple[list[Hashable], Batch]] = [
        ([(s, int(i)) for i in b.sample_index.tolist()], b.to(device))
        for s, data in enumerate(sets)
        for b in data.batches(batch_size, pad)
    ]
    positions = sum(int(answer_positions(b.answer_mask, b.attention_mask).sum()) for _, b in batches)
    nbytes = positions * int(moe.config.vocab_size) * 4
    teacher = TeacherCache(device=Placement.of(moe.model).cache_device(nbytes, what="the repair teacher"))
    for ids, b in batches:
        logits = moe.model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False).logits
        teacher.add(ids, logits, b.input_ids, b.answer_mask, b.attention_mask)
    if not teacher.per_sample:
        raise DataError(f"no {source} sample has an answer position: repair has nothing to check on")
    return HeldOut(source, batches, teacher, sum(len(d.samples) for d in sets))


@torch.no_grad()
def held_out_fitness(moe: MoEModel, held: HeldOut, fitness: str, seed: int) -> float:
    """The pruned model's fitness on the held-out tokens, as the searches score a candidate."""
    accumulator = FitnessAccumulator(held.teacher, fitness, seed, label="the repaired model")
    for ids, b in held.batches:
        logits = moe.model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False).logits
        accumulator.add(ids, logits, b.answer_mask, b.attention_mask)
    return accumulator.result()
