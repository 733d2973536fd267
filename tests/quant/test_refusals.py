"""Until a stage reads quantized tensors itself, a quantized checkpoint is refused there in one
line, before any weight is read, and nothing is written: never a silently up-cast result (the
survey behind it: in-memory prunes crashed or saved bf16 without the quantization, layer-by-layer
observation read fp8 codes without their scales and gave scores 1e8 times too large)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from moeprune.cli.main import main
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.errors import MoePruneError
from moeprune.models.factory import tiny_model
from moeprune.quant import quantization_of, refuse_quantized
from moeprune.quant.testing import save_fp8_checkpoint

pytestmark = pytest.mark.integration  # writes a tiny FP8 checkpoint and runs the command line


def test_quantization_is_described_and_refused_in_one_line(tmp_path):
    fp8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    assert quantization_of(fp8) == "fp8, 128x128 blocks"
    assert quantization_of({"quantization_config": {"quant_method": "mxfp4"}}) == "mxfp4"
    assert quantization_of({}) is None
    refuse_quantized(tmp_path, {}, "pruning")  # full precision: nothing to refuse
    with pytest.raises(MoePruneError, match=r"is quantized \(mxfp4\); pruning does not read quantized weights yet"):
        refuse_quantized(tmp_path, {"quantization_config": {"quant_method": "mxfp4"}}, "pruning")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    tokenizer = byte_tokenizer()
    path = tmp_path_factory.mktemp("fp8") / "ck"
    save_fp8_checkpoint(tiny_model("qwen3_moe", vocab_size=len(tokenizer)), path, tokenizer=tokenizer)
    data = path.parent / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} " * 6}) + "\n" for i in range(12)))
    return path, data


@pytest.mark.parametrize(
    ("args", "stage"),
    [
        (["prune", "--criterion", "reap", "--sparsity", "0.25"], "pruning the loaded model"),
        (["prune", "--criterion", "aimer", "--sparsity", "0.25", "--allocation", "global"], "pruning the loaded model"),
        (["prune", "--criterion", "reap", "--sparsity", "0.25", "--no-load"], "criterion 'reap' (observed layer by layer)"),
        (["score", "--criterion", "reap"], "observing the loaded model"),
        (["score", "--criterion", "reap", "--sequential"], "criterion 'reap' (observed layer by layer)"),
        (["score", "--criterion", "aimer"], "loading the model"),
    ],
)
def test_quantized_checkpoint_is_refused_before_any_weight(fp8_checkpoint, tmp_path, args, stage):
    path, data = fp8_checkpoint
    out = tmp_path / ("out.json" if args[0] == "score" else "out")
    extra = [] if "aimer" in args and args[0] == "score" else ["--data", str(data)]
    done = CliRunner().invoke(main, [args[0], str(path), *args[1:], *extra, "--output", str(out), "--quiet"])
    assert done.exit_code == 2, done.output
    assert done.output.count("\n") == 1 and "Traceback" not in done.output
    assert f"is quantized (fp8, 16x16 blocks); {stage} does not read quantized weights yet" in done.output
    assert not out.exists()
    assert "score --streaming" in done.output  # for fp8, the route that keeps the format


def test_inspect_still_describes_a_quantized_checkpoint(fp8_checkpoint):
    path = fp8_checkpoint[0]
    done = CliRunner().invoke(main, ["inspect", str(path)])
    assert done.exit_code == 0, done.output
    assert "  quantized: fp8, 16x16 blocks\n" in done.output
    on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert f"  weights on disk: {on_disk:,} bytes\n" in done.output
    info = json.loads(CliRunner().invoke(main, ["inspect", str(path), "--json"]).output)
    assert (info["quantization"], info["weight_bytes"]) == ("fp8, 16x16 blocks", on_disk)
