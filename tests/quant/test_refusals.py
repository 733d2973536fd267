"""What moeprune cannot do with a quantized checkpoint is refused in one line, before any weight
is read, and nothing is written: never a silently up-cast or re-quantized result. Everything
else reads fp8 (tests/quant/test_fp8_loaded.py, tests/shards/test_fp8_streaming.py)."""

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
    refuse_quantized(tmp_path, {}, "cutting neurons")  # full precision: nothing to refuse
    with pytest.raises(MoePruneError, match=r"is quantized \(fp8, 128x128 blocks\); cutting neurons would split"):
        refuse_quantized(tmp_path, fp8, "cutting neurons")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    tokenizer = byte_tokenizer()
    path = tmp_path_factory.mktemp("fp8") / "ck"
    save_fp8_checkpoint(tiny_model("qwen3_moe", vocab_size=len(tokenizer)), path, tokenizer=tokenizer)
    data = path.parent / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} " * 6}) + "\n" for i in range(12)))
    return path, data


def refused(args: list, out, expected: str) -> None:
    done = CliRunner().invoke(main, [*map(str, args), "--output", str(out), "--quiet"])
    assert done.exit_code == 2, done.output
    assert done.output.count("\n") == 1 and "Traceback" not in done.output
    assert expected in done.output, done.output
    assert not out.exists()


KEEP_FP8 = "a result in that format is written from the input's bytes, which holds whole experts"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--criterion", "reap", "--method", "neurons"], KEEP_FP8),
        (["--criterion", "reap", "--method", "novice"], KEEP_FP8),
        (["--criterion", "reap", "--method", "neurons", "--no-load"], "the neurons method would split its scale blocks"),
    ],
)
def test_what_cannot_keep_fp8_is_refused_before_any_weight(fp8_checkpoint, tmp_path, args, expected):
    path, data = fp8_checkpoint
    refused(["prune", path, *args, "--sparsity", "0.25", "--data", data], tmp_path / "out", expected)


def test_fp8_is_not_made_from_full_precision(fp8_checkpoint, tmp_path):
    path, data = fp8_checkpoint
    plain = tmp_path / "plain"
    tiny_model("qwen3_moe", vocab_size=len(byte_tokenizer())).save_pretrained(plain)
    byte_tokenizer().save_pretrained(plain)
    refused(
        ["prune", plain, "--criterion", "frequency", "--sparsity", "0.25", "--data", data, "--save-dtype", "fp8"],
        tmp_path / "out",
        "is not quantized (to quantize, use the quantize option)",
    )


@pytest.mark.parametrize(
    "args",
    [
        ["prune", "--criterion", "frequency", "--sparsity", "0.25"],
        ["prune", "--criterion", "aimer", "--sparsity", "0.25", "--no-load"],
        ["score", "--criterion", "frequency"],
        ["score", "--criterion", "aimer", "--streaming"],
        ["score", "--criterion", "frequency", "--sequential"],
    ],
)
def test_a_format_moeprune_does_not_read_is_refused_everywhere(fp8_checkpoint, tmp_path, args):
    """A quant_method moeprune does not read (here awq) is refused by name before the data is read."""
    path, data = fp8_checkpoint
    other = tmp_path / "other"
    other.mkdir()
    for item in path.iterdir():
        (other / item.name).write_bytes(item.read_bytes())
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq"}
    (other / "config.json").write_text(json.dumps(config))
    out = tmp_path / ("out.json" if args[0] == "score" else "out")
    extra = [] if "aimer" in args else ["--data", data]  # weight-only criteria refuse data
    refused([args[0], other, *args[1:], *extra], out, "quantization_config has quant_method 'awq'")


def test_inspect_still_describes_a_quantized_checkpoint(fp8_checkpoint):
    path = fp8_checkpoint[0]
    done = CliRunner().invoke(main, ["inspect", str(path)])
    assert done.exit_code == 0, done.output
    assert "  quantized: fp8, 16x16 blocks\n" in done.output
    on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert f"  weights on disk: {on_disk:,} bytes\n" in done.output
    info = json.loads(CliRunner().invoke(main, ["inspect", str(path), "--json"]).output)
    assert (info["quantization"], info["weight_bytes"]) == ("fp8, 16x16 blocks", on_disk)
