"""compressed-tensors checkpoints (W4A16 pack-quantized, FP8 float-quantized) through moeprune:
read wherever the model is loaded or observed, a uniform drop written back in the same format from
the input's bytes, refused in one line where they can be neither read nor kept.

The reference is `save_dequantized_checkpoint`: the numbers the library decodes (in the scale's
dtype, bf16: each int4 or fp8 value times its scale rounded once), in the same layout, with no
quantizer; moeprune's loader gives the very same model (bit-exact). The library that defines the
format is the oracle where it is installed (the dev extra installs it): transformers with
compressed-tensors loads the same checkpoints to the same weights, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import (
    assert_streamed_scores_and_no_load_drop,
    fixed_logits,
    kept_expert_sources,
    kept_quantization,
    run_cli,
    stock_from_pretrained,
    stored_tensors,
)
from moeprune.checkpoint import load_model, load_pretrained
from moeprune.checkpoint.load import read_activations
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models.factory import tiny_model
from moeprune.quant.testing import save_compressed_checkpoint, save_dequantized_checkpoint

pytestmark = pytest.mark.integration

FAMILIES = {"qwen3_moe": {}, "deepseek_v3": {"qk_rope_head_dim": 16}, "minimax_m2": {}}
SCHEMES = ("w4a16", "fp8")


@pytest.fixture(
    scope="module", params=[(f, s) for f in sorted(FAMILIES) for s in SCHEMES], ids=lambda p: "-".join(p)
)
def checkpoints(request, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(compressed checkpoint, its float32 dequantized reference, calibration data)."""
    family, scheme = request.param
    root = tmp_path_factory.mktemp(f"ct-{family}-{scheme}")
    tokenizer = byte_tokenizer()
    model = tiny_model(family, vocab_size=len(tokenizer), **FAMILIES[family])
    # groups of 16: the tiny experts are 16 neurons wide (real W4A16 releases use 32 or 128)
    save_compressed_checkpoint(model, root / "ct", scheme=scheme, group_size=16, tokenizer=tokenizer)
    save_dequantized_checkpoint(root / "ct", root / "ref")
    data = root / "calib.jsonl"
    data.write_text(
        "".join(
            json.dumps({"text": f"Question {i}: {i} plus {i} is {2 * i}. " * 3}) + "\n" for i in range(16)
        )
    )
    return root / "ct", root / "ref", data


def test_loaded_model_is_its_dequantized_checkpoint(checkpoints):
    """The same weights; the same logits once the reference quantizes the inputs the checkpoint's
    config quantizes (FP8: dynamic per token, as compressed-tensors' forward does) and holds its fp8
    experts as transformers holds them (bf16 before 5.21), and not before."""
    ct, ref, _ = checkpoints
    got, _ = load_model(ct, dtype="float32")
    expected, _ = load_model(ref, dtype="float32")
    a, b = got.state_dict(), expected.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)
    activations = "fp8" in ct.parent.name
    assert torch.equal(fixed_logits(got), fixed_logits(expected)) != activations
    read_activations(expected, ct)
    assert torch.equal(fixed_logits(got), fixed_logits(expected))


def test_the_library_reads_the_checkpoint_as_we_do(checkpoints):
    """The stack in the checkpoint's dtype (bf16) holds the library's values in every transformers
    version (in a float32 model, 5.23 folds FP8 experts itself as float32 products and 5.16 upcasts
    the scales with the model): moeprune's float32 model rounds to it, and its quantized weights
    are those bf16 values exactly, the library decoding in the scale's dtype."""
    pytest.importorskip("compressed_tensors")
    from transformers import CompressedTensorsConfig

    ct = checkpoints[0]
    config = CompressedTensorsConfig(dequantize=True) if "dequantize" in CompressedTensorsConfig.__init__.__code__.co_varnames \
        else CompressedTensorsConfig(run_compressed=False)  # fmt: skip
    try:
        theirs = stock_from_pretrained(ct, dtype=torch.bfloat16, quantization_config=config).state_dict()
    except (ImportError, ValueError, AttributeError, RuntimeError) as exc:  # an older transformers
        pytest.skip(f"transformers cannot load this compressed-tensors checkpoint on CPU: {exc}")
    ours, _ = load_model(ct, dtype="float32")
    quantized = {k.removesuffix(".weight_scale") for k in stored_tensors(ct) if k.endswith(".weight_scale")}
    exact = 0
    for name, tensor in ours.state_dict().items():
        assert torch.equal(theirs[name], tensor.to(theirs[name].dtype)), (
            name
        )  # bf16, but what it keeps in fp32
        if name.removesuffix(".weight") in quantized or (".experts." in name and tensor.dim() == 3):
            assert torch.equal(theirs[name].float(), tensor.float()), name
            exact += 1
    assert exact > 0


@pytest.mark.parametrize("mode", [[], ["--sequential"]])
def test_observed_scores_are_the_dequantized_models(checkpoints, tmp_path, mode):
    ct, ref, data = checkpoints
    common = ["--criterion", "ean", "--data", data, "--samples", "8", "--quiet", *mode]
    run_cli("score", ct, *common, "--output", tmp_path / "q.json")
    run_cli("score", ref, *common, "--output", tmp_path / "r.json")
    got, expected = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("q", "r"))
    if "fp8" in ct.parent.name:  # dynamic fp8 inputs: the reference is the other way of observing ct
        other = ["--sequential"] if not mode else []
        run_cli("score", ct, *common[: len(common) - len(mode)], *other, "--output", tmp_path / "s.json")
        expected = json.loads((tmp_path / "s.json").read_text())
    assert got["layers"] == expected["layers"]


def test_uniform_drop_keeps_the_format_from_the_input_bytes(checkpoints, tmp_path):
    ct, ref, data = checkpoints
    out, no_load, ref_out = tmp_path / "out", tmp_path / "no_load", tmp_path / "ref_out"
    # fp8's inputs are quantized at run time: routing statistics differ from the reference's, weights do not
    criterion = "magnitude" if "fp8" in ct.parent.name else "frequency"
    common = ["--criterion", criterion, "--sparsity", "0.25", "--data", data, "--samples", "8", "--quiet"]
    run_cli("prune", ct, *common, "--output", out)
    run_cli("prune", ct, *common, "--no-load", "--output", no_load)
    run_cli("prune", ref, *common, "--output", ref_out)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["layers"] == json.loads((ref_out / "plan.json").read_text())["layers"]
    config = json.loads((out / "config.json").read_text())
    assert (
        kept_quantization(config["quantization_config"]) == json.loads((ct / "config.json").read_text())["quantization_config"]
    )
    assert json.loads((out / "report.json").read_text())["save_dtype"].startswith("compressed-tensors (")
    for file in out.glob("*.safetensors"):
        assert file.read_bytes() == (no_load / file.name).read_bytes()

    before, after = stored_tensors(ct), stored_tensors(out)
    sources = kept_expert_sources(plan, after)
    for key, source in sources.items():
        assert after[key].dtype == before[source].dtype and torch.equal(after[key], before[source]), (
            key,
            source,
        )
    compared = sum(not key.endswith(".weight") for key in sources)  # the companions: scales, shapes
    assert compared > 0
    reference = load_pretrained(ref_out)
    read_activations(reference, out)  # the input's run-time quantization (fp8: the Linears' inputs)
    assert torch.equal(fixed_logits(load_pretrained(out)), fixed_logits(reference))
    assert "with the `compressed-tensors` package installed" in (out / "README.md").read_text()


def test_the_summary_names_the_package_stock_loaders_need_only_where_it_is_missing(
    checkpoints, tmp_path, monkeypatch
):
    """moeprune decodes compressed-tensors itself; transformers and vLLM need the package to load
    the result: the summary says so, with the install command, when this machine lacks it."""
    import moeprune.report.summary as summary
    from moeprune.quant.support import package_missing

    assert not package_missing("torch") and package_missing("no-such-package-moeprune")
    ct, _, _ = checkpoints
    run_cli(
        "prune", ct, "--criterion", "aimer", "--sparsity", "0.25", "--quiet", "--output", tmp_path / "out"
    )
    facts = summary.prune_facts(json.loads((tmp_path / "out" / "report.json").read_text()), tmp_path / "out")
    line = 'pip install "moeprune[quantized]"'
    monkeypatch.setattr(summary, "package_missing", lambda package: package == "compressed-tensors")
    assert any(line in text for text in summary.format_lines(facts))
    monkeypatch.setattr(summary, "package_missing", lambda package: False)
    assert not any(line in text for text in summary.format_lines(facts))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["prune", "--criterion", "frequency", "--sparsity", "0.25", "--method", "neurons"],
            "holds whole experts",
        ),
    ],
)
def test_what_cannot_read_or_keep_it_is_refused_in_one_line(checkpoints, tmp_path, args, expected):
    ct, _, data = checkpoints
    out = tmp_path / ("s.json" if args[0] == "score" else "out")
    extra = [] if "aimer" in args else ["--data", data]
    done = run_cli(args[0], ct, *args[1:], *extra, "--output", out, "--quiet", ok=False)
    assert done.exit_code == 2 and done.output.count("\n") == 1 and expected in done.output, done.output
    assert not out.exists()


def test_a_compressed_format_moeprune_does_not_decode_is_refused_by_name(checkpoints, tmp_path):
    ct, _, data = checkpoints
    other = tmp_path / "mxfp4"
    other.mkdir()
    for item in ct.iterdir():
        (other / item.name).write_bytes(item.read_bytes())
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"]["format"] = "mxfp4-pack-quantized"
    (other / "config.json").write_text(json.dumps(config))
    done = run_cli("prune", other, "--criterion", "frequency", "--sparsity", "0.25", "--data", data,
               "--output", tmp_path / "out", "--quiet", ok=False)  # fmt: skip
    assert done.exit_code == 2 and done.output.count("\n") == 1
    assert "'mxfp4-pack-quantized'; moeprune reads pack-quantized, float-quantized, nvfp4-pack-quantized" in done.output


def test_streamed_weight_scores_and_the_no_load_drop(checkpoints, tmp_path):
    assert_streamed_scores_and_no_load_drop(checkpoints[0], checkpoints[1], tmp_path)
