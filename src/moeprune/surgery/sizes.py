"""What the parts of a model weigh in the format a result is saved in: the vocabulary of size
planning (`--target-size`) that every method's byte hooks speak (surgery/target_size.py).

Made from a checkpoint's headers by moeprune.shards.weight_bytes; read by each method's
`planned_bytes` and `target_steps` hooks (surgery/registry.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerBytes:
    """What the parts of one MoE layer weigh in the output's format."""

    experts: int
    width: int  # neurons of each routed expert
    per_neuron: int  # bytes one neuron adds to one routed expert (0: not linear, e.g. fp8 blocks)
    per_expert: int  # bytes of one routed expert besides its neurons (all of it when per_neuron is 0)
    router_row: int  # bytes of one expert's router rows and per-expert routing tensors
    novice: int = 0  # bytes of a novice's mean output vector
    shared_width: int = 0  # neurons of a shared expert whose width derives from the routed width
    shared_per_neuron: int = 0  # bytes per neuron of that shared expert (it is zero-padded: neurons.py)

    def expert(self, width: int | None = None) -> int:
        return self.per_neuron * (self.width if width is None else width) + self.per_expert


@dataclass(frozen=True)
class WeightBytes:
    """The unpruned model's weights in the output's format, and what each MoE layer's parts weigh."""

    format: str  # "bfloat16", "float8_e4m3fn (fp8, 128x128 blocks)", ...
    total: int  # bytes of every tensor the result is saved with, before pruning
    layers: tuple[LayerBytes, ...]
    linear_neurons: bool = True  # False: an expert's bytes are not linear in its width (fp8 blocks)
