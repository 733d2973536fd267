"""Fitness of a pruned candidate on teacher-forced search data (docs/allocation.md, "EvoESAP").

Each sample is a prompt followed by an answer. Position t holds the distribution that predicts
token t+1, so it counts only when token t+1 is an answer token (shift by one). The full
model's (teacher's) log-probabilities at those positions are computed once into a
:class:`TeacherCache` and reused for every candidate; only answer positions are stored, never
full-length logits. A candidate is scored batch by batch with a :class:`FitnessAccumulator`,
so the caller never holds more than one batch of candidate logits.

All distributions are computed in fp32 from logits (bf16 logits are upcast first); sums over the
vocabulary and over positions accumulate in fp64. NaN or infinite logits at a scored position stop
with :class:`~moeprune.finite.NonFiniteError` (one reduction over rows already gathered): a NaN
teacher would otherwise read as p = 0 everywhere, i.e. KL 0. Each sample's score is the mean over its
answer positions, and the fitness is the mean over samples (every sample weighs the same).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from moeprune.config import SEARCH_DATA, Registry, SearchConfig
from moeprune.errors import DataError, MoePruneError
from moeprune.runtime.finite import NonFiniteError, all_finite, kind

F32 = torch.float32
F64 = torch.float64


@dataclass(frozen=True)
class Fitness:
    """One way to score a candidate against the full model at an answer position."""

    name: str
    help: str
    higher_is_better: bool
    best_sample: float  # the best one sample can score, in the search's direction (racing's bound)
    needs: tuple[str, ...] = (SEARCH_DATA,)
    fn: Callable | None = (
        None  # (teacher log p [n, V], candidate log q [n, V], targets [n], generator) -> [n] fp64
    )


FITNESSES: Registry[Fitness] = Registry("fitness", "fitness")


def check_fitness(fitness: str) -> str:
    """Validate a fitness name early, so a typo fails before any model runs."""
    return FITNESSES.get(fitness).name


def higher_is_better(fitness: str) -> bool:
    """Direction of a fitness: a search maximises esap/sap and minimises kl/nll."""
    return FITNESSES.get(fitness).higher_is_better


@FITNESSES.register(
    Fitness(
        "esap",
        "sum_v min(p, q) = 1 - TV(p, q): the expected speculative-decoding acceptance of "
        "the candidate drafting for the full model",
        True,
        1.0,
    )
)
def esap(logp: torch.Tensor, logq: torch.Tensor, targets: torch.Tensor, generator) -> torch.Tensor:
    return torch.minimum(logp.exp(), logq.exp()).sum(-1, dtype=F64)


@FITNESSES.register(Fitness("sap", "min(1, p(y) / q(y)) with y drawn from q (seeded)", True, 1.0))
def sap(logp: torch.Tensor, logq: torch.Tensor, targets: torch.Tensor, generator) -> torch.Tensor:
    """y ~ q by inverse CDF with one uniform per position from `generator` (CPU): every candidate
    sees the same uniforms (common random numbers), so comparisons are less noisy."""
    if generator is None:
        raise MoePruneError("the sap fitness needs a seeded generator")
    cdf = torch.cumsum(logq.exp().to(F64), dim=-1)
    u = torch.rand(logq.shape[0], generator=generator, dtype=F64).to(cdf.device) * cdf[:, -1]
    y = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=logq.shape[-1] - 1)
    log_ratio = logp.gather(-1, y) - logq.gather(-1, y)
    return log_ratio.squeeze(-1).to(F64).clamp(max=0.0).exp()


@FITNESSES.register(Fitness("kl", "sum_v p log(p / q), the full model to the candidate", False, 0.0))
def kl(logp: torch.Tensor, logq: torch.Tensor, targets: torch.Tensor, generator) -> torch.Tensor:
    p = logp.exp()
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))
    return terms.sum(-1, dtype=F64)


@FITNESSES.register(Fitness("nll", "-log q(answer token)", False, 0.0))
def nll(logp: torch.Tensor, logq: torch.Tensor, targets: torch.Tensor, generator) -> torch.Tensor:
    return -logq.gather(-1, targets.to(logq.device).long()[:, None]).squeeze(-1).to(F64)


def answer_positions(answer_mask: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Positions whose next-token distribution is scored: token t+1 is a (non-padding) answer token.

    The last position predicts nothing inside the sequence and never counts; a padding position
    never counts either. Works on [..., S] masks.
    """
    answer = answer_mask.bool()
    if attention_mask is not None:
        answer = answer & attention_mask.bool()
    positions = torch.zeros_like(answer)
    positions[..., :-1] = answer[..., 1:]
    if attention_mask is not None:
        positions &= attention_mask.bool()
    return positions


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = 1/2 sum_v |p - q| over the last dimension, summed in fp64."""
    return 0.5 * (p.to(F32) - q.to(F32)).abs().sum(-1, dtype=F64)


def _sample_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator per (seed, sample): SAP draws do not depend on batching, order or device."""
    state = np.random.SeedSequence([int(seed), int(index)]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device="cpu").manual_seed(int(state))


def position_scores(
    fitness: str,
    teacher_log_probs: torch.Tensor,
    candidate_logits: torch.Tensor,
    targets: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Per-position fitness in fp64 for rows of teacher log-probs [n, V] and candidate logits [n, V].

    Each fitness's own function (registered above) scores the rows.
    """
    spec = FITNESSES.get(fitness)
    assert spec.fn is not None, f"fitness {spec.name!r} registered without a function"
    logp = teacher_log_probs.to(F32)
    logq = torch.log_softmax(candidate_logits.to(F32), dim=-1)
    return spec.fn(logp, logq, targets, generator)


def _ids(sample_ids: Sequence[Hashable] | torch.Tensor) -> list[Hashable]:
    return sample_ids.tolist() if isinstance(sample_ids, torch.Tensor) else list(sample_ids)


def _check_logits(logits: torch.Tensor, n_samples: int) -> None:
    if logits.dim() != 3 or logits.shape[0] != n_samples:
        raise MoePruneError(f"expected logits [batch={n_samples}, seq, vocab], got {tuple(logits.shape)}")


@dataclass
class TeacherSample:
    """The full model's answer-position distributions for one sample."""

    sample_id: Hashable
    index: int  # order of insertion; seeds this sample's SAP draws
    positions: torch.Tensor  # [n] long: predicting positions t in the row as it was batched
    targets: torch.Tensor  # [n] long: the answer tokens a_{t+1}
    log_probs: torch.Tensor  # [n, V] fp32 log p(. | x_t)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.positions, self.targets, self.log_probs))


@dataclass
class TeacherCache:
    """Teacher log-probs at answer positions only; fill it batch by batch with :meth:`add`.

    Stored on ``device`` (CPU by default, so a long search set does not take GPU memory); rows
    move to the candidate logits' device when scored.
    """

    per_sample: list[TeacherSample] = field(default_factory=list)
    skipped: list[Hashable] = field(default_factory=list)  # samples with no answer position
    device: torch.device | str = "cpu"
    vocab_size: int | None = None
    label: str = "the full model"  # who produced the logits, for error messages
    _by_id: dict[Hashable, int] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes held: n_answer_positions * V * 4 for the log-probs plus 16 bytes a position."""
        return sum(s.nbytes for s in self.per_sample)

    @property
    def num_positions(self) -> int:
        return sum(int(s.targets.numel()) for s in self.per_sample)

    def __len__(self) -> int:
        return len(self.per_sample)

    def get(self, sample_id: Hashable) -> TeacherSample | None:
        index = self._by_id.get(sample_id)
        return None if index is None else self.per_sample[index]

    def add(
        self,
        sample_ids: Sequence[Hashable] | torch.Tensor,
        logits: torch.Tensor,
        input_ids: torch.Tensor,
        answer_mask: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        """Store one batch of the full model's logits [B, S, V] at its answer positions."""
        ids = _ids(sample_ids)
        _check_logits(logits, len(ids))
        if self.vocab_size is None:
            self.vocab_size = int(logits.shape[-1])
        elif logits.shape[-1] != self.vocab_size:
            raise MoePruneError(f"teacher vocab changed from {self.vocab_size} to {logits.shape[-1]}")
        scored = answer_positions(answer_mask, attention_mask)
        for row, sample_id in enumerate(ids):
            if sample_id in self._by_id or sample_id in self.skipped:
                raise MoePruneError(f"sample id {sample_id!r} was added to the teacher cache twice")
            positions = scored[row].nonzero().squeeze(-1)
            if positions.numel() == 0:
                self.skipped.append(sample_id)
                continue
            rows = torch.log_softmax(logits[row, positions.to(logits.device)].to(F32), dim=-1)
            if not all_finite(rows):  # else NaN would read as p = 0: KL 0, a perfect score
                raise NonFiniteError(f"{self.label} produced {kind(rows)} logits for sample {sample_id!r}")
            targets = input_ids[row, (positions + 1).to(input_ids.device)]
            self._by_id[sample_id] = len(self.per_sample)
            self.per_sample.append(
                TeacherSample(
                    sample_id=sample_id,
                    index=len(self.per_sample),
                    positions=positions.to(self.device, torch.long),
                    targets=targets.to(self.device, torch.long),
                    log_probs=rows.to(self.device),
                )
            )

    @classmethod
    def from_logits(
        cls,
        batches: Iterable[
            tuple[
                Sequence[Hashable] | torch.Tensor,
                torch.Tensor,
                torch.Tensor,
                torch.Tensor,
                torch.Tensor | None,
            ]
        ],
        device: torch.device | str = "cpu",
    ) -> TeacherCache:
        """Build from an iterable of (sample_ids, logits, input_ids, answer_mask, attention_mask)."""
        cache = cls(device=device)
        for batch in batches:
            cache.add(*batch)
        return cache


class FitnessAccumulator:
    """Streams one candidate's logits, batch by batch, into one fitness value.

    Batches may come in any order and grouping, as long as every teacher sample is scored once.
    Pass the masks again when the candidate's batches are padded differently from the
    teacher's; without them the stored teacher positions are used.
    """

    def __init__(
        self, teacher: TeacherCache, fitness: str, seed: int = 0, label: str = "the candidate"
    ) -> None:
        self.teacher = teacher
        self.fitness = check_fitness(fitness)
        self.seed = seed
        self.label = label  # who produced the logits, for error messages
        self.per_sample: dict[Hashable, float] = {}

    @property
    def skipped(self) -> int:
        """Samples without any answer position: not scored, not in the mean."""
        return len(self.teacher.skipped)

    def add(
        self,
        sample_ids: Sequence[Hashable] | torch.Tensor,
        logits: torch.Tensor,
        answer_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        ids = _ids(sample_ids)
        _check_logits(logits, len(ids))
        if logits.shape[-1] != self.teacher.vocab_size:
            raise MoePruneError(
                f"candidate vocab {logits.shape[-1]} != teacher vocab {self.teacher.vocab_size}"
            )
        scored = None if answer_mask is None else answer_positions(answer_mask, attention_mask)
        for row, sample_id in enumerate(ids):
            sample = self.teacher.get(sample_id)
            if sample is None:
                if sample_id in self.teacher.skipped:
                    continue
                raise MoePruneError(f"sample id {sample_id!r} is not in the teacher cache")
            if sample_id in self.per_sample:
                raise MoePruneError(f"sample id {sample_id!r} was scored twice for one candidate")
            positions = sample.positions if scored is None else scored[row].nonzero().squeeze(-1)
            if positions.numel() != sample.targets.numel():
                raise MoePruneError(
                    f"sample {sample_id!r}: {positions.numel()} answer positions in the candidate batch,"
                    f" {sample.targets.numel()} in the teacher cache"
                )
            rows = logits[row, positions.to(logits.device)]
            if not all_finite(rows):
                raise NonFiniteError(f"{self.label} produced {kind(rows)} logits for sample {sample_id!r}")
            generator = _sample_generator(self.seed, sample.index) if self.fitness == "sap" else None
            scores = position_scores(
                self.fitness, sample.log_probs.to(rows.device), rows, sample.targets, generator
            )
            self.per_sample[sample_id] = float(scores.mean())

    def result(self) -> float:
        """Mean over samples of the per-sample mean over answer positions."""
        if not self.teacher.per_sample:
            raise DataError("no search sample has an answer position: nothing to score")
        missing = len(self.teacher) - len(self.per_sample)
        if missing:
            raise MoePruneError(f"candidate scored {len(self.per_sample)} of {len(self.teacher)} samples")
        return math.fsum(self.per_sample.values()) / len(self.per_sample)


def score_candidate(
    teacher: TeacherCache,
    batches: Iterable[tuple],
    fitness: str,
    seed: int = 0,
) -> float:
    """Fitness of a candidate from (sample_ids, logits[, answer_mask, attention_mask]) batches."""
    accumulator = FitnessAccumulator(teacher, fitness, seed)
    for batch in batches:
        accumulator.add(*batch)
    return accumulator.result()


def check_search(search: SearchConfig) -> None:
    """Refuse impossible search settings before any model runs (a SearchConfig checks itself when
    made; one changed since is checked again here, with its fitness name)."""
    search.validate()
    check_fitness(search.fitness)
