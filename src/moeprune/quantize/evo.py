"""`prune --quantize auto:A,B --target-size T --allocation evo` without `--sparsity`: EvoESAP over
(experts removed per MoE layer, scheme per layer) under T (quantize/evo_space.py), seeded with
the grid's points (quantize/grid.py: uniform splits each with its exact choice of schemes,
sparsity 0 among them when it fits).

A candidate is scored by the evo search's teacher-forced fitness (`CandidateEvaluator`, teacher:
the full-precision, unpruned model) with its removals masked (`mask_experts`, the criterion's
orders) and every layer's routed experts swapped for their round-to-nearest fake-quantized copies
in the layer's scheme (`LayerSwap`, cached per (layer, scheme); the base scheme counts like any
other: the whole model is quantized). The swaps put the original tensors back after each
candidate, so the model leaves the search as it came. The prefix cache stays on: its key is the
candidate's prefix, whose pairs hold each earlier layer's scheme with its removals, which is all
the hidden state entering a layer depends on.

Cost: one teacher pass, then one evaluation per distinct candidate (population x generations at
most, fewer with `--patience`), on top of the grid's points x (layers x schemes + 1); the fake
copies hold every routed expert once per scheme in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any, Protocol, cast

from moeprune.allocate.fitness import check_fitness
from moeprune.config import PruneConfig
from moeprune.data.loading import CalibrationData
from moeprune.models import MoEModel
from moeprune.models.reshape import mask_experts
from moeprune.quantize.choice import LayerSwap, precision_bytes
from moeprune.quantize.evo_space import Joint, PrecisionSpace
from moeprune.quantize.options import QuantizeOptions
from moeprune.quantize.per_layer import PrecisionTarget
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.document import SearchDocument, evo_settings
from moeprune.search.evo import EvoResult, EvoSearch, generations_document
from moeprune.search.options import SearchRuntime
from moeprune.search.run import model_fingerprint, run_seeded_search
from moeprune.surgery.registry import ResolvedConfig
from moeprune.surgery.sizes import WeightBytes


def joint_space(
    meta: MoEModel,
    config: PruneConfig,
    options: QuantizeOptions,
    size: WeightBytes,
    dtype_bytes: int,
    target: int,
) -> PrecisionSpace:
    """The byte model of `precision_bytes` taken apart per layer (it is linear in the removals:
    one call with nothing removed, one per layer with one expert removed there) and the method's
    per-layer limits."""
    schemes = tuple(options.candidates or ())
    count = len(meta.layers)
    none = precision_bytes(size, meta, schemes, options, dtype_bytes, [0] * count)
    rows, per_expert = [], []
    for layer in range(count):
        unit = [0] * count
        unit[layer] = 1
        one = precision_bytes(size, meta, schemes, options, dtype_bytes, unit)
        rows.append(none.fixed - one.fixed)
        per_expert.append(tuple(none.layers[layer][s] - one.layers[layer][s] for s in schemes))
    limits = ResolvedConfig.of(config).limits(meta)
    return PrecisionSpace(
        schemes,
        none.fixed,
        tuple(rows),
        tuple(m.num_experts for m in meta.layers),
        tuple(per_expert),
        tuple(limits.caps),
        tuple(limits.multiples),
        int(target),
    )


def grid_seeds(
    space: PrecisionSpace, rows: Sequence[dict[str, Any]], layers: Sequence[int]
) -> dict[str, Joint]:
    """The grid's points as candidates, named by their sparsity."""
    seeds = {}
    for row in rows:
        seeds[f"grid {row['sparsity']:.4g}"] = tuple(
            (int(row["removed_per_layer"][str(i)]), space.schemes.index(row["chosen"][str(i)]))
            for i in layers
        )
    return seeds


@contextmanager
def joint_candidate(
    evaluator: CandidateEvaluator, moe: MoEModel, swap: LayerSwap, schemes: Sequence[str], candidate: Joint
) -> Iterator[None]:
    """The candidate applied virtually: its removals masked, each layer's experts in its scheme."""
    with ExitStack() as stack:
        stack.enter_context(mask_experts(moe, evaluator.removals([r for r, _ in candidate])))
        for position, (_, scheme) in enumerate(candidate):
            stack.enter_context(swap.quantized(position, schemes[scheme]))
        yield


def joint_fingerprint(
    moe: MoEModel, config: PruneConfig, schemes: Sequence[str], group: int, data: CalibrationData, **more: Any
) -> dict[str, Any]:
    """What a joint search's saved state is keyed by (a resumed search must match it): the model,
    criterion, method, schemes, group, fitness, `more` (mixed: the calibration) and the search data."""
    return {
        "model": model_fingerprint(moe),
        "criterion": config.criterion,
        "method": config.method,
        "quantize": list(schemes),
        "group": group,
        "fitness": check_fitness(config.search.fitness),
        **more,
        "search_data": data.fingerprint,
    }


def search_joint(
    moe: MoEModel,
    space: PrecisionSpace,
    seeds: dict[str, Joint],
    orders: list[list[int]],
    data: CalibrationData,
    config: PruneConfig,
    runtime: SearchRuntime,
    group: int,
) -> tuple[Joint, dict[str, Any]]:
    """The best candidate on the search data, and search.json."""
    swap = LayerSwap(moe, group)
    fingerprint = joint_fingerprint(moe, config, space.schemes, group, data)
    result, search, evaluator = run_seeded_search(
        lambda evaluate, io: EvoSearch(evaluate, space, seeds, config.search, io=io),
        moe,
        data,
        orders,
        fingerprint=fingerprint,
        runtime=runtime,
        plan_context=lambda e, c: joint_candidate(e, moe, swap, space.schemes, c),
    )
    best = cast(Joint, result.best)
    head = {
        "space": "experts removed and scheme per MoE layer, under the target bytes",
        "schemes": list(space.schemes),
        "target_bytes": space.target,
    }
    cache = cast(dict[Any, float], search.cache)
    layout = lambda c: {"allocation": [r for r, _ in c]}  # noqa: E731
    document = joint_document(space, seeds, cache, result, config, evaluator, layout, head)
    evaluator.release()
    return best, document


class JointSpace(Protocol):
    """What search.json reads of a joint space (quantize/evo_space.py, quantize/mixed_space.py)."""

    def named(self, candidate: Any) -> list[str]: ...

    def bytes(self, candidate: Any) -> int: ...


def joint_document(
    space: JointSpace,
    seeds: dict[str, Any],
    cache: dict[Any, float],
    result: EvoResult,
    config: PruneConfig,
    evaluator: CandidateEvaluator,
    layout: Callable[[Any], dict[str, Any]],
    head: dict[str, Any],
) -> dict[str, Any]:
    """search.json of the joint searches of schemes (experts removed, or mixed genes, with the
    schemes): `head` (the space, its schemes and target), the winner and every seed as `layout`
    describes a candidate, with its schemes, predicted bytes and fitness (in the user's direction),
    the settings and the generations."""
    sign = evaluator.sign

    def row(candidate: Any) -> dict[str, Any]:
        return {
            **layout(candidate),
            "chosen_schemes": space.named(candidate),
            "predicted_bytes": space.bytes(candidate),
        }

    return SearchDocument(
        head=head,
        fitness=evaluator.fitness,
        higher_is_better=sign > 0,
        config=evo_settings(config.search),
        found=row(result.best),
        fitness_value=sign * result.best_fitness,
        references={
            "seeds": {name: {**row(c), "fitness_value": sign * cache[c]} for name, c in seeds.items()}
        },
        evaluations=result.evaluations,
        stopped=result.stopped,
        history={"generations": generations_document(result.history, sign, "best_candidate")},
        **evaluator.data_summary(),
        speed={"speedups": {"resume_mode": evaluator.mode, **evaluator.counters}},
    ).to_json()


def joint_choice(space: PrecisionSpace, best: Joint, layers: Sequence[int], fitness: str) -> dict[str, Any]:
    """report.json's `quantization.precision` for the joint search's winner."""
    keys = [str(i) for i in layers]
    return {
        "schemes": list(space.schemes),
        "base_scheme": space.schemes[0],
        "fitness": fitness,
        "search": "evo (experts removed and schemes per layer together)",
        "target_bytes": space.target,
        "removed_per_layer": dict(zip(keys, (r for r, _ in best))),
        "chosen": dict(zip(keys, space.named(best))),
        "expert_bytes": dict(zip(keys, space.layer_bytes(best))),
        # outside the kept routed experts: the base scheme, less the removed experts' router rows
        "fixed_bytes": space.fixed - sum(r * row for (r, _), row in zip(best, space.router_rows)),
        "predicted_bytes": space.bytes(best),
    }


def joint_layer_schemes(space: PrecisionSpace, best: Joint, layers: Sequence[int]) -> dict[int, str]:
    return dict(zip(layers, space.named(best)))


NOTHING_REMOVED = (
    "no expert removed: the whole model quantized, every layer at its chosen scheme, fit the target "
    "with the best fitness on the search data of every candidate tried (the sparsity was chosen with "
    "the schemes; --sparsity 0 itself is refused, there is nothing to prune)"
)


def run_joint(
    full: MoEModel,
    config: PruneConfig,
    quantize: QuantizeOptions,
    target: PrecisionTarget,
    orders: list[list[int]],
    data: CalibrationData,
    grid_rows: list[dict[str, Any]],
    runtime: SearchRuntime,
) -> tuple[list[int], QuantizeOptions, dict[str, Any], dict[str, Any]]:
    """The joint search on the full model, seeded with the grid's rows: the experts removed per
    layer, the options with the chosen `layer_schemes`, report.json's choice and search.json."""
    space = joint_space(full, config, quantize, target.size, target.dtype_bytes, target.target_bytes)
    layers = [m.index for m in full.layers]
    seeds = grid_seeds(space, grid_rows, layers)
    best, document = search_joint(full, space, seeds, orders, data, config, runtime, quantize.group)
    choice = joint_choice(space, best, layers, document["fitness"])
    choice["search_fitness"] = document["fitness_value"]
    choice["seed_fitness"] = {name: row["fitness_value"] for name, row in document["seeds"].items()}
    choice["sparsity_grid"] = grid_rows
    if not any(r for r, _ in best):
        choice["no_expert_removed"] = NOTHING_REMOVED
    schemes = joint_layer_schemes(space, best, layers)
    return [r for r, _ in best], replace(quantize, layer_schemes=schemes), choice, document


__all__ = [
    "NOTHING_REMOVED",
    "joint_document",
    "joint_fingerprint",
    "grid_seeds",
    "joint_candidate",
    "joint_choice",
    "joint_space",
    "run_joint",
    "search_joint",
]
