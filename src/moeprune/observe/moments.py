"""A second, targeted observation pass: input/output co-moments of chosen experts (fp64).

Low-rank novices (surgery/lowrank.py) fit y ~ mu + B (h - hbar) by least squares over an
expert's routed tokens, which needs the d x d statistics cov(h) and cov(y, h). Those cost
2 d^2 x 8 bytes per expert, so they are collected only for the experts a plan removes, in a pass
run once the plan is known (the first pass, observer.py, keeps O(d) per expert for every expert).

Tokens stream through: per batch, each target expert's rows give a batch mean and centred
cross-products in fp64, merged into the running ones with Chan's parallel update (the matrix
form of the Welford merge the first pass uses), so no token is kept and the result does not
depend on how tokens were batched, up to rounding.

h is the expert's input as the expert sees it: the block input, times the routing weight for
Llama-4 (whose experts take g h); y is the expert's un-gated output, as for mu.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from moeprune.data.loading import CalibrationData
from moeprune.models import MoELayer, MoEModel
from moeprune.models.routed import RoutedOptions, RoutedRows, override_routed
from moeprune.observe.stats import F64
from moeprune.runtime.device import input_device
from moeprune.runtime.progress import progress_bar


@dataclass
class Moments:
    """One expert's running fp64 moments over its routed tokens."""

    count: float
    mean_h: torch.Tensor  # [d]
    mean_y: torch.Tensor  # [d]
    c_hh: torch.Tensor  # [d, d] sum_t (h_t - hbar)(h_t - hbar)^T
    c_yh: torch.Tensor  # [d, d] sum_t (y_t - mu)(h_t - hbar)^T
    yy: float = 0.0  # sum_t ||y_t - mu||^2: the constant novice's squared error (held-out checks)

    @classmethod
    def zeros(cls, d: int, device: torch.device | str = "cpu") -> Moments:
        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=F64, device=device)

        return cls(0.0, z(d), z(d), z(d, d), z(d, d))

    @classmethod
    def of(cls, h: torch.Tensor, y: torch.Tensor) -> Moments:
        """The moments of one batch of rows h [n, d], y [n, d] (computed in fp64)."""
        h64, y64 = h.to(F64), y.to(F64)
        mh, my = h64.mean(0), y64.mean(0)
        hc, yc = h64 - mh, y64 - my
        return cls(float(h.shape[0]), mh, my, hc.T @ hc, yc.T @ hc, float(yc.square().sum()))

    def merge(self, other: Moments) -> None:
        """Chan's update: exact for any split of the tokens (up to rounding)."""
        if other.count == 0:
            return
        if self.count == 0:
            self.count, self.mean_h, self.mean_y = other.count, other.mean_h.clone(), other.mean_y.clone()
            self.c_hh, self.c_yh, self.yy = other.c_hh.clone(), other.c_yh.clone(), other.yy
            return
        n_a, n_b = self.count, other.count
        n = n_a + n_b
        dh = (other.mean_h - self.mean_h).to(self.mean_h.device)
        dy = (other.mean_y - self.mean_y).to(self.mean_h.device)
        scale = n_a * n_b / n
        self.c_hh += other.c_hh.to(self.c_hh.device) + scale * torch.outer(dh, dh)
        self.c_yh += other.c_yh.to(self.c_yh.device) + scale * torch.outer(dy, dh)
        self.yy += other.yy + scale * float(dy.square().sum())
        self.mean_h += dh * (n_b / n)
        self.mean_y += dy * (n_b / n)
        self.count = n

    def to(self, device: torch.device | str) -> Moments:
        return Moments(
            self.count,
            self.mean_h.to(device),
            self.mean_y.to(device),
            self.c_hh.to(device),
            self.c_yh.to(device),
            self.yy,
        )


# decoder layer -> router position -> moments
LayerMoments = dict[int, dict[int, Moments]]


class _MomentAccumulator:
    def __init__(self, targets: Mapping[int, Sequence[int]]):
        self.targets = {layer: sorted(set(p)) for layer, p in targets.items() if p}
        self.moments: LayerMoments = {layer: {} for layer in self.targets}
        self.valid: torch.Tensor | None = None

    def __call__(self, layer: MoELayer, routed: RoutedRows) -> None:
        wanted = self.targets.get(layer.index)
        if not wanted:
            return
        assert self.valid is not None, "set valid before every batch"
        keep = self.valid.to(routed.rows.device)[routed.rows]
        for position in wanted:
            rows = keep & (routed.experts == position)
            if not bool(rows.any()):
                continue
            h = routed.inputs[rows]
            if layer.spec.weight_on_input:  # Llama-4's experts take g h
                h = h * routed.weights[rows].unsqueeze(1).to(h.dtype)
            batch = Moments.of(h, routed.outputs[rows])
            self.moments[layer.index].setdefault(position, Moments.zeros(h.shape[1], h.device)).merge(batch)


def observe_moments(
    moe: MoEModel,
    sets: Sequence[CalibrationData],
    targets: Mapping[int, Sequence[int]],
    *,
    batch_size: int = 8,
    pad_token_id: int = 0,
    progress: bool = True,
) -> LayerMoments:
    """Input/output co-moments of the experts `targets` names ({decoder layer: positions}), over
    every calibration set (domains pooled: the moments merge like the first pass's means).

    Memory: 2 d^2 fp64 values (16 d^2 bytes) per target expert; an expert no token reached has
    no entry."""
    acc = _MomentAccumulator(targets)
    if not acc.targets:
        return {}
    model = moe.model
    device = input_device(model)
    with torch.no_grad(), override_routed(moe, RoutedOptions(on_layer=acc)):
        for data in sets:
            total = (len(data.samples) + batch_size - 1) // batch_size
            batches = data.batches(batch_size, pad_token_id)
            for batch in progress_bar(
                batches, total=total, desc="observe (novice fit)", unit="batch", enabled=progress
            ):
                mask = batch.attention_mask.to(device)
                acc.valid = mask.reshape(-1).bool()
                model(input_ids=batch.input_ids.to(device), attention_mask=mask, use_cache=False)
    return {layer: {p: m.to("cpu") for p, m in by_pos.items()} for layer, by_pos in acc.moments.items()}
