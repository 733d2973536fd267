"""The searches over a method's forms (`Method.genes` FORMS: per MoE layer how many experts stay
whole, are narrowed, become novices or are dropped, and the narrowed width), registered: evo over
the genes (mixed_search.py) and the gradient allocation's form logits (gradient_mixed.py). Both
fit every expert's rank-R novice first, and both are refused before loading the same way."""

from __future__ import annotations

from moeprune.allocate.limits import layer_limits
from moeprune.models.adapter import MoEModel
from moeprune.search.gradient_mixed import check_gradient_family, gradient_mixed_allocation
from moeprune.search.mixed_search import check_mixed_seeds, search_mixed
from moeprune.search.registry import SEARCHES, Search, Searched, SearchJob
from moeprune.surgery.lowrank import check_every_novice_fits
from moeprune.surgery.registry import FORMS, ResolvedConfig


def forms_before_loading(meta: MoEModel, config: ResolvedConfig, joint: bool) -> None:
    """Before loading: every expert's novice fit must fit in memory (a forms search fits them all
    first) and, unless --quantize auto seeds in bytes itself, some recipe must meet the sparsity."""
    check_every_novice_fits(meta, config.options.novice_rank)
    if not joint:  # the joint search seeds in bytes (the quantize stage)
        check_mixed_seeds(meta, config)


def _evo_forms(job: SearchJob) -> Searched:
    novices = job.every_novice()
    removed, doc = search_mixed(*job.args, **job.kwargs, novices=novices)
    return Searched(removed, doc, novices=novices)


def _gradient_forms(job: SearchJob) -> Searched:
    novices = job.every_novice()
    removed, scores, doc = gradient_mixed_allocation(*job.args, **job.kwargs, novices=novices)
    return Searched(removed, doc, scores, novices)  # its orders make the trained plan


def _check_gradient_forms(moe: MoEModel, config: ResolvedConfig) -> None:
    check_gradient_family(moe, layer_limits(moe, config.expert_multiple))


SEARCHES.add(
    Search(
        "evo forms",
        "EvoESAP over each layer's genes (whole, narrowed, novice, dropped, width)",
        "evo",
        FORMS,
        _evo_forms,
        before_loading=forms_before_loading,
        joint_schemes=True,
    )
)
SEARCHES.add(
    Search(
        "gradient forms",
        "per-expert form logits",
        "gradient",
        FORMS,
        _gradient_forms,
        check=_check_gradient_forms,
        before_loading=forms_before_loading,
    )
)
