"""Runs in vLLM's Python, started by `moeprune serve-check` as a script: `python vllm_driver.py SPEC OUT`.

Why a script and not an import: vLLM often lives in its own environment (it pins torch and
transformers), so serve-check starts that environment's Python on this file. It imports vLLM and
the standard library only, never moeprune: the moeprune installed beside vLLM comes in through
vLLM's own plugin loading, exactly as in `vllm serve`.

SPEC (JSON): {"models": [path, ...], "prompts": [[token ids], ...], "new_tokens": N,
"logprobs": K, "llm": {extra vllm.LLM keywords}}. For each model in turn, in one process (the
engine in-process, one worker): build `vllm.LLM`, generate greedily for every prompt (one batch),
keeping each prompt's tokens and its top-K logprobs per step, then time the same batch again
several times (MIN_RUNS, MIN_SECONDS) and keep the fastest (the first batch also warms the engine
up: on the CPU build it ran at a fifth of the later ones' speed). OUT (JSON): {"vllm_version", "models": {path: {...} or {"error": line}}}.
A model vLLM refuses to build is recorded by its error's one line; the others still run.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the timing is the engine's
# timed runs of the whole batch: at least MIN_RUNS and MIN_SECONDS, the fastest kept (on a shared
# machine a run is only ever slowed down, so the fastest is the engine's own speed)
MIN_RUNS, MIN_SECONDS, MAX_RUNS = 3, 3.0, 50


def _serve(path: str, spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    longest = max(len(p) for p in spec["prompts"]) + spec["new_tokens"]
    options = {
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": longest,
        "distributed_executor_backend": "uni",
        **spec.get("llm", {}),
    }
    try:
        engine = LLM(model=path, **options)
    except Exception as exc:  # vLLM's own refusal (a plugin's one sentence included)
        message = str(exc).strip().splitlines()
        return {"error": f"{type(exc).__name__}: {message[-1] if message else ''}"}
    params = SamplingParams(
        max_tokens=spec["new_tokens"], temperature=0.0, logprobs=spec["logprobs"], ignore_eos=True
    )
    results = engine.generate(prompts, params, use_tqdm=False)  # also warms up: the first batch is slow
    seconds, spent, runs = float("inf"), 0.0, 0
    while runs < MAX_RUNS and (runs < MIN_RUNS or spent < MIN_SECONDS):
        start = time.perf_counter()
        engine.generate(prompts, params, use_tqdm=False)
        took = time.perf_counter() - start
        seconds, spent, runs = min(seconds, took), spent + took, runs + 1
    out = {
        "architecture": engine.llm_engine.model_config.architectures[0],
        "seconds": seconds,
        "generated_tokens": sum(len(r.outputs[0].token_ids) for r in results),
        "tokens": [list(r.outputs[0].token_ids) for r in results],
        "logprobs": [
            [{str(t): lp.logprob for t, lp in step.items()} for step in r.outputs[0].logprobs]
            for r in results
        ],
    }
    del engine, results
    gc.collect()
    return out


def main() -> None:
    import vllm

    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    models: dict[str, dict] = {}
    out = {"vllm_version": str(vllm.__version__), "models": models}
    for path in spec["models"]:
        models[path] = _serve(path, spec)
    with open(sys.argv[2], "w") as handle:
        json.dump(out, handle)


if __name__ == "__main__":
    main()
