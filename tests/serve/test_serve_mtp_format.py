"""vLLM drafts with the MTP layer of a DeepSeek-V3 result saved in moeprune's format.

A tiny DeepSeek-V3 release (two MoE layers and the MTP layer; dims within vLLM's CPU limits, see
test_serve_mtp.py) is pruned with the global allocation to different expert counts per layer
(moeprune's format); its MTP layer is dropped to the last MoE layer's count (shards/mtp.py).
vLLM 0.32's CPU build serves it through moeprune's plugin with MTP speculative decoding in one
subprocess (test_serve_mtp.py's driver):

- the greedy tokens with speculation are vLLM's own without it, on the same result, and
  moeprune.load_pretrained's (up to a tie of transformers' logits);
- the draft model vLLM built is its stock DeepSeekMTP (the plugin's `draft_config` turns the
  moeprune config back into DeepSeek-V3's) with the MTP layer's expert count, every parameter
  loaded from the checkpoint, and it drafted;
- a moeprune-format result pruned with --drop-mtp, asked for MTP drafts, is refused in one sentence.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_serve_mtp import CONFIG, DRIVER, PROMPTS, SPECULATIVE
from test_serve_vllm import (  # noqa: F401  (vllm_python: the fixture)
    _NATIVE_ROPE,
    LOGPROB_ATOL,
    NEW_TOKENS,
    _greedy_and_logprobs,
    drive_vllm,
    vllm_python,
)
from tests.helpers import run_cli
from tests.release_layouts import write_mtp_release

import moeprune

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore")]

# two MoE layers after the dense one; no routing groups, so any count per layer is allowed
FORMAT_CONFIG = {**CONFIG, "num_hidden_layers": 3, "n_group": 1, "topk_group": 1}
SPARSITY = "0.3125"  # 5 of 16 experts: the two layers cannot keep the same count


def _prune(source: Path, out: Path, *args: str) -> Path:
    run_cli(
        "prune", source, "--output", out, "--criterion", "aimer", "--sparsity", SPARSITY,
        "--allocation", "global", "--quiet", *args,
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def served(vllm_python, tmp_path_factory) -> dict:  # noqa: F811
    root = tmp_path_factory.mktemp("mtp-format")
    source = write_mtp_release("deepseek_v3", root / "release", **FORMAT_CONFIG)
    result = _prune(source, root / "result")
    dropped = _prune(source, root / "dropped", "--drop-mtp")
    speculative = {**_NATIVE_ROPE, "speculative_config": SPECULATIVE}
    spec = {
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        "runs": [["speculative", str(result), speculative], ["plain", str(result), _NATIVE_ROPE]],
        "refuse": [["dropped", str(dropped), speculative]],
    }
    work = root / "vllm"
    work.mkdir()
    start = time.time()
    out = drive_vllm(vllm_python, work, spec, DRIVER)
    print(f"\nvLLM: {len(spec['runs'])} runs and a refusal in {time.time() - start:.0f} s (one process)")
    return {"vllm": out, "result": result}


def test_result_is_moeprune_format_with_its_mtp_layer_recorded(served):
    config = json.loads((served["result"] / "config.json").read_text())
    plan = json.loads((served["result"] / "plan.json").read_text())
    counts = [len(lp["kept"]) for lp in plan["layers"]]
    assert len(set(counts)) == 2 and config["architectures"] == ["MoePruneDeepseekV3ForCausalLM"]
    assert config["moeprune"]["mtp"]["num_experts"] == counts[-1]
    assert config["num_nextn_predict_layers"] == 1


def test_vllm_drafts_with_the_mtp_layer_of_a_moeprune_result(served):
    runs = served["vllm"]["runs"]
    run, plain = runs["speculative"], runs["plain"]
    assert run["tokens"] == plain["tokens"]  # speculation never changes greedy tokens
    assert len(run["tokens"]) == len(PROMPTS) and all(len(t) == NEW_TOKENS for t in run["tokens"])
    count = json.loads((served["result"] / "config.json").read_text())["moeprune"]["mtp"]["num_experts"]
    assert "MoePruneDeepseekV3ForCausalLM" in run["built"]  # the target: moeprune's per-layer class
    draft = run["built"]["DeepSeekMTP"]  # the draft: vLLM's own class, at the MTP layer's count
    (w13,) = [shape for n, shape in draft.items() if "mtp_block" in n and n.endswith("w13_weight")]
    assert w13[0] == count, draft
    (router,) = [shape for n, shape in draft.items() if "mtp_block" in n and n.endswith("mlp.gate.weight")]
    assert router == [count, CONFIG["hidden_size"]]
    assert run["spec_decode"]["spec_decode_num_draft_tokens"] > 0, run["spec_decode"]
    assert not any(plain["spec_decode"].values()) and "DeepSeekMTP" not in plain["built"]


def test_vllm_generates_like_moeprune(served):
    model = moeprune.load_pretrained(served["result"])
    for prompt, tokens in zip(PROMPTS, served["vllm"]["runs"]["speculative"]["tokens"]):
        greedy, reference = _greedy_and_logprobs(model, prompt, tokens)
        for t, token in enumerate(tokens):
            if tokens[: t + 1] != greedy[: t + 1]:
                gap = float(reference[t].max() - reference[t, token])
                assert gap <= 2 * LOGPROB_ATOL, f"prompt {prompt}: vLLM generated {tokens}, moeprune {greedy}"
                break


def test_vllm_refuses_mtp_drafts_of_a_result_without_them(served):
    error = served["vllm"]["refused"]["dropped"]
    assert error is not None and "keeps no multi-token-prediction layer" in error, error
