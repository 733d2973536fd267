"""A pruned DeepSeek-V3 release keeps a multi-token-prediction layer that vLLM drafts with.

A tiny DeepSeek-V3 release with its MTP layer (`model.layers.{num_hidden_layers}.*`, config
`num_nextn_predict_layers: 1`; dims within vLLM's CPU limits, see test_serve_vllm.py) is pruned
by a uniform drop (a stock result), by the in-memory pipeline and by --no-load. vLLM 0.32's CPU
build serves each result with MTP speculative decoding (`method: "mtp"`, which `deepseek_mtp`
is now an alias of) in one subprocess:

- the greedy tokens with speculation are vLLM's own greedy tokens without it, on the same result,
  and moeprune.load_pretrained's (up to a tie of transformers' logits);
- the draft model vLLM built (DeepSeekMTP) holds the result's expert count, its loader took
  every parameter from the checkpoint (vLLM refuses a start that leaves one uninitialised), and
  it drafted (vLLM's spec-decode counters; these random weights accept few drafts, if any);
- the check is real: the pruned result with the input's unpruned (8-expert) MTP layer put back
  in place of its own fails to start.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_serve_vllm import (  # noqa: F401  (vllm_python: the fixture)
    _MLA,
    _NATIVE_ROPE,
    LOGPROB_ATOL,
    NEW_TOKENS,
    _greedy_and_logprobs,
    drive_vllm,
    vllm_python,
)
from tests.helpers import run_cli
from tests.release_layouts import mtp_keys, write_mtp_release

import moeprune

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore")]

FAMILY = "deepseek_v3"
# vLLM's CPU limits (MLA: kv_lora_rank 512, qk_rope_head_dim 64); two decoder layers (one dense,
# one MoE) and the MTP layer (MoE), 8 experts in two groups
CONFIG = dict(
    _MLA, vocab_size=256, hidden_size=64, num_hidden_layers=2, max_position_embeddings=256, q_lora_rank=32,
    topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5,
)  # fmt: skip
PROMPTS = [[5, 17, 33, 60, 91], [70, 71, 72], [200, 13, 101, 45, 9, 120]]
SPECULATIVE = {"method": "mtp", "num_speculative_tokens": 1}
_EXPERT = re.compile(r"\.experts\.(\d+)\.")

# Runs under .venv-vllm: each (name, path, options) in turn in one process, then each refusal.
DRIVER = r"""
import gc, json, os, sys

os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # an explicit, small KV cache is passed below
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

BUILT = {}  # model class: {parameter: shape}, when its loader starts

def record_built():
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    original = DefaultModelLoader.load_weights

    def load_weights(self, model, model_config):
        BUILT[type(model).__name__] = {n: list(p.shape) for n, p in model.named_parameters()}
        return original(self, model, model_config)

    DefaultModelLoader.load_weights = load_weights

def counters(engine):
    out = {}
    for metric in engine.get_metrics():
        if metric.name.startswith("vllm:spec_decode") and hasattr(metric, "value"):
            out[metric.name.split(":")[1]] = metric.value
    return out

def main():
    from vllm import LLM, SamplingParams
    record_built()
    spec = json.load(open(sys.argv[1]))
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    def llm(path, options):
        return LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
                   max_model_len=64, kv_cache_memory_bytes=1 << 26, distributed_executor_backend="uni",
                   disable_log_stats=False, **options)
    out = {"runs": {}, "refused": {}}
    for name, path, options in spec["runs"]:
        BUILT.clear()
        engine = llm(path, options)
        before = counters(engine)
        results = engine.generate(prompts, params, use_tqdm=False)
        after = counters(engine)
        out["runs"][name] = {
            "tokens": [list(r.outputs[0].token_ids) for r in results],
            "spec_decode": {k: v - before.get(k, 0) for k, v in after.items()},
            "built": dict(BUILT),
        }
        del engine, results
        gc.collect()
    for name, path, options in spec["refuse"]:  # last: a failed start may leave state behind
        try:
            llm(path, options)
            out["refused"][name] = None
        except Exception as exc:
            out["refused"][name] = f"{type(exc).__name__}: {exc}"
    json.dump(out, open(sys.argv[2], "w"))

if __name__ == "__main__":
    main()
"""


def _prune(source: Path, out: Path, *args: str) -> Path:
    run_cli("prune", source, "--output", out, "--criterion", "aimer", "--sparsity", "0.25", "--quiet", *args)
    return out


def _with_mtp_of(result: Path, source: Path, folder: Path) -> Path:
    """`result` with its MTP tensors replaced by `source`'s (one shard, the same names)."""
    shutil.copytree(result, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    own = mtp_keys(result, FAMILY)
    tensors = {}
    for file in sorted(result.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(file).items() if k not in own})
    tensors.update(mtp_keys(source, FAMILY))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def served(vllm_python, tmp_path_factory) -> dict:  # noqa: F811
    root = tmp_path_factory.mktemp("mtp")
    source = write_mtp_release(FAMILY, root / "release", **CONFIG)
    results = {
        "in-memory": _prune(source, root / "in-memory"),
        "no-load": _prune(source, root / "no-load", "--no-load"),
    }
    unpruned_mtp = _with_mtp_of(results["in-memory"], source, root / "unpruned-mtp")
    speculative = {**_NATIVE_ROPE, "speculative_config": SPECULATIVE}
    spec = {
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        "runs": [
            ["in-memory", str(results["in-memory"]), speculative],
            ["in-memory, no speculation", str(results["in-memory"]), _NATIVE_ROPE],
            ["no-load", str(results["no-load"]), speculative],
        ],
        "refuse": [["unpruned-mtp", str(unpruned_mtp), speculative]],
    }
    work = root / "vllm"
    work.mkdir()
    start = time.time()
    served = drive_vllm(vllm_python, work, spec, DRIVER)
    print(f"\nvLLM: {len(spec['runs'])} runs and a refusal in {time.time() - start:.0f} s (one process)")
    return {"vllm": served, "source": source, **results}


def _mtp_experts(folder: Path) -> set[int]:
    return {int(m.group(1)) for key in mtp_keys(folder, FAMILY) if (m := _EXPERT.search(key))}


def test_results_keep_a_pruned_mtp_layer(served):
    assert _mtp_experts(served["source"]) == set(range(8))
    for name in ("in-memory", "no-load"):
        config = json.loads((served[name] / "config.json").read_text())
        assert config["n_routed_experts"] == 6 and config["num_nextn_predict_layers"] == 1
        assert _mtp_experts(served[name]) == set(range(6)), name
    in_memory, no_load = mtp_keys(served["in-memory"], FAMILY), mtp_keys(served["no-load"], FAMILY)
    assert in_memory.keys() == no_load.keys()
    assert all(torch.equal(in_memory[k], no_load[k]) for k in in_memory)


@pytest.mark.parametrize("name", ["in-memory", "no-load"])
def test_vllm_drafts_with_the_pruned_mtp_layer(served, name):
    runs = served["vllm"]["runs"]
    run, plain = runs[name], runs["in-memory, no speculation"]
    assert run["tokens"] == plain["tokens"]  # speculation never changes greedy tokens
    assert len(run["tokens"]) == len(PROMPTS) and all(len(t) == NEW_TOKENS for t in run["tokens"])
    # the draft model: built with the result's 6 experts, every parameter loaded from the checkpoint
    draft = run["built"]["DeepSeekMTP"]  # its layer: model.layers.2.mtp_block
    (w13,) = [shape for n, shape in draft.items() if "mtp_block" in n and n.endswith("w13_weight")]
    assert w13[0] == 6, draft
    (router,) = [shape for n, shape in draft.items() if "mtp_block" in n and n.endswith("mlp.gate.weight")]
    assert router == [6, CONFIG["hidden_size"]]
    # and it drafted: one token for each decoding step
    assert run["spec_decode"]["spec_decode_num_draft_tokens"] > 0, run["spec_decode"]
    assert not any(plain["spec_decode"].values()) and "DeepSeekMTP" not in plain["built"]


def test_vllm_generates_like_moeprune(served):
    """vLLM's speculative greedy tokens are moeprune.load_pretrained's (a differing token only at a
    tie of transformers' logits, as in test_serve_vllm.py)."""
    model = moeprune.load_pretrained(served["in-memory"])
    for prompt, tokens in zip(PROMPTS, served["vllm"]["runs"]["in-memory"]["tokens"]):
        greedy, reference = _greedy_and_logprobs(model, prompt, tokens)
        for t, token in enumerate(tokens):
            if tokens[: t + 1] != greedy[: t + 1]:
                gap = float(reference[t].max() - reference[t, token])
                assert gap <= 2 * LOGPROB_ATOL, f"prompt {prompt}: vLLM generated {tokens}, moeprune {greedy}"
                break


def test_vllm_refuses_the_unpruned_mtp_layer(served):
    """The input's MTP layer (8 experts) in the result (6): vLLM's draft model cannot hold it."""
    error = served["vllm"]["refused"]["unpruned-mtp"]
    assert error is not None, "vLLM started with an 8-expert MTP layer in a 6-expert result"
    # its loader finds no parameter for the first expert beyond the result's count
    assert "KeyError" in error and "mtp_block.mlp.experts.6." in error, error
    print(f"\nvLLM refused the unpruned MTP layer: {error[:300]}")
