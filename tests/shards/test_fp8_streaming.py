"""Block-scaled FP8 checkpoints through the no-load path: `score --streaming` dequantizes each
expert block-row by block-row, and `prune --no-load` (uniform drop) copies the kept experts' fp8
bytes and scales as they are.

The reference is `save_dequantized_checkpoint(fp8, dtype=float32)`: the same float32 numbers the
format defines, in the same layout, with no quantizer. Streamed scores of the fp8 checkpoint and
of the reference are sums of the very same values, so they differ at most by summation order
(SUM_RTOL); the logits of the pruned fp8 checkpoint, which stock transformers dequantizes to
float32 on CPU, and of the pruned reference hold the same numbers in the same modules, so they
differ by summation order (helpers.REORDER_RTOL).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner
from packaging.version import Version

from helpers import assert_logits_close, kept_quantization, stock_from_pretrained
from helpers import raw_bytes as raw
from helpers import stored_tensors as stored
from moeprune.cli.main import main
from moeprune.models.factory import tiny_model
from moeprune.quant.testing import save_dequantized_checkpoint, save_fp8_checkpoint
from moeprune.shards import weight_scores
from moeprune.shards.weight_scores import score_checkpoint

pytestmark = pytest.mark.integration

BLOCK = (16, 16)
# deepseek_v3's kv_a_proj_with_mqa has kv_lora_rank + qk_rope_head_dim rows: a multiple of the
# block, which transformers 5.23 reads correctly on CPU (tests/quant/test_fp8_checkpoint.py)
FAMILIES = {"qwen3_moe": {}, "deepseek_v3": {"qk_rope_head_dim": 16}, "minimax_m2": {}}
SUM_RTOL = 1e-6  # fp32 block sums added in fp64: the same values summed in another order
EXPERT = re.compile(r"\.experts\.(\d+)\.")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
ROUTER = re.compile(r"\.gate\.|e_score_correction_bias")  # router rows and per-expert biases: cut, not copied


def layer_of(key: str) -> int | None:
    match = LAYER.match(key)
    return int(match.group(1)) if match else None


def run(*args, ok: bool = True):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoints(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(family, fp8 checkpoint, its float32 dequantized reference)."""
    root = tmp_path_factory.mktemp(f"fp8-{request.param}")
    save_fp8_checkpoint(tiny_model(request.param, **FAMILIES[request.param]), root / "fp8", block=BLOCK)
    save_dequantized_checkpoint(root / "fp8", root / "ref", dtype=torch.float32)
    return request.param, root / "fp8", root / "ref"






def load_fp8(path):
    """Stock transformers on an FP8 folder; skipped on the versions that cannot load one on CPU."""
    try:
        return stock_from_pretrained(path)
    except AttributeError as exc:  # 5.16: FineGrainedFP8HfQuantizer.update_tp_plan reads a None map
        if Version(transformers.__version__) >= Version("5.23"):
            raise
        pytest.skip(f"transformers {transformers.__version__} loads no FP8 checkpoint on CPU: {exc}")


def logits(model, vocab: int) -> torch.Tensor:
    ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits.float()


# ------------------------------------------------------------------------------------------ scores
@pytest.mark.parametrize("criterion", ["aimer", "magnitude"])
def test_streaming_scores_are_the_dequantized_models(checkpoints, criterion):
    _, fp8, ref = checkpoints
    got, expected = score_checkpoint(fp8, criterion), score_checkpoint(ref, criterion)
    assert [s.layer for s in got] == [s.layer for s in expected]
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a.scores, b.scores, rtol=SUM_RTOL, atol=0)


def test_streaming_reads_whole_block_rows(checkpoints, monkeypatch):
    """With a read block of 256 values, each fp8 piece is read 16 rows (one block-row) at a time,
    each with its own row of scales: the sums are still the dequantized model's."""
    _, fp8, ref = checkpoints
    expected = score_checkpoint(ref, "aimer")
    reads: list[int] = []
    original = weight_scores.SafetensorsExperts.read_into

    def counted(self, key, offset, out):
        reads.append(len(out))
        original(self, key, offset, out)

    monkeypatch.setattr(weight_scores, "_BLOCK", 256)
    monkeypatch.setattr(weight_scores.SafetensorsExperts, "read_into", counted)
    got = score_checkpoint(fp8, "aimer", workers=1)
    widest = max(t.shape[-1] for k, t in stored(fp8).items() if EXPERT.search(k) and t.dtype == torch.float8_e4m3fn)
    assert reads and max(reads) <= BLOCK[0] * widest  # at most one block-row of the widest expert piece
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a.scores, b.scores, rtol=SUM_RTOL, atol=0)


def test_cli_score_streaming(checkpoints, tmp_path):
    _, fp8, ref = checkpoints
    run("score", fp8, "--criterion", "aimer", "--streaming", "--output", tmp_path / "fp8.json")
    run("score", ref, "--criterion", "aimer", "--streaming", "--output", tmp_path / "ref.json")
    got, expected = (json.loads((tmp_path / f"{n}.json").read_text())["layers"] for n in ("fp8", "ref"))
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a["scores"], b["scores"], rtol=SUM_RTOL, atol=0)


# ------------------------------------------------------------------------------------------- prune
def test_no_load_drop_writes_the_kept_fp8_bytes(checkpoints, tmp_path):
    family, fp8, ref = checkpoints
    out, ref_out = tmp_path / "out", tmp_path / "ref_out"
    common = ["--no-load", "--criterion", "aimer", "--sparsity", "0.25", "--quiet"]
    run("prune", fp8, *common, "--output", out)
    run("prune", ref, *common, "--output", ref_out)

    plan = json.loads((out / "plan.json").read_text())
    assert plan["layers"] == json.loads((ref_out / "plan.json").read_text())["layers"]  # same experts
    source_config = json.loads((fp8 / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert kept_quantization(config["quantization_config"]) == source_config["quantization_config"]
    report = json.loads((out / "report.json").read_text())
    assert report["save_dtype"] == "float8_e4m3fn (fp8, 16x16 blocks)"

    before, after = stored(fp8), stored(out)
    index = {lp["layer"]: lp for lp in plan["layers"]}
    routed_before = routed_after = 0
    renamed = set()
    for key, tensor in before.items():
        match, layer = EXPERT.search(key), layer_of(key)
        if layer in index and ROUTER.search(key):
            continue
        if match is None or layer not in index:
            assert raw(after[key]) == raw(tensor), key  # copied whole, scales included
            continue
        routed_before += len(raw(tensor))
        expert = int(match.group(1))
        if expert in index[layer]["dropped"]:
            continue
        kept = [e for e in range(index[layer]["num_experts"]) if e not in index[layer]["dropped"]]
        new = EXPERT.sub(f".experts.{kept.index(expert)}.", key, count=1)
        assert after[new].dtype == tensor.dtype and raw(after[new]) == raw(tensor), (key, new)
        renamed.add(new)
        routed_after += len(raw(tensor))
    routed_out = {k for k in after if EXPERT.search(k) and layer_of(k) in index}
    assert routed_out == renamed  # dropped experts gone, weights and scales alike
    assert any(k.endswith("_scale_inv") for k in renamed)
    assert routed_after == pytest.approx(0.75 * routed_before)
    for layer, lp in index.items():  # the router lost the dropped rows
        gate = next(k for k in before if layer_of(k) == layer and k.endswith(".gate.weight"))
        kept = [e for e in range(lp["num_experts"]) if e not in lp["dropped"]]
        assert torch.equal(after[gate], before[gate][kept])

    source = tiny_model(family, **FAMILIES[family])
    vocab = source.config.vocab_size
    loaded = load_fp8(out)
    assert_logits_close(logits(loaded, vocab), logits(stock_from_pretrained(ref_out), vocab))


# ---------------------------------------------------------------------------------------- bad input
def _edit(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _copy(fp8: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(fp8, tmp_path / "model"))


def _unknown_method(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "awq"
    (model / "config.json").write_text(json.dumps(config))


def _missing_scale(model: Path) -> None:
    _edit(model, lambda t: t.pop("model.layers.2.mlp.experts.2.up_proj.weight_scale_inv"))


def _wrong_shape(model: Path) -> None:
    def edit(t):
        key = "model.layers.2.mlp.experts.2.up_proj.weight_scale_inv"
        t[key] = torch.ones(t[key].shape[0] + 1, t[key].shape[1])

    _edit(model, edit)


def _no_config(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    del config["quantization_config"]
    (model / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_unknown_method, "quant_method 'awq'"),
        (_missing_scale, "scales missing"),
        (_wrong_shape, "needs [1, 2]"),
        (_no_config, "no fp8 quantization_config"),
    ],
)
@pytest.mark.parametrize("command", ["score", "prune", "score-loaded", "prune-loaded"])
def test_bad_fp8_input_is_refused_in_one_line(checkpoints, tmp_path, damage, message, command):
    """Streamed or loaded, from the headers alone: nothing is read or written."""
    family, fp8, _ = checkpoints
    if family != "qwen3_moe":
        pytest.skip("one family is enough for the refusals")
    model = _copy(fp8, tmp_path)
    damage(model)
    files = sorted(p.name for p in tmp_path.rglob("*"))
    out = tmp_path / "out"
    streaming = [] if command.endswith("loaded") else ["--streaming"]
    if command.startswith("score"):
        args = ["score", model, "--criterion", "aimer", *streaming, "--output", tmp_path / "s.json"]
    else:
        no_load = [] if command.endswith("loaded") else ["--no-load"]
        args = ["prune", model, *no_load, "--criterion", "aimer", "--sparsity", "0.25", "--output", out]
    result = run(*args, ok=False)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.rglob("*")) == files  # nothing written
