"""vLLM 0.33's native description of a constant-novice result (serve/vllm_native.py): accepted
by 0.33's own parser and constant-expert table, and the same model as moeprune's novices.

vLLM 0.33 has no CPU build, so it cannot serve here. Its parser and its `ConstantExpertSubstitution`
(vllm/model_executor/layers/fused_moe/expert_substitution.py) need only torch: they are taken
from the 0.33 wheel's source in .venv-vllm33 (scripts/setup_vllm33.sh) and run with this
environment's torch, the module's three vLLM imports left out (they are used only by
`SubstitutedRoutedExperts`, the fused-MoE subclass, which is not taken). The routing semantics
that vLLM documents for substitution (logical ids kept, router weights kept, no renormalisation
after substitution: a substituted pick is a zero-weight route plus g * value) are implemented
here as a reference on transformers' stock class and compared with moeprune's loader.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

import moeprune
from moeprune.config import DataOptions, PruneConfig, RunOptions
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.job import PruneRequest, prune_checkpoint
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.serve.vllm_native import NATIVE_DIR, native_config, native_refusal

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = {  # qwen3_moe renormalises the top-k weights (norm_topk_prob); deepseek_v3 routes by sigmoid + bias
    "qwen3_moe": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, moe_intermediate_size=16,
                      intermediate_size=32, mlp_only_layers=[], norm_topk_prob=True),
    "deepseek_v3": dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=16, intermediate_size=32,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=2, topk_group=1, q_lora_rank=16, routed_scaling_factor=2.5),
}  # fmt: skip


def vllm33_substitution() -> types.ModuleType:
    """vLLM 0.33's expert_substitution module, from its source, without its vLLM imports."""
    found = sorted((ROOT / ".venv-vllm33").glob("lib/python3*/site-packages/vllm"))
    if not found:
        pytest.skip(".venv-vllm33 is not set up (scripts/setup_vllm33.sh)")
    path = found[0] / "model_executor/layers/fused_moe/expert_substitution.py"
    tree = ast.parse(path.read_text(), str(path))
    tree.body = [
        node
        for node in tree.body
        if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"))
        and not (isinstance(node, ast.ClassDef) and node.name == "SubstitutedRoutedExperts")
    ]
    module = sys.modules.setdefault("vllm33_expert_substitution", types.ModuleType("vllm33_expert_substitution"))
    exec(compile(tree, str(path), "exec"), module.__dict__)  # noqa: S102 - vLLM 0.33's own code, from its wheel
    return module


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native")
    tokenizer = byte_tokenizer()
    data = root / "calib.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"def f{i}(a):\n    return a * {i}  # {'q' * i}\n"}) for i in range(12)))
    made = {}
    for family, fields in FAMILIES.items():
        reference = root / family / "reference"
        tiny_model(family, vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=3, **fields).save_pretrained(reference)
        tokenizer.save_pretrained(reference)
        made[family] = root / family / "novice"
        prune_checkpoint(PruneRequest(
            reference, made[family], PruneConfig(criterion="mone", sparsity=0.25, method="novice"),
            data=DataOptions(sources=[str(data)], samples=12, max_length=48), run=RunOptions(progress=False),
        ))  # fmt: skip
    return made


def _names(path: Path) -> set[str]:
    names = set()
    for shard in path.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            names.update(handle.keys())
    return names


def _tensor(path: Path, name: str) -> torch.Tensor:
    for shard in path.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            if name in set(handle.keys()):
                return handle.get_tensor(name)
    raise KeyError(name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm33_parser_accepts_the_native_description(family, results):
    """0.33's parser reads the description; its constant-expert table loads every value by the
    named tensors and finds none missing; the named retained experts exist, the substituted not."""
    vllm = vllm33_substitution()
    path = results[family]
    native = json.loads((path / NATIVE_DIR / "config.json").read_text())
    section = json.loads((path / "config.json").read_text())["moeprune"]
    assert native["model_type"] == family and native["architectures"] == [section["base_architecture"]]
    config = types.SimpleNamespace(**native)
    spec = vllm.get_expert_substitution_spec(types.SimpleNamespace(hf_text_config=config, hf_config=config))
    layers = {entry["layer"]: entry for entry in section["layers"]}
    assert spec.experts == {i: tuple(e["novice"]) for i, e in layers.items() if e["novice"]}
    names = _names(path)
    for layer, substituted in spec.experts.items():
        count = layers[layer]["num_experts"]
        table = vllm.ConstantExpertSubstitution(layer, count, substituted, native["hidden_size"], torch.float32)
        for name, pairs in spec.value_names.items():
            for at, expert in pairs:
                if at == layer:
                    table.values.weight_loader(table.values, _tensor(path, name).float(), expert)
        table.validate_loaded_values(f"layer {layer}")
        for expert in range(count):  # 0.33 loads retained experts under their logical names
            stored = any(f".layers.{layer}.mlp.experts.{expert}.gate_proj.weight" in n for n in names)
            assert stored == (expert not in substituted), (layer, expert)
    broken = json.loads(json.dumps(native))  # the parser can refuse: renormalising after substitution
    broken["compression_config"]["transform_config"]["expert_substitution"]["router_semantics"][
        "renormalize_after_substitution"
    ] = True
    with pytest.raises(ValueError, match="unchanged routing"):
        config = types.SimpleNamespace(**broken)
        vllm.get_expert_substitution_spec(types.SimpleNamespace(hf_text_config=config, hf_config=config))


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _load_logical(model: torch.nn.Module, path: Path) -> None:
    """The result's tensors into the stock model: retained experts into their logical rows of
    the fused expert tensors (as vLLM 0.33 loads them by their logical names); substituted rows
    stay as initialised (their routes are zero-weighted)."""
    params = dict(model.named_parameters())
    plain = {}
    with torch.no_grad():
        for name in _names(path):
            match = _EXPERT.match(name)
            tensor = _tensor(path, name).float()
            if match is None:
                plain[name] = tensor
                continue
            prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
            width = tensor.shape[1] if part == "down_proj" else tensor.shape[0]
            if part == "down_proj":
                params[f"{prefix}.down_proj"][expert].copy_(tensor)
            else:
                rows = slice(0, width) if part == "gate_proj" else slice(width, 2 * width)
                params[f"{prefix}.gate_up_proj"][expert][rows].copy_(tensor)
    missing, unexpected = model.load_state_dict(plain, strict=False)
    assert all(".experts." in m for m in missing), missing
    assert all(u.endswith(".mean_output") for u in unexpected), unexpected


def _reference(path: Path, renormalize_after: bool = False) -> torch.nn.Module:
    """transformers' stock class from the native config, served as vLLM 0.33 documents
    substitution: the router over all logical experts unchanged, a substituted pick's expert
    output replaced by g * value (its route zero-weighted), nothing renormalised after."""
    native = json.loads((path / NATIVE_DIR / "config.json").read_text())
    description = native.pop("compression_config")["transform_config"]["expert_substitution"]
    config = AutoConfig.for_model(native.pop("model_type"), **native)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _load_logical(model, path)
    moe = MoEModel(model)
    for layer in moe.layers:
        target = next(t for p, t in description["targets"].items() if f".layers.{layer.index}." in p + ".")
        values = torch.zeros(layer.num_experts, config.hidden_size)
        for expert, replacement in target["replacements"].items():
            values[int(expert)] = _tensor(path, replacement["tensors"]["value"]).float()
        substituted = values.abs().sum(dim=1) > 0
        experts, original = layer.experts, layer.experts.forward

        def forward(hidden, top_k_index, top_k_weights, *, original=original, values=values, substituted=substituted, renormalize=renormalize_after):
            replaced = substituted[top_k_index]
            kept = top_k_weights.masked_fill(replaced, 0.0)
            if renormalize:  # what vLLM 0.33 refuses: retained weights rescaled to sum to 1
                kept = kept / kept.sum(dim=-1, keepdim=True).clamp_min(1e-9)
            out = original(hidden, top_k_index, kept)
            constant = (top_k_weights * replaced).unsqueeze(-1) * values[top_k_index]
            return out + constant.sum(dim=1).to(out.dtype)

        experts.forward = forward
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_native_semantics_equal_moeprunes_novices(family, results):
    path = results[family]
    ids = torch.tensor([[3, 17, 42, 99, 7, 64, 5, 88, 21, 13, 250, 1]])
    with torch.no_grad():
        ours = moeprune.load_pretrained(path).float().eval()(ids).logits
        native = _reference(path)(ids).logits
    assert (ours - native).abs().max().item() < 1e-5
    assert ours.abs().max().item() > 1e-3  # a real comparison, not of zeros
    with torch.no_grad():  # moeprune's novices do not renormalise after substitution: that model differs
        renormalized = _reference(path, renormalize_after=True)(ids).logits
    assert (ours - renormalized).abs().max().item() > 1e-3


def test_native_refusals_name_the_reason(results):
    path = results["qwen3_moe"]
    config, names = json.loads((path / "config.json").read_text()), _names(path)
    assert native_refusal(config, names) is None
    assert native_config(config, names)["model_type"] == "qwen3_moe"
    quantized = dict(config, quantization_config={"quant_method": "compressed-tensors"})
    assert "unquantized" in native_refusal(quantized, names)
    lowrank = json.loads(json.dumps(config))
    for layer in lowrank["moeprune"]["layers"]:
        layer["novice_rank"] = 2
    assert "low-rank" in native_refusal(lowrank, names)
    report = json.loads((path / "report.json").read_text())
    assert report["serving"]["vllm_native"].startswith("natively in vLLM >= 0.33")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_pretrained_writes_the_native_description_too(family, results, tmp_path):
    """`moeprune.save_pretrained` of a loaded constant-novice result writes the description the
    prune wrote, naming the tensors it stores (the parser test reads the prune's)."""
    path = results[family]
    moeprune.save_pretrained(moeprune.load_pretrained(path), tmp_path / "resaved")
    written = json.loads((tmp_path / "resaved" / NATIVE_DIR / "config.json").read_text())
    assert written == json.loads((path / NATIVE_DIR / "config.json").read_text())
    named = written["compression_config"]["transform_config"]["expert_substitution"]
    assert json.dumps(named).count("mean_output") > 0
    stored = _names(tmp_path / "resaved")
    assert all(name in stored for name in re.findall(r"[\w.]+\.mean_output", json.dumps(named)))


def test_the_no_load_path_writes_no_novice_result_without_the_description(results, tmp_path):
    """The no-load pipeline writes no novices (it refuses the method in one line); its moeprune-
    format results go through the same writer, which describes none (no novices to substitute)."""
    from helpers import run_cli

    reference = results["qwen3_moe"].parent / "reference"
    common = [reference, "--criterion", "magnitude", "--no-load", "--quiet"]
    refused = run_cli("prune", *common, "--method", "novice", "--sparsity", "0.25", "--output", tmp_path / "n", ok=False)
    assert refused.exit_code == 2 and "novice method" in refused.output and not (tmp_path / "n").exists()
    run_cli("prune", *common, "--allocation", "global", "--sparsity", str(7 / 24), "--output", tmp_path / "g")
    assert json.loads((tmp_path / "g" / "config.json").read_text())["model_type"] == "moeprune_qwen3_moe"
    assert not (tmp_path / "g" / NATIVE_DIR).exists()
    assert "vllm_native" not in json.dumps(json.loads((tmp_path / "g" / "report.json").read_text()).get("serving"))
