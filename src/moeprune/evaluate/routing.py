"""How a pruned model's expert selection frequencies moved away from the reference's.

Why original ids: after surgery a layer's experts are renumbered, so frequencies are compared
by the ids the experts had in the full model: the ids the model carries (moeprune format, or an
in-memory pruned model), else the ``kept`` lists of the ``plan.json`` saved beside a stock
checkpoint. Counts come from the observer (padding excluded, the router's own selection).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.adapter import EXPERT_IDS_ATTR
from moeprune.observe.kinds import NONE
from moeprune.observe.observer import observe
from moeprune.plan import Plan

PLAN_FILE = "plan.json"


def original_ids(moe: MoEModel, checkpoint: str | Path | None = None) -> dict[int, list[int]]:
    """Per MoE layer, the original id of each expert the model holds, in storage order."""
    plan_path = Path(checkpoint) / PLAN_FILE if checkpoint else None
    carried = all(getattr(m.block, EXPERT_IDS_ATTR, None) is not None for m in moe.layers)
    if carried or plan_path is None or not plan_path.is_file():
        return {m.index: m.expert_ids for m in moe.layers}
    plan = Plan.load(plan_path)
    ids = {}
    for m in moe.layers:
        kept = plan.layer(m.index).kept
        if len(kept) != m.num_experts:
            raise MoePruneError(
                f"{plan_path}: layer {m.index} keeps {len(kept)} experts but the checkpoint has {m.num_experts}; "
                "the plan does not belong to this model"
            )
        ids[m.index] = list(kept)
    return ids


def selection_frequencies(
    moe: MoEModel, data: CalibrationData, ids: dict[int, list[int]], *, batch_size: int, pad_token_id: int
) -> tuple[dict[int, dict[int, float]], int]:
    """Per layer, {original id: fraction of tokens that selected it} (sums to top_k), and tokens seen."""
    stats = observe(
        moe, data, batch_size=batch_size, pad_token_id=pad_token_id, progress=False, statistics=NONE
    )  # counts only
    tokens = max(stats.tokens, 1)
    freq = {}
    for m, layer_stats in zip(moe.layers, stats.layers):
        counts = layer_stats.count.tolist()
        freq[m.index] = {orig: counts[pos] / tokens for pos, orig in enumerate(ids[m.index])}
    return freq, stats.tokens


def routing_shift(
    model_freq: dict[int, dict[int, float]], ref_freq: dict[int, dict[int, float]]
) -> dict[str, object]:
    """Per layer: frequencies by original id, their change, and summaries.

    ``tv`` is the total variation between the two selection distributions (frequencies divided
    by their sum, top_k), ``dropped_mass`` the share of the reference's selections that went to
    experts the model no longer has, ``max_abs_change`` the largest per-expert change.
    """
    missing = sorted(set(ref_freq) ^ set(model_freq))
    if missing:
        raise MoePruneError(f"model and reference have different MoE layers ({missing} in only one)")
    layers = []
    for index in sorted(ref_freq):
        experts = sorted(set(ref_freq[index]) | set(model_freq[index]))
        ref = np.array([ref_freq[index].get(e, 0.0) for e in experts])
        mod = np.array([model_freq[index].get(e, 0.0) for e in experts])
        ref_p, mod_p = ref / max(ref.sum(), 1e-30), mod / max(mod.sum(), 1e-30)
        gone = [i for i, e in enumerate(experts) if e not in model_freq[index]]
        layers.append(
            {
                "layer": index,
                "experts": experts,
                "reference": ref.round(6).tolist(),
                "model": mod.round(6).tolist(),
                "change": (mod - ref).round(6).tolist(),
                "tv": float(0.5 * np.abs(mod_p - ref_p).sum()),
                "dropped_mass": float(ref_p[gone].sum()) if gone else 0.0,
                "max_abs_change": float(np.abs(mod - ref).max()),
            }
        )
    return {"mean_tv": float(np.mean([lay["tv"] for lay in layers])), "layers": layers}
