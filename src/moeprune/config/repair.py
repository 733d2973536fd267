"""`--repair`'s settings (RepairConfig): what the distillation after surgery trains, how long, and
what it is checked on. Declared here with their flags and bounds, validated once when made; the
training itself is moeprune.repair."""

from __future__ import annotations

from dataclasses import dataclass

from moeprune.config.fields import check_bounds, setting
from moeprune.errors import MoePruneError

# The small tensors repair may train, in the order they are collected (moeprune.repair registers one
# collector per name; a test keeps the two lists equal). Expert weights are never among them.
REPAIR_PARTS = ("routers", "gains", "novices", "norms")


@dataclass
class RepairConfig:
    """Distil the pruned model toward the full one on the calibration tokens, training only small
    tensors (docs/surgery.md, "Repair"); off unless `enabled`."""

    enabled: bool = setting(
        False,
        "After surgery, distil the pruned model toward the full one (KL on the calibration tokens, "
        "early stopping on the search data or a held-back share of the calibration data), training only "
        "routers, per-layer output gains, novices and the norms around the MoE blocks; never expert "
        "weights. A stock checkpoint stays stock; the repaired tensors are kept only when they score "
        "better on the held-out tokens.",
        flag="--repair",
    )
    parts: str = setting(
        ",".join(REPAIR_PARTS),
        f"repair: the tensors trained, comma separated, of: {', '.join(REPAIR_PARTS)}.",
        flag="--repair-parts",
        metavar="PART,...",
    )
    steps: int = setting(
        200, "repair: training steps at most (one calibration batch each).", flag="--repair-steps", minimum=1
    )
    learning_rate: float = setting(
        1e-2,
        "repair: Adam's learning rate on the trained tensors.",
        flag="--repair-lr",
        minimum=0,
        open_bounds=True,
    )
    kl_top_k: int = setting(
        64,
        "repair: the loss is the KL from the full model on its k most likely tokens, renormalised "
        "(0 = the whole vocabulary; k tokens of the full model are kept per calibration position).",
        flag="--repair-kl-top-k",
        minimum=0,
    )
    eval_every: int = setting(
        10,
        "repair: steps between two fitness evaluations on the held-out tokens.",
        flag="--repair-eval-every",
        minimum=1,
    )
    patience: int = setting(
        3,
        "repair: stop after this many evaluations without a better held-out fitness.",
        flag="--repair-patience",
        minimum=1,
    )
    holdout: float = setting(
        0.25,
        "repair without search data: the share of the calibration samples held back for early stopping.",
        flag="--repair-holdout",
        minimum=0,
        maximum=1,
        open_bounds=True,
    )

    def __post_init__(self) -> None:
        self.validate()

    @property
    def part_names(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.parts.split(",") if p.strip())

    def to_plan(self) -> str:
        """The dry run's line: what repair will train and how it stops."""
        return (
            f"{', '.join(self.part_names)}; at most {self.steps} steps (lr {self.learning_rate:g}, top-"
            f"{self.kl_top_k or 'all'} KL), held-out fitness every {self.eval_every}, patience {self.patience}"
        )

    def validate(self) -> None:
        """Impossible settings are one line naming the parameter, before any model runs."""
        if not isinstance(self.enabled, bool):
            raise MoePruneError(f"repair must be true or false, got {self.enabled!r}", options=("repair",))
        unknown = [p for p in self.part_names if p not in REPAIR_PARTS]
        if unknown or not self.part_names:
            raise MoePruneError(
                f"repair parts {unknown or 'none'} are not known; give some of {', '.join(REPAIR_PARTS)}",
                options=("repair_parts",),
            )
        check_bounds(self, "repair")
