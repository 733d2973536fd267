"""EvoESAP on a real model: candidate fitness through reversible masks, and the search driver.

A candidate allocation r (experts removed per MoE layer) is evaluated without copying the model:
:func:`~moeprune.surgery.drop.mask_experts` removes the first r_l experts of each layer's pruning
order from routing (exactly equal to physical removal), the model runs over the search set and
the candidate's answer-position logits are scored against the full model's, which are computed
once into a :class:`~moeprune.fitness.TeacherCache`.

Speed (the search evaluates hundreds of candidates):

- Fitness cache: :class:`~moeprune.allocate.evo.EvoSearch` evaluates each distinct allocation once.
- Shared prefix: the state of MoE layer p depends only on r_0..r_{p-1}. Per batch it is cached
  (LRU, byte budget) keyed by that prefix; a candidate resumes at its longest cached prefix and
  runs only the layers from there on. The state is the layer's post-attention residual ("split"
  mode: the attention of the first differing layer is shared too, only its MoE half runs), or
  its input ("layer" mode). The decoder layers are called with the very arguments (masks,
  rotary embeddings, ...) that the model's own forward passed them during the teacher pass,
  captured by hooks, so nothing family-specific is rebuilt. A self-check on the first batch
  compares each mode with ``model(...)`` and keeps the first that matches; the plain forward is
  the fallback.
- Answer rows only: the final norm and LM head run on the scored positions only.
- Racing: after each batch, a candidate whose fitness could not reach the m-th best fitness seen
  so far even if every remaining sample scored perfectly stops there. Elites are always the top m
  of everything evaluated (the population keeps the previous elites), so such a candidate can
  never be an elite nor the result: the search's trajectory and selection are unchanged. Its
  recorded fitness is the mean over the samples it was scored on (always below that threshold).

Data-parallel search (under ``torchrun``, world size W > 1): every rank holds the whole model and
the search set and does its own teacher pass. Each generation's new allocations (not cached,
deduplicated, in population order) are split round-robin over the ranks (rank r takes positions
r, r+W, ...), each rank evaluates its share, and the results (fitness, raced or not) are merged
with ``all_gather_object`` into every rank's fitness cache, in population order: every rank
holds the same cache, population and RNG state. A candidate's fitness does not depend on what
its rank evaluated before (prefix reuse is bitwise exact), and racing uses the elite threshold of
the cache at the start of the generation (one process raises it as the generation goes), so
elites, the per-generation best and the result are identical to one process for a fixed seed.
Raced candidates' partial fitnesses, and so a generation's mean, may differ. Rank 0 alone writes
the search state and the race log (every rank reads them to resume); the state is saved at
generation boundaries.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moeprune.allocate.basic import plan_removals, uniform_allocation
from moeprune.allocate.limits import LayerLimits, layer_limits
from moeprune.allocate.search.evo import Allocation, EvoConfig, EvoResult, EvoSearch
from moeprune.allocate.search.fitness import (
    FitnessAccumulator,
    TeacherCache,
    answer_positions,
    check_fitness,
    higher_is_better,
    teacher_home,
)
from moeprune.checkpoint import write_json
from moeprune.data.loading import Batch, CalibrationData
from moeprune.errors import DataError, MoePruneError
from moeprune.models.adapter import MoEModel, decoder_layers, input_device
from moeprune.runtime.distributed import all_gather_objects, rank_and_world, split_map
from moeprune.surgery.drop import mask_experts

__all__ = [
    "DEFAULT_PREFIX_CACHE_BYTES",
    "TEXT_ONLY_NOTE",
    "CandidateEvaluator",
    "LayerLimits",
    "PrefixCache",
    "layer_limits",
    "run_evo_search",
]

_LOG = logging.getLogger(__name__)

DEFAULT_PREFIX_CACHE_BYTES = 1 << 30  # at most 1 GiB of cached hidden states
# The cache needs, per batch, the states of the elites' prefixes at every MoE layer: a few times
# one layer's states for the whole search set. More only ever holds one-off candidates.
PREFIX_CACHE_COPIES = 6
TEXT_ONLY_NOTE = "search data has no prompt/answer split: every token counts as answer"
# Upper bound of one sample's score in the search's direction (esap, sap <= 1; -kl, -nll <= 0),
# padded for rounding (sum_v min(p, q) can exceed 1 by a few ulps): racing stays conservative.
_BEST_SAMPLE_SCORE = {"esap": 1.0, "sap": 1.0, "kl": 0.0, "nll": 0.0}
_RACE_MARGIN = 1e-4
# Manual layer loop vs model(...) on the first batch: max |diff| allowed, times (1 + max |logit|).
_SELF_CHECK_TOL = {torch.float32: 1e-4, torch.float64: 1e-8}
_SELF_CHECK_TOL_LOW_PRECISION = 3e-2


# ---------------------------------------------------------------------------------------------
# Per-layer limits shared by the allocations


# ---------------------------------------------------------------------------------------------
# Prefix cache


class PrefixCache:
    """LRU of hidden states, keyed by (batch, allocation prefix), bounded in bytes.

    A tensor larger than the whole budget is not stored. Hits refresh an entry, so the prefixes
    of elites (shared by their offspring) stay while one-off candidates age out.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise MoePruneError(f"prefix cache budget must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        self.peak_bytes = 0
        self.evictions = 0
        self._entries: OrderedDict[tuple[int, Allocation], torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[int, Allocation]) -> torch.Tensor | None:
        tensor = self._entries.get(key)
        if tensor is not None:
            self._entries.move_to_end(key)
        return tensor

    def put(self, key: tuple[int, Allocation], tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if size > self.max_bytes or key in self._entries:
            return
        while self.nbytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()
            self.evictions += 1
        self._entries[key] = tensor
        self.nbytes += size
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


# ---------------------------------------------------------------------------------------------
# The search set, prepared once


@dataclass
class _Row:
    """One scored sample of a batch: its id and its slice of the batch's answer rows."""

    sample_id: int
    start: int
    stop: int
    mask: torch.Tensor  # [1, n + 1] answer mask that puts the n compact rows at positions 0..n-1


@dataclass
class _SearchBatch:
    """A search batch on the model's device plus what the fast path needs to resume in it."""

    batch: Batch
    rows: list[_Row]
    flat_index: torch.Tensor  # [n] indices of the answer positions in the flattened [B * S]
    calls: dict[int, tuple[tuple, dict[str, Any]]] = field(default_factory=dict)  # layer -> args
    # Allocation-free states at the first MoE decoder layer: its input ("layer") and its
    # post-attention residual ("split").
    start: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return [r.sample_id for r in self.rows]


def _prepare_batch(batch: Batch, device: torch.device) -> _SearchBatch:
    batch = batch.to(device)
    scored = answer_positions(batch.answer_mask, batch.attention_mask)
    counts = scored.sum(1).tolist()
    rows, start = [], 0
    for sample_id, n in zip(batch.sample_index.tolist(), counts):
        mask = torch.zeros(1, n + 1, dtype=torch.bool)
        mask[0, 1:] = True
        rows.append(_Row(int(sample_id), start, start + n, mask))
        start += n
    return _SearchBatch(batch, rows, scored.flatten().nonzero().squeeze(-1))


# ---------------------------------------------------------------------------------------------
# Candidate evaluation

# How a candidate resumes inside a batch. SPLIT: from the post-attention residual of the first
# MoE layer that differs (its attention input, hence output, is shared), running only that
# layer's MoE half. LAYER: from the input of that decoder layer. PLAIN: model(...) every time.
SPLIT, LAYER, PLAIN = "split", "layer", "plain"


def _hidden_of(output: Any) -> torch.Tensor:
    """Decoder layers and MoE blocks return a tensor, or a tuple starting with it."""
    return output[0] if isinstance(output, tuple) else output


# How a candidate's removed experts ({decoder layer: positions}) are applied virtually: router
# slicing for drop (the default), constant substitution for MoNE novices.
CandidateContext = Callable[[dict[int, list[int]]], AbstractContextManager]


class CandidateEvaluator:
    """Fitness of allocations on one search set, with the full model as teacher.

    ``orders[l]`` lists the expert positions of MoE layer l (``moe.layers`` order), first pruned
    first; group-limited layers lose the earliest experts of every group evenly. ``evaluate``
    returns the value the search maximises (ESAP, SAP, -KL, -NLL); ``raw`` the fitness itself.
    ``fast=False`` forces the plain ``model(...)`` forward (the reference the tests compare to).
    """

    def __init__(
        self,
        moe: MoEModel,
        search_data: CalibrationData,
        orders: Sequence[Sequence[int]],
        *,
        fitness: str = "esap",
        batch_size: int = 8,
        seed: int = 0,
        pad_token_id: int | None = None,
        fast: bool = True,
        prefix_cache_bytes: int | None = None,
        teacher_device: torch.device | str | None = None,
        candidate_context: CandidateContext | None = None,
    ) -> None:
        self.moe = moe
        self.candidate_context = candidate_context or (lambda removed: mask_experts(moe, removed))
        moe.model.eval()  # a fitness under dropout would be noise
        self.fitness = check_fitness(fitness)
        self.sign = 1.0 if higher_is_better(fitness) else -1.0
        self.seed = int(seed)
        self.limits = layer_limits(moe)
        self.orders = [[int(e) for e in o] for o in orders]
        if len(self.orders) != len(moe.layers):
            raise MoePruneError(f"{len(self.orders)} pruning orders for {len(moe.layers)} MoE layers")
        plan_removals(self.orders, [0] * len(self.orders), self.limits.groups)  # validates orders
        self.notes: list[str] = [TEXT_ONLY_NOTE] if search_data.text_only else []
        self.notes += list(search_data.notes)
        self.device = input_device(moe.model)
        self.prefix_cache = PrefixCache(
            prefix_cache_bytes if prefix_cache_bytes is not None else default_prefix_cache_bytes(moe, search_data)
        )
        self.raw_values: dict[Allocation, float] = {}
        self.raced: dict[Allocation, int] = {}  # allocation -> samples scored before it stopped
        self._layers = decoder_layers(moe.model)
        self._position = {layer: p for p, layer in enumerate(self.limits.layers)}  # decoder -> MoE
        self._taps: dict[int, torch.Tensor] = {}  # post-attention residuals seen in this batch
        self._batches = [
            _prepare_batch(b, self.device) for b in search_data.batches(batch_size, pad_token_id)
        ]
        self.counters = _zero_counters()
        start = time.perf_counter()
        self.teacher, reference = self._teacher_pass(teacher_device or self._teacher_home())
        self.teacher_seconds = time.perf_counter() - start
        if not self.teacher.per_sample:
            raise DataError("no search sample has an answer position: nothing to score")
        self.mode = self._choose_mode(reference) if fast else PLAIN
        for b in self._batches:  # keep only what the chosen mode resumes from
            b.start = {self.mode: b.start[self.mode]} if self.mode in b.start else {}
            if self.mode == PLAIN:
                b.calls = {}
        self.counters = _zero_counters()  # the self-check does not count

    def release(self) -> None:
        """Drop the teacher distributions, cached states and batches: the evaluator is done."""
        self.prefix_cache.clear()
        self._batches, self._taps, self.teacher = [], {}, None

    # -- setup --------------------------------------------------------------------------------
    def _teacher_home(self) -> torch.device:
        positions = sum(r.stop - r.start for b in self._batches for r in b.rows)
        return teacher_home(self.device, positions, int(self.moe.config.vocab_size))

    @property
    def fast(self) -> bool:
        """Whether candidates run through the resumable layer loop (else the plain forward)."""
        return self.mode != PLAIN

    @property
    def cache_nbytes(self) -> int:
        """Bytes of the teacher cache (answer positions x vocabulary x 4, plus indices)."""
        return self.teacher.nbytes

    @property
    def num_samples(self) -> int:
        """Samples that are scored (those with at least one answer position)."""
        return len(self.teacher)

    @torch.no_grad()
    def _teacher_pass(self, teacher_device: torch.device | str) -> tuple[TeacherCache, torch.Tensor]:
        """One plain forward of the full model that also records how to resume inside it.

        Hooks capture each decoder layer's call arguments and, at the first MoE layer, its input
        and post-attention residual. Also returns the first batch's answer-row logits, the
        reference of the fast-path self-check.
        """
        teacher = TeacherCache(device=teacher_device)
        reference = None
        for b in self._batches:
            with self._recording(b):
                logits = self._plain_logits(b.batch)
            batch = b.batch
            teacher.add(b.ids, logits, batch.input_ids, batch.answer_mask, batch.attention_mask)
            if reference is None:
                reference = logits.flatten(0, 1)[b.flat_index]
        return teacher, reference

    @contextmanager
    def _recording(self, b: _SearchBatch) -> Iterator[None]:
        first = self.limits.layers[0]

        def capture(index: int) -> Callable:
            def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
                kwargs = dict(kwargs)
                hidden = args[0] if args else kwargs.pop("hidden_states")
                b.calls[index] = (tuple(args[1:]), kwargs)
                if index == first:
                    b.start[LAYER] = hidden

            return hook

        handles = [
            layer.register_forward_pre_hook(capture(i), with_kwargs=True)
            for i, layer in enumerate(self._layers)
        ]
        norm = getattr(self._layers[first], "post_attention_layernorm", None)
        if norm is not None:
            handles.append(
                norm.register_forward_pre_hook(lambda m, args: b.start.__setitem__(SPLIT, args[0]))
            )
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _plain_logits(self, batch: Batch) -> torch.Tensor:
        return self.moe.model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
        ).logits

    @torch.no_grad()
    def _choose_mode(self, reference: torch.Tensor) -> str:
        """The fastest resumable mode that reproduces ``model(...)`` on the first batch, else PLAIN."""
        b = self._batches[0]
        for mode in (SPLIT, LAYER):
            try:
                got = self._run_layers(b, mode, 0, b.start[mode], None, ())
            except Exception as exc:  # an unforeseen layout: try the next mode
                _LOG.debug("resume mode %s unavailable: %s: %s", mode, type(exc).__name__, exc)
                continue
            if got.shape == reference.shape and _close(got, reference):
                return mode
        self.notes.append("the resumable layer loop does not reproduce model(...): plain forward used")
        _LOG.warning(self.notes[-1])
        return PLAIN

    # -- one candidate --------------------------------------------------------------------------
    def removals(self, allocation: Sequence[int]) -> dict[int, list[int]]:
        """{decoder layer: expert positions} removed by an allocation (group-balanced where needed)."""
        chosen = plan_removals(self.orders, list(allocation), self.limits.groups)
        return {layer: experts for layer, experts in zip(self.limits.layers, chosen) if experts}

    def raw(self, allocation: Sequence[int]) -> float:
        """The fitness itself (KL / NLL not negated) of an evaluated, not raced, allocation."""
        return self.raw_values[tuple(int(r) for r in allocation)]

    @torch.no_grad()
    def evaluate(self, allocation: Sequence[int], threshold: float | None = None) -> float:
        """The value the search maximises; stops early (racing) when it cannot reach ``threshold``.

        A raced candidate returns the mean over the samples it was scored on, which is below
        ``threshold``; it is recorded in ``raced`` and has no ``raw`` value.
        """
        allocation = tuple(int(r) for r in allocation)
        self.counters["candidates"] += 1
        accumulator = FitnessAccumulator(self.teacher, self.fitness, self.seed)
        with self.candidate_context(self.removals(allocation)), self._tapping():
            for index, b in enumerate(self._batches):
                self._score_batch(accumulator, b, self._candidate_rows(index, b, allocation))
                if threshold is not None and self._hopeless(accumulator, threshold):
                    return self._stop(allocation, accumulator)
        raw = accumulator.result()
        self.raw_values[allocation] = raw
        return self.sign * raw

    @contextmanager
    def _tapping(self) -> Iterator[None]:
        """In SPLIT mode, record the post-attention residual of every MoE layer as it runs."""
        handles = []
        if self.mode == SPLIT:
            for decoder_index in self.limits.layers:

                def tap(module: nn.Module, args: tuple, i: int = decoder_index) -> None:
                    self._taps[i] = args[0]

                norm = self._layers[decoder_index].post_attention_layernorm
                handles.append(norm.register_forward_pre_hook(tap))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._taps.clear()

    def _candidate_rows(self, index: int, b: _SearchBatch, allocation: Allocation) -> torch.Tensor:
        """Candidate logits at the batch's answer positions [n, V]."""
        self.counters["batch_evaluations"] += 1
        if self.mode == PLAIN:
            self.counters["decoder_layers_run"] += len(self._layers)
            return self._plain_logits(b.batch).flatten(0, 1)[b.flat_index]
        p, state = self._longest_prefix(index, b, allocation)
        return self._run_layers(b, self.mode, p, state, index, allocation)

    def _longest_prefix(
        self, index: int, b: _SearchBatch, allocation: Allocation
    ) -> tuple[int, torch.Tensor]:
        for p in range(len(allocation) - 1, 0, -1):
            state = self.prefix_cache.get((index, allocation[:p]))
            if state is not None:
                self.counters["prefix_hits"] += 1
                return p, state
        return 0, b.start[self.mode]

    def _run_layers(
        self,
        b: _SearchBatch,
        mode: str,
        p: int,
        state: torch.Tensor,
        index: int | None,
        allocation: Allocation,
    ) -> torch.Tensor:
        """Resume at MoE layer p from ``state``; then final norm and LM head on the answer rows only.

        With a batch ``index``, the state of each later MoE layer (its input, or in SPLIT mode its
        post-attention residual) is cached under the allocation prefix it depends on.
        """
        first = self.limits.layers[p]
        if mode == SPLIT:
            hidden, begin = self._moe_half(first, state), first + 1
            self.counters["attention_skipped"] += 1
        else:
            hidden, begin = state, first
        self.counters["decoder_layers_skipped"] += first
        self.counters["decoder_layers_run"] += len(self._layers) - first
        for i in range(begin, len(self._layers)):
            q = self._position.get(i) if index is not None else None
            if q is not None and mode == LAYER:
                self.prefix_cache.put((index, allocation[:q]), hidden)
            args, kwargs = b.calls[i]
            hidden = _hidden_of(self._layers[i](hidden, *args, **kwargs))
            if q is not None and mode == SPLIT:
                self.prefix_cache.put((index, allocation[:q]), self._taps.pop(i))
        rows = hidden.flatten(0, 1)[b.flat_index.to(hidden.device)]  # a split model ends on another GPU
        model = self.moe.model
        return model.get_output_embeddings()(_final_norm(model)(rows))

    def _moe_half(self, decoder_index: int, residual: torch.Tensor) -> torch.Tensor:
        """The second half of a pre-norm decoder layer: residual + block(post_attention_norm(residual))."""
        layer = self._layers[decoder_index]
        block = getattr(layer, self.moe.spec.block_attr)
        out = _hidden_of(block(layer.post_attention_layernorm(residual)))
        return residual + out.view(residual.shape)

    def _score_batch(self, accumulator: FitnessAccumulator, b: _SearchBatch, rows: torch.Tensor) -> None:
        for row in b.rows:
            if row.stop > row.start:
                accumulator.add([row.sample_id], rows[row.start : row.stop][None], answer_mask=row.mask)

    # -- racing ---------------------------------------------------------------------------------
    def _hopeless(self, accumulator: FitnessAccumulator, threshold: float) -> bool:
        """Even perfect scores on the unscored samples would leave the mean below ``threshold``."""
        n, k = self.num_samples, len(accumulator.per_sample)
        if k >= n:
            return False
        best = _BEST_SAMPLE_SCORE[self.fitness] + _RACE_MARGIN
        bound = (self.sign * math.fsum(accumulator.per_sample.values()) + (n - k) * best) / n
        return bound < threshold

    def _stop(self, allocation: Allocation, accumulator: FitnessAccumulator) -> float:
        k = len(accumulator.per_sample)
        self.raced[allocation] = k
        self.counters["raced"] += 1
        self.counters["samples_skipped_by_racing"] += self.num_samples - k
        return self.sign * math.fsum(accumulator.per_sample.values()) / k


def _close(got: torch.Tensor, reference: torch.Tensor) -> bool:
    """Max |diff| within a dtype-dependent tolerance times (1 + max |logit|)."""
    if not reference.numel():
        return True
    scale = 1.0 + float(reference.float().abs().max())
    diff = float((got.float() - reference.float()).abs().max())
    return diff <= _SELF_CHECK_TOL.get(reference.dtype, _SELF_CHECK_TOL_LOW_PRECISION) * scale


def _zero_counters() -> dict[str, int]:
    return dict.fromkeys(
        (
            "candidates",
            "batch_evaluations",
            "prefix_hits",
            "decoder_layers_run",
            "decoder_layers_skipped",
            "attention_skipped",
            "raced",
            "samples_skipped_by_racing",
        ),
        0,
    )


def _final_norm(model: nn.Module) -> nn.Module:
    base = getattr(model, "model", model)
    norm = getattr(base, "norm", None)
    if norm is None:
        raise MoePruneError(f"{type(model).__name__} has no final norm at model.norm")
    return norm


# ---------------------------------------------------------------------------------------------
# The search driver


def _elite_threshold(cache: Mapping[Allocation, float], elites: int) -> float | None:
    """The m-th best fitness evaluated so far (elites are always the top m of everything seen)."""
    if len(cache) < elites:
        return None
    return sorted(cache.values(), reverse=True)[elites - 1]


def _raced_path(state_path: Path | None) -> Path | None:
    return None if state_path is None else state_path.with_name(state_path.name + ".raced.json")


class _RaceLog:
    """Which evaluations were raced, in which generation; persisted beside the search state.

    A fresh search removes an old log; an allocation raced again after a crash is logged once.
    With ``write=False`` (every torchrun rank but 0) the log is read for a resume, never written.
    """

    def __init__(self, path: Path | None, resume: bool, write: bool = True) -> None:
        self.path = path
        self.write = write
        self.entries: dict[Allocation, dict[str, Any]] = {}
        if path is not None and not resume:
            if write:
                path.unlink(missing_ok=True)
        elif path is not None and path.is_file():
            self.entries = {tuple(e["allocation"]): e for e in json.loads(path.read_text())["raced"]}

    def add(self, allocation: Allocation, generation: int, samples: int) -> None:
        entry = {"allocation": list(allocation), "generation": generation, "samples_scored": samples}
        self.entries[allocation] = entry
        if self.path is not None and self.write:
            write_json(self.path, {"raced": self.listed()})

    def listed(self) -> list[dict[str, Any]]:
        return list(self.entries.values())

    def per_generation(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for entry in self.entries.values():
            counts[entry["generation"]] = counts.get(entry["generation"], 0) + 1
        return counts


def run_evo_search(
    moe: MoEModel,
    search_data: CalibrationData,
    orders: Sequence[Sequence[int]],
    budget: int,
    *,
    fitness: str = "esap",
    config: EvoConfig,
    state_path: str | Path | None = None,
    resume: bool = False,
    fingerprint: Mapping[str, Any],
    batch_size: int = 8,
    progress: bool = True,
    pad_token_id: int | None = None,
    fast: bool = True,
    race: bool = True,
    prefix_cache_bytes: int | None = None,
    candidate_context: CandidateContext | None = None,
    expert_multiple: int = 1,
) -> tuple[list[int], dict[str, Any]]:
    """EvoESAP over ``moe``: the best allocation (experts removed per MoE layer) and ``search.json``.

    Bad input fails before the teacher pass: an unknown fitness, population < elites, or a
    budget no feasible allocation meets. ``fingerprint`` (model, data, criterion, ...) and the
    fitness name must match the saved state for ``resume``. ``fast``/``race`` only change speed.
    Under torchrun (a joined process group, world > 1) every rank calls this with the same
    arguments: candidates are split over the ranks (module docstring), every rank returns the
    same allocation, and rank 0 alone writes ``state_path`` and its race log.
    """
    check_fitness(fitness)
    limits = layer_limits(moe, expert_multiple)  # every candidate keeps multiples of expert_multiple
    uniform = uniform_allocation(
        budget, limits.num_experts, limits.top_k, multiple_of=limits.multiples, max_removed=limits.caps
    )  # raises InfeasibleBudgetError with the reason
    path = Path(state_path) if state_path is not None else None
    if resume and (path is None or not path.is_file()):
        raise MoePruneError(f"cannot resume: no search state at {path}; run without resume")
    rank, world = rank_and_world()  # under torchrun: candidates split over ranks, rank 0 writes
    race_log = _RaceLog(_raced_path(path), resume, write=rank == 0)
    evaluator: CandidateEvaluator | None = None  # built below, after the cheap checks
    parallel = _DataParallel(lambda: evaluator, lambda: search, race_log, race) if world > 1 else None
    search = EvoSearch(  # validates the config (population >= elites) before any model runs
        lambda allocation: _evaluate(evaluator, search, race_log, allocation, race),
        budget,
        limits.caps,
        uniform,
        config,
        limits.multiples,
        state_path=path,
        fingerprint={**fingerprint, "fitness": fitness, "search_data": search_data.fingerprint},
        progress=progress and rank == 0,
        evaluate_many=parallel,
        write_state=rank == 0,
    )
    if search_data.text_only:
        _LOG.warning(TEXT_ONLY_NOTE)
    start = time.perf_counter()
    evaluator = CandidateEvaluator(
        moe, search_data, orders, fitness=fitness, batch_size=batch_size, seed=config.seed,
        pad_token_id=pad_token_id, fast=fast, prefix_cache_bytes=prefix_cache_bytes,
        candidate_context=candidate_context,
    )  # fmt: skip
    result = search.run(resume=resume)
    seconds = time.perf_counter() - start
    counters, distributed = dict(evaluator.counters), None
    if parallel is not None:  # every rank reaches this collective once, after the last generation
        per_rank = all_gather_objects(evaluator.counters)
        counters = {k: sum(c[k] for c in per_rank) for k in counters}
        distributed = {
            "world_size": world,
            "backend": torch.distributed.get_backend(),
            "evaluations_per_rank": [c["candidates"] for c in per_rank],
            "racing_threshold": "elite threshold at the start of each generation",
            "note": "candidates evaluated in parallel over ranks; elites and result equal one process,"
            " raced candidates' partial fitnesses (and generation means) may differ",
        }
    document = _search_document(
        evaluator, search, result, race_log, limits, tuple(uniform), seconds, race, counters, distributed
    )
    evaluator.release()  # the search and its closures form cycles: free the caches now, not at the next gc
    return list(result.best), document


def default_prefix_cache_bytes(moe: MoEModel, search_data: CalibrationData) -> int:
    """PREFIX_CACHE_COPIES x the MoE layers x one layer's states over the search set, at most 1 GiB."""
    tokens = sum(len(s.input_ids) for s in search_data.samples)
    element = next(moe.model.parameters()).element_size()
    one_layer = tokens * int(moe.config.hidden_size) * max(element, 4)
    return min(DEFAULT_PREFIX_CACHE_BYTES, PREFIX_CACHE_COPIES * len(moe.layers) * one_layer)


class _DataParallel:
    """``EvoSearch.evaluate_many`` under torchrun: one generation's new allocations, split over ranks.

    Rank r evaluates positions r, r+W, ... of ``allocations`` (``distributed.split_map``) against
    the elite threshold of the cache at the start of the generation, so its results do not depend
    on which candidates the other ranks got; every rank gets all (fitness, samples scored if
    raced) pairs in the given order.
    """

    def __init__(
        self, evaluator: Callable[[], CandidateEvaluator], search: Callable[[], EvoSearch], race_log: _RaceLog,
        race: bool,
    ) -> None:  # fmt: skip
        self.evaluator, self.search = evaluator, search
        self.race_log, self.race = race_log, race

    def __call__(self, generation: int, allocations: list[Allocation]) -> list[float]:
        search, evaluator = self.search(), self.evaluator()
        threshold = _elite_threshold(search.cache, search.config.elites) if self.race else None

        def one(allocation: Allocation) -> tuple[float, int | None]:
            return float(evaluator.evaluate(allocation, threshold)), evaluator.raced.get(allocation)

        results = split_map(one, allocations, "evaluating search candidates")
        for allocation, (_, samples) in zip(allocations, results):
            if samples is not None:
                self.race_log.add(allocation, generation, samples)
        return [value for value, _ in results]


def _evaluate(
    evaluator: CandidateEvaluator, search: EvoSearch, race_log: _RaceLog, allocation: Allocation, race: bool
) -> float:
    threshold = _elite_threshold(search.cache, search.config.elites) if race else None
    value = evaluator.evaluate(allocation, threshold)
    if allocation in evaluator.raced:
        race_log.add(allocation, len(search.history), evaluator.raced[allocation])
    return value


def _search_document(
    evaluator: CandidateEvaluator,
    search: EvoSearch,
    result: EvoResult,
    race_log: _RaceLog,
    limits: LayerLimits,
    uniform: Allocation,
    seconds: float,
    race: bool,
    counters: Mapping[str, int] | None = None,
    distributed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``search.json``: per generation best / mean / population fitness (in the fitness's own
    units: KL and NLL are not negated), the final and uniform allocations, cache size, timings.
    ``counters``: the speedup counters (summed over ranks under torchrun; default this evaluator's)."""
    sign = evaluator.sign
    counters = dict(evaluator.counters if counters is None else counters)
    raced = race_log.per_generation()
    generations = [
        {
            "generation": h.generation,
            "best": sign * h.best,
            "mean": sign * h.mean,
            "fitnesses": [sign * f for f in h.fitnesses],
            "new_evaluations": h.new_evaluations,
            "raced": raced.get(h.generation, 0),
            "best_allocation": h.best_allocation,
        }
        for h in result.history
    ]
    evaluations_here = counters["candidates"]
    document = {
        "fitness": evaluator.fitness,
        "higher_is_better": sign > 0,
        "config": asdict(search.config),
        "budget": search.feas.budget,
        "layers": limits.layers,
        "num_experts": limits.num_experts,
        "top_k": limits.top_k,
        "caps": limits.caps,
        "multiples": limits.multiples,
        "allocation": list(result.best),
        "fitness_value": sign * result.best_fitness,
        "uniform": {"allocation": list(uniform), "fitness_value": sign * search.cache[uniform]},
        "evaluations": result.evaluations,
        "stopped": result.stopped,
        "generations": generations,
        "search_samples": evaluator.num_samples,
        "teacher_cache": {
            "bytes": evaluator.cache_nbytes,
            "answer_positions": evaluator.teacher.num_positions,
            "vocab_size": evaluator.teacher.vocab_size,
        },
        "notes": evaluator.notes,
        "timings_s": {
            "teacher_pass": round(evaluator.teacher_seconds, 3),
            "total": round(seconds, 3),
            "per_evaluation": round((seconds - evaluator.teacher_seconds) / max(1, evaluations_here), 4),
        },
        "speedups": {
            "resume_mode": evaluator.mode,
            "racing": race,
            "prefix_cache_budget_bytes": evaluator.prefix_cache.max_bytes,
            "prefix_cache_peak_bytes": evaluator.prefix_cache.peak_bytes,
            "prefix_cache_evictions": evaluator.prefix_cache.evictions,
            **counters,
        },
        "raced_evaluations": race_log.listed(),
    }
    if distributed is not None:
        document["distributed"] = distributed
    return document
