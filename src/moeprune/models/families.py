"""Which MoE families of the installed transformers moeprune works on, found at run time.

Each family is tried as a user would meet it: a tiny random model built from its own config
class (`models/factory.py`), then structure discovery (`models/discover.py`). The answer is
"works" with the MoE layers found, "refused" with the one-line reason discovery gives, or "no
tiny model" when no small config of the family could be built here (its real checkpoints may
still work). The README's family table and the family test read this one function.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import cache

import torch

from moeprune.errors import UnsupportedModelError
from moeprune.models.adapter import MoEModel, decoder_layers
from moeprune.models.factory import moe_families, tiny_model

WORKS, REFUSED, NO_TINY = "works", "refused", "no tiny model"


@dataclass(frozen=True)
class FamilyStatus:
    model_type: str
    status: str  # WORKS, REFUSED or NO_TINY
    detail: str  # what was found (layout, routing), or why not, in one line
    moe_layers: tuple[int, ...] = field(default_factory=tuple)
    decoder_layers: int = 0


@cache
def family_status(model_type: str) -> FamilyStatus:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tiny_model(model_type)
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5, 6]]), use_cache=False)
    except Exception as exc:  # noqa: BLE001 - transformers' own refusal of a shrunk config
        return FamilyStatus(model_type, NO_TINY, _one_line(exc))
    try:
        moe = MoEModel(model)
    except UnsupportedModelError as exc:
        return FamilyStatus(model_type, REFUSED, _one_line(exc))
    spec = moe.spec
    parts = [f"{spec.layout} experts at {spec.block_attr or 'the decoder layer'}", spec.routing]
    if spec.shared_attrs:
        parts.append("shared " + ", ".join(spec.shared_attrs))
    if moe.kept_whole_note():  # layers no method may prune (hash routing)
        parts.append(str(moe.kept_whole_note()))
    return FamilyStatus(
        model_type,
        WORKS,
        "; ".join(parts),
        tuple(m.index for m in moe.layers),
        len(decoder_layers(model)),
    )


def family_table() -> list[FamilyStatus]:
    """Every MoE family of the installed transformers with its status, sorted by model type."""
    return [family_status(m) for m in moe_families()]


def working_families() -> list[str]:
    return [s.model_type for s in family_table() if s.status == WORKS]


def supported_families() -> list[str]:
    """Every MoE family of the installed transformers moeprune works on, found at run time
    (each family's tiny model built and its structure discovered)."""
    return working_families()


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines else type(exc).__name__
    return text if len(text) <= 240 else text[:237] + "..."
