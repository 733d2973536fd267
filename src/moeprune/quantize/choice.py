"""Per-layer precision (`--quantize auto:w4a16,w8a16`): one scheme per MoE layer's routed experts,
chosen under one byte budget, for a fixed allocation of expert counts.

Why per layer and not per expert: vLLM reads one compressed-tensors scheme per MoE layer (from
expert 0), so a layer's experts share a scheme; layers can differ.

How (exact for its model, cheap; the joint search of schemes and expert counts inside evo is
later work, it needs the evo gene that mixed plans change):

1. Loss per (layer, scheme), one layer at a time: the layer's routed-expert weights swapped for
   their round-to-nearest fake-quantized copies (quantize/fake.py, llm-compressor's numbers; cached
   per (layer, scheme), restored exactly afterwards: the original tensors are put back, not a
   copy), every other layer in full precision, scored with the evo search's own teacher-forced
   fitness (`CandidateEvaluator.evaluate` on the allocation; its prefix cache is cleared around
   each swap since cached states depend on the weights). The loss is the drop in that fitness.
2. Bytes per (layer, scheme): quantize/pricing.py's per-layer expert bytes times the kept
   experts; everything outside the routed experts takes the list's first scheme (the base).
3. Choice: minimise the summed losses (losses taken as additive across layers) under the budget,
   exactly, by a dynamic programme over layers that keeps the Pareto front of (bytes, loss).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.packed import PACKED_PREFIX, expert_tensors, is_packed
from moeprune.quantize.fake import fake_quantize
from moeprune.quantize.options import AUTO, QuantizeOptions, check_auto, parse_auto
from moeprune.quantize.pricing import quantized_weight_bytes
from moeprune.surgery.sizes import PrecisionBytes, WeightBytes, kept_bytes, removal_keeps


def expert_weights(moe: MoEModel, position: int) -> dict[str, torch.nn.Parameter]:
    """The quantized weights of MoE layer `position`'s routed experts: every matrix parameter; of a
    packed layer (per-expert widths, novices: models/packed.py) its packed expert tensors, never
    the novices' vectors and factors (llm-compressor leaves them unquantized)."""
    layer = moe.layers[position]
    experts: Any = layer.experts  # a packed layer's attributes are set on the module (models/packed.py)
    if is_packed(layer):
        return {
            PACKED_PREFIX + unit: getattr(experts, PACKED_PREFIX + unit) for unit in experts.moeprune_units
        }
    return {name: p for name, p in experts.named_parameters() if p.ndim >= 2}


def fake_expert_weight(moe: MoEModel, position: int, name: str, scheme: str, group: int) -> torch.Tensor:
    """The fake-quantized copy of `expert_weights(moe, position)[name]`: of a packed tensor, each
    expert's slice in its own [out, in] shape (its own width: groups along it for down), flat again."""
    layer = moe.layers[position]
    data = expert_weights(moe, position)[name].data
    if not (is_packed(layer) and name.startswith(PACKED_PREFIX)):
        return fake_quantize(data, scheme, group)
    unit = name.removeprefix(PACKED_PREFIX)
    experts: Any = layer.experts
    slots = range(len(experts.moeprune_widths))
    parts = [fake_quantize(expert_tensors(experts, s)[unit], scheme, group).reshape(-1) for s in slots]
    return torch.cat(parts) if parts else data.clone()


class LayerSwap:
    """Swaps a layer's expert weights for fake-quantized copies (cached per (layer, scheme)) and
    back: `with swap.quantized(position, scheme): ...` restores the original tensors on exit."""

    def __init__(self, moe: MoEModel, group: int) -> None:
        self.moe, self.group = moe, group
        self.cache: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def copies(self, position: int, scheme: str) -> dict[str, torch.Tensor]:
        key = (position, scheme)
        if key not in self.cache:
            self.cache[key] = {
                n: fake_expert_weight(self.moe, position, n, scheme, self.group)
                for n in expert_weights(self.moe, position)
            }
        return self.cache[key]

    @contextmanager
    def quantized(self, position: int, scheme: str) -> Iterator[None]:
        params = expert_weights(self.moe, position)
        originals = {n: p.data for n, p in params.items()}
        try:
            for n, fake in self.copies(position, scheme).items():
                params[n].data = fake
            yield
        finally:
            for n, original in originals.items():
                params[n].data = original


def measure_losses(
    evaluator, moe: MoEModel, allocation: Sequence[int], schemes: Sequence[str], group: int
) -> list[dict[str, float]]:
    """Per MoE layer, per scheme: the drop in the evaluator's fitness (the value evo maximises) when
    only that layer's experts are fake-quantized, the allocation's experts removed."""
    swap = LayerSwap(moe, group)
    evaluator.prefix_cache.clear()
    full = evaluator.evaluate(allocation)
    losses: list[dict[str, float]] = []
    for position in range(len(moe.layers)):
        row = {}
        for scheme in schemes:
            with swap.quantized(position, scheme):
                evaluator.prefix_cache.clear()
                row[scheme] = full - evaluator.evaluate(allocation)
            swap.cache.pop((position, scheme))  # one layer at a time: no need to keep the copies
        losses.append(row)
    evaluator.prefix_cache.clear()
    return losses


def scheme_bytes(
    size: WeightBytes, moe: MoEModel, schemes: Sequence[str], options: QuantizeOptions, dtype_bytes: int
) -> dict[str, WeightBytes]:
    """`size` (the unpruned model's full-precision bytes) quantized with each scheme everywhere."""
    return {
        s: quantized_weight_bytes(
            size, moe, QuantizeOptions(s, options.method, options.group_size), dtype_bytes
        )
        for s in schemes
    }


def precision_bytes(
    size: WeightBytes,
    moe: MoEModel,
    schemes: Sequence[str],
    options: QuantizeOptions,
    dtype_bytes: int,
    removed: Sequence[int],
) -> PrecisionBytes:
    """`size` (the unpruned model's full-precision bytes) quantized with the first scheme outside
    the routed experts and any scheme per layer inside, `removed[l]` experts of layer l gone (with
    their router rows; experts dropped from routing, as drop's surgery does): their keeps priced by
    surgery/sizes.py `kept_bytes`."""
    return kept_bytes(scheme_bytes(size, moe, schemes, options, dtype_bytes), removal_keeps(size, removed))


def choose_schemes(bytes_: PrecisionBytes, losses: Sequence[dict[str, float]], budget: int) -> list[str]:
    """The per-layer schemes of least summed loss whose total bytes fit `budget` (ties: fewer
    bytes). Exact: a dynamic programme over layers keeping every Pareto-optimal (bytes, loss)."""
    front: list[tuple[int, float, tuple[str, ...]]] = [(bytes_.fixed, 0.0, ())]
    for layer, loss in zip(bytes_.layers, losses):
        grown = sorted(
            ((b + layer[s], cost + loss[s], chosen + (s,)) for b, cost, chosen in front for s in layer),
            key=lambda item: (item[0], item[1]),
        )
        front = []
        for item in grown:  # ascending bytes: keep only strictly better losses
            if item[0] <= budget and (not front or item[1] < front[-1][1]):
                front.append(item)
        if not front:
            smallest = bytes_.fixed + sum(min(layer.values()) for layer in bytes_.layers)
            raise MoePruneError(
                f"no per-layer choice fits {budget:,} bytes: the smallest weighs {smallest:,}; "
                "prune more or raise the target",
                options=("target_size", "sparsity"),
            )
    return list(min(front, key=lambda item: (item[1], item[0]))[2])


def budget_per_scheme(bytes_: PrecisionBytes, schemes: Sequence[str]) -> dict[str, int]:
    """What `--dry-run` prints: the total bytes with every layer at each scheme."""
    return {s: bytes_.total([s] * len(bytes_.layers)) for s in schemes}


__all__ = [
    "AUTO",
    "LayerSwap",
    "PrecisionBytes",
    "budget_per_scheme",
    "check_auto",
    "choose_schemes",
    "measure_losses",
    "parse_auto",
    "precision_bytes",
    "scheme_bytes",
]
