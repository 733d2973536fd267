"""`--repair`: distil the pruned model toward the full one, training only small tensors.

Why: removing experts moves each layer's routed output (fewer experts share the routing mass), and
the layers after it see inputs they were not trained on. The router rows, a gain per layer, the
novices and the norms around the MoE blocks are a few thousand numbers per layer that can move the
pruned model back toward the full one without touching the experts (parts.py lists them).

How: Adam on fp32 master copies of the trained tensors only (optimizer state for them alone; a bf16
model computes in bf16, its tensors get the rounded masters before each step), loss = the KL from
the full model on its top-k tokens at every calibration position (teacher.py), one calibration batch
per step. Every `eval_every` steps the held-out fitness (the searches' fitness on the search data,
or on a held-back share of the calibration samples) is measured; training stops after `patience`
evaluations without a better one, and the best tensors are kept. The unrepaired model is the first
evaluation: when nothing beats it (after the gains are folded, measured again), the original
tensors are put back exactly, so repair never lowers the held-out fitness.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moeprune.allocate.fitness import higher_is_better
from moeprune.config import RepairConfig
from moeprune.data.loading import CalibrationData
from moeprune.models import MoEModel
from moeprune.repair.parts import Trained, applied_gains, collect, fold_gains, unfold_gains
from moeprune.repair.teacher import (
    HeldOut,
    TrainBatch,
    held_out_fitness,
    held_out_teacher,
    split_held_out,
    training_teacher,
)
from moeprune.runtime.progress import progress_bar


@dataclass
class RepairData:
    """What the full model said, computed before surgery (`prepare_repair`)."""

    train: list[TrainBatch]
    held: HeldOut
    fitness: str
    seed: int
    seconds: float


def prepare_repair(
    moe: MoEModel,
    config: RepairConfig,
    sets: Sequence[CalibrationData],
    search: CalibrationData | None,
    *,
    fitness: str = "esap",
    seed: int = 0,
    batch_size: int = 8,
    pad: int = 0,
) -> RepairData:
    """The full model's distributions on the training and the held-out tokens (before surgery)."""
    start = time.perf_counter()
    train, held, source = split_held_out(sets, search, config.holdout)
    moe.model.eval()
    return RepairData(
        training_teacher(moe, train, config.kl_top_k, batch_size, pad),
        held_out_teacher(moe, held, source, batch_size, pad),
        fitness,
        seed,
        time.perf_counter() - start,
    )


@dataclass
class _State:
    """The trained tensors' fp32 masters, their optimizer, and the best ones seen."""

    trained: list[Trained]
    masters: list[torch.Tensor]
    originals: list[torch.Tensor]
    reached: set[int] = field(default_factory=set)  # tensors a gradient reached

    @classmethod
    def of(cls, trained: list[Trained]) -> _State:
        masters = [t.tensor if t.gain_of is not None else t.tensor.detach().float().clone() for t in trained]
        for m in masters:
            m.requires_grad_(True)
        return cls(trained, masters, [t.tensor.detach().clone() for t in trained])

    @torch.no_grad()
    def push(self) -> None:
        """The masters into the model's tensors (rounded to their dtype)."""
        for t, m in zip(self.trained, self.masters):
            if t.gain_of is None:
                t.tensor.copy_(m.to(t.tensor.dtype))

    def pull_gradients(self) -> None:
        for i, (t, m) in enumerate(zip(self.trained, self.masters)):
            grad = m.grad if t.gain_of is not None else t.tensor.grad
            if grad is not None:
                self.reached.add(i)
                if t.gain_of is None:
                    m.grad = grad.float()
                    t.tensor.grad = None

    def snapshot(self) -> list[torch.Tensor]:
        return [m.detach().clone() for m in self.masters]

    @torch.no_grad()
    def load(self, values: Sequence[torch.Tensor]) -> None:
        for m, v in zip(self.masters, values):
            m.copy_(v.to(m.dtype))
        self.push()

    @torch.no_grad()
    def restore(self) -> None:
        """The unrepaired tensors, exactly."""
        for t, original in zip(self.trained, self.originals):
            t.tensor.copy_(original)


def _summary(state: _State, data: RepairData, config: RepairConfig) -> dict[str, Any]:
    parts: dict[str, dict[str, int]] = {}
    for t in state.trained:
        row = parts.setdefault(t.part, {"tensors": 0, "parameters": 0})
        row["tensors"] += 1
        row["parameters"] += t.tensor.numel()
    untouched = [t.name for i, t in enumerate(state.trained) if i not in state.reached]
    return {
        "parts": list(config.part_names),
        "trained": [{"part": p, **row} for p, row in parts.items()],
        "no_gradient": untouched,
        "fitness": data.fitness,
        "held_out": data.held.source,
        "held_out_samples": data.held.samples,
        "calibration_positions": sum(int(b.flat_index.numel()) for b in data.train),
    }


def run_repair(
    moe: MoEModel, config: RepairConfig, data: RepairData, *, progress: bool = True
) -> dict[str, Any]:
    """Train the pruned model's small tensors toward the full model (in place); returns the report's
    `repair` part: what was trained, the held-out fitness before and after, whether it was kept."""
    start = time.perf_counter()
    sign = 1.0 if higher_is_better(data.fitness) else -1.0
    state = _State.of(collect(moe, config.part_names))
    before = held_out_fitness(moe, data.held, data.fitness, data.seed)
    history: list[dict[str, float]] = [{"step": 0, data.fitness: before}]
    best, best_step, best_values = before, 0, None
    losses: list[float] = []
    frozen = [p.requires_grad for p in moe.model.parameters()]
    moe.model.requires_grad_(False)
    for t in state.trained:
        t.tensor.requires_grad_(True)
    optimizer = torch.optim.Adam(state.masters, lr=config.learning_rate)
    bar = progress_bar(total=config.steps, desc="repair", unit="step", enabled=progress)
    try:
        with applied_gains(state.trained), torch.enable_grad():
            waited = 0
            for step in range(1, config.steps + 1):
                batch = data.train[(step - 1) % len(data.train)]
                optimizer.zero_grad()
                logits = moe.model(
                    input_ids=batch.batch.input_ids,
                    attention_mask=batch.batch.attention_mask,
                    use_cache=False,
                ).logits
                loss = batch.loss(logits)
                loss.backward()
                state.pull_gradients()
                optimizer.step()
                state.push()
                losses.append(float(loss.detach()))
                bar.update(1)
                if step % config.eval_every and step != config.steps:
                    continue
                value = held_out_fitness(moe, data.held, data.fitness, data.seed)
                history.append({"step": step, data.fitness: value})
                bar.set_postfix_str(f"KL {losses[-1]:.4g}, held-out {data.fitness} {value:.4f}")
                if math.isfinite(value) and sign * value > sign * best:
                    best, best_step, best_values, waited = value, step, state.snapshot(), 0
                else:
                    waited += 1
                    if waited >= config.patience:
                        break
            if best_values is not None:
                state.load(best_values)
    finally:
        bar.close()
        for t in state.trained:
            t.tensor.requires_grad_(False)
            t.tensor.grad = None
        for p, flag in zip(moe.model.parameters(), frozen):
            p.requires_grad_(flag)
    kept, after = best_values is not None, before
    if kept:
        folded = fold_gains(state.trained)
        after = held_out_fitness(moe, data.held, data.fitness, data.seed)  # as saved: gains folded
        if not sign * after > sign * before:  # the fold's rounding lost the gain: the original back
            unfold_gains(folded)
            kept, after = False, before
    if not kept:
        state.restore()
    return _summary(state, data, config) | {
        "before": before,
        "after": after,
        "kept": kept,
        "best_step": best_step if kept else 0,
        "steps_run": len(losses),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "history": history,
        "seconds": {
            "teacher": round(data.seconds, 3),
            "training": round(time.perf_counter() - start, 3),
        },
    }
