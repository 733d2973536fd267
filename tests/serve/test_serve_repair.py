"""A repaired uniform drop (`--repair`) serves in stock vLLM's CPU build as moeprune loads it.

The tiny Qwen3-MoE of test_serve_vllm.py, REAP uniform drop at 50 % with repair, served by
`.venv-vllm` through test_serve_vllm.py's driver: the result is a stock checkpoint (no plugin
architecture), vLLM's greedy tokens are moeprune.load_pretrained's (a differing token only where
transformers itself has a tie, as there) and its top-5 logprobs within LOGPROB_ATOL.
"""

from __future__ import annotations

import json

import pytest
from test_serve_vllm import (
    DRIVER,
    LOGPROB_ATOL,
    NEW_TOKENS,
    PROMPTS,
    TOP_LOGPROBS,
    _greedy_and_logprobs,
    _reference,
    code_calibration,
    drive_vllm,
)

import moeprune
from moeprune.config import PruneConfig, RepairConfig, RunOptions
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.job import PruneRequest, prune_checkpoint

pytestmark = pytest.mark.vllm  # drives vLLM's CPU build in a subprocess (.venv-vllm)


def test_vllm_serves_a_repaired_uniform_drop_like_moeprune(shared_vllm_python, tmp_path):
    """Served in the worker's warm vLLM process (conftest.py): nothing here asks a fresh one."""
    tokenizer = byte_tokenizer()
    _reference("qwen3_moe", tmp_path / "ref", len(tokenizer))
    tokenizer.save_pretrained(tmp_path / "ref")
    repair = RepairConfig(enabled=True, steps=30, eval_every=10)
    out = tmp_path / "repaired"
    report = prune_checkpoint(PruneRequest(tmp_path / "ref", out, PruneConfig("reap", 0.5, repair=repair),
                                           data=code_calibration(tmp_path), run=RunOptions(progress=False)))  # fmt: skip
    assert report["format"] == "stock" and report["repair"]["kept"], report.get("repair")
    spec = {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "logprobs": TOP_LOGPROBS, "models": [[str(out), {}]],
            "refuse": []}  # fmt: skip
    (tmp_path / "vllm").mkdir()
    result = drive_vllm(shared_vllm_python, tmp_path / "vllm", spec, DRIVER)["models"][str(out)]
    assert result["architecture"] == json.loads((out / "config.json").read_text())["architectures"][0]
    assert not result["architecture"].startswith("MoePrune"), "a stock result needs no plugin"
    model, worst = moeprune.load_pretrained(out), 0.0
    for prompt, tokens, steps in zip(PROMPTS, result["tokens"], result["logprobs"]):
        greedy, reference = _greedy_and_logprobs(model, prompt, tokens)
        for t, top in enumerate(steps):
            worst = max(worst, *(abs(lp - float(reference[t, int(c)])) for c, lp in top.items()))
        if tokens != greedy:  # only at a tie of transformers' own logits
            t = next(i for i, (a, b) in enumerate(zip(tokens, greedy)) if a != b)
            gap = float(reference[t].max() - reference[t, tokens[t]])
            assert gap <= 2 * LOGPROB_ATOL, (
                f"prompt {prompt}: vLLM {tokens}, moeprune {greedy} (gap {gap:.4f})"
            )
    assert worst <= LOGPROB_ATOL, f"vLLM's logprobs differ from moeprune's by {worst:.2e}"
