"""Mixed results (whole, narrowed, novice and dropped experts in one layer) served by vLLM's CPU
build through the plugin as moeprune's loader computes them, at the size the issue allows.

Tiny Qwen3-MoE and DeepSeek-V3 models (test_serve_vllm.py's), pruned with `--method mixed` at 70 %
of routed parameters, the Qwen3-MoE one also with rank-2 novices (`--novice-rank 2`: low-rank novices
beside narrowed and dropped experts in one layer). The warm `.venv-vllm` process of conftest.py's
shared_vllm_python serves all three in one driver run (test_serve_vllm.py's driver):
greedy tokens equal `moeprune.load_pretrained`'s (a differing token only at a tie of its logits),
top-5 logprobs within LOGPROB_ATOL, and vLLM holds what the checkpoint stores plus the zero
neurons padding each width group (served_parameter_count), at most 1.05x the stored parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_serve_lowrank import _compare
from test_serve_vllm import (
    DRIVER,
    LOGPROB_ATOL,
    NEW_TOKENS,
    PROMPTS,
    TOP_LOGPROBS,
    VLLM_OPTIONS,
    _reference,
    _stored,
    code_calibration,
    drive_vllm,
)

import moeprune
from moeprune.config import PruneConfig, RunOptions
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.job import PruneRequest, prune_checkpoint

pytestmark = pytest.mark.vllm  # drives vLLM's CPU build in a subprocess (.venv-vllm)

FAMILIES = ("qwen3_moe", "deepseek_v3")
OPTIONS = {"mixed_whole": 0.25, "mixed_novice": 0.125, "mixed_width": 0.25}
CASES = {"qwen3_moe": 0, "deepseek_v3": 0, "qwen3_moe-rank2": 2}  # result -> novice rank


def _family(case: str) -> str:
    return case.split("-")[0]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve_mixed")
    tokenizer = byte_tokenizer()
    data = code_calibration(root)
    made = {}
    for family in FAMILIES:
        _reference(family, root / family, len(tokenizer))
        tokenizer.save_pretrained(root / family)
    for case, rank in CASES.items():
        family = _family(case)
        made[case] = root / f"{case}-mixed"
        config = PruneConfig("reap", 0.7, method="mixed", options={**OPTIONS, **({"novice_rank": rank} if rank else {})})
        prune_checkpoint(PruneRequest(root / family, made[case], config, data=data, run=RunOptions(progress=False)))
        if family == "deepseek_v3":  # transformers-written configs leave DeepSeek-V3's routing implicit
            path = made[case] / "config.json"
            written = json.loads(path.read_text())
            assert written.pop("scoring_func") == "sigmoid" and written.pop("topk_method") == "noaux_tc"
            path.write_text(json.dumps(written, indent=2))
    return made


@pytest.fixture(scope="module")
def served(shared_vllm_python, results, tmp_path_factory) -> dict:
    spec = {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "logprobs": TOP_LOGPROBS,
            "models": [[str(results[c]), VLLM_OPTIONS.get(_family(c), {})] for c in CASES], "refuse": []}  # fmt: skip
    return drive_vllm(shared_vllm_python, tmp_path_factory.mktemp("vllm_mixed"), spec, DRIVER)


@pytest.mark.parametrize("case", CASES)
def test_results_mix_every_form_in_every_layer(case, results):
    for entry in json.loads((results[case] / "config.json").read_text())["moeprune"]["layers"]:
        widths = entry["widths"]  # None: a novice; several narrowed widths beside the whole one
        assert entry["novice"] and None in widths and len({w for w in widths if w is not None}) > 1, entry
        assert entry.get("novice_rank", 0) == CASES[case], entry


@pytest.mark.parametrize("case", CASES)
def test_vllm_serves_a_mixed_result_like_moeprune(case, served, results):
    family, path = _family(case), results[case]
    result = served["models"][str(path)]
    assert result["architecture"].startswith("MoePrune")
    worst, _ = _compare(family, result, moeprune.load_pretrained(path))
    assert worst <= LOGPROB_ATOL, f"{family}: vLLM's logprobs differ from moeprune's by {worst:.2e}"
    counts = result["routing"]
    assert counts["layer_forwards"] > 0 and counts["routings"] == counts["layer_forwards"], counts


@pytest.mark.parametrize("case", CASES)
def test_vllm_holds_at_most_1_05x_the_stored_parameters(case, served, results):
    from moeprune.serve.vllm.layout import served_parameter_count

    family, path = case, results[case]
    allocated = served["models"][str(path)]["allocated"]
    assert allocated is not None, "the driver did not see vLLM load this model"
    held = allocated["parameters"] - allocated["vocab_padding"]
    assert held == served_parameter_count(path), (held, served_parameter_count(path))
    assert _stored(path) <= held <= 1.05 * _stored(path), f"{family}: vLLM holds {held / _stored(path):.4f}x"
    print(f"{family} mixed: vLLM holds {held:,} parameters, {held / _stored(path):.4f}x the stored {_stored(path):,}")
