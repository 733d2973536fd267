"""Neuron surgery (ENP / TENP): routed experts keep their most important intermediate neurons.

For y = W_down m (+ b) with m = act(W_gate h) * (W_up h), neuron k's share is
y_k = W_down[:, k] m_k. Its importance is the mean over the expert's routed tokens of
<y_k, y> / (||y|| + 1e-8) ("projection", the default) or of ||y_k|| ("l2"), read from the
observer's neuron sums (``observe(..., neurons=True)``). Keeping neuron k keeps row k of W_gate
and W_up, column k of W_down, and gpt_oss's per-neuron gate/up biases.

Which families qualify: every supported family is gated with one activation value per neuron.
gpt_oss's clamped variant, m_k = clamp(g_k) sigmoid(alpha clamp(g_k)) (clamp(u_k) + 1), is still
elementwise per neuron, so removing neuron k removes exactly y_k: it qualifies. A family whose
experts are not stored in a known gated layout gets a MoePruneError naming it.

Physical forms (virtual: ``override_routed(..., neuron_masks=...)``):

- the same K for every expert of every layer: tensors stay rectangular and the config's
  intermediate field becomes K, so stock ``from_pretrained`` reloads the result. Where the shared
  expert's width derives from that field (DeepSeek-V2/V3, GLM-4-MoE: ``moe_intermediate_size *
  n_shared_experts``; ERNIE: ``* moe_num_shared_experts``), the multiplier becomes ceil(W / K) and
  the shared expert is padded with zero neurons up to K * ceil(W / K): a zero neuron adds exactly
  nothing (act(0) * 0 = 0, zero down column). Llama-4 builds its shared expert from the very same
  field with no multiplier, so it cannot be expressed: it is packed instead. So is a K that is not
  a multiple of 8: transformers' default grouped_mm kernel needs 16-byte strides, and a stock
  checkpoint that fails on its default kernel is worse than a moeprune one.
- different K per expert (TENP): packed layers (models/packed.py), saved in moeprune's format.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

from moeprune.allocate.basic import check_ratio
from moeprune.config import NEURON_STATS, MethodOptions, PruneConfig, setting
from moeprune.criteria.super_experts import NEURONS_WHOLE
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoELayer, MoEModel, set_path
from moeprune.models.packed import (
    NEURON_AXES,
    ExpertCost,
    expert_tensor_names,
    is_packed,
    layer_cost,
    slice_neurons,
)
from moeprune.observe.stats import F64, LayerStats
from moeprune.plan import LayerPlan, Plan
from moeprune.surgery.genes import LayerKeep
from moeprune.surgery.novice import StatsInput, layer_stats, require_stats
from moeprune.surgery.parameters import plan_routed_parameters, routed_parameters
from moeprune.surgery.registry import METHODS, PARAMETERS, Method, PlanRequest, options_as
from moeprune.surgery.sizes import WeightBytes
from moeprune.surgery.target_size import planned_bytes
from moeprune.surgery.widths import (
    STOCK_MULTIPLE,
    check_width_multiple,
    guarded_shared,
    nearest_multiple,
    promoted_widths,
    width_step,
)

IMPORTANCE: dict[str, str] = {"projection": "neuron_proj_sum", "l2": "neuron_l2_sum"}
SHARED_MULTIPLIERS = (
    "n_shared_experts",
    "moe_num_shared_experts",
    "num_shared_experts",
)  # shared width = I * this
_WIDTH_ATTRS = ("intermediate_dim", "intermediate_size", "expert_dim")  # on experts modules
Keep = Mapping[int, Mapping[int, torch.Tensor]]  # decoder layer -> position -> kept neuron ids


def check_neuron_prunable(moe: MoEModel) -> None:
    """MoePruneError unless every MoE layer has gated (SwiGLU-like) or ungated experts in a known
    layout (one activation value per neuron either way)."""
    for layer in moe.layers:
        reason = _not_gated(layer)
        if reason:
            raise MoePruneError(
                f"neuron pruning needs SwiGLU-like experts (m = act(W_gate h) * (W_up h), one value per "
                f"neuron); {moe.model_type} layer {layer.index} {reason}"
            )


def _not_gated(layer: MoELayer) -> str | None:
    if is_packed(layer):
        return "already holds novices or per-expert widths: prune neurons before, not after"
    if layer.spec.layout not in NEURON_AXES:
        return f"stores its experts as {layer.spec.layout!r}, not a gated gate/up + down layout"
    if not (hasattr(layer.experts, "act_fn") or hasattr(layer.experts, "_apply_gate")):
        return f"has no gated activation on {type(layer.experts).__name__}"
    if not {"gate_up_proj", "up_proj"} & set(expert_tensor_names(layer)):
        return f"has no fused gate/up projection on {type(layer.experts).__name__}"
    return None


def check_importance(kind: str) -> str:
    if kind not in IMPORTANCE:
        raise MoePruneError(
            f"unknown neuron importance {kind!r}; choose one of: {', '.join(IMPORTANCE)}",
            options=("neuron_importance",),
        )
    return kind


@dataclass(frozen=True)
class NeuronOptions(MethodOptions):
    """The neuron methods' own setting: how intermediate neurons are ranked."""

    neuron_importance: str = setting(
        "projection",
        "neurons/tenp/mixed: rank intermediate neurons by projection onto the expert output, or by L2 norm.",
        choices=tuple(IMPORTANCE),
    )

    def __post_init__(self) -> None:
        check_importance(self.neuron_importance)


@dataclass(frozen=True)
class NarrowOptions(NeuronOptions):
    """The neurons and TENP methods' settings: how neurons rank, which widths are kept."""

    width_multiple: int | None = setting(
        None,
        "neurons/tenp/mixed: every narrowed expert width is a multiple of N (the full width is always allowed) "
        "[default: the group size with --quantize, else 32 where the expert width allows it; surgery/widths.py].",
        minimum=1,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_width_multiple(self.width_multiple)


def neuron_importance(stats: LayerStats, kind: str = "projection") -> torch.Tensor:
    """[E, I] fp64: mean importance of each neuron over its expert's routed tokens (0 if unseen)."""
    sums = getattr(stats, IMPORTANCE[check_importance(kind)])
    if sums is None:
        raise MoePruneError(
            f"layer {stats.layer}: the statistics have no neuron sums; observe with neurons=True "
            "(neuron surgery needs them)"
        )
    count = stats.count.to(F64).unsqueeze(1)
    return torch.where(count > 0, sums.to(F64) / count.clamp(min=1), torch.zeros_like(sums, dtype=F64))


def top_neurons(importance: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending ids of the k most important neurons (ties: the lower id)."""
    if not 1 <= k <= importance.numel():
        raise MoePruneError(f"cannot keep {k} of {importance.numel()} neurons; keep between 1 and all")
    order = torch.argsort(-importance, stable=True)
    return order[:k].sort().values


def kept_neurons(
    layer: MoELayer, stats: LayerStats, counts: Mapping[int, int], kind: str = "projection"
) -> dict[int, torch.Tensor]:
    """{position: kept neuron ids} for the experts whose count is below the full width."""
    if not counts:
        return {}
    importance = neuron_importance(stats, kind)
    width = layer.intermediate_size
    return {p: top_neurons(importance[p], int(k)) for p, k in counts.items() if int(k) < width}


def neuron_masks(layer: MoELayer, keep: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The virtual form: {position: 0/1 mask over the intermediate neurons}."""
    masks = {}
    for p, ids in keep.items():
        mask = torch.zeros(layer.intermediate_size, device=cast(torch.Tensor, layer.experts.down_proj).device)
        mask[ids.to(mask.device)] = 1
        masks[p] = mask
    return masks


# ----------------------------------------------------------------------------- uniform (stock) form
def shared_multiplier(moe: MoEModel) -> str | None:
    """The config field the shared experts' width is multiplied by: the config's own field
    first (config.json holds it under that name), else a name the config maps onto one."""
    own = vars(moe.config)
    return next((f for f in SHARED_MULTIPLIERS if own.get(f) is not None), None) or next(
        (f for f in SHARED_MULTIPLIERS if getattr(moe.config, f, None) is not None), None
    )


def _multiplier_resizes_shared(moe: MoEModel) -> bool:
    """Whether the shared experts are one gate/up/down MLP whose width is the multiplier field
    times the expert width (DeepSeek): padded, then it still is. Inkling's `n_shared_experts`
    counts separate shared experts (and the router's sink rows scoring them) instead."""
    return shared_multiplier(moe) is not None and all(
        isinstance(getattr(module, name, None), nn.Linear)
        for layer in moe.layers[:1]
        for module in layer.shared_modules
        for name in ("gate_proj", "up_proj", "down_proj")
    )


def stock_width_expressible(moe: MoEModel, width: int | None = None) -> bool:
    """Whether a stock checkpoint can hold uniform expert width `width` and still run.

    The config must state it without changing the shared expert, and the width must keep
    grouped_mm's 16-byte strides (a multiple of 8 neurons, unless the original width is not).
    """
    if moe.spec.shared_width_derived and not _multiplier_resizes_shared(moe) or moe.spec.dense_width_derived:
        return False
    full = moe.layers[0].intermediate_size
    return width is None or width % STOCK_MULTIPLE == 0 or full % STOCK_MULTIPLE != 0


def uniform_width(moe: MoEModel, keep: Keep) -> int | None:
    """K when every expert of every layer keeps K < I neurons (a rectangular, stock result)."""
    widths = {
        len(keep.get(m.index, {}).get(p, range(m.intermediate_size)))
        for m in moe.layers
        for p in range(m.num_experts)
    }
    full = {m.intermediate_size for m in moe.layers}
    if len(widths) != 1 or len(full) != 1 or widths == full:
        return None
    return widths.pop()


def shrink_uniform(moe: MoEModel, keep: Keep) -> None:
    """Every expert keeps its own K neurons; tensors stay rectangular, the config says K."""
    width = uniform_width(moe, keep)
    if width is None or not stock_width_expressible(moe, width):
        raise MoePruneError(
            "shrink_uniform needs the same neuron count for every expert of a stock-expressible family"
        )
    full = moe.layers[0].intermediate_size
    for layer in moe.layers:
        for name in expert_tensor_names(layer):
            param = getattr(layer.experts, name).detach()
            rows = [
                slice_neurons(layer.spec.layout, name, param[p], keep[layer.index][p], full)
                for p in range(layer.num_experts)
            ]
            # rows of extra experts without weights of their own (LongCat's zero experts in
            # gate_up_proj): never computed, cut to the new width so the stock shapes hold
            first = torch.arange(width, device=param.device)
            rows += [
                slice_neurons(layer.spec.layout, name, param[p], first, full)
                for p in range(layer.num_experts, param.shape[0])
            ]
            set_path(layer.experts, name, torch.stack(rows))
        _set_int_attrs(layer.experts, _WIDTH_ATTRS, full, width)
    _resize_shared(moe, full, width)
    setattr(moe.config, moe.spec.intermediate_field, width)


def _set_int_attrs(module: nn.Module, names: Sequence[str], old: int, new: int) -> None:
    for name in names:
        if getattr(module, name, None) == old:
            setattr(module, name, new)


def _resize_shared(moe: MoEModel, full: int, width: int) -> None:
    """Keep a derived shared expert exactly as it was: multiplier ceil(W / K), zero-padded to K * it."""
    if not moe.spec.shared_width_derived:
        return
    field = shared_multiplier(moe)
    assert field is not None, "a derived shared-expert width without a multiplier field"
    multiplier = int(getattr(moe.config, field) or 0)
    if multiplier <= 0:
        return
    new_multiplier = math.ceil(full * multiplier / width)
    for layer in moe.layers:
        for module in layer.shared_modules:
            pad_mlp(module, width * new_multiplier)
    setattr(moe.config, field, new_multiplier)


def pad_mlp(module: nn.Module, width: int) -> None:
    """Widen a gate/up/down MLP to `width` neurons with zero weights (its output is unchanged)."""
    for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        linear = getattr(module, name)
        extra = width - linear.weight.shape[dim]
        if extra <= 0:
            continue
        pad = [0, 0, 0, extra] if dim == 0 else [0, extra]
        linear.weight = nn.Parameter(nn.functional.pad(linear.weight.detach(), pad))
        if dim == 0 and linear.bias is not None:
            linear.bias = nn.Parameter(nn.functional.pad(linear.bias.detach(), [0, extra]))
        if dim == 0:
            linear.out_features = width
        else:
            linear.in_features = width
    if hasattr(module, "intermediate_size"):
        mlp: Any = module  # nn.Module does not declare the family's width attribute
        mlp.intermediate_size = width


# ----------------------------------------------------------------------------- plans
def uniform_keep(cost: ExpertCost, width: int, ratio: float, step: int = 1) -> int:
    """Neurons K so that an expert keeps the fraction `ratio` of its parameters: the multiple of
    `step` nearest that (the full width always allowed; surgery/widths.py says which step).
    transformers' default grouped_mm experts kernel needs 16-byte strides, so a stock checkpoint
    needs K a multiple of 8 (bf16/fp16; 4 in fp32).
    """
    check_ratio(ratio, "neuron keep ratio (1 - sparsity)")
    target = (ratio * cost.params(width) - cost.per_expert) / cost.per_neuron
    k = nearest_multiple(target, step, width)
    if k < 1:
        raise MoePruneError(
            f"keeping {ratio:.4g} of each expert's parameters leaves less than "
            f"{'one neuron' if step == 1 else f'one block of {step} neurons'} of its {width}; lower the sparsity"
            + ("" if step == 1 else " or the width multiple"),
            options=("sparsity", "width_multiple"),
        )
    return k


def check_neuron_stats(moe: MoEModel, stats: StatsInput | None, kind: str) -> None:
    """Early bad-input check: statistics exist, match the model, and carry neuron sums."""
    domains = require_stats(stats, "neuron surgery (neuron importance comes from calibration data)")
    for layer in moe.layers:
        neuron_importance(layer_stats(domains, layer), kind)


def neuron_keep_ratio(sparsity: float) -> float:
    """1 - sparsity, checked: the fraction of each routed expert's parameters ENP keeps."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, int | float):
        raise MoePruneError(f"sparsity must be a number, got {sparsity!r}")
    return check_ratio(1 - sparsity, f"neuron keep ratio 1 - sparsity (sparsity {sparsity!r})")


def uniform_widths(moe: MoEModel, sparsity: float, width_multiple: int | None = None) -> list[int]:
    """ENP's K per MoE layer, a multiple of its layer's step (`width_step`, grouped_mm's 8 as the
    floor): needs no statistics, so a sparsity that cannot be met fails before any calibration
    pass (works on a meta-device model)."""
    ratio = neuron_keep_ratio(sparsity)
    return [
        uniform_keep(
            layer_cost(m),
            m.intermediate_size,
            ratio,
            width_step(m.intermediate_size, width_multiple, STOCK_MULTIPLE),
        )
        for m in moe.layers
    ]


def neuron_plan(
    moe: MoEModel,
    stats: StatsInput | None,
    sparsity: float,
    *,
    importance: str = "projection",
    width_multiple: int | None = None,
    criterion: str | None = None,
    data_fingerprint: str = "",
) -> Plan:
    """ENP: every routed expert keeps the fraction 1 - sparsity of its parameters (its top-K neurons).

    K is the nearest multiple of the layer's width step (see :func:`uniform_keep`); the plan's
    extra records the parameter fraction actually kept. A layer's super experts (`moe.protected`,
    the guard) stay whole and its other experts share the widest width that keeps no more than K
    would (`guarded_width`), some of them one step wider with what that leaves (`promoted_widths`): the
    result is then in moeprune's format (per-expert widths).
    """
    check_neuron_prunable(moe)
    check_neuron_stats(moe, stats, check_importance(importance))
    ratio = neuron_keep_ratio(sparsity)
    layers, steps, whole = [], [], {}
    for m, k in zip(moe.layers, uniform_widths(moe, sparsity, width_multiple)):
        ids = m.expert_ids
        steps.append(width_step(m.intermediate_size, width_multiple, STOCK_MULTIPLE))
        guarded = sorted(set(moe.protected.get(m.index, ())) & set(ids))
        neurons = {e: k for e in ids} if k < m.intermediate_size else {}
        if neurons and guarded:  # moeprune's format anyway: grouped_mm's floor of 8 does not apply
            shared, steps[-1] = guarded_shared(m, len(guarded), k, width_multiple)
            neurons = promoted_widths(
                m, [e for e in ids if e not in guarded], len(guarded), k, shared, steps[-1]
            )
            whole[str(m.index)] = guarded
        layers.append(
            LayerPlan(
                layer=m.index, num_experts=m.num_experts, top_k=m.top_k, kept=sorted(ids), neurons=neurons
            )
        )
    plan = Plan.create(
        model_type=moe.model_type,
        layers=layers,
        criterion=criterion or f"{importance} neuron importance",
        allocation="uniform",
        method="neurons",
        sparsity=sparsity,
        data_fingerprint=data_fingerprint,
        extra={
            "neuron_importance": importance,
            "neuron_keep_ratio": ratio,
            "width_multiple": dict(zip([str(m.index) for m in moe.layers], steps)),
            **({"super_experts_whole": whole} if whole else {}),
        },
    )
    plan.validate({m.index: m.intermediate_size for m in moe.layers})
    kept = plan_routed_parameters(moe, plan)["routed_experts"]
    plan.extra["routed_parameters_kept_fraction"] = kept / routed_parameters(moe)["routed_experts"]
    return plan


def _asked(config: PruneConfig) -> int | None:
    """The config's width multiple (None: the default rule of surgery/widths.py)."""
    return options_as(config, NarrowOptions).width_multiple


def _neuron_steps(
    moe: MoEModel, config: PruneConfig, size: WeightBytes, _target: int
) -> list[tuple[float, int]]:
    """(sparsity, planned bytes) of every width step below the full width: the sparsity each width
    keeps exactly (1 - params(K) / params(I)), from the widest step down."""
    check_neuron_prunable(moe)
    asked = _asked(config)
    candidates = set()
    for m in moe.layers:
        cost, full = layer_cost(m), m.intermediate_size
        step = width_step(full, asked, STOCK_MULTIPLE)
        for k in range((full - 1) // step * step, 0, -step):
            candidates.add(1 - cost.params(k) / cost.params(full))
    out = []
    for sparsity in sorted(candidates):
        try:
            out.append(
                (sparsity, planned_bytes(moe, replace(config, sparsity=sparsity, target_size=None), size))
            )
        except MoePruneError:  # less than one block of neurons left
            continue
    return out


def _neuron_feasible(moe: MoEModel, config: PruneConfig) -> dict:
    widths = uniform_widths(moe, config.sparsity_value(), _asked(config))
    return {"neurons_per_expert": dict(zip([m.index for m in moe.layers], widths))}


def _neuron_keeps(meta: MoEModel, config: PruneConfig) -> list[LayerKeep]:
    """Every routed expert of a layer at the uniform width K of that layer."""
    ks = uniform_widths(meta, config.sparsity_value(), _asked(config))
    return [LayerKeep((k,) * m.num_experts) for k, m in zip(ks, meta.layers)]


@METHODS.register(
    Method(
        "neurons",
        "every expert keeps its top-K intermediate neurons (ENP; K the same everywhere)",
        PARAMETERS,
        ("uniform",),
        needs=(NEURON_STATS,),
        neurons=True,
        one_width=True,
        options=NarrowOptions,
        feasible=_neuron_feasible,
        target_steps=_neuron_steps,
        planned_keeps=_neuron_keeps,
        super_experts="keep their routing and stay whole, the other experts of their layers narrowed to one "
        "shared width; " + NEURONS_WHOLE,
    )
)
def plan_neurons(request: PlanRequest) -> Plan:
    return neuron_plan(
        request.moe,
        request.domains,
        request.sparsity,
        importance=request.options.neuron_importance,
        width_multiple=request.options.width_multiple,
        criterion=request.criterion.name,
        data_fingerprint=request.data_fingerprint,
    )
