"""Expert-parallel degrees: which EP sizes a model's per-layer expert counts allow.

vLLM's expert parallelism spreads each MoE layer's experts over the EP ranks. Several of vLLM
0.33's model classes (the families whose spec says `ep_divisible`) assert that each layer's expert
count divides the EP size and fail at load otherwise; a pruned count that does not is a result no
one can serve at that degree. `ep_sizes` lists the degrees a result allows (inspect, the summary);
`apply_ep_size` turns a declared degree into the plan's expert multiple and refuses, before any
weight is read, a request no plan could meet.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace

from moeprune.config import PruneConfig
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel

# Larger EP degrees than this are not listed: a node holds 8 GPUs, large deployments 64 and more
# only for counts in the hundreds, and the list would only grow with every divisor of big counts.
MAX_EP_SIZE = 64

_LOG = logging.getLogger("moeprune")


def ep_sizes(counts: Iterable[int | None], limit: int = MAX_EP_SIZE) -> list[int]:
    """Every EP degree up to `limit` that divides each MoE layer's expert count (None: a dense
    layer, ignored); [] when there is no MoE layer."""
    found = [int(c) for c in counts if c is not None]
    if not found:
        return []
    return [n for n in range(1, limit + 1) if all(c % n == 0 for c in found)]


def format_ep_sizes(sizes: list[int]) -> str:
    """'EP sizes 1, 2, 4, 8' (what inspect and the summary print)."""
    return f"EP sizes {', '.join(map(str, sizes))}" if sizes else "EP sizes -"


def apply_ep_size(moe: MoEModel, config: PruneConfig) -> PruneConfig:
    """The config with `ep_size` applied to `moe`'s family (a meta-device model will do).

    A family whose vLLM classes require divisible counts gets `expert_multiple = ep_size` unless
    one was given; a given multiple that is not a multiple of ep_size, or an input layer whose
    count ep_size does not divide, is refused now: no plan could then be served at that degree.
    Other families are served at any degree (vLLM's fused MoE spreads uneven counts), so the
    plan is left as it is and the summary lists the degrees the result allows."""
    ep = config.ep_size
    if ep is None:
        return config
    if not moe.spec.ep_divisible:
        _LOG.info(
            "ep_size=%d: vLLM's %s classes take any expert count under expert parallelism; the plan is "
            "not constrained (the summary lists the EP sizes the result allows)",
            ep,
            moe.model_type,
        )
        return config
    for m in moe.layers:
        if m.num_experts % ep:
            raise MoePruneError(
                f"decoder layer {m.index} of this {moe.model_type} model has {m.num_experts} experts, which "
                f"ep_size={ep} does not divide (vLLM's {moe.model_type} classes require it): no pruned count "
                f"can be served at that degree; choose an EP size among {ep_sizes(x.num_experts for x in moe.layers)}",
                options=("ep_size",),
            )
    multiple = config.expert_multiple
    if multiple == 1:
        return replace(config, expert_multiple=ep)
    if multiple % ep:
        raise MoePruneError(
            f"expert_multiple={multiple} with ep_size={ep}: kept counts that are multiples of {multiple} need "
            f"not be divisible by {ep}, which vLLM's {moe.model_type} classes require; give a multiple of "
            f"{ep}, or leave expert_multiple out (it defaults to ep_size for this family)",
            options=("expert_multiple", "ep_size"),
        )
    return config
