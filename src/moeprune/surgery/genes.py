"""What a mixed gene is and the rules it must keep: one MoE layer's experts per form (whole,
narrowed, novice, dropped) with the narrowed width (`LayerGene`), what those parts hold
(`LayerCosts`, in parameters or bytes or any linear unit), and `check_genes`, which the plans,
the searches and their repairs all ask (surgery/mixed.py builds plans from genes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moeprune.errors import MoePruneError


@dataclass(frozen=True)
class LayerGene:
    """One MoE layer of a mixed plan: experts per form and the narrowed experts' neurons."""

    whole: int
    narrowed: int
    novice: int
    dropped: int
    width: int  # neurons each narrowed expert keeps before the budget's fill (fill_widths)


@dataclass(frozen=True)
class LayerKeep:
    """What one MoE layer keeps of its routed experts (`Method.planned_keeps`: what per-layer
    precision prices before loading)."""

    widths: tuple[int, ...]  # neurons of each expert that keeps weights (the full width: whole)
    novices: int = 0  # experts replaced by novices (routing kept)
    removed: int = 0  # experts dropped with their router rows


@dataclass(frozen=True)
class LayerCosts:
    """What one MoE layer's parts hold, in parameters (or any linear unit)."""

    experts: int
    width: int  # neurons of a whole expert
    per_neuron: int
    per_expert: int
    novice: int  # a novice's vector
    top_k: int
    protected: int  # super experts: the gene keeps at least this many whole
    cap: int  # most experts the layer may drop (routing groups, super experts)
    multiple: int  # drops per layer are a multiple of this (routing groups, --expert-multiple)
    step: int = 1  # narrowed widths are multiples of this (--width-multiple; the full width allowed)

    def on_step(self, width: int) -> bool:
        """Whether a narrowed expert may keep `width` neurons: a multiple of the step, or all."""
        return width == self.width or width % self.step == 0

    def expert(self, width: int | None = None) -> int:
        return self.per_neuron * (self.width if width is None else width) + self.per_expert

    def kept(self, gene: LayerGene) -> int:
        return (
            gene.whole * self.expert() + gene.narrowed * self.expert(gene.width) + gene.novice * self.novice
        )


def check_genes(costs: Sequence[LayerCosts], genes: Sequence[LayerGene], layers: Sequence[int]) -> None:
    """One line naming the layer when a gene breaks a form's rule (what a search must respect)."""
    if len(genes) != len(costs):
        raise MoePruneError(f"{len(genes)} mixed genes for {len(costs)} MoE layers")
    for index, c, g in zip(layers, costs, genes):
        where = f"mixed gene of layer {index}"
        counts = (g.whole, g.narrowed, g.novice, g.dropped)
        if min(counts) < 0 or sum(counts) != c.experts:
            raise MoePruneError(f"{where}: counts {counts} must be non-negative and add up to {c.experts}")
        if g.narrowed and not 1 <= g.width <= c.width:
            raise MoePruneError(f"{where}: narrowed experts keep {g.width} neurons, not in [1, {c.width}]")
        if g.narrowed and not c.on_step(g.width):
            raise MoePruneError(
                f"{where}: narrowed experts keep {g.width} neurons, not a multiple of the width step {c.step}"
            )
        if g.whole < c.protected:
            raise MoePruneError(
                f"{where}: keeps {g.whole} experts whole but the layer has {c.protected} super experts"
            )
        if g.whole + g.narrowed < c.top_k:
            raise MoePruneError(
                f"{where}: {g.whole + g.narrowed} experts keep weights, fewer than top_k {c.top_k}"
            )
        if g.dropped > c.cap or g.dropped % c.multiple:
            raise MoePruneError(
                f"{where}: drops {g.dropped} experts; at most {c.cap}, in multiples of {c.multiple}"
            )


__all__ = ["LayerCosts", "LayerGene", "LayerKeep", "check_genes"]
