"""`moeprune score` on the loaded model: its checks before any weight (`prepare_score`) and the
scores document (`score_loaded`)."""

from __future__ import annotations

from pathlib import Path

from moeprune.checkpoint import (
    check_model_path,
    load_config,
    load_placed,
    require_tokenizer,
)
from moeprune.checkpoint.files import check_weights
from moeprune.checkpoint.quantized import check_quantized
from moeprune.config import DataOptions, RunOptions
from moeprune.criteria import (
    get_criterion,
    score_experts,
    scores_document,
    unseen_experts,
)
from moeprune.criteria.super_experts import found_in
from moeprune.data.loading import CalibrationData, calibration_sets
from moeprune.errors import MoePruneError
from moeprune.job.prepare import check_sources
from moeprune.models import MoEModel
from moeprune.runtime.atomic import check_creatable, check_not_inside
from moeprune.runtime.device import SPREAD, Placement
from moeprune.runtime.progress import stage, transformers_bars_off


def prepare_score(
    model_path: str | Path,
    output: str | Path,
    criterion: str,
    *,
    data: DataOptions,
    tokenizer_path=None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    load_sets: bool = True,
) -> tuple[Path, object | None, list[CalibrationData]]:
    """The checks of `moeprune score` that need no weights; returns (model path, tokenizer, data)."""
    crit = get_criterion(criterion)
    Placement.choose(data.device if data.device != SPREAD or not data.sequential else None, None)
    checked = check_model_path(model_path)
    load_config(checked, trust_remote_code)
    check_weights(checked)
    check_quantized(checked)  # fp8 is read (dequantized as it loads); other formats, bad scales fail here
    output = Path(output)
    check_not_inside(output, [checked], what="scores file")
    if output.is_dir():
        raise MoePruneError(f"{str(output)!r} is a folder; the scores go to a JSON file", options=("output",))
    if output.exists() and not overwrite:
        raise MoePruneError(
            f"{str(output)!r} already exists; choose another path or allow overwriting it",
            options=("overwrite",),
        )
    check_creatable(output)
    if not crit.needs_data:
        return checked, None, []
    check_sources(data.sources, "calibration data")
    tokenizer = require_tokenizer(checked, tokenizer_path, trust_remote_code)
    return (
        checked,
        tokenizer,
        calibration_sets(tokenizer, data, per_domain=crit.per_domain) if load_sets else [],
    )


def score_loaded(
    model_path: Path,
    criterion: str,
    sets: list[CalibrationData],
    data: DataOptions,
    *,
    tokenizer=None,
    seed: int = 0,
    run: RunOptions | None = None,
) -> dict:
    """`moeprune score` on the loaded model: the scores document."""
    run = run or RunOptions()
    progress = run.progress
    with stage(f"loading {model_path}", progress), transformers_bars_off():
        model, _ = load_placed(model_path, Placement.choose(data.device, data.dtype), run.trust_remote_code)
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    crit, scores, stats = score_experts(
        MoEModel(model),
        criterion,
        sets,
        batch_size=data.batch_size,
        pad_token_id=pad,
        seed=seed,
        progress=progress,
    )
    return {
        **scores_document(crit, scores, stats),
        "unseen": unseen_experts(stats) if stats else {},
        "super_experts": found_in(stats),
    }
