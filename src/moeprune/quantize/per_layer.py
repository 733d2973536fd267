"""`prune --quantize auto:A,B --target-size T --sparsity S`: the user fixes the expert split (S,
any allocation) and the bytes (T); each MoE layer's routed experts then take the scheme of the list
that costs the fitness least under T (quantize/choice.py measures and chooses), everything else the
list's first scheme, and llm-compressor quantizes with that choice (`layer_schemes`).

Three steps, each where it is cheapest:

- `plan_precision`, before loading: the bytes with every layer at each scheme after the uniform
  split at S (exact for the uniform allocation; evo and the other allocations remove the same
  number of experts, so with equally sized layers the same bytes) and the refusal of a T that even
  the cheapest scheme misses there; the dry run prints them.
- `precision_teacher`, once the full model is loaded and before the surgery: a `CandidateEvaluator`
  whose teacher is the full-precision, unpruned model (the one the result should stay close to),
  on the search data, or else the first `--search-samples` calibration samples (every token then
  scored). Its plain forward is used, so the pruned model it later scores is run as it is.
- `choose_precision`, after the surgery: the losses per (layer, scheme) on the pruned model
  (`measure_losses` with nothing masked: the allocation is already physical), the bytes of the
  experts the plan kept, and the exact choice under T.

Methods that remove whole experts with their router rows (drop, merge) are priced by
`precision_bytes`; those that narrow experts or keep novices (neurons, tenp, novice, mixed) by
what each layer keeps (quantize/keeps.py: the uniform plan's keeps before loading, the plan's
own after the surgery), with `--sparsity`. Without `--sparsity` the sparsity is chosen with the
schemes first (quantize/grid.py, drop and merge), then these steps run at it; the mixed method
searches its forms and the schemes together instead (quantize/mixed.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from moeprune.allocate.basic import uniform_allocation
from moeprune.config import PruneConfig
from moeprune.criteria import AUTO
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.plan import Plan
from moeprune.quantize.choice import budget_per_scheme, choose_schemes, measure_losses, precision_bytes
from moeprune.quantize.keeps import (
    kept_precision_bytes,
    plan_keeps,
    planned_precision_bytes,
    priced_here,
)
from moeprune.quantize.memory import JointMemory
from moeprune.quantize.options import QuantizeOptions, check_auto
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.options import SearchRuntime
from moeprune.surgery.lowrank import plan_rank
from moeprune.surgery.planning import check_config
from moeprune.surgery.registry import EXPERTS, FORMS, ResolvedConfig
from moeprune.surgery.sizes import WeightBytes


def resolve_auto(
    config: PruneConfig, options: QuantizeOptions | None, has_data: bool
) -> tuple[PruneConfig, QuantizeOptions | None]:
    """`--quantize auto:A,B` resolved once, before the config is checked: the options with the
    candidates (A the base scheme) and the target size as their budget, the config without it
    (it is not solved into a sparsity). Anything else comes back as it is (also a resolved one)."""
    if options is None or options.candidates:
        return config, options
    names = check_auto(options.scheme, has_data)
    if names is None:
        return config, options
    options = replace(options, scheme=names[0], candidates=names)
    joint = config.sparsity is None
    config, target = _split_target(config, options)
    if joint:  # the sparsity is chosen with the schemes (prepare sets the grid's first point)
        config = replace(config, sparsity=JOINT_PLACEHOLDER)
    return config, replace(options, budget=target, joint=joint)


def _split_target(config: PruneConfig, options: QuantizeOptions) -> tuple[PruneConfig, Any]:
    """The config without its target size and that target; refuses, in one line, what per-layer
    precision cannot run."""
    asked = options.asked
    if config.target_size is None:
        raise MoePruneError(
            f"{asked} chooses each layer's scheme under a size: give --target-size (without one, every "
            "layer would take the most precise scheme: give that scheme alone)",
            options=("quantize", "target_size"),
        )
    if options.sparsity_grid < 1:
        raise MoePruneError(
            f"the sparsity grid needs at least one point, got {options.sparsity_grid}",
            options=("quant_sparsity_grid",),
        )
    if config.sparsity is None and config.criterion == AUTO:
        raise MoePruneError(
            f"{asked} without --sparsity scores a grid of sparsities by one named criterion's order: "
            "name a criterion, or give --sparsity",
            options=("quantize", "criterion"),
        )
    resolved = ResolvedConfig.of(config)  # names only: the target size is still in the config
    method = resolved.surgery
    whole = not (method.sparsity_unit != EXPERTS or method.keeps_routing or method.neurons)
    joint_mixed = config.sparsity is None and method.genes == FORMS  # forms and schemes: quantize/mixed.py
    if not whole and not joint_mixed and not (config.sparsity is not None and priced_here(config)):
        raise MoePruneError(
            f"per-layer precision prices whole experts removed with their router rows (drop, merge) and "
            f"searches mixed forms with the schemes; {resolved.described()} narrows experts or keeps "
            "novices: give one scheme"
            + (", or --sparsity (its plan is then priced by what it keeps)" if priced_here(config) else ""),
            options=("quantize", "method"),
        )
    return replace(config, target_size=None), config.target_size


JOINT_PLACEHOLDER = 0.5  # the config's sparsity until prepare sets the grid's (the config needs one)


@dataclass(frozen=True)
class PrecisionTarget:
    """Per-layer precision as planned before loading: the schemes, the target, the unpruned
    model's bytes in the saved dtype (what `precision_bytes` starts from) and, at the uniform
    split, the total with every layer at each scheme."""

    schemes: tuple[str, ...]
    target_bytes: int
    size: WeightBytes
    dtype_bytes: int
    every_layer_at: dict[str, int]
    # no --sparsity: the sparsities tried for the joint choice, each with every_layer_at (grid.py)
    grid: tuple[tuple[float, dict[str, int]], ...] = ()
    memory: JointMemory | None = None  # the joint evo search's copies and model (quantize/memory.py)
    by_keeps: bool = False  # the method declares what its layers keep: its plan is priced by them (keeps.py)
    search: str = ""  # the joint search's dry-run line (stage.py `plan_target`); "" when none runs

    def describe(self) -> dict[str, Any]:
        """The dry run's facts."""
        out: dict[str, Any] = {
            "precision_schemes": list(self.schemes),
            "precision_target_bytes": self.target_bytes,
            "precision_every_layer_at": dict(self.every_layer_at),
            "precision_reachable": min(self.every_layer_at.values()) <= self.target_bytes,
        }
        if self.grid:
            out["precision_grid"] = [{"sparsity": s, "every_layer_at": dict(per)} for s, per in self.grid]
        if self.search:
            out["precision_search"] = self.search
        if self.memory is not None:
            out.update(self.memory.describe())
        return out


def plan_precision(
    meta: MoEModel,
    config: PruneConfig,
    options: QuantizeOptions,
    size: WeightBytes,
    dtype_bytes: int,
    target_bytes: int,
    grid: tuple[tuple[float, dict[str, int]], ...] = (),
) -> PrecisionTarget:
    """The bytes per scheme at the sparsity (uniform split), and the refusal of an unreachable target."""
    assert options.candidates is not None and config.sparsity is not None
    if priced_here(config):  # narrowed experts or novices: the uniform plan's keeps (keeps.py)
        pb = planned_precision_bytes(meta, config, options, size, dtype_bytes)
    else:
        limits = check_config(config).limits(meta)
        removed = uniform_allocation(
            limits.budget(config.sparsity), limits.num_experts, limits.top_k, **limits.as_kwargs()
        )
        pb = precision_bytes(size, meta, options.candidates, options, dtype_bytes, removed)
    per = budget_per_scheme(pb, options.candidates)
    cheapest = min(per, key=lambda s: per[s])
    if per[cheapest] > target_bytes:
        raise MoePruneError(
            f"even with every layer in {cheapest} the result weighs {per[cheapest]:,} bytes at sparsity "
            f"{config.sparsity:g}, over the target {target_bytes:,}: raise the sparsity or the target",
            options=("target_size", "sparsity", "quantize"),
        )
    return PrecisionTarget(
        options.candidates, target_bytes, size, dtype_bytes, per, grid, by_keeps=priced_here(config)
    )


def scoring_data(
    search_set: CalibrationData | None, calibration: list[CalibrationData], samples: int
) -> CalibrationData:
    """The search data when given; else the first `samples` (0: all) calibration samples."""
    if search_set is not None:
        return search_set
    first = calibration[0]
    pooled = [s for d in calibration for s in d.samples]
    return replace(first, samples=pooled[:samples] if samples else pooled)


def precision_teacher(
    moe: MoEModel,
    data: CalibrationData,
    config: PruneConfig,
    batch_size: int,
    pad: int | None,
    progress: bool,
    orders: list[list[int]] | None = None,
) -> CandidateEvaluator:
    """The evaluator of the losses, built on the full model (its teacher pass) before the surgery;
    `orders`: the criterion's pruning orders (the joint choice masks by them), else any."""
    orders = orders or [list(range(layer.num_experts)) for layer in moe.layers]
    runtime = SearchRuntime(batch_size=batch_size, pad_token_id=pad, progress=progress, fast=False)
    return CandidateEvaluator(
        moe, data, orders, fitness=config.search.fitness, seed=config.seed, runtime=runtime
    )


def choose_precision(
    evaluator: CandidateEvaluator,
    pruned: MoEModel,
    meta: MoEModel,
    plan: Plan,
    options: QuantizeOptions,
    target: PrecisionTarget,
) -> tuple[QuantizeOptions, dict[str, Any]]:
    """The options with each layer's scheme chosen, and report.json's account of the choice."""
    removed_of = {lp.layer: len(lp.dropped) for lp in plan.layers}
    removed = [removed_of.get(layer.index, 0) for layer in meta.layers]
    pb = precision_bytes(target.size, meta, target.schemes, options, target.dtype_bytes, removed)
    if target.by_keeps:  # priced exactly by what the plan keeps (keeps.py)
        keeps, rank = plan_keeps(meta, plan), plan_rank(plan)
        pb = kept_precision_bytes(target.size, meta, target.schemes, options, target.dtype_bytes, keeps, rank)
    nothing = [0] * len(pruned.layers)  # the allocation is physical now: nothing left to mask
    losses = measure_losses(evaluator, pruned, nothing, target.schemes, options.group)
    scored = evaluator.num_samples
    evaluator.release()
    choice = choose_schemes(pb, losses, target.target_bytes)
    indices = [layer.index for layer in meta.layers]
    chosen = dict(zip(indices, choice))
    doc = {
        "schemes": list(target.schemes),
        "base_scheme": target.schemes[0],
        "fitness": evaluator.fitness,
        "scored_samples": scored,
        "target_bytes": target.target_bytes,
        "chosen": {str(k): v for k, v in chosen.items()},
        "losses": {str(i): row for i, row in zip(indices, losses)},
        "expert_bytes": {str(i): row for i, row in zip(indices, pb.layers)},
        "fixed_bytes": pb.fixed,
        "every_layer_at": budget_per_scheme(pb, target.schemes),
        "predicted_bytes": pb.total(choice),
        "summed_loss": sum(row[s] for row, s in zip(losses, choice)),
    }
    return replace(options, layer_schemes=chosen), doc


def precision_note(doc: dict[str, Any]) -> str:
    """The run log's and summary's line: the scheme per layer, and the bytes against the target."""
    chosen = ", ".join(f"{layer} {scheme}" for layer, scheme in doc["chosen"].items())
    written = doc.get("written_bytes")
    on_disk = f", {written:,} written" if written is not None else ""
    mixed = (
        "; stock transformers reads one experts scheme for every layer: load it with moeprune.load_pretrained "
        "or vLLM"
        if len(set(doc["chosen"].values())) > 1
        else ""
    )
    scored = (  # the joint search scores whole candidates, the fixed-split choice sums per-layer losses
        f"summed {doc['fitness']} loss {doc['summed_loss']:.6g}"
        if "summed_loss" in doc
        else f"{doc['fitness']} {doc['search_fitness']:.6g} on the search data (joint search)"
    )
    return (
        f"per-layer precision (experts of layer: scheme) {chosen}; {doc['predicted_bytes']:,} bytes predicted"
        f"{on_disk}, target {doc['target_bytes']:,}; {scored}{mixed}"
    )


__all__ = [
    "precision_note",
    "PrecisionTarget",
    "choose_precision",
    "plan_precision",
    "precision_teacher",
    "scoring_data",
    "resolve_auto",
]
