"""Per-layer precision (`--quantize auto:A,B --sparsity S`) for the methods that narrow experts or
keep novices: neurons, tenp, novice and mixed. quantize/choice.py prices whole experts removed with
their router rows (drop, merge); these methods keep experts of other widths and vectors instead,
so their bytes per (layer, scheme) come from what each layer keeps (`LayerKeep`):

- every expert that keeps weights, at its width w: `per_neuron * w + per_expert` in the layer's
  scheme (quantize/pricing.py: codes, scales and header entries of its three Linears);
- every novice: its vector (rank R: d + 2dR values) in the saved dtype, whatever the scheme.
  llm-compressor quantizes Linear modules only, and novices are parameters of the experts module,
  not Linears (quantize/layout.py), so they stay unquantized: priced outside the choice;
- every expert dropped: its weights and its router rows gone (as quantize/choice.py prices drop).

Everything outside the routed experts takes the base (first) scheme, as for drop. Where it is
priced:

- before loading (`planned_keeps`): the uniform plan's own widths and counts, from the structure
  and options (the neurons method's K per layer, TENP's trapezoid, the novice method's uniform
  split, the mixed method's uniform genes and fill). Exact for those plans; a mixed search keeps
  the same routed parameters (within half a block) but picks its own forms, and the neurons
  method's guarded super experts keep at most what K would: the prediction is what `--dry-run`
  prints and what an unreachable T is refused against;
- after the surgery (`plan_keeps`): the plan the model now has, so the choice is exact for the
  bytes the quantized result will hold (the test checks them tensor by tensor).

Both are priced by the one function every size is (surgery/sizes.py `kept_bytes`), the stock
form's zero-padded shared expert (surgery/neurons.py) included, in the fixed part.
"""

from __future__ import annotations

from collections.abc import Sequence

from moeprune.config import PruneConfig
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.plan import Plan
from moeprune.quantize.choice import budget_per_scheme, scheme_bytes
from moeprune.quantize.options import QuantizeOptions
from moeprune.surgery.genes import LayerKeep
from moeprune.surgery.registry import ResolvedConfig
from moeprune.surgery.sizes import PrecisionBytes, WeightBytes, kept_bytes


def priced_here(config: PruneConfig) -> bool:
    """Whether `config`'s method is priced by what its layers keep (this module): it declares its
    keeps (`Method.planned_keeps`); drop and merge are priced by their removals (quantize/choice.py)."""
    return ResolvedConfig.of(config).method_spec.planned_keeps is not None


def _rank(config: PruneConfig) -> int:
    return int(ResolvedConfig.of(config).options.novice_rank)


def planned_keeps(meta: MoEModel, config: PruneConfig) -> list[LayerKeep]:
    """The uniform plan's keeps from the structure and options alone (a meta-device model does):
    the method's own answer (`Method.planned_keeps`)."""
    resolved = ResolvedConfig.of(config)
    keeps = resolved.method_spec.planned_keeps
    if keeps is None:
        raise MoePruneError(f"per-layer precision does not price the {config.method} method by its keeps")
    return keeps(meta, resolved)


def plan_keeps(meta: MoEModel, plan: Plan) -> list[LayerKeep]:
    """What each MoE layer of `meta` keeps under `plan` (a layer the plan leaves out keeps all)."""
    by_layer = {lp.layer: lp for lp in plan.layers}
    out = []
    for m in meta.layers:
        lp = by_layer.get(m.index)
        if lp is None:
            out.append(LayerKeep((m.intermediate_size,) * m.num_experts))
            continue
        novice = set(lp.novice)
        widths = tuple(lp.neurons.get(e, m.intermediate_size) for e in lp.kept if e not in novice)
        out.append(LayerKeep(widths, len(novice), len(lp.dropped)))
    return out


def kept_precision_bytes(
    size: WeightBytes,
    moe: MoEModel,
    schemes: Sequence[str],
    options: QuantizeOptions,
    dtype_bytes: int,
    keeps: Sequence[LayerKeep],
    novice_rank: int = 0,
) -> PrecisionBytes:
    """`size` (the unpruned model's full-precision bytes) quantized with the first scheme outside
    the routed experts and any scheme per layer inside, each layer keeping `keeps[l]`."""
    return kept_bytes(scheme_bytes(size, moe, schemes, options, dtype_bytes), keeps, novice_rank)


def planned_precision_bytes(
    meta: MoEModel,
    config: PruneConfig,
    options: QuantizeOptions,
    size: WeightBytes,
    dtype_bytes: int,
) -> PrecisionBytes:
    """Before loading: the bytes per (layer, scheme) of the config's uniform plan."""
    assert options.candidates is not None
    keeps = planned_keeps(meta, config)
    return kept_precision_bytes(size, meta, options.candidates, options, dtype_bytes, keeps, _rank(config))


def every_layer_at(
    meta: MoEModel, config: PruneConfig, options: QuantizeOptions, size: WeightBytes, dtype_bytes: int
) -> dict[str, int]:
    """What `--dry-run` prints for these methods: the total with every layer at each scheme."""
    pb = planned_precision_bytes(meta, config, options, size, dtype_bytes)
    return budget_per_scheme(pb, options.candidates or ())


__all__ = [
    "LayerKeep",
    "every_layer_at",
    "kept_bytes",
    "kept_precision_bytes",
    "plan_keeps",
    "planned_keeps",
    "planned_precision_bytes",
    "priced_here",
    "scheme_bytes",
]
