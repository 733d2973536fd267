"""The full model on the search data, prepared once: the search batches (each with what the fast
path resumes from) and the teacher cache every candidate is scored against (search/candidates.py).

A contest of several searches on the same data (`--method auto`, search/portfolio.py) makes this
once and hands it to each search (`SearchRuntime.teacher`): the teacher pass, the capture of the
decoder layers' call arguments and the fast path's self-check then run once, not once per search.
None of it depends on the search (its orders, fitness, seed or candidates), only on the model,
the data and how they are batched, which `SharedTeacher.key` records and a search checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moeprune.allocate.fitness import TeacherCache, answer_positions
from moeprune.data.loading import Batch, CalibrationData


@dataclass
class Row:
    """One scored sample of a batch: its id and its slice of the batch's answer rows."""

    sample_id: int
    start: int
    stop: int
    mask: torch.Tensor  # [1, n + 1] answer mask that puts the n compact rows at positions 0..n-1


@dataclass
class SearchBatch:
    """A search batch on the model's device plus what the fast path needs to resume in it."""

    batch: Batch
    rows: list[Row]
    flat_index: torch.Tensor  # [n] indices of the answer positions in the flattened [B * S]
    calls: dict[int, tuple[tuple, dict[str, Any]]] = field(default_factory=dict)  # layer -> args
    # Allocation-free states at the first MoE decoder layer: its input ("layer") and its
    # post-attention residual ("split").
    start: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return [r.sample_id for r in self.rows]


def prepare_batch(batch: Batch, device: torch.device) -> SearchBatch:
    batch = batch.to(device)
    scored = answer_positions(batch.answer_mask, batch.attention_mask)
    counts = scored.sum(1).tolist()
    rows, start = [], 0
    for sample_id, n in zip(batch.sample_index.tolist(), counts):
        mask = torch.zeros(1, n + 1, dtype=torch.bool)
        mask[0, 1:] = True
        rows.append(Row(int(sample_id), start, start + n, mask))
        start += n
    return SearchBatch(batch, rows, scored.flatten().nonzero().squeeze(-1))


@dataclass(frozen=True)
class SharedTeacher:
    """One teacher pass for several searches: the prepared batches (the chosen mode's resume
    states kept), the teacher cache, the resume mode the self-check chose and the pass's seconds.
    `key` (data, batch size, padding) must equal a search's own for it to be taken."""

    key: tuple
    batches: list[SearchBatch]
    teacher: TeacherCache
    mode: str
    seconds: float

    def scored(self) -> tuple[TeacherCache, list[Batch]]:
        """The cache and the plain batches, as `plan_fitness` (search/auto.py) scores a plan."""
        return self.teacher, [b.batch for b in self.batches]


def teacher_key(data: CalibrationData, batch_size: int, pad: int | None) -> tuple:
    """What a shared teacher must have been made on for a search to take it (a search that runs
    the plain forward, `SearchRuntime(fast=False)`, takes one made for the fast path: the plain
    forward reads only the batches and the cache)."""
    return (data.fingerprint, len(data.samples), batch_size, pad)
