"""EvoESAP on a real model: a candidate's fitness through reversible masks, fast.

A candidate allocation r (experts removed per MoE layer) is evaluated without copying the model:
:func:`~moeprune.models.reshape.mask_experts` removes the first r_l experts of each layer's pruning
order from routing (exactly equal to physical removal), the model runs over the search set and
the candidate's answer-position logits are scored against the full model's, which are computed
once into a :class:`~moeprune.fitness.TeacherCache`.

Speed (the search evaluates hundreds of candidates):

- Fitness cache: EvoSearch evaluates each distinct allocation once. Shared prefix: the state of MoE layer p depends only on r_0..r_{p-1}. Per batch it is cached
  (LRU, byte budget) keyed by that prefix; a candidate resumes at its longest cached prefix and
  runs only the layers from there on. The state is the layer's post-attention residual ("split"
  mode: the attention of the first differing layer is shared too, only its MoE half runs), or
  its input ("layer" mode). The decoder layers are called with the very arguments (masks,
  rotary embeddings, ...) that the model's own forward passed them during the teacher pass,
  captured by hooks, so nothing family-specific is rebuilt. A self-check on the first batch
  compares each mode with ``model(...)`` and keeps the first that matches; the plain forward is
  the fallback. Answer rows only: the final norm and LM head run on the scored positions only.
- Racing: after each batch, a candidate whose fitness could not reach the m-th best fitness seen
  so far even if every remaining sample scored perfectly stops there. Elites are always the top m
  of everything evaluated (the population keeps the previous elites), so such a candidate can
  never be an elite nor the result: the search's trajectory and selection are unchanged. Its
  recorded fitness is the mean over the samples it was scored on (always below that threshold).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from moeprune.allocate.basic import plan_removals
from moeprune.allocate.fitness import (
    FITNESSES,
    FitnessAccumulator,
    TeacherCache,
    check_fitness,
    higher_is_better,
)
from moeprune.allocate.limits import layer_limits
from moeprune.data.loading import Batch, CalibrationData
from moeprune.errors import DataError, MoePruneError
from moeprune.models.adapter import MoEModel, block_of, decoder_layers
from moeprune.models.reshape import mask_experts
from moeprune.runtime.device import Placement, input_device
from moeprune.runtime.progress import progress_bar
from moeprune.search.options import CandidateContext, SearchRuntime
from moeprune.search.population import Allocation
from moeprune.search.prefix import PrefixCache, default_prefix_cache_bytes
from moeprune.search.teacher import SearchBatch, SharedTeacher, prepare_batch, teacher_key

_LOG = logging.getLogger(__name__)

TEXT_ONLY_NOTE = "search data has no prompt/answer split: every token counts as answer"
# A sample's best score (the fitness's own bound) is padded for rounding (sum_v min(p, q) can
# exceed 1 by a few ulps): racing stays conservative.
_RACE_MARGIN = 1e-4
# Manual layer loop vs model(...) on the first batch: max |diff| allowed, times (1 + max |logit|).
_SELF_CHECK_TOL = {torch.float32: 1e-4, torch.float64: 1e-8}
_SELF_CHECK_TOL_LOW_PRECISION = 3e-2


# ---------------------------------------------------------------------------------------------
# Candidate evaluation

# How a candidate resumes inside a batch. SPLIT: from the post-attention residual of the first
# MoE layer that differs (its attention input, hence output, is shared), running only that
# layer's MoE half. LAYER: from the input of that decoder layer. PLAIN: model(...) every time.
SPLIT, LAYER, PLAIN = "split", "layer", "plain"


def _hidden_of(output: Any) -> torch.Tensor:
    """Decoder layers and MoE blocks return a tensor, or a tuple starting with it."""
    return output[0] if isinstance(output, tuple) else output


class CandidateEvaluator:
    """Fitness of allocations on one search set, with the full model as teacher.

    ``orders[l]`` lists the expert positions of MoE layer l (``moe.layers`` order), first pruned
    first; group-limited layers lose the earliest experts of every group evenly. ``evaluate``
    returns the value the search maximises (ESAP, SAP, -KL, -NLL); ``raw`` the fitness itself.
    ``runtime`` says how candidates run (batch size, padding, the teacher cache's device, the
    prefix cache's budget, the method's virtual form, progress; default: no progress bar);
    ``SearchRuntime(fast=False)`` forces the plain ``model(...)`` forward (the reference the tests
    compare to).
    """

    def __init__(
        self,
        moe: MoEModel,
        search_data: CalibrationData,
        orders: Sequence[Sequence[int]],
        *,
        fitness: str = "esap",
        seed: int = 0,
        runtime: SearchRuntime | None = None,
        plan_context: Callable[[Any], AbstractContextManager] | None = None,
        prefix_key: Callable[[Any], tuple] | None = None,
    ) -> None:
        runtime = runtime or SearchRuntime(progress=False)
        self.moe = moe
        # mixed genes (search/mixed_search.py): applied by plan_context, cached by a per-layer key
        self.plan_context = plan_context
        self.prefix_key = prefix_key
        self.progress = runtime.progress
        self.candidate_context: CandidateContext = runtime.candidate_context or (
            lambda removed: mask_experts(moe, removed)
        )
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
            runtime.prefix_cache_bytes
            if runtime.prefix_cache_bytes is not None
            else default_prefix_cache_bytes(moe, search_data)
        )
        self.raw_values: dict[Allocation, float] = {}
        self.raced: dict[Allocation, int] = {}  # allocation -> samples scored before it stopped
        self._layers = decoder_layers(moe.model)
        self._position = {layer: p for p, layer in enumerate(self.limits.layers)}  # decoder -> MoE
        self._taps: dict[int, torch.Tensor] = {}  # post-attention residuals seen in this batch
        self.counters = _zero_counters()
        key = teacher_key(search_data, runtime.batch_size, runtime.pad_token_id)
        given = runtime.teacher
        if isinstance(given, SharedTeacher) and given.key == key:  # one pass for several searches
            self._batches, self.teacher = list(given.batches), given.teacher
            self.mode, self.teacher_seconds = given.mode if runtime.fast else PLAIN, 0.0
        else:
            self._own_teacher(search_data, runtime)
        self.key = key

    def _own_teacher(self, search_data: CalibrationData, runtime: SearchRuntime) -> None:
        """The batches, the teacher pass and the fast path's self-check, for this search alone."""
        self._batches = [
            prepare_batch(b, self.device)
            for b in search_data.batches(runtime.batch_size, runtime.pad_token_id)
        ]
        start = time.perf_counter()
        self.teacher, reference = self._teacher_pass(runtime.teacher_device or self._teacher_home())
        self.teacher_seconds = time.perf_counter() - start
        if not self.teacher.per_sample:
            raise DataError("no search sample has an answer position: nothing to score")
        assert reference is not None, "a sample was scored, so a batch ran"
        self.mode = self._choose_mode(reference) if runtime.fast else PLAIN
        for b in self._batches:  # keep only what the chosen mode resumes from
            b.start = {self.mode: b.start[self.mode]} if self.mode in b.start else {}
            if self.mode == PLAIN:
                b.calls = {}
        self.counters = _zero_counters()  # the self-check does not count

    def shared(self) -> SharedTeacher:
        """This evaluator's teacher pass, for other searches on the same data to take."""
        return SharedTeacher(self.key, list(self._batches), self.teacher, self.mode, self.teacher_seconds)

    def release(self) -> None:
        """Drop the teacher distributions, cached states and batches: the evaluator is done."""
        self.prefix_cache.clear()
        self._batches, self._taps = [], {}
        del self.teacher  # read after release, it fails as the None it used to be set to did

    # -- setup --------------------------------------------------------------------------------
    def _teacher_home(self) -> torch.device:
        positions = sum(r.stop - r.start for b in self._batches for r in b.rows)
        return Placement.of(self.moe.model).cache_device(
            positions * int(self.moe.config.vocab_size) * 4, what="the teacher cache"
        )

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
    def _teacher_pass(self, teacher_device: torch.device | str) -> tuple[TeacherCache, torch.Tensor | None]:
        """One plain forward of the full model that also records how to resume inside it.

        Hooks capture each decoder layer's call arguments and, at the first MoE layer, its input
        and post-attention residual. Also returns the first batch's answer-row logits, the
        reference of the fast-path self-check.
        """
        teacher = TeacherCache(device=teacher_device)
        reference = None
        for b in progress_bar(
            self._batches, desc="teacher pass (full model, search data)", unit="batch", enabled=self.progress
        ):
            with self._recording(b):
                logits = self._plain_logits(b.batch)
            batch = b.batch
            teacher.add(b.ids, logits, batch.input_ids, batch.answer_mask, batch.attention_mask)
            if reference is None:
                reference = logits.flatten(0, 1)[b.flat_index]
        return teacher, reference

    @contextmanager
    def _recording(self, b: SearchBatch) -> Iterator[None]:
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

    def data_summary(self) -> dict[str, Any]:
        """search.json's account of the search data and the teacher cache (evo and gradient alike)."""
        return {
            "search_samples": self.num_samples,
            "teacher_cache": {
                "bytes": self.cache_nbytes,
                "answer_positions": self.teacher.num_positions,
                "vocab_size": self.teacher.vocab_size,
            },
            "notes": self.notes,
        }

    @property
    def batch_count(self) -> int:
        """Search batches held (the gradient allocation cycles through them)."""
        return len(self._batches)

    def answer_logits(self, index: int) -> tuple[torch.Tensor, Sequence[Any]]:
        """The model's logits as it computes now (whatever masks the caller applied, gradients
        kept) at search batch `index`'s answer positions [n, V], and the batch's rows: each has
        `sample_id` and the `start`/`stop` of its positions in those logits."""
        b = self._batches[index]
        return self._plain_logits(b.batch).flatten(0, 1)[b.flat_index], b.rows

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
        allocation = tuple(allocation) if self.plan_context is not None else tuple(int(r) for r in allocation)
        self.counters["candidates"] += 1
        accumulator = FitnessAccumulator(self.teacher, self.fitness, self.seed)
        virtual = self.plan_context or (lambda a: self.candidate_context(self.removals(a)))
        with virtual(allocation), self._tapping():
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

                norm = self._layers[decoder_index].get_submodule("post_attention_layernorm")
                handles.append(norm.register_forward_pre_hook(tap))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._taps.clear()

    def _candidate_rows(self, index: int, b: SearchBatch, allocation: Allocation) -> torch.Tensor:
        """Candidate logits at the batch's answer positions [n, V]."""
        self.counters["batch_evaluations"] += 1
        if self.mode == PLAIN:
            self.counters["decoder_layers_run"] += len(self._layers)
            return self._plain_logits(b.batch).flatten(0, 1)[b.flat_index]
        key = self.prefix_key(allocation) if self.prefix_key is not None else allocation
        p, state = self._longest_prefix(index, b, key)
        return self._run_layers(b, self.mode, p, state, index, key)

    def _longest_prefix(self, index: int, b: SearchBatch, allocation: Allocation) -> tuple[int, torch.Tensor]:
        for p in range(len(allocation) - 1, 0, -1):
            state = self.prefix_cache.get((index, allocation[:p]))
            if state is not None:
                self.counters["prefix_hits"] += 1
                return p, state
        return 0, b.start[self.mode]

    def _run_layers(
        self,
        b: SearchBatch,
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
            if q is not None and index is not None and mode == LAYER:
                self.prefix_cache.put((index, allocation[:q]), hidden)
            args, kwargs = b.calls[i]
            hidden = _hidden_of(self._layers[i](hidden, *args, **kwargs))
            if q is not None and index is not None and mode == SPLIT:
                self.prefix_cache.put((index, allocation[:q]), self._taps.pop(i))
        rows = hidden.flatten(0, 1)[b.flat_index.to(hidden.device)]  # a split model ends on another GPU
        model = self.moe.model
        return _lm_head(model)(_final_norm(model)(rows))

    def _moe_half(self, decoder_index: int, residual: torch.Tensor) -> torch.Tensor:
        """The second half of a pre-norm decoder layer: residual + block(post_attention_norm(residual))."""
        layer = self._layers[decoder_index]
        block = block_of(layer, self.moe.spec)
        assert block is not None, f"decoder layer {decoder_index} has no MoE block"
        out = _hidden_of(block(layer.get_submodule("post_attention_layernorm")(residual)))
        return residual + out.view(residual.shape)

    def _score_batch(self, accumulator: FitnessAccumulator, b: SearchBatch, rows: torch.Tensor) -> None:
        for row in b.rows:
            if row.stop > row.start:
                accumulator.add([row.sample_id], rows[row.start : row.stop][None], answer_mask=row.mask)

    # -- racing ---------------------------------------------------------------------------------
    def _hopeless(self, accumulator: FitnessAccumulator, threshold: float) -> bool:
        """Even perfect scores on the unscored samples would leave the mean below ``threshold``."""
        n, k = self.num_samples, len(accumulator.per_sample)
        if k >= n:
            return False
        best = FITNESSES.get(self.fitness).best_sample + _RACE_MARGIN
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


def _lm_head(model: nn.Module) -> nn.Module:
    if not isinstance(model, PreTrainedModel):
        raise MoePruneError(f"{type(model).__name__} is not a transformers model: no output embeddings")
    return model.get_output_embeddings()


def _final_norm(model: nn.Module) -> nn.Module:
    base = getattr(model, "model", model)
    norm = getattr(base, "norm", None)
    if norm is None:
        raise MoePruneError(f"{type(model).__name__} has no final norm at model.norm")
    return norm
