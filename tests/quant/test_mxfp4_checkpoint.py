"""gpt-oss in its release format (MXFP4 experts) through moeprune: read everywhere it is loaded
or observed, a uniform drop written back as MXFP4 from the input's bytes, dequantized only when
asked, refused in one line where it can be neither read nor kept.

The reference is `save_dequantized_checkpoint`: the float32 numbers MXFP4 defines (exact: an e2m1
value times a power of two), under the parameters' own names, with no quantizer. moeprune's
loader gives the very same model (bit-exact: the same numbers through the same conversion), and
so does stock transformers' own MXFP4 loader on CPU (its dequantizer is the same table lookup
and ldexp), which checks our reading of the format against the library that defines it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import (
    assert_streamed_scores_and_no_load_drop,
    fixed_logits,
    kept_quantization,
    run_cli,
    stock_from_pretrained,
)
from moeprune.checkpoint import load_model, load_pretrained
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models.factory import tiny_model
from moeprune.quant.testing import save_dequantized_checkpoint, save_mxfp4_checkpoint

pytestmark = pytest.mark.integration




@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(mxfp4 gpt-oss, its float32 dequantized reference, calibration data)."""
    root = tmp_path_factory.mktemp("mxfp4")
    tokenizer = byte_tokenizer()
    # intermediate 32: MXFP4 groups 32 inputs, so down_proj's inputs must be a multiple of 32
    model = tiny_model("gpt_oss", vocab_size=len(tokenizer), intermediate_size=32)
    save_mxfp4_checkpoint(model, root / "mxfp4", tokenizer=tokenizer)
    save_dequantized_checkpoint(root / "mxfp4", root / "ref")
    data = root / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": f"Question {i}: {i} plus {i} is {2 * i}. " * 3}) + "\n" for i in range(16)))
    return root / "mxfp4", root / "ref", data




def test_the_checkpoint_is_gpt_oss_release_layout(checkpoints):
    mxfp4 = checkpoints[0]
    config = json.loads((mxfp4 / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    from safetensors import safe_open

    with safe_open(str(mxfp4 / "model.safetensors"), "pt") as f:
        shapes = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert shapes["model.layers.0.mlp.experts.gate_up_proj_blocks"][0] == "U8"
    assert "model.layers.0.mlp.experts.gate_up_proj" not in shapes


def test_loaded_mxfp4_model_is_its_dequantized_checkpoint(checkpoints):
    mxfp4, ref, _ = checkpoints
    got, _ = load_model(mxfp4, dtype="float32")
    expected, _ = load_model(ref, dtype="float32")
    a, b = got.state_dict(), expected.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(fixed_logits(got), fixed_logits(expected))


def test_stock_transformers_reads_the_format_as_we_do(checkpoints):
    mxfp4 = checkpoints[0]
    try:
        stock = stock_from_pretrained(mxfp4, dtype=torch.float32)
    except (ImportError, AttributeError, ValueError) as exc:  # an older transformers without a CPU path
        pytest.skip(f"stock transformers cannot load MXFP4 on CPU here: {exc}")
    ours, _ = load_model(mxfp4, dtype="float32")
    theirs = stock.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(theirs[name].float(), tensor), name


@pytest.mark.parametrize("mode", [[], ["--sequential"]])
def test_observed_scores_are_the_dequantized_models(checkpoints, tmp_path, mode):
    mxfp4, ref, data = checkpoints
    common = ["--criterion", "ean", "--data", data, "--samples", "8", "--quiet", *mode]
    run_cli("score", mxfp4, *common, "--output", tmp_path / "q.json")
    run_cli("score", ref, *common, "--output", tmp_path / "r.json")
    got, expected = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("q", "r"))
    assert got["layers"] == expected["layers"]


def test_dequantized_save_on_request(checkpoints, tmp_path):
    mxfp4, ref, data = checkpoints
    common = ["--criterion", "frequency", "--sparsity", "0.25", "--data", data, "--samples", "8",
              "--save-dtype", "fp32", "--quiet"]  # fmt: skip
    run_cli("prune", mxfp4, *common, "--output", tmp_path / "q")
    run_cli("prune", ref, *common, "--output", tmp_path / "r")
    assert "quantization_config" not in json.loads((tmp_path / "q" / "config.json").read_text())
    assert torch.equal(fixed_logits(load_pretrained(tmp_path / "q")), fixed_logits(load_pretrained(tmp_path / "r")))


def test_uniform_drop_keeps_mxfp4_from_the_input_bytes(checkpoints, tmp_path):
    mxfp4, ref, data = checkpoints
    out, no_load, ref_out = tmp_path / "out", tmp_path / "no_load", tmp_path / "ref_out"
    common = ["--criterion", "frequency", "--sparsity", "0.25", "--data", data, "--samples", "8", "--quiet"]
    run_cli("prune", mxfp4, *common, "--output", out)
    run_cli("prune", mxfp4, *common, "--no-load", "--output", no_load)  # observed layer by layer
    run_cli("prune", ref, *common, "--output", ref_out)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["layers"] == json.loads((ref_out / "plan.json").read_text())["layers"]
    assert kept_quantization(json.loads((out / "config.json").read_text())["quantization_config"]) == json.loads(
        (mxfp4 / "config.json").read_text()
    )["quantization_config"]
    assert json.loads((out / "report.json").read_text())["save_dtype"].startswith("mxfp4")
    assert (out / "model.safetensors").read_bytes() == (no_load / "model.safetensors").read_bytes()

    from safetensors import safe_open

    def tensors(folder):
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118

    before, after = tensors(mxfp4), tensors(out)
    for lp in plan["layers"]:
        kept = [e for e in range(lp["num_experts"]) if e not in lp["dropped"]]
        for suffix in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"):
            key = f"model.layers.{lp['layer']}.mlp.experts.{suffix}"
            assert after[key].dtype == torch.uint8 and torch.equal(after[key], before[key][kept]), key
    # reloaded, the mxfp4 result is the pruned dequantized model, exactly; stock transformers agrees
    ours = load_pretrained(out)
    assert torch.equal(fixed_logits(ours), fixed_logits(load_pretrained(ref_out)))
    try:
        stock = stock_from_pretrained(out, dtype=torch.float32)
    except (ImportError, AttributeError, ValueError):  # no CPU MXFP4 path in this transformers
        return
    assert stock.config.num_local_experts == 6
    theirs = stock.state_dict()  # the weights: transformers 5.16's MXFP4 forward rounds through bf16
    for name, tensor in ours.state_dict().items():
        assert torch.equal(theirs[name].float(), tensor), name


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["prune", "--criterion", "frequency", "--sparsity", "0.25", "--method", "neurons"], "holds whole experts"),
        (["prune", "--criterion", "frequency", "--sparsity", "0.25", "--save-dtype", "fp8"], "is mxfp4"),
    ],
)
def test_what_does_not_read_or_keep_mxfp4_is_refused_in_one_line(checkpoints, tmp_path, args, expected):
    mxfp4, _, data = checkpoints
    out = tmp_path / ("s.json" if args[0] == "score" else "out")
    extra = [] if "aimer" in args else ["--data", data]
    done = run_cli(args[0], mxfp4, *args[1:], *extra, "--output", out, "--quiet", ok=False)
    assert done.exit_code == 2, done.output
    assert done.output.count("\n") == 1 and expected in done.output, done.output
    assert not out.exists()


def test_streamed_weight_scores_and_the_no_load_drop(checkpoints, tmp_path):
    assert_streamed_scores_and_no_load_drop(checkpoints[0], checkpoints[1], tmp_path)
