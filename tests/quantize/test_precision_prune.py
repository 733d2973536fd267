"""`prune --quantize auto:w4a16,w8a16 --target-size T --sparsity 0.25` end to end, in the
quantization environment (.venv-quant; skipped with the reason when absent): a tiny qwen3_moe
(3 MoE layers, 8 experts 16 wide), pruned by frequency with the global allocation (per-layer
counts: moeprune's format, quantized through its modeling files), each layer's experts in the
scheme chosen under T by llm-compressor's round-to-nearest. One prune (about a minute) shared by
the module.

T lies halfway between every layer at w4a16 and every layer at w8a16. What must hold: the choice is
the brute-force optimum of the reported losses and bytes, and mixed; each layer's experts are
stored in the chosen scheme (config groups, packed codes) and everything else in w4a16; each
layer's expert tensors weigh the byte model's prediction; the file is within T; recipe.json
repeats the run; and `moeprune.load_pretrained` and the folder's modeling files
(`trust_remote_code`) compute the logits of the original model with the dropped experts masked and
every quantized weight fake-quantized as chosen (the compressed-tensors arithmetic). Stock
transformers is no oracle: it reads one experts scheme for every layer (get_experts_scheme), so it
misreads a mixed checkpoint (docs/large-models.md); vLLM reads each layer's from its expert 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import (
    assert_expert_header_bound,
    assert_logits_close,
    brute_force_choice,
    header_entries,
    prune_auto_halfway,
    run_cli,
    save_tiny_qwen,
    stored_tensors,
    write_arithmetic,
)
from moeprune.checkpoint import load_pretrained
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.models.reshape import mask_experts
from moeprune.quantize.fake import fake_quantize
from moeprune.quantize.pricing import ignored

pytestmark = pytest.mark.quant_env

QUANT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-quant" / "bin" / "python"
GROUP = 16
BITS = {"w4a16": 4, "w8a16": 8}


@pytest.fixture(scope="module")
def pruned(tmp_path_factory) -> dict:
    if not QUANT_PYTHON.is_file():
        pytest.skip(f"no quantization environment ({QUANT_PYTHON} absent): run scripts/setup_quant.sh")
    root = tmp_path_factory.mktemp("precision-prune")
    torch.manual_seed(0)
    model, _ = save_tiny_qwen(root / "model")
    data = write_arithmetic(root / "calib.jsonl")
    common = [root / "model", "--data", data, "--criterion", "frequency", "--sparsity", "0.25", "--allocation", "global",
              "--quantize", "auto:w4a16,w8a16", "--quant-method", "rtn", "--quant-group-size", str(GROUP),
              "--quant-python", QUANT_PYTHON]  # fmt: skip
    target, _ = prune_auto_halfway(common, root / "out")
    out = root / "out"
    report = json.loads((out / "report.json").read_text())
    return {"root": root, "model": model, "out": out, "target": target, "report": report, "common": common}


def test_the_choice_is_the_brute_force_optimum_of_the_reported_tables(pruned):
    precision = pruned["report"]["quantization"]["precision"]
    losses, layers = precision["losses"], ["0", "1", "2"]
    assert set(losses) == set(layers) and all(set(row) == {"w4a16", "w8a16"} for row in losses.values())
    assert len(set(pruned["report"]["removed_per_layer"].values())) > 1  # per-layer counts: the layers differ
    best = brute_force_choice(precision, pruned["target"])
    assert precision["chosen"] == best
    assert set(best.values()) == {"w4a16", "w8a16"}  # the target leaves a real choice
    assert pruned["report"]["quantization"]["layer_schemes"] == precision["chosen"]
    assert precision["target_bytes"] == pruned["target"]


def test_each_layer_is_stored_in_its_scheme_and_weighs_the_prediction(pruned):
    out, precision = pruned["out"], pruned["report"]["quantization"]["precision"]
    tensors = stored_tensors(out)
    for layer, scheme in precision["chosen"].items():
        kept = 8 - pruned["report"]["removed_per_layer"][layer]
        prefix = f"model.layers.{layer}.mlp.experts."
        packed = tensors[f"{prefix}0.down_proj.weight_packed"]  # int32 codes: 8 int4 or 4 int8 a word
        assert packed.dtype == torch.int32 and packed.shape[1] * 32 // BITS[scheme] == 16, (layer, scheme)
        stored = sum(t.nbytes for k, t in tensors.items() if k.startswith(prefix))
        assert header_entries(out, prefix)[0] == kept * 3 * 3
        assert_expert_header_bound(precision["expert_bytes"][layer][scheme], stored, out, prefix)
    q = tensors["model.layers.0.self_attn.q_proj.weight_packed"]  # outside the experts: the base, int4
    assert q.shape[1] * 8 == int(tensors["model.layers.0.self_attn.q_proj.weight_shape"][1])
    assert tensors["lm_head.weight"].dtype == torch.float32
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    bits = {g["weights"]["num_bits"]: g["targets"] for g in groups.values()}
    eight = "|".join(layer for layer, s in precision["chosen"].items() if s == "w8a16")
    assert bits[4] == ["Linear"] and bits[8] == [rf"re:.*layers\.({eight})\.mlp\.experts\.\d+\.(gate|up|down)_proj$"]
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert written == precision["written_bytes"] <= precision["predicted_bytes"] <= pruned["target"]
    assert "per-layer bits  experts of layer" in (out / "report.md").read_text()


def test_recipe_repeats_auto_with_its_target_and_sparsity(pruned, tmp_path):
    recipe = json.loads((pruned["out"] / "recipe.json").read_text())
    chosen = pruned["report"]["quantization"]["precision"]["chosen"]
    assert recipe["quantize"] == {
        "scheme": "auto:w4a16,w8a16", "method": "rtn", "group_size": GROUP, "layer_schemes": chosen,
        "target_size": pruned["target"],
    }  # fmt: skip
    assert recipe["config"]["sparsity"] == 0.25
    again = run_cli("prune", pruned["root"] / "model", "--config", pruned["out"] / "recipe.json",
                    "--output", tmp_path / "again", "--quant-python", QUANT_PYTHON, "--dry-run").output  # fmt: skip
    assert f"({pruned['target']:,} bytes): reachable" in again and "sparsity 0.25 of experts" in again


def test_moeprune_reads_it_as_the_masked_fake_quantized_original(pruned):
    plan = json.loads((pruned["out"] / "plan.json").read_text())
    chosen = pruned["report"]["quantization"]["precision"]["chosen"]
    reference = tiny_model("qwen3_moe", vocab_size=len(byte_tokenizer()), num_hidden_layers=3, mlp_only_layers=[])
    reference.load_state_dict(pruned["model"].state_dict())
    reference.eval()
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and not ignored(name):
            module.weight.data = fake_quantize(module.weight.data, "w4a16", GROUP)
    for layer, scheme in chosen.items():
        for p in reference.model.layers[int(layer)].mlp.experts.parameters():
            p.data = fake_quantize(p.data, scheme, GROUP)
    removed = {lp["layer"]: lp["dropped"] for lp in plan["layers"]}
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 8, 200, 31, 64]])
    ours = load_pretrained(pruned["out"]).eval()
    files = AutoModelForCausalLM.from_pretrained(pruned["out"], trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad(), mask_experts(MoEModel(reference), removed):
        expected = reference(ids).logits
        assert_logits_close(ours(ids).logits, expected)
        assert_logits_close(files(ids).logits, expected)
