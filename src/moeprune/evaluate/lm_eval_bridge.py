"""Task accuracies through EleutherAI's lm-evaluation-harness, on the HF or the vLLM backend.

Engine `hf` (the default): moeprune-format checkpoints (non-uniform expert counts) load only
through moeprune, so the harness gets the loaded model object through its HF wrapper (HFLM)
instead of a path. Engine `vllm`: how large models are evaluated. lm-eval's vLLM backend serves
each checkpoint folder in a subprocess of the Python that has vLLM (`vllm_python`, as for
`moeprune serve-check`), where moeprune's plugin serves moeprune-format results
(lm_eval_vllm_driver.py). lm-eval is an optional extra (``pip install 'moeprune[eval]'``) imported
only here. The recovery ratio is MODEL's score divided by the reference's, per task and metric.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path
from typing import Any

from moeprune.errors import MoePruneError
from moeprune.evaluate.driver import find_vllm_python, run_driver
from moeprune.evaluate.vllm_host import refuse_quantized_moe

EXTRA = "moeprune[eval]"
ENGINES = ("hf", "vllm")
VLLM_DRIVER = Path(__file__).with_name("lm_eval_vllm_driver.py")
# lm-eval's names for the dtypes moeprune's --dtype accepts; None: vLLM's own choice ("auto")
VLLM_ELSEWHERE = "run `eval --engine vllm`"  # the refusal's advice (vllm_host.py)
_VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class LmEvalOptions:
    """Which harness tasks to run and how much of each."""

    tasks: Sequence[str]
    include: str | None = None  # folder with extra task YAMLs (local tasks)
    limit: float | None = None  # documents per task (a fraction when < 1), None: all
    batch_size: int = 8
    num_fewshot: int | None = None
    engine: str = "hf"  # or "vllm": lm-eval's vLLM backend on the saved folders
    vllm_python: str | None = None  # engine vllm: the Python with vLLM and lm-eval (None: this one)
    vllm_options: dict[str, Any] = field(default_factory=dict)  # engine vllm: extra vllm.LLM keywords
    timeout_s: float = 24 * 3600.0


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


def check_vllm_folders(options: LmEvalOptions, folders: Sequence[str]) -> None:
    """Engine `vllm`: every checkpoint folder it will serve is one vLLM has kernels for here
    (a quantized MoE one needs a GPU, AMX or Arm: vllm_host.py), checked before any model loads."""
    if options.engine != "vllm":
        return
    for folder in folders:
        path = Path(folder) / "config.json"
        if path.is_file():
            refuse_quantized_moe(folder, json.loads(path.read_text()), VLLM_ELSEWHERE)


def check_engine(options: LmEvalOptions) -> None:
    """Engine `vllm`: the Python that will run it has vLLM and lm-eval (looked up without importing
    them: seconds, not a vLLM start-up), so a missing package fails before any model loads."""
    if options.engine not in ENGINES:
        raise MoePruneError(
            f"unknown lm-eval engine {options.engine!r}; choose {' or '.join(ENGINES)}", options=("lm_eval",)
        )
    if options.engine != "vllm":
        if options.vllm_python or options.vllm_options:
            raise MoePruneError("--vllm-python and --vllm-option need --engine vllm", options=("lm_eval",))
        return
    python = find_vllm_python(options.vllm_python)
    probe = "import importlib.util as u; print(','.join(m for m in ('vllm', 'lm_eval') if u.find_spec(m) is None))"
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    missing = done.stdout.strip() if done.returncode == 0 else "a working Python"
    if missing:
        raise MoePruneError(
            f"--engine vllm runs lm-eval's vLLM backend in {python}, which lacks {missing}; install vLLM "
            f"and '{EXTRA}' there, or give the Python of such an environment",
            options=("vllm_python",),
        )


def task_manager(options: LmEvalOptions) -> Any:
    """A TaskManager that knows the requested tasks; unknown task names fail here.

    With the vLLM engine and no lm-eval in this Python, None: the tasks are checked in vLLM's
    Python instead, before vLLM starts (lm-eval need only be installed where vLLM is)."""
    if options.engine == "vllm" and importlib.util.find_spec("lm_eval") is None:
        return None
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


def run_tasks_vllm(
    folder: str, tokenizer_folder: str, options: LmEvalOptions, dtype: str | None = None
) -> dict[str, dict[str, float]]:
    """Scores of the checkpoint in `folder` on lm-eval's vLLM backend, in a subprocess of the
    vLLM Python (lm_eval_vllm_driver.py). A moeprune-format folder is read with
    `trust_remote_code`: lm-eval reads config.json with transformers' AutoConfig, which knows the
    `moeprune_<family>` type only from the folder's own self-contained modeling file (vLLM itself
    builds the model through moeprune's plugin)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    refuse_quantized_moe(folder, config, VLLM_ELSEWHERE)  # before vLLM's minute of start-up
    python = find_vllm_python(options.vllm_python)
    spec = {
        "model": str(folder),
        "tokenizer": str(tokenizer_folder),
        "tasks": list(options.tasks),
        "include": options.include,
        "limit": options.limit,
        "num_fewshot": options.num_fewshot,
        "batch_size": options.batch_size,
        "dtype": _VLLM_DTYPES.get(dtype or "", dtype or "auto"),
        "trust_remote_code": "moeprune" in config,
        "llm": options.vllm_options,
    }
    out = run_driver(python, VLLM_DRIVER, spec, options.timeout_s, "lm-eval on vLLM", f" on {folder}")
    if "error" in out:
        raise MoePruneError(out["error"], options=("lm_eval_tasks", "lm_eval_include"))
    if not out["results"]:
        raise MoePruneError("lm-eval returned no results")
    return _metrics(out["results"])


def _scores(model: Any, ctx: Any) -> dict[str, dict[str, float]]:
    """One model's scores on the engine the options name."""
    options = ctx.options.lm_eval
    if options.engine != "vllm":
        return run_tasks(model.model, ctx.tokenizer, options)
    if not model.path:
        raise MoePruneError(
            f"--engine vllm evaluates checkpoint folders, and {model.label!r} is a model in memory: save it "
            "first (moeprune.save_pretrained) or use the hf engine",
            options=("lm_eval",),
        )
    return run_tasks_vllm(model.path, _tokenizer_folder(model, ctx), options, ctx.options.dtype)


def _tokenizer_folder(model: Any, ctx: Any) -> str:
    """The tokenizer the HF engine uses too: --tokenizer, else the reference's, else the model's."""
    if ctx.options.tokenizer_path:
        return str(ctx.options.tokenizer_path)
    if ctx.reference.tokenizer is not None and ctx.reference.path:
        return str(ctx.reference.path)
    return str(model.path)


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
        ctx.reference_lm_eval = _scores(ctx.reference, ctx)
    return ctx.reference_lm_eval


def lm_eval_entry(model: Any, ctx: Any) -> dict[str, object]:
    """A model's scores and its recovery ratio against the reference."""
    reference = reference_entry(ctx)
    ctx.options.log(f"lm-eval: {model.label}")
    scores = _scores(model, ctx)
    return {"results": scores, "recovery": recovery(scores, reference)}
