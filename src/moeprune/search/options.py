"""What an EvoESAP search is told besides its SearchConfig.

`SearchRuntime` is how a search executes on this machine (batching, speed-ups, progress, where it
checkpoints, how a candidate is applied to the model): none of it changes which allocation the
search finds, so it stays out of SearchConfig and recipe.json. (`check_search`, the check of a
SearchConfig's settings, lives in allocate/fitness.py: surgery's planning calls it, and the search
comes after surgery in the pipeline.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from moeprune.search.teacher import SharedTeacher

# How a candidate's removed experts ({decoder layer: positions}) are applied virtually: router
# slicing for drop (the default), constant substitution for MoNE novices.
CandidateContext = Callable[[dict[int, list[int]]], AbstractContextManager]


@dataclass(frozen=True)
class SearchRuntime:
    """How one search runs, none of which changes the allocation it finds (for a fixed seed).

    Grouped so the search's entry points (`run_evo_search`, `search_allocation`,
    `CandidateEvaluator`) take one object instead of a dozen keywords that they only pass on.
    """

    batch_size: int = 8  # search samples per forward pass
    pad_token_id: int | None = None  # None pads with 0 (padding is masked anyway)
    progress: bool = True  # progress bars (the teacher pass, the generations)
    fast: bool = True  # resume candidates at their longest cached prefix (False: model(...) each time)
    race: bool = True  # stop a candidate once it cannot reach the elites (never changes the selection)
    prefix_cache_bytes: int | None = None  # the prefix cache's budget; None: sized from the model
    teacher_device: torch.device | str | None = None  # where the teacher cache lives; None: chosen
    # How a candidate is applied virtually (None: drop's router slicing); the method's virtual
    # form, which equals its physical surgery, so the search scores the method's own plans.
    candidate_context: CandidateContext | None = None
    state_path: str | os.PathLike[str] | None = None  # the search checkpoints here every generation
    resume: bool = False  # continue the search saved at state_path (refuses other data or settings)
    # The full model on the search data, computed once for several searches (`SharedTeacher`,
    # search/teacher.py): a search on the same data and batches takes it instead of its own pass.
    teacher: SharedTeacher | None = None
    # Where a search leaves its state for a larger run of the same search to continue in memory
    # (evo: `EvoSearch.run(carry=...)`, to the result a fresh run of that size reaches); None: none.
    continuation: dict[str, Any] | None = None
