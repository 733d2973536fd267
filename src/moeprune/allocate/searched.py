"""The searched allocations, declared: `evo` finds the per-layer counts by EvoESAP on search data,
`gradient` the experts themselves by training per-expert keep logits (search/gradient.py; mixed
plans: per-expert form logits, search/gradient_mixed.py).

Only the declaration lives here, so the allocation table, validation and `requirements()` know it
without importing the search; the search itself (moeprune.search) evaluates candidate plans
through surgery's masks and so comes after surgery in the pipeline.
"""

from __future__ import annotations

from moeprune.allocate.registry import ALLOCATIONS, Allocator
from moeprune.config import SEARCH_DATA

ALLOCATIONS.add(
    Allocator(
        "evo",
        "EvoESAP: search the per-layer counts under the same budget, candidates scored on "
        "teacher-forced search data",
        needs=(SEARCH_DATA,),
        knobs=("population", "elites", "generations", "patience", "delta_max", "tau_max", "resume"),
        label="an EvoESAP search",
    )
)

ALLOCATIONS.add(
    Allocator(
        "gradient",
        "per-expert keep logits (mixed: form logits) trained with straight-through Gumbel samples "
        "against the full model's top-k KL on teacher-forced search data; the exact budget and every "
        "per-layer limit at every step (drop and mixed)",
        needs=(SEARCH_DATA,),
        knobs=(
            "gradient_steps",
            "gradient_lr",
            "gradient_temperature",
            "gradient_temperature_end",
            "gradient_kl_top_k",
        ),
        neuron_by_neuron=True,
    )
)
