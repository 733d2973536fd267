"""A quantized input pruned to different expert counts per layer is written in moeprune's format
with the input's codes kept (fp8 blocks, MXFP4, compressed-tensors), and every loader reads it:
moeprune's own, and stock transformers through the folder's self-contained modeling files
(`trust_remote_code=True`), which decode the codes while loading.

Each case builds a tiny model, writes it in the format, and writes its float32 dequantized
reference (`save_dequantized_checkpoint`). Both are pruned with the same uniform budget that does
not divide over the MoE layers, so the plan keeps different counts per layer (a moeprune-format
result) and is the same plan for both (asserted). Then:

- every stored code tensor of the result (the quantized weights and their companions) is, expert
  by expert, a byte copy of the input's;
- moeprune.load_pretrained of the result equals that of the pruned reference, bit for bit (the
  same float32 numbers through the same code);
- the modeling files load it as an unquantized model with moeprune's weights and logits, bit for
  bit (the same decoding functions), and `save_pretrained` of that model writes a full-precision
  folder both loaders read;
- a compressed-tensors input: the modeling files' weights are the library's own stack's readings
  of the kept bytes, bit for bit (the library decodes in the scale's dtype).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import (
    assert_logits_close,
    fixed_logits,
    kept_quantization,
    raw_bytes,
    run_cli,
    stock_from_pretrained,
    stored_tensors,
)
from moeprune.checkpoint import load_pretrained
from moeprune.checkpoint.load import read_activations
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models.factory import tiny_model
from moeprune.quant.testing import (
    save_compressed_checkpoint,
    save_dequantized_checkpoint,
    save_fp8_checkpoint,
    save_mxfp4_checkpoint,
)

pytestmark = pytest.mark.integration

# (writer, family, tiny-model overrides, sparsity): budgets that do not split evenly over the MoE
# layers, so one layer keeps fewer experts (3 MoE layers of 8 experts: 7 of 24; deepseek_v3 has
# 2 MoE layers whose expert groups take multiples of 2: 6 of 16 as 2 + 4)
CASES = {
    "mxfp4-gpt_oss": (save_mxfp4_checkpoint, "gpt_oss", {"intermediate_size": 32}, 7 / 24),
    "ct_w4a16-qwen3_moe": (
        lambda m, p, **k: save_compressed_checkpoint(m, p, "w4a16", 16, **k),
        "qwen3_moe",
        {},
        7 / 24,
    ),
    "ct_fp8-deepseek_v3": (
        lambda m, p, **k: save_compressed_checkpoint(m, p, "fp8", 16, **k),
        "deepseek_v3",
        {"qk_rope_head_dim": 16},
        6 / 16,
    ),
    "fp8-deepseek_v3": (
        lambda m, p, **k: save_fp8_checkpoint(m, p, block=(16, 16), **k),
        "deepseek_v3",
        {"qk_rope_head_dim": 16},
        6 / 16,
    ),
}
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@pytest.fixture(scope="module", params=sorted(CASES))
def pruned(request, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(quantized input, its moeprune-format result, the result of pruning the dequantized reference)."""
    write, family, overrides, sparsity = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    tokenizer = byte_tokenizer()
    write(tiny_model(family, vocab_size=len(tokenizer), **overrides), root / "q", tokenizer=tokenizer)
    save_dequantized_checkpoint(root / "q", root / "ref", dtype=torch.float32)
    tokenizer.save_pretrained(root / "ref")
    data = root / "calib.jsonl"
    data.write_text(
        "".join(
            json.dumps({"text": f"Question {i}: {i} plus {i} is {2 * i}. " * 3}) + "\n" for i in range(16)
        )
    )
    common = [
        "--criterion",
        "frequency",
        "--sparsity",
        str(sparsity),
        "--data",
        data,
        "--samples",
        "8",
        "--quiet",
    ]
    run_cli("prune", root / "q", *common, "--output", root / "out")
    run_cli("prune", root / "ref", *common, "--output", root / "ref_out")
    return root / "q", root / "out", root / "ref_out"


def _expert_codes(folder: Path) -> set[bytes]:
    """The bytes of every expert's stored codes and companions (non-float tensors, and their scales):
    a per-expert tensor whole, a fused [experts, ...] tensor one expert at a time."""
    found = set()
    for name, tensor in stored_tensors(folder).items():
        if ".experts." not in name:
            continue
        pieces = [tensor] if _EXPERT.search(name) else list(tensor)
        found.update(raw_bytes(piece) for piece in pieces)
    return found


def test_the_result_is_moeprune_format_with_the_input_codes(pruned):
    q, out, ref_out = pruned
    plan = json.loads((out / "plan.json").read_text())
    assert plan["layers"] == json.loads((ref_out / "plan.json").read_text())["layers"]
    assert len({lp["num_experts"] - len(lp["dropped"]) for lp in plan["layers"]}) > 1  # per-layer counts
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"].startswith("moeprune_")
    assert kept_quantization(config["quantization_config"]) == json.loads((q / "config.json").read_text())["quantization_config"]
    codes = {
        n: t for n, t in stored_tensors(out).items() if not t.is_floating_point() or t.element_size() == 1
    }
    assert any(".experts." in n for n in codes)  # the experts stayed quantized
    assert _expert_codes(out) <= _expert_codes(q)  # expert by expert, bytes of the input


def test_moeprune_reads_it_as_the_pruned_dequantized_model(pruned):
    _, out, ref_out = pruned
    reference = load_pretrained(ref_out)
    read_activations(reference, out)  # what the input's config quantizes at run time (FP8: the inputs)
    assert torch.equal(fixed_logits(load_pretrained(out)), fixed_logits(reference))


def test_stock_transformers_reads_it_through_the_modeling_files(pruned, tmp_path):
    from transformers import AutoModelForCausalLM

    _, out, _ = pruned
    ours = fixed_logits(load_pretrained(out))
    stock = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    assert type(stock).__module__.endswith(".modeling_moeprune")
    assert getattr(stock.config, "quantization_config", None) is None  # decoded: not quantized in memory
    assert {p.dtype for n, p in stock.named_parameters() if ".experts." not in n} == {torch.float32}
    # decoded by the same functions: the same weights, the same logits, to the last bit
    mine, theirs = load_pretrained(out).state_dict(), stock.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(fixed_logits(stock), ours)
    stock.save_pretrained(tmp_path / "resaved")
    resaved = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert "quantization_config" not in resaved
    assert all(
        t.is_floating_point() and t.element_size() >= 2 for t in stored_tensors(tmp_path / "resaved").values()
    )
    resaved_model = load_pretrained(tmp_path / "resaved")  # the weights; the run-time quantization stays behind
    read_activations(resaved_model, out)
    assert_logits_close(fixed_logits(resaved_model), ours)


def test_the_modeling_files_hold_the_compressed_tensors_stacks_numbers(pruned):
    """A compressed-tensors input read by the library's own stack (transformers with the
    `compressed-tensors` package, decompressed on load) in the checkpoint's dtype, bf16: every
    weight of the pruned result, as the modeling files decode it in float32, is the stack's weight
    of the input it was kept from (a fused expert tensor: the kept rows, in order) rounded to bf16,
    and every quantized one is that bf16 value exactly: the library decodes in the scale's dtype
    (bf16). Float32 products are up to half a bf16 ulp away and flip routing.

    The stack in a float32 model is no reference: transformers 5.23 folds FP8 experts itself as
    float32 products, 5.16 upcasts the scales with the model (float32 products for dense modules)."""
    q, out, _ = pruned
    if (
        json.loads((q / "config.json").read_text())["quantization_config"]["quant_method"]
        != "compressed-tensors"
    ):
        pytest.skip("the compressed-tensors stack reads compressed-tensors inputs only")
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    config = CompressedTensorsConfig(dequantize=True) if "dequantize" in CompressedTensorsConfig.__init__.__code__.co_varnames \
        else CompressedTensorsConfig(run_compressed=False)  # fmt: skip
    library = stock_from_pretrained(q, dtype=torch.bfloat16, quantization_config=config).state_dict()
    result = AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, dtype=torch.float32
    ).state_dict()
    plan = {lp["layer"]: lp for lp in json.loads((out / "plan.json").read_text())["layers"]}
    quantized = {k.removesuffix(".weight_scale") for k in stored_tensors(q) if k.endswith(".weight_scale")}
    compared = 0
    for name, tensor in result.items():
        source = library[name]
        if tensor.shape != source.shape:  # fused experts, router rows: [kept, ...] of [num_experts, ...]
            lp = plan[int(re.match(r"model\.layers\.(\d+)\.", name).group(1))]
            source = source[[e for e in range(lp["num_experts"]) if e not in lp["dropped"]]]
        assert torch.equal(tensor.to(source.dtype), source), name  # bf16, but what the stack keeps in fp32
        if name.removesuffix(".weight") in quantized or (".experts." in name and tensor.dim() == 3):
            assert torch.equal(tensor.float(), source.float()), name  # the library's bf16 values, exactly
            compared += 1
    assert compared > 0


def test_a_missing_scale_is_named_not_loaded_as_numbers(pruned, tmp_path):
    """A companion deleted from the folder: the modeling files name the weight that lacks it
    rather than load codes as values (or leave a weight uninitialised)."""
    from transformers import AutoModelForCausalLM

    _, out, _ = pruned
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    file = damaged / "model.safetensors"
    tensors = load_file(file)
    companion = next(
        n for n in sorted(tensors) if ".experts." in n and re.search(r"(_scale_inv|_scales|weight_scale)$", n)
    )
    del tensors[companion]
    save_file(tensors, str(file), metadata={"format": "pt"})
    weight = re.sub(r"(_scale_inv|_scales|\.weight_scale)$", "", companion)  # the weight it decodes
    with pytest.raises(ValueError, match=re.escape(weight)):
        AutoModelForCausalLM.from_pretrained(damaged, trust_remote_code=True)


def test_the_report_card_and_serve_check_say_vllm_does_not_serve_it_yet(pruned):
    """The plugin refuses these folders (it builds full-precision fused blocks): the report, the
    model card and `serve-check` say so in its one sentence, serve-check before vLLM starts."""
    _, out, _ = pruned
    refused = json.loads((out / "report.json").read_text())["serving"]["vllm_refused"]
    assert "does not serve moeprune-format checkpoints that keep" in refused
    assert refused in (out / "README.md").read_text()
    from moeprune.report.summary import format_lines, prune_facts

    summary = format_lines(prune_facts(json.loads((out / "report.json").read_text()), out))
    assert any("not served" in line and "checkpoints that keep" in line for line in summary)
    result = run_cli("serve-check", out, "--vllm-python", "/nonexistent/python", ok=False)
    assert result.exit_code == 2 and "does not serve moeprune-format checkpoints that keep" in result.output


@pytest.mark.parametrize("pipeline", [[], ["--no-load"]])
def test_names_of_unquantized_experts_follow_the_renumbering(tmp_path, pipeline):
    """A release may leave single experts unquantized and name them in `modules_to_not_convert`
    (compressed-tensors: `ignore`). After a drop the list must still describe the tensors: the
    kept experts' names renumbered as their tensors were, the dropped ones' names gone."""
    model = tiny_model("qwen3_moe", vocab_size=len(byte_tokenizer()))
    plain = [f"model.layers.2.mlp.experts.{e}.down_proj" for e in range(8)]  # MoE layers: 0 and 2
    fp8 = save_fp8_checkpoint(
        model, tmp_path / "fp8", block=(16, 16), skip=("lm_head", "embed_tokens", "gate", *plain)
    )
    out = tmp_path / "out"
    run_cli("prune", fp8, "--criterion", "aimer", "--sparsity", "0.25", "--quiet", *pipeline, "--output", out)
    names = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    experts = [n for n in names if ".experts." in n]
    assert experts == [f"model.layers.2.mlp.experts.{e}.down_proj" for e in range(6)]  # 2 of 8 dropped
    stored = stored_tensors(out)
    for e in range(6):
        assert stored[f"model.layers.2.mlp.experts.{e}.down_proj.weight"].dtype == torch.float32
        assert stored[f"model.layers.2.mlp.experts.{e}.up_proj.weight"].dtype == torch.float8_e4m3fn
        assert stored[f"model.layers.0.mlp.experts.{e}.down_proj.weight"].dtype == torch.float8_e4m3fn
