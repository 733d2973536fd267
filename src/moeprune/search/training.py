"""The gradient allocation's one training loop, with a pluggable relaxation (RCO's idea, arXiv
2605.00649): logits trained against the full model by projected Adam.

What differs between the searches is the relaxation (`Relaxation`): keep logits for drop counts
(search/gradient.py, one logit per expert, logistic noise, the sigmoid) and form logits for mixed
plans (search/form_training.py, one logit per expert and form, Gumbel noise, the softmax). Each
step, the loop here:

1. takes the temperature of the step (geometric from `temperature` to `temperature_end`);
2. has the relaxation sample a hard plan from the noisy logits, projected on the budget, and set
   the straight-through weights the model's forward reads (`sample`);
3. runs one search batch through the frozen model: the loss is the KL from the full model
   (teacher-forced answer positions, the evo fitness's teacher cache) on its `kl_top_k` most
   likely tokens, renormalised; every search sample weighs the same (`batch_loss`);
4. removes the gradient's component along the budget's normal (`project_gradient`), steps Adam,
   and puts the expected kept budget back (`retract`).

search.json's `training` holds one record per step: step, loss, temperature and what the
relaxation adds (`sample`'s return).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from moeprune.config import SearchConfig
from moeprune.models.adapter import MoEModel
from moeprune.runtime.progress import progress_bar
from moeprune.search.candidates import CandidateEvaluator


class Relaxation(Protocol):
    """How one gradient allocation turns its logits into a plan the model runs (module docstring)."""

    label: str  # the progress bar's

    def installed(self, moe: MoEModel) -> AbstractContextManager[None]:
        """The model's experts reading the weights `sample` sets, while inside; nothing after."""
        ...

    def sample(self, theta: torch.Tensor, generator: torch.Generator, tau: float) -> dict[str, Any]:
        """Draw noise, project a hard plan on the budget, set the straight-through weights; the
        step's record fields beyond step, loss and temperature."""
        ...

    def project_gradient(self, theta: torch.Tensor) -> None:
        """Remove from theta.grad its component along the budget's normal."""
        ...

    def retract(self, theta: torch.Tensor) -> torch.Tensor:
        """theta (float64) moved back onto the expected budget."""
        ...


def train_logits(
    moe: MoEModel,
    relaxation: Relaxation,
    theta: torch.Tensor,
    evaluator: CandidateEvaluator,
    config: SearchConfig,
    progress: bool,
) -> tuple[list[dict[str, Any]], float]:
    """Train `theta` in place (the model frozen, its parameters' flags restored after); each
    step's record for search.json and the seconds the training took."""
    began = time.perf_counter()
    optimizer = torch.optim.Adam([theta], lr=config.learning_rate)
    generator = torch.Generator().manual_seed(config.seed)
    frozen = [p.requires_grad for p in moe.model.parameters()]
    moe.model.requires_grad_(False)
    history: list[dict[str, Any]] = []
    bar = progress_bar(total=config.steps, desc=relaxation.label, unit="step", enabled=progress)
    try:
        with relaxation.installed(moe), torch.enable_grad():
            for step in range(config.steps):
                tau = temperature(config, step)
                record = relaxation.sample(theta, generator, tau)
                optimizer.zero_grad()
                loss = batch_loss(evaluator, step % evaluator.batch_count, config.kl_top_k)
                loss.backward()
                relaxation.project_gradient(theta)
                optimizer.step()
                with torch.no_grad():
                    theta.copy_(relaxation.retract(theta.detach().double()).float())
                history.append({"step": step, "loss": float(loss.detach()), "temperature": tau, **record})
                bar.set_postfix_str(f"top-{config.kl_top_k} KL {history[-1]['loss']:.4g}")
                bar.update(1)
    finally:
        bar.close()
        for p, flag in zip(moe.model.parameters(), frozen):
            p.requires_grad_(flag)
    return history, time.perf_counter() - began


def top_k_kl(teacher: torch.Tensor, logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per row KL(p_k || q_k) on the teacher's k most likely tokens, both renormalised over them
    (0 when the candidate equals the teacher; unlike RCO's, whose q is not renormalised)."""
    if 0 < k < teacher.shape[-1]:
        top, index = teacher.topk(k, dim=-1)
        logp = top - torch.logsumexp(top, dim=-1, keepdim=True)
        logq = torch.log_softmax(logits.float().gather(-1, index), dim=-1)
    else:
        logp, logq = teacher, torch.log_softmax(logits.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def batch_loss(evaluator: CandidateEvaluator, index: int, k: int) -> torch.Tensor:
    """Mean over the batch's samples of each sample's mean top-k KL (every sample weighs the same)."""
    logits, rows_of_samples = evaluator.answer_logits(index)
    losses = []
    for row in rows_of_samples:
        if row.stop == row.start:
            continue
        sample = evaluator.teacher.get(row.sample_id)
        assert sample is not None, "a scored row has a teacher sample"
        rows = logits[row.start : row.stop]
        losses.append(top_k_kl(sample.log_probs.to(rows.device), rows, k).mean())
    return torch.stack(losses).mean()


def temperature(config: SearchConfig, step: int) -> float:
    """The step's temperature: geometric from `temperature` to `temperature_end`."""
    if config.steps == 1:
        return config.temperature
    frac = step / (config.steps - 1)
    return config.temperature * (config.temperature_end / config.temperature) ** frac


def training_settings(config: SearchConfig) -> dict[str, Any]:
    """search.json's `config` of a gradient allocation (drop or mixed): what its training read."""
    return {
        k: getattr(config, k)
        for k in ("steps", "learning_rate", "temperature", "temperature_end", "kl_top_k", "seed")
    }


def rounded(values: torch.Tensor | Sequence[Any]) -> list[Any]:
    """Logits as search.json holds them: six decimals, rows kept."""
    return [rounded(v) if getattr(v, "ndim", 0) else round(float(v), 6) for v in values]


def timings(evaluator: CandidateEvaluator, train_seconds: float, eval_start: float, start: float) -> dict:
    """search.json's `timings_s` of a gradient allocation."""
    now = time.perf_counter()
    return {
        "teacher_pass": round(evaluator.teacher_seconds, 3),
        "training": round(train_seconds, 3),
        "evaluation": round(now - eval_start, 3),
        "total": round(now - start, 3),
    }
