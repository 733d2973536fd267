"""Task accuracies through EleutherAI's lm-evaluation-harness, on models already in memory.

Why in memory: moeprune-format checkpoints (non-uniform expert counts) load only through
moeprune, so the harness gets the loaded model object through its HF wrapper (HFLM) instead of
a path. lm-eval is an optional extra (``pip install 'moeprune[eval]'``) imported only here.
The recovery ratio is MODEL's score divided by the reference's, per task and metric.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

from moeprune.errors import MoePruneError

EXTRA = "moeprune[eval]"


@dataclass
class LmEvalOptions:
    """Which harness tasks to run and how much of each."""

    tasks: Sequence[str]
    include: str | None = None  # folder with extra task YAMLs (local tasks)
    limit: float | None = None  # documents per task (a fraction when < 1), None: all
    batch_size: int = 8
    num_fewshot: int | None = None


def parse_tasks(spec: str | None) -> list[str]:
    return [t.strip() for t in (spec or "").split(",") if t.strip()]


def require_lm_eval() -> Any:
    """The lm_eval module, or a clear error naming the extra to install."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401  (its own imports: accelerate, ...)
    except ImportError as exc:
        raise MoePruneError(
            f"lm-eval tasks need lm-evaluation-harness, which is not installed ({exc.name or exc}); "
            f"install the extra: pip install '{EXTRA}'",
            options=("lm_eval_tasks",),
        ) from None
    return lm_eval


@functools.lru_cache(maxsize=8)
def _manager(include: str | None, defaults: bool) -> Any:
    """Indexing the harness's own task folders takes tens of seconds: once per process, and only
    when the lm-eval include folder does not hold every requested task."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include, include_defaults=defaults)


def _missing(manager: Any, tasks: Sequence[str]) -> list[str]:
    return [t for t in tasks if not manager.match_tasks([t])]


def task_manager(options: LmEvalOptions) -> Any:
    """A TaskManager that knows the requested tasks; unknown task names fail here."""
    require_lm_eval()
    if options.include and not _missing(_manager(options.include, False), options.tasks):
        return _manager(options.include, False)
    manager = _manager(options.include, True)
    missing = _missing(manager, options.tasks)
    if missing:
        where = (
            f" (also looked in {options.include})"
            if options.include
            else "; for local tasks, give the folder that holds them"
        )
        raise MoePruneError(
            f"unknown lm-eval task(s) {', '.join(missing)}{where}",
            options=("lm_eval_tasks", "lm_eval_include"),
        )
    return manager


def _metrics(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from the harness's results, stderr and bookkeeping left out."""
    out = {}
    for task, values in results.items():
        out[task] = {
            key.removesuffix(",none"): float(value)
            for key, value in values.items()
            if isinstance(value, Real)
            and not isinstance(value, bool)
            and "stderr" not in key
            and key != "sample_len"
        }
    return out


def run_tasks(model: Any, tokenizer: Any, options: LmEvalOptions) -> dict[str, dict[str, float]]:
    """Scores of an in-memory model on the tasks (HFLM wraps the model object, no reload)."""
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    if tokenizer is None:
        raise MoePruneError("lm-eval needs a tokenizer: give its path", options=("tokenizer",))
    manager = task_manager(options)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=options.batch_size)
    result = simple_evaluate(
        model=lm,
        tasks=list(options.tasks),
        task_manager=manager,
        limit=options.limit,
        num_fewshot=options.num_fewshot,
        log_samples=False,
        bootstrap_iters=0,
    )
    if not result:
        raise MoePruneError("lm-eval returned no results")
    return _metrics(result["results"])


def recovery(
    model: dict[str, dict[str, float]], reference: dict[str, dict[str, float]]
) -> dict[str, dict[str, float | None]]:
    """MODEL / REF per task and metric (None where the reference scored 0)."""
    return {
        task: {
            metric: (value / reference[task][metric] if reference[task].get(metric) else None)
            for metric, value in values.items()
            if metric in reference.get(task, {}) and math.isfinite(value)
        }
        for task, values in model.items()
        if task in reference
    }


def reference_entry(ctx: Any) -> dict[str, dict[str, float]]:
    """The reference's scores, computed once per evaluation."""
    if ctx.reference_lm_eval is None:
        ctx.options.log("lm-eval: reference")
        ctx.reference_lm_eval = run_tasks(ctx.reference.model, ctx.tokenizer, ctx.options.lm_eval)
    return ctx.reference_lm_eval


def lm_eval_entry(model: Any, ctx: Any) -> dict[str, object]:
    """A model's scores and its recovery ratio against the reference."""
    reference = reference_entry(ctx)
    ctx.options.log(f"lm-eval: {model.label}")
    scores = run_tasks(model.model, ctx.tokenizer, ctx.options.lm_eval)
    return {"results": scores, "recovery": recovery(scores, reference)}
