"""Stock vLLM serves every kind of moeprune output, through moeprune's plugin, like moeprune does.

For each family and output kind, a tiny model is pruned with moeprune's own API and served by
vLLM 0.32 (the CPU build in `.venv-vllm`, made by ./scripts/setup_vllm.sh) in one subprocess
that loads every output in turn. vLLM's greedy tokens must be moeprune.load_pretrained's, and
vLLM's top-5 logprobs at every generated position must equal transformers' log-softmax at the
same position (teacher-forced on vLLM's tokens) within LOGPROB_ATOL. A differing greedy token
is accepted only where transformers itself has a tie: its argmax beats vLLM's token by at most
2 * LOGPROB_ATOL. Everything runs in fp32 on the CPU.

LOGPROB_ATOL is 2e-4: vLLM's fused-MoE, attention and MLA kernels sum in other orders than
transformers (the worst difference measured on these models is 1.9e-5), while a plugin bug moves
logprobs by far more. Checked by breaking the plugin on purpose while writing this test: without
the novice term the novice outputs moved by 0.5 to 1.4; with the novice term missing DeepSeek's
routed_scaling_factor, by 0.2 to 0.5; with the padding neurons non-zero, the TENP output by 0.9;
with width groups not masking the other groups' picks, the TENP output's greedy tokens differ.

Mixed-width outputs (TENP, and "widths": TENP cut further to many widths per layer) are served
as width groups; the driver also counts the parameters of the model vLLM built (when its loader
starts, before the CPU build repacks weights for its kernels), which must be the packed size
plus the padding inside the groups, `served_parameter_count`.

The tiny models respect the CPU build's limits (attention head_dim 64, DeepSeek MLA with
kv_lora_rank 512 and qk_rope_head_dim 64). Six of the first MoE layer's experts get weights of
one magnitude, so AIMER (which prunes the most uniform experts first) makes `global` and `evo`
allocations that differ between layers. The DeepSeek-V3 reference spells out its routing
("scoring_func": "sigmoid", "topk_method": "noaux_tc") as DeepSeek's own configs do, since stock
vLLM needs that for the stock outputs; the moeprune-format outputs have both removed, as
transformers-written configs lack them, and the plugin must still route like transformers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import moeprune
from moeprune.config import DataOptions, PruneConfig, RunOptions, SearchConfig
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.job import PruneRequest, prune_checkpoint
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model

pytestmark = pytest.mark.vllm  # drives vLLM's CPU build in a subprocess (.venv-vllm)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
LOGPROB_ATOL = 2e-4  # measured worst |vLLM - transformers| on these models: 1.9e-5 (printed as "worst")
PROMPTS = [[5, 17, 33, 60, 91], [70, 71, 72], [200, 13, 101, 45, 9, 120], [33, 33, 250]]
NEW_TOKENS = 8
TOP_LOGPROBS = 5

_COMMON = dict(hidden_size=64, num_hidden_layers=4, max_position_embeddings=256)
_MLA = dict(
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
    v_head_dim=32, moe_intermediate_size=32, intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
)  # fmt: skip
FAMILIES = {
    "qwen3_moe": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64, moe_intermediate_size=32,
                      intermediate_size=64, mlp_only_layers=[]),
    "olmoe": dict(num_attention_heads=1, num_key_value_heads=1, intermediate_size=32),
    "mixtral": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=32),
    # DeepSeek's own configs spell out the routing that transformers' configs leave implicit
    "deepseek_v3": dict(_MLA, q_lora_rank=32, topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5),
    "deepseek_v2": dict(_MLA, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5),
    "qwen2_moe": dict(num_attention_heads=1, num_key_value_heads=1, moe_intermediate_size=32, intermediate_size=64,
                      shared_expert_intermediate_size=32, mlp_only_layers=[]),
    "glm4_moe": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64, moe_intermediate_size=32,
                     intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.5),
    # a family found by discovery (no hand-made fixture): its tiny config, with vLLM's CPU head size
    "exaone_moe": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64),
}  # fmt: skip
TESTED = ("qwen3_moe", "olmoe", "mixtral", "deepseek_v3")  # every kind; the other families: EXTRA_KINDS
_EVO = SearchConfig(samples=4, population=4, elites=2, generations=2)
KINDS = {  # kind: (prune arguments, expected format)
    "drop": (dict(criterion="reap", sparsity=0.25), "stock"),
    "global": (dict(criterion="aimer", sparsity=0.25, allocation="global"), "moeprune"),
    "evo": (dict(criterion="aimer", sparsity=0.25, allocation="evo"), "moeprune"),
    "novice": (dict(criterion="mone", sparsity=0.25, method="novice"), "moeprune"),
    # stock ENP: super experts narrowed with the others (guarded, they stay whole: moeprune's format, "tenp" covers it)
    "neurons": (dict(criterion="reap", sparsity=0.25, method="neurons", allow_super_experts=True), "stock"),
    "tenp": (dict(criterion="tenp", sparsity=0.25, method="tenp"), "moeprune"),
}
EXTRA_KINDS = ("global", "novice", "tenp")  # per-layer counts, novices and widths for the other families
# "widths": the TENP output with each expert cut further to its own width (WIDTH_FACTORS in turn),
# so a layer has more distinct widths than MAX_WIDTH_GROUPS: some merge within the tolerance
# (32 and 31), the rest by the cap. A moeprune-format folder as `save_pretrained` would write it
# for per-expert neuron widths, which no surgery method makes on its own today.
WIDTH_FACTORS = (1.0, 0.97, 0.75, 0.5, 0.3, 0.15)
WIDTH_KINDS = ("tenp", "widths")  # outputs whose layers mix widths: served as width groups
CASES = [(f, k) for f in FAMILIES for k in KINDS if f in TESTED or k in EXTRA_KINDS]
CASES += [(f, "widths") for f in TESTED]
# vLLM 0.32's CPU rotary kernel (_C.rotary_embedding) rotates a 3-D query [tokens, heads, dim]
# wrongly (2-D input is right); DeepSeek's MLA passes one, so its stock models run the kernel off
# here (the Python path is exact). Not moeprune's to fix: see the plugin's report.
_NATIVE_ROPE = {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}
VLLM_OPTIONS = {"deepseek_v3": _NATIVE_ROPE, "deepseek_v2": _NATIVE_ROPE}

# Runs under .venv-vllm: serves each model in turn in one process (engine in-process, one worker),
# and tries to load each "refuse" folder, recording the error.
DRIVER = r"""
import gc, json, os, sys, time

os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # an explicit, small KV cache is passed below
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

ALLOCATED = {}

def record_allocation():
    # Parameters of the model vLLM built, counted when its loader starts (after construction,
    # before the weights arrive): vLLM's CPU build repacks linear layers and aligns fused-MoE
    # widths to 32 after loading, a kernel layout that is not the model's.
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    original = DefaultModelLoader.load_weights

    def load_weights(self, model, model_config):
        params = dict(model.named_parameters())
        config = model_config.hf_text_config
        vocab, hidden = config.vocab_size, config.hidden_size
        ALLOCATED[model_config.model] = {
            "parameters": sum(p.numel() for p in params.values()),
            # vLLM pads the vocabulary of embed_tokens / lm_head to a multiple of 64
            "vocab_padding": sum((p.shape[0] - vocab) * hidden for n, p in params.items()
                                 if n.endswith(("embed_tokens.weight", "lm_head.weight"))),
            "width_group_blocks": sum(".width_groups." in n and n.endswith("w2_weight") for n in params),
        }
        return original(self, model, model_config)

    DefaultModelLoader.load_weights = load_weights

ROUTING = {"routings": 0, "layer_forwards": 0}

def count_routing():
    # How often the plugin's MoE layers run, and how often they route (the family's top-k over
    # all router positions): a layer with width groups or novices routes once per forward.
    from moeprune.serve.vllm import moe
    route, forward = moe.GroupRouter.route, moe.PrunedMoERunner.forward

    def counted_route(self, *args, **kwargs):
        ROUTING["routings"] += 1
        return route(self, *args, **kwargs)

    def counted_forward(self, *args, **kwargs):
        ROUTING["layer_forwards"] += 1
        return forward(self, *args, **kwargs)

    moe.GroupRouter.route, moe.PrunedMoERunner.forward = counted_route, counted_forward

def main():
    from vllm import LLM, SamplingParams
    record_allocation()
    count_routing()
    spec = json.load(open(sys.argv[1]))
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, logprobs=spec["logprobs"],
                            ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    out = {"models": {}, "refused": {}}
    def llm(path, **extra):
        return LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
                   max_model_len=64, kv_cache_memory_bytes=1 << 26, distributed_executor_backend="uni", **extra)
    for path, extra in spec["models"]:
        start = time.time()
        engine = llm(path, **extra)
        ROUTING.update(routings=0, layer_forwards=0)
        results = engine.generate(prompts, params, use_tqdm=False)
        out["models"][path] = {
            "seconds": time.time() - start,
            "architecture": engine.llm_engine.model_config.architectures[0],
            "allocated": ALLOCATED.get(path),
            "routing": dict(ROUTING),
            "tokens": [list(r.outputs[0].token_ids) for r in results],
            "logprobs": [[{str(t): lp.logprob for t, lp in step.items()} for step in r.outputs[0].logprobs]
                         for r in results],
        }
        del engine, results
        gc.collect()
    for path in spec["refuse"]:  # last: a failed start may leave state behind
        try:
            llm(path)
            out["refused"][path] = None
        except Exception as exc:
            out["refused"][path] = f"{type(exc).__name__}: {exc}"
    out["moeprune_modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "moeprune")
    json.dump(out, open(sys.argv[2], "w"))

if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.is_file():
        pytest.fail(
            f"{VLLM_PYTHON} is missing: run ./scripts/setup_vllm.sh to install vLLM beside moeprune",
            pytrace=False,
        )
    return VLLM_PYTHON


def _reference(family: str, path: Path, vocab: int) -> None:
    """A tiny model of `family` where AIMER ranks six experts of the first MoE layer first."""
    model = tiny_model(family, vocab_size=vocab, **_COMMON, **FAMILIES[family])
    with torch.no_grad():
        for tensor in MoEModel(model).layers[0].experts.parameters():
            if tensor.dim() == 3:  # [experts, ., .]: gate_up and down
                tensor[:6] = 0.2 * torch.sign(tensor[:6])
    model.save_pretrained(path)


def code_calibration(root: Path) -> DataOptions:
    """16 small code samples written under `root`, as the calibration data of every served result."""
    data = root / "calib.jsonl"
    rows = [{"text": f"def f{i}(a, b):\n    return a * {i} + b  # {'xyz' * i}\n"} for i in range(16)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return DataOptions(sources=[str(data)], samples=16, max_length=64)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Every (family, kind) output, made by moeprune.job.prune_checkpoint."""
    root = tmp_path_factory.mktemp("serve")
    tokenizer = byte_tokenizer()
    options = code_calibration(root)
    made = {}
    for family in FAMILIES:
        reference = root / family / "reference"
        _reference(family, reference, len(tokenizer))
        tokenizer.save_pretrained(reference)
        for kind in KINDS:
            if (family, kind) not in CASES:
                continue
            config = PruneConfig(**KINDS[kind][0], search=_EVO)
            made[family, kind] = root / family / kind
            search = list(options.sources) if config.allocation == "evo" else []
            prune_checkpoint(PruneRequest(
                reference, made[family, kind], config, data=options, search_data=search, run=RunOptions(progress=False)
            ))
            if family == "deepseek_v3" and KINDS[kind][1] == "moeprune":
                config_path = made[family, kind] / "config.json"
                config = json.loads(config_path.read_text())
                assert config.pop("scoring_func") == "sigmoid" and config.pop("topk_method") == "noaux_tc"
                config_path.write_text(json.dumps(config, indent=2))
        if (family, "widths") in CASES:
            made[family, "widths"] = _narrowed(made[family, "tenp"], root / family / "widths")
    return made


def _narrowed(source: Path, folder: Path) -> Path:
    """`source` (moeprune's format) with router position p of every layer cut to its first
    round(width * WIDTH_FACTORS[p % 6]) neurons: gate and up rows, down columns, config widths."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    cut = {}
    for entry in config["moeprune"]["layers"]:
        entry["widths"] = [None if w is None else max(1, round(w * WIDTH_FACTORS[p % len(WIDTH_FACTORS)]))
                           for p, w in enumerate(entry["widths"])]  # fmt: skip
        cut.update({(entry["layer"], p): w for p, w in enumerate(entry["widths"]) if w is not None})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    expert = re.compile(r"\.layers\.(\d+)\.[A-Za-z_]+\.experts\.(\d+)\.(\w+)\.weight$")
    for shard in folder.glob("*.safetensors"):
        tensors = load_file(shard)
        for name, tensor in tensors.items():
            match = expert.search(name)
            if match and (int(match.group(1)), int(match.group(2))) in cut:
                width = cut[int(match.group(1)), int(match.group(2))]
                down = match.group(3) in ("down_proj", "w2")
                tensors[name] = (tensor[:, :width] if down else tensor[:width]).contiguous()
        save_file(tensors, shard, metadata={"format": "pt"})
    return folder


def _unserved(tmp_path_factory, family: str, architecture: str) -> Path:
    """A moeprune-format config of a family the plugin refuses (no weights needed: refused first)."""
    folder = tmp_path_factory.mktemp(family)
    config = {"model_type": f"moeprune_{family}", "architectures": [f"MoePrune{architecture}"],
              "moeprune": {"format": "moeprune-checkpoint", "format_version": 3, "base_model_type": family,
                           "layers": [{"layer": 0, "num_experts": 2, "expert_ids": [0, 1], "widths": [8, None],
                                       "novice": [1]}]}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def unserved_family(tmp_path_factory) -> Path:
    return _unserved(tmp_path_factory, "gpt_oss", "GptOssForCausalLM")


@pytest.fixture(scope="module")
def new_family(tmp_path_factory) -> Path:
    """A family beyond the eleven (found by discovery): refused in the same sentence."""
    return _unserved(tmp_path_factory, "minimax_m2", "MiniMaxM2ForCausalLM")


@pytest.fixture(scope="module")
def damaged(outputs, tmp_path_factory) -> Path:
    """A TENP output whose config.json gives one expert a width its tensors do not have."""
    folder = tmp_path_factory.mktemp("damaged") / "tenp"
    shutil.copytree(outputs["qwen3_moe", "tenp"], folder)
    config = json.loads((folder / "config.json").read_text())
    widths = config["moeprune"]["layers"][0]["widths"]
    widths[0] -= 1
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def drive_vllm(vllm_python, work: Path, spec: dict, driver: str) -> dict:
    """Run `driver` (a script reading spec.json, writing out.json) in vLLM's venv; its output, or
    the test fails showing the end of vLLM's log."""
    (work / "spec.json").write_text(json.dumps(spec))
    (work / "driver.py").write_text(driver)
    result = _run_vllm(
        vllm_python, [work / "driver.py", work / "spec.json", work / "out.json"], work / "log.txt"
    )
    if result.returncode != 0:
        pytest.fail(
            f"vLLM failed (exit {result.returncode}); the end of its log:\n{_tail(work / 'log.txt')}",
            pytrace=False,
        )
    return json.loads((work / "out.json").read_text())


@pytest.fixture(scope="module")
def served(vllm_python, outputs, unserved_family, new_family, damaged, tmp_path_factory) -> dict:
    """vLLM's results for every output, from one subprocess; also its load times."""
    work = tmp_path_factory.mktemp("vllm")
    spec = {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "logprobs": TOP_LOGPROBS,
            "models": [[str(path), VLLM_OPTIONS.get(family, {})] for (family, _), path in outputs.items()],
            "refuse": [str(unserved_family), str(new_family), str(damaged)]}  # fmt: skip
    start = time.time()
    served = drive_vllm(vllm_python, work, spec, DRIVER)
    served["seconds"] = time.time() - start
    print(f"\nvLLM served {len(outputs)} outputs in {served['seconds']:.0f} s (one process)")
    return served


def _run_vllm(python: Path, args: list, log: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    with log.open("w") as handle:
        return subprocess.run([str(python), *map(str, args)], stdout=handle, stderr=subprocess.STDOUT,
                              env={**os.environ, **(env or {})}, timeout=1500, check=False)  # fmt: skip


def _tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _is_moeprune_format(path: Path) -> bool:
    return "moeprune" in json.loads((path / "config.json").read_text())


@torch.no_grad()
def _greedy_and_logprobs(model, prompt: list[int], continuation: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens after `prompt`, and its log-softmax at each position of
    prompt + continuation (teacher-forced), both in fp32 without a KV cache."""
    greedy = list(prompt)
    for _ in range(NEW_TOKENS):
        greedy.append(int(model(torch.tensor([greedy])).logits[0, -1].argmax()))
    forced = torch.tensor([prompt + continuation])
    logprobs = torch.log_softmax(model(forced).logits[0].float(), dim=-1)
    return greedy[len(prompt) :], logprobs[len(prompt) - 1 : -1]


@pytest.mark.parametrize("family,kind", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_vllm_serves_like_moeprune(family, kind, served, outputs):
    path = outputs[family, kind]
    expected_format = KINDS[kind][1] if kind in KINDS else "moeprune"
    assert _is_moeprune_format(path) == (expected_format == "moeprune"), (
        f"{family} {kind} was expected to give a {expected_format} checkpoint; change the test model or settings"
    )
    result = served["models"][str(path)]
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    assert result["architecture"] == arch
    model = moeprune.load_pretrained(path)
    worst = 0.0
    for prompt, tokens, steps in zip(PROMPTS, result["tokens"], result["logprobs"]):
        assert len(tokens) == NEW_TOKENS
        greedy, reference = _greedy_and_logprobs(model, prompt, tokens)
        for t, (token, top) in enumerate(zip(tokens, steps)):
            for candidate, logprob in top.items():
                diff = abs(logprob - float(reference[t, int(candidate)]))
                worst = max(worst, diff)
                assert diff <= LOGPROB_ATOL, (
                    f"{family} {kind}, prompt {prompt}, step {t}: vLLM's logprob of token {candidate} is {logprob:.6f}, "
                    f"transformers' {float(reference[t, int(candidate)]):.6f}"
                )
            if tokens[: t + 1] == greedy[: t + 1]:
                continue
            gap = float(reference[t].max() - reference[t, token])
            assert gap <= 2 * LOGPROB_ATOL, (
                f"{family} {kind}, prompt {prompt}: vLLM generated {tokens}, moeprune {greedy}; at step {t} "
                f"transformers prefers its token by {gap:.4f} (not a tie)"
            )
            break  # a tie: the sequences may part from here on; the logprobs above still cover vLLM's
    print(f"{family}-{kind}: worst |logprob difference| {worst:.2e}")


def test_served_formats_cover_every_per_layer_structure(outputs):
    """The moeprune-format outputs exercise per-layer counts, per-expert widths and novices."""
    seen = set()
    for path in outputs.values():
        section = json.loads((path / "config.json").read_text()).get("moeprune")
        if section is None:
            continue
        layers = section["layers"]
        if len({entry["num_experts"] for entry in layers}) > 1:
            seen.add("counts")
        if any(len({w for w in entry["widths"] if w is not None}) > 1 for entry in layers):
            seen.add("widths")
        if any(entry["novice"] for entry in layers):
            seen.add("novices")
    assert seen == {"counts", "widths", "novices"}


def test_served_outputs_carry_the_sparsity_metadata(outputs):
    """Every output with fewer experts carries `moe_sparsity_config` (checkpoint/sparsity_metadata.py)
    as a top-level key and no quantization_config, so test_vllm_serves_like_moeprune shows that
    vLLM 0.32 serves results carrying it (the stock drop ones without the plugin) as before."""
    carried = set()
    for (family, kind), path in outputs.items():
        config = json.loads((path / "config.json").read_text())
        assert "quantization_config" not in config and "compression_config" not in config
        plan = json.loads((path / "plan.json").read_text())
        if not any(lp.get("dropped") or lp.get("novice") for lp in plan["layers"]):
            assert "moe_sparsity_config" not in config, (family, kind)
            continue
        counts = config["moe_sparsity_config"]["num_experts"]
        for lp in plan["layers"]:
            assert counts[lp["layer"]] == len(lp["kept"]) - len(lp.get("novice", [])), (family, kind)
        carried.add(kind)
    assert {"drop", "global", "evo", "novice"} <= carried


def test_plugin_refuses_a_family_it_does_not_serve(served, unserved_family):
    message = served["refused"][str(unserved_family)]
    assert message is not None, "vLLM loaded a gpt_oss checkpoint in moeprune's format"
    assert "moeprune's vLLM plugin does not serve gpt_oss models" in message
    assert "trust_remote_code=True" in message and "moeprune.load_pretrained" in message


def test_plugin_refuses_families_beyond_the_eleven_in_one_sentence(served, new_family):
    message = served["refused"][str(new_family)]
    assert message is not None, "vLLM loaded a minimax_m2 checkpoint in moeprune's format"
    assert "moeprune's vLLM plugin does not serve minimax_m2 models" in message
    assert "rotary_dim" in message, "the refusal names why vLLM's class cannot take this family's config"


def test_plugin_refuses_a_damaged_checkpoint(served, damaged):
    message = served["refused"][str(damaged)]
    assert message is not None, "vLLM served a checkpoint whose widths disagree with its tensors"
    assert "the checkpoint is damaged" in message and "layer 0" in message, message


# moeprune's modules vLLM's processes may import: its plugin and serving code (no pipeline, data, ...)
SERVING_MODULES = {"moeprune", "moeprune.serve", "moeprune.serve.vllm_plugin", "moeprune.serve.modeling_moeprune",
                   "moeprune.serve.moeprune_layers", "moeprune.serve.moeprune_families", "moeprune.serve.moeprune_loading",
                   "moeprune.serve.moeprune_quantized", "moeprune.serve.moeprune_novices",
                   "moeprune.serve.moeprune_format", "moeprune.serve.vllm", "moeprune.serve.vllm.layout",
                   "moeprune.serve.vllm.moe", "moeprune.serve.vllm.novices", "moeprune.serve.vllm.version",
                   "moeprune.serve.vllm.models"}  # fmt: skip


def test_serving_imports_nothing_heavy_from_moeprune(served):
    """vLLM's processes import moeprune's plugin and serving code only (no pipeline, data, ...)."""
    assert set(served["moeprune_modules"]) <= SERVING_MODULES, sorted(set(served["moeprune_modules"]) - SERVING_MODULES)


def test_plugin_import_is_light():
    """Importing the entry point's module loads neither torch nor vLLM nor moeprune's pipeline."""
    code = (
        "import sys, json; import moeprune.serve.vllm_plugin as p; assert callable(p.register); "
        "print(json.dumps(sorted(sys.modules)))"
    )
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout))  # fmt: skip
    heavy = {"torch", "transformers", "vllm", "numpy", "moeprune.api", "moeprune.job", "moeprune.observe", "moeprune.allocate",
             "moeprune.evaluate", "moeprune.data", "moeprune.models", "moeprune.checkpoint.load"}  # fmt: skip
    assert not loaded & heavy, sorted(loaded & heavy)


def test_without_the_plugin_vllm_refuses(outputs, vllm_python, tmp_path):
    """A moeprune-format folder is never served by stock vLLM alone (wrong shapes): with the
    plugin disabled, vLLM stops at the config."""
    path = outputs["qwen3_moe", "novice"]
    code = (
        "from vllm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    LLM(model={str(path)!r}, skip_tokenizer_init=True, dtype='float32', enforce_eager=True)\n"
    )
    (tmp_path / "load.py").write_text(code)
    result = _run_vllm(vllm_python, [tmp_path / "load.py"], tmp_path / "log.txt", env={"VLLM_PLUGINS": ""})
    log = (tmp_path / "log.txt").read_text(errors="replace")
    assert result.returncode != 0, "stock vLLM loaded a moeprune-format checkpoint without the plugin"
    assert "moeprune_qwen3_moe" in log or "trust_remote_code" in log, _tail(tmp_path / "log.txt")


def _stored(path: Path, experts_only: bool = False) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for shard in path.glob("*.safetensors") for name, t in load_file(shard).items()
               if not experts_only or ".experts." in name)  # fmt: skip


def _group_padding(path: Path, **rule) -> int:
    """Zero-neuron parameters (gate, up and down) padding each expert to its width group's width."""
    from moeprune.serve.moeprune_format import width_groups

    config = json.loads((path / "config.json").read_text())
    padding = 0
    for entry in config["moeprune"]["layers"]:
        widths = entry["widths"]
        for group in width_groups(widths, **rule):
            padding += sum(3 * config["hidden_size"] * (group.width - widths[p]) for p in group.positions)
    return padding


def test_served_parameter_count(outputs):
    """What vLLM holds for a result: what is stored plus the zero neurons padding each expert to
    its width group's width; the same figure the pipeline writes into report.json for the model
    card."""
    from safetensors.torch import load_file

    from moeprune.serve.vllm.layout import served_parameter_count

    path = outputs["qwen3_moe", "tenp"]
    assert served_parameter_count(path) == _stored(path) + _group_padding(path)
    assert _group_padding(path, max_groups=1) > _group_padding(path)  # one block per layer padded more
    stock = outputs["qwen3_moe", "drop"]
    assert served_parameter_count(stock) == _stored(stock)
    for (_, kind), path in outputs.items():
        serving = json.loads((path / "report.json").read_text()).get("serving")
        if serving is not None and kind in KINDS:  # report.json counts model.parameters(): transformers
            # keeps the selection bias (DeepSeek-V3, GLM-4) as a buffer, vLLM as a parameter
            biases = sum(t.numel() for shard in path.glob("*.safetensors")
                         for name, t in load_file(shard).items() if name.endswith("e_score_correction_bias"))  # fmt: skip
            assert served_parameter_count(path) == serving["vllm_parameters"] + biases, path


ROUTED_CASES = [(f, k) for f, k in CASES if KINDS.get(k, ("", "moeprune"))[1] == "moeprune"]


@pytest.mark.parametrize("family,kind", ROUTED_CASES, ids=[f"{f}-{k}" for f, k in ROUTED_CASES])
def test_each_layer_routes_once_per_forward(family, kind, served, outputs):
    """A layer of width groups or novices computes its routing once per forward and hands each
    group's block, and the novice term, a share of it (it used to route again for the other
    groups and, with the gate, for the novices: 0.82x uniform's tokens/s on the demo model, now
    0.85-0.89x). Counted in vLLM's process by wrapping the plugin's router and runner; results
    without novices or width groups are served by vLLM's own runner and route zero times here."""
    from moeprune.serve.moeprune_format import read_structure

    path = outputs[family, kind]
    structure = read_structure(path)
    assert structure is not None, f"{family} {kind} is not in moeprune's format"
    routed = [layer for layer in structure.layers if layer.novices or len(layer.groups) > 1]
    counts = served["models"][str(path)]["routing"]
    if not routed:
        assert counts == {"routings": 0, "layer_forwards": 0}, counts
        return
    assert counts["layer_forwards"] > 0, f"{family} {kind}: vLLM never ran the plugin's MoE layers"
    assert counts["routings"] == counts["layer_forwards"], (
        f"{family} {kind}: {counts['routings']} routings in {counts['layer_forwards']} MoE layer forwards"
    )


WIDTH_CASES = [(f, k) for f in TESTED for k in WIDTH_KINDS]


@pytest.mark.parametrize("family,kind", WIDTH_CASES, ids=[f"{f}-{k}" for f, k in WIDTH_CASES])
def test_vllm_holds_the_width_grouped_size(family, kind, served, outputs):
    """The model vLLM built for a mixed-width result holds the packed size plus the padding
    inside width groups (nothing else, apart from vLLM's own vocabulary padding), with one extra
    fused block per extra group; TENP results within WIDTH_MERGE_TOLERANCE of the packed experts."""
    from moeprune.serve.moeprune_format import WIDTH_MERGE_TOLERANCE, width_groups
    from moeprune.serve.vllm.layout import served_parameter_count

    path = outputs[family, kind]
    allocated = served["models"][str(path)]["allocated"]
    assert allocated is not None, "the driver did not see vLLM load this model"
    held = allocated["parameters"] - allocated["vocab_padding"]
    assert held == served_parameter_count(path) == _stored(path) + _group_padding(path), (
        f"{family} {kind}: vLLM holds {held:,} parameters, the width groups give {served_parameter_count(path):,}"
    )
    layers = json.loads((path / "config.json").read_text())["moeprune"]["layers"]
    assert allocated["width_group_blocks"] == sum(len(width_groups(entry["widths"])) - 1 for entry in layers)
    widest = _group_padding(path, max_groups=1)  # what one block per layer, padded to its widest, held
    print(f"{family}-{kind}: vLLM holds {held:,} parameters ({_stored(path):,} stored; "
          f"{_stored(path) + widest:,} with one block per layer)")  # fmt: skip
    assert _group_padding(path) < widest
    if kind == "tenp":
        assert _group_padding(path) <= WIDTH_MERGE_TOLERANCE * _stored(path, experts_only=True)
