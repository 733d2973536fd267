"""The drop method: the first r_l experts of each layer's pruning order are removed, and where
their picks go is `reroute`:

- `next` (the default): router row and weights removed; the router computes its top-k and gates
  over the survivors, so the next survivor takes each pick. The removal itself (virtual masks and
  physical slicing) is models/reshape.py.
- `none`: the pick stays empty. The router still scores every expert (its rows stay) and the
  survivors keep the gates they had in the full model; a removed expert adds nothing. That is a
  novice whose vector is zero (surgery/novice.py), so its virtual form is the routed computation
  with zero constants, its physical form a packed layer, and the result is in moeprune's format
  (one zero d-vector per removed expert: a single format and serving path, for d values where the
  expert held about 3 d I), served by the plugins' novice path like vLLM's constant experts.
  Routing is unchanged, so group-limited routers need no group balance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from moeprune.allocate.basic import plan_removals
from moeprune.config import MethodOptions, setting
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoELayer, MoEModel
from moeprune.models.routed import RoutedOptions, override_routed
from moeprune.plan import ModelShape, Plan
from moeprune.surgery.registry import EXPERTS, METHODS, Method, PlanRequest

REROUTES = ("next", "none")
REROUTE_KEY = "reroute"  # plan.extra: "none" marks a drop whose novices are zero vectors


@dataclass(frozen=True)
class DropOptions(MethodOptions):
    """The drop method's own setting: where a removed expert's picks go."""

    reroute: str = setting(
        "next",
        "drop: where a removed expert's picks go. next: the router picks among the survivors and "
        "gates over them; none: the pick stays empty and the survivors keep their full-model gates "
        "(a zero novice; moeprune's format).",
        choices=REROUTES,
    )

    def __post_init__(self) -> None:
        if self.reroute not in REROUTES:
            raise MoePruneError(
                f"reroute must be one of {', '.join(REROUTES)}, got {self.reroute!r}", options=("reroute",)
            )

    @property
    def keeps_routing(self) -> bool:
        """`none` keeps every router row (Method.configured reads this)."""
        return self.reroute == "none"

    @property
    def label(self) -> str:
        """What refusals add to 'the drop method' (Method.described)."""
        return " (--reroute none)" if self.keeps_routing else ""

    def candidate_context(self, moe: MoEModel):
        """How a search applies a candidate (Method.search_context): zero novices for `none`;
        None (the plain expert mask) for `next`."""
        return zero_context(moe) if self.keeps_routing else None


def zero_vectors(layer: MoELayer, positions: Sequence[int]) -> dict[int, torch.Tensor]:
    """A zero d-vector per position, in the experts' dtype and device: an empty pick."""
    ref = next(layer.experts.parameters())
    return {p: torch.zeros(layer.hidden_size, dtype=ref.dtype, device=ref.device) for p in positions}


def zero_context(moe: MoEModel):
    """`context(removed)`: the removed positions add nothing, routing unchanged, for a `with`."""

    def context(removed: Mapping[int, Sequence[int]]):
        novices = {i: zero_vectors(moe.layer(i), positions) for i, positions in removed.items()}
        return override_routed(moe, RoutedOptions(novices=novices))

    return context


@METHODS.register(
    Method(
        "drop",
        "expert weights removed; its picks go to the next survivor (--reroute next) or stay empty (none)",
        EXPERTS,
        ("uniform", "global", "evo", "gradient"),
        options=DropOptions,
    )
)
def drop_plan(request: PlanRequest) -> Plan:
    """Drop the first r_l experts of each layer's pruning order (group-balanced where routing changes)."""
    moe, criterion, removed = request.moe, request.criterion, request.removals()
    options = request.options
    assert isinstance(options, DropOptions)  # PlanRequest resolved it with the drop method's class
    layers = moe.layers
    groups = None if options.keeps_routing else [m.n_group for m in layers]
    positions = plan_removals([s.order for s in request.scores], removed, groups)
    ids = [[m.expert_ids[p] for p in sorted(pos)] for m, pos in zip(layers, positions)]
    plan = Plan.from_removals(
        ModelShape.of(moe),
        removals=ids,
        criterion=criterion.name,
        allocation=request.allocation,
        method="drop",
        sparsity=request.sparsity,
        novices=options.keeps_routing,
        data_fingerprint=request.data_fingerprint,
    )
    plan.extra["budget"] = sum(removed)
    if options.keeps_routing:  # `next` plans stay as they were (no key)
        plan.extra[REROUTE_KEY] = options.reroute
    return plan  # the allocation's note: surgery/planning.py finish_plan


def zero_novices(plan: Plan) -> bool:
    """Whether the plan's novices are empty picks (a `--reroute none` drop), not mean outputs."""
    return plan.extra.get(REROUTE_KEY) == "none"
