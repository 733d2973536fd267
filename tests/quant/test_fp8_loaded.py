"""Block-scaled FP8 checkpoints through the loaded paths: the in-memory model, layer-by-layer
observation, the in-memory prune (written back as fp8 from the input's bytes) and eval.

The reference is `save_dequantized_checkpoint(fp8, dtype=float32)`: the very float32 numbers the
format defines, in the same layout, with no quantizer. moeprune's loader dequantizes each fp8
weight to those numbers and hands them to transformers' own conversion, so the loaded models,
their scores and the pruned results' logits must be *equal* to the reference's (the same values
through the same code: bit-exact, no tolerance). Only stock transformers' fp8 loader, a
different kernel, is compared within a tolerance (helpers.REORDER_RTOL).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import (
    assert_logits_close,
    fixed_logits,
    kept_expert_sources,
    kept_quantization,
    raw_bytes,
    run_cli,
    stored_tensors,
)
from moeprune.checkpoint import load_model, load_pretrained
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models.factory import tiny_model
from moeprune.quant.testing import save_dequantized_checkpoint, save_fp8_checkpoint

pytestmark = pytest.mark.integration

BLOCK = (16, 16)
FAMILIES = {"qwen3_moe": {}, "deepseek_v3": {"qk_rope_head_dim": 16}, "minimax_m2": {}}




@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoints(request, tmp_path_factory) -> tuple[str, Path, Path, Path]:
    """(family, fp8 checkpoint, its float32 dequantized reference, calibration data)."""
    root = tmp_path_factory.mktemp(f"fp8-loaded-{request.param}")
    tokenizer = byte_tokenizer()
    model = tiny_model(request.param, vocab_size=len(tokenizer), **FAMILIES[request.param])
    save_fp8_checkpoint(model, root / "fp8", block=BLOCK, tokenizer=tokenizer)
    save_dequantized_checkpoint(root / "fp8", root / "ref", dtype=torch.float32)
    tokenizer.save_pretrained(root / "ref")
    data = root / "calib.jsonl"
    rows = [{"text": f"Question {i}: what is {i} plus {i}? It is {2 * i}. " * 3} for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return request.param, root / "fp8", root / "ref", data








# ------------------------------------------------------------------------------------------ loading
def test_loaded_fp8_model_is_its_dequantized_checkpoint(checkpoints):
    _, fp8, ref, _ = checkpoints
    got, _ = load_model(fp8, dtype="float32")
    expected, _ = load_model(ref, dtype="float32")
    assert not hasattr(got.config, "quantization_config")  # the model in memory is not quantized
    a, b = got.state_dict(), expected.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert torch.equal(fixed_logits(got), fixed_logits(expected))


def test_loaded_fp8_model_takes_the_requested_dtype(checkpoints):
    """Every weight, dequantized or stored in bf16 beside the fp8 ones, in the dtype transformers
    gives the dequantized checkpoint when bf16 is asked for (its dtype plan may keep a few
    tensors, such as DeepSeek's routing bias, in float32)."""
    _, fp8, ref, _ = checkpoints
    model, _ = load_model(fp8, dtype="bf16")
    expected, _ = load_model(ref, dtype="bf16")
    got = {name: p.dtype for name, p in model.state_dict().items()}
    assert got == {name: p.dtype for name, p in expected.state_dict().items()}
    assert torch.bfloat16 in got.values()


# ------------------------------------------------------------------------------------------- scores
@pytest.mark.parametrize("mode", [[], ["--sequential"]])
def test_observed_scores_are_the_dequantized_models(checkpoints, tmp_path, mode):
    """Calibration statistics of the loaded fp8 model, and of layer-by-layer observation reading
    fp8 shards, equal the reference's exactly: the same weights through the same code."""
    _, fp8, ref, data = checkpoints
    common = ["--criterion", "ean", "--data", data, "--samples", "8", "--quiet", *mode]
    run_cli("score", fp8, *common, "--output", tmp_path / "fp8.json")
    run_cli("score", ref, *common, "--output", tmp_path / "ref.json")
    got, expected = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("fp8", "ref"))
    assert got["layers"] == expected["layers"] and got["tokens"] == expected["tokens"]


# -------------------------------------------------------------------------------------------- prune
def test_in_memory_drop_keeps_fp8_from_the_input_bytes(checkpoints, tmp_path):
    family, fp8, ref, data = checkpoints
    out, ref_out, no_load = tmp_path / "out", tmp_path / "ref_out", tmp_path / "no_load"
    common = ["--criterion", "frequency", "--sparsity", "0.25", "--data", data, "--samples", "8", "--quiet"]
    run_cli("prune", fp8, *common, "--output", out)
    run_cli("prune", ref, *common, "--output", ref_out)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["layers"] == json.loads((ref_out / "plan.json").read_text())["layers"]

    # the format: kept as it was, named in the report, the recipe says how to ask for it again
    source_config = json.loads((fp8 / "config.json").read_text())
    assert kept_quantization(json.loads((out / "config.json").read_text())["quantization_config"]) == source_config["quantization_config"]
    report = json.loads((out / "report.json").read_text())
    assert report["save_dtype"] == "float8_e4m3fn (fp8, 16x16 blocks)" and report["format"] == "stock"
    assert json.loads((out / "recipe.json").read_text())["save"]["dtype"] is None  # the input's: fp8

    # every kept fp8 expert tensor and scale is the input's bytes, renumbered
    before, after = stored_tensors(fp8), stored_tensors(out)
    sources = kept_expert_sources(plan, after)
    for key, source in sources.items():
        assert raw_bytes(after[key]) == raw_bytes(before[source]), (key, source)
    kept_fp8 = sum(after[key].dtype == torch.float8_e4m3fn for key in sources)
    assert kept_fp8 > 0
    assert report["disk_bytes"]["after"] < report["disk_bytes"]["before"]

    # the same plan without loading writes the very same files
    run_cli("prune", fp8, "--no-load", "--criterion", "frequency", "--sparsity", "0.25", "--data", data,
        "--samples", "8", "--quiet", "--output", no_load)  # fmt: skip
    assert json.loads((no_load / "plan.json").read_text())["layers"] == plan["layers"]
    for file in out.glob("*.safetensors"):
        assert file.read_bytes() == (no_load / file.name).read_bytes()

    # reloaded by moeprune, the fp8 result is the pruned dequantized model, exactly
    assert torch.equal(fixed_logits(load_pretrained(out)), fixed_logits(load_pretrained(ref_out)))


def test_dequantized_save_on_request_runs_every_method(checkpoints, tmp_path):
    """--save-dtype bf16 is the explicit way to a method fp8 cannot keep (here neurons): the
    result is a plain bf16 checkpoint, equal to the one pruned from the dequantized reference."""
    _, fp8, ref, data = checkpoints
    common = ["--criterion", "frequency", "--method", "neurons", "--sparsity", "0.25", "--data", data,
              "--samples", "8", "--save-dtype", "bf16", "--quiet"]  # fmt: skip
    run_cli("prune", fp8, *common, "--output", tmp_path / "out")
    run_cli("prune", ref, *common, "--output", tmp_path / "ref_out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    assert {t.dtype for t in stored_tensors(tmp_path / "out").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "report.json").read_text())["save_dtype"] == "bfloat16"
    for file in (tmp_path / "out").glob("*.safetensors"):
        assert file.read_bytes() == (tmp_path / "ref_out" / file.name).read_bytes()


def test_recipe_repeats_an_fp8_prune(checkpoints, tmp_path):
    _, fp8, _, data = checkpoints
    first, again = tmp_path / "first", tmp_path / "again"
    run_cli("prune", fp8, "--criterion", "frequency", "--sparsity", "0.25", "--data", data, "--samples", "8",
        "--quiet", "--output", first)  # fmt: skip
    run_cli("prune", fp8, "--config", first / "recipe.json", "--quiet", "--output", again)
    for file in first.glob("*.safetensors"):
        assert file.read_bytes() == (again / file.name).read_bytes()


def test_eval_of_fp8_models_is_the_dequantized_models(checkpoints, tmp_path):
    """eval loads both fp8 models dequantized: every figure equals the dequantized pair's."""
    _, fp8, ref, data = checkpoints
    figures = {}
    for name, source in (("fp8", fp8), ("ref", ref)):
        out = tmp_path / f"{name}_out"
        run_cli("prune", source, "--criterion", "frequency", "--sparsity", "0.25", "--data", data, "--samples", "8",
            "--quiet", "--output", out)  # fmt: skip
        run_cli("eval", out, "-r", source, "--data", data, "--samples", "8", "--metrics", "esap,kl,nll,size",
            "--no-plots", "--quiet", "--output", tmp_path / f"{name}.json")  # fmt: skip
        figures[name] = json.loads((tmp_path / f"{name}.json").read_text())["models"][0]
    assert figures["fp8"]["per_data"] == figures["ref"]["per_data"]
    assert figures["fp8"]["size"]["quantization"] == "fp8, 16x16 blocks"
    assert "quantization" not in figures["ref"]["size"]
    assert figures["fp8"]["size"]["weight_bytes"] < figures["ref"]["size"]["weight_bytes"]


def test_target_size_on_fp8_counts_fp8_bytes_and_keeps_the_format(checkpoints, tmp_path):
    """A size target for a kept fp8 result is solved in fp8 bytes and scales: both pipelines
    write fp8 under the target; without loading only one count per layer can be written (a stock
    config), so the loaded pipeline, which may write per-layer counts in moeprune's format, never
    needs a larger sparsity."""
    _, fp8, _, data = checkpoints
    weights = sum(f.stat().st_size for f in fp8.glob("*.safetensors"))
    target = int(weights * 0.97)  # within reach of every family (deepseek_v3 routes a small share of its bytes)
    common = ["--criterion", "frequency", "--target-size", target, "--data", data, "--samples", "8", "--quiet"]
    run_cli("prune", fp8, *common, "--output", tmp_path / "loaded")
    run_cli("prune", fp8, *common, "--no-load", "--output", tmp_path / "no_load")
    loaded, no_load = (json.loads((tmp_path / n / "report.json").read_text()) for n in ("loaded", "no_load"))
    assert 0 < loaded["sparsity"] <= no_load["sparsity"]
    for name in ("loaded", "no_load"):
        report = json.loads((tmp_path / name / "report.json").read_text())
        assert report["save_dtype"].startswith("float8_e4m3fn")
        assert sum(f.stat().st_size for f in (tmp_path / name).glob("*.safetensors")) <= target
    plan = json.loads((tmp_path / "no_load" / "plan.json").read_text())
    assert len({lp["num_experts"] - len(lp["dropped"]) for lp in plan["layers"]}) == 1


@pytest.mark.parametrize("allocation", [["--allocation", "global"], ["--sparsity", "0.28125"]])
def test_per_layer_counts_keep_fp8_in_moeprune_format(checkpoints, tmp_path, allocation):
    """Different counts per layer (a global allocation; or a uniform one whose budget does not
    divide evenly) are written in moeprune's format, still from the input's bytes: fp8 kept,
    loaded by moeprune as the pruned dequantized model, exactly, and by stock transformers through
    the self-contained modeling files, which decode the fp8 blocks while loading (other module
    code: the suite's reordering tolerance)."""
    family, fp8, ref, data = checkpoints
    if "--sparsity" in allocation and family != "qwen3_moe":
        pytest.skip("0.28125 splits unevenly over qwen3_moe's 4 layers of 8 experts only")
    sparsity = [] if "--sparsity" in allocation else ["--sparsity", "0.25"]
    common = ["--criterion", "frequency", *sparsity, *allocation, "--data", data, "--samples", "8", "--quiet"]
    run_cli("prune", fp8, *common, "--output", tmp_path / "out")
    run_cli("prune", ref, *common, "--output", tmp_path / "ref_out")
    out, ref_out = tmp_path / "out", tmp_path / "ref_out"
    plan = json.loads((out / "plan.json").read_text())
    assert plan["layers"] == json.loads((ref_out / "plan.json").read_text())["layers"]
    counts = {lp["num_experts"] - len(lp["dropped"]) for lp in plan["layers"]}
    report = json.loads((out / "report.json").read_text())
    config = json.loads((out / "config.json").read_text())
    if len(counts) == 1:
        pytest.skip(f"this family's plan came out uniform ({counts}): a stock result, tested above")
    assert report["format"] == "moeprune" and config["model_type"].startswith("moeprune_")
    assert kept_quantization(config["quantization_config"]) == json.loads((fp8 / "config.json").read_text())["quantization_config"]
    fp8_tensors = [t for t in stored_tensors(out).values() if t.dtype == torch.float8_e4m3fn]
    source = {raw_bytes(t) for t in stored_tensors(fp8).values() if t.dtype == torch.float8_e4m3fn}
    assert fp8_tensors and all(raw_bytes(t) in source for t in fp8_tensors)  # the input's bytes
    assert torch.equal(fixed_logits(load_pretrained(out)), fixed_logits(load_pretrained(ref_out)))

    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    assert_logits_close(fixed_logits(stock), fixed_logits(load_pretrained(out)))


def test_sharded_fp8_with_scales_in_their_own_shard(tmp_path):
    """Releases are sharded, and a scale need not sit in its weight's shard: here every
    `weight_scale_inv` is moved to a shard of its own. The loaded model is still the dequantized
    checkpoint's, and a drop writes a sharded fp8 result whose index names every tensor."""
    from safetensors.torch import load_file, save_file

    tokenizer = byte_tokenizer()
    model = tiny_model("qwen3_moe", vocab_size=len(tokenizer))
    fp8, ref = tmp_path / "fp8", tmp_path / "ref"
    save_fp8_checkpoint(model, fp8, block=BLOCK, tokenizer=tokenizer, max_shard_size="20KB")
    save_dequantized_checkpoint(fp8, ref, dtype=torch.float32)
    index_file = fp8 / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    assert len(set(index["weight_map"].values())) > 1
    scales = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(fp8 / shard)
        scales.update({k: tensors.pop(k) for k in list(tensors) if k.endswith("_scale_inv")})
        save_file(tensors, str(fp8 / shard), metadata={"format": "pt"})
    save_file(scales, str(fp8 / "model-scales.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(scales, "model-scales.safetensors"))
    index_file.write_text(json.dumps(index))

    got, _ = load_model(fp8, dtype="float32")
    expected, _ = load_model(ref, dtype="float32")
    assert torch.equal(fixed_logits(got), fixed_logits(expected))
    out = tmp_path / "out"
    run_cli("prune", fp8, "--criterion", "aimer", "--sparsity", "0.25", "--quiet", "--output", out)
    written = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(written) == set(stored_tensors(out)) and any(k.endswith("_scale_inv") for k in written)
    ref_out = tmp_path / "ref_out"
    run_cli("prune", ref, "--criterion", "aimer", "--sparsity", "0.25", "--quiet", "--output", ref_out)
    assert torch.equal(fixed_logits(load_pretrained(out)), fixed_logits(load_pretrained(ref_out)))
