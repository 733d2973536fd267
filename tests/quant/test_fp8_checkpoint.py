"""Tiny FP8 checkpoints written by moeprune.quant.testing: the releases' layout per family, and
stock transformers reading them on CPU as the numbers the format defines.

transformers dequantizes an FP8 checkpoint while loading it on a CPU, into the config's dtype.
The reference is the same on-disk checkpoint with every fp8 weight replaced by
`dequantize_blocks(...)` (moeprune's reading of the spec), loaded with no quantizer into the source
model: the very same float32 numbers in the same modules, so the logits may differ only by
summation order (helpers.REORDER_RTOL), and in practice do not differ at all.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from packaging.version import Version
from safetensors import safe_open

from helpers import assert_logits_close, stock_from_pretrained
from moeprune.models.factory import tiny_model
from moeprune.quant import FP8_DTYPE, dequantize_blocks, read_fp8_config, scale_shape
from moeprune.quant.testing import DEFAULT_SKIP, save_dequantized_checkpoint, save_fp8_checkpoint

pytestmark = pytest.mark.integration

BLOCK = (16, 16)
# Dimensions that are multiples of the block (see test_partial_blocks_in_stock_transformers):
# deepseek_v3's kv_a_proj_with_mqa has kv_lora_rank + qk_rope_head_dim = 16 + 16 rows
FAMILIES = {"qwen3_moe": {}, "deepseek_v3": {"qk_rope_head_dim": 16}, "minimax_m2": {}}
EXPERT = re.compile(r"\.experts\.(\d+)\.")


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - not a dict
    return out


def load_fp8(path, **kwargs):
    """Stock transformers on an FP8 folder; skipped on the versions that cannot load one on CPU."""
    try:
        return stock_from_pretrained(path, **kwargs)
    except AttributeError as exc:  # 5.16: FineGrainedFP8HfQuantizer.update_tp_plan reads a None map
        if Version(transformers.__version__) >= Version("5.23"):
            raise
        pytest.skip(f"transformers {transformers.__version__} loads no FP8 checkpoint on CPU: {exc}")


def logits(model, vocab: int) -> torch.Tensor:
    ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp8_checkpoint_loads_in_stock_transformers(family, tmp_path):
    source = tiny_model(family, **FAMILIES[family])
    save_fp8_checkpoint(source, tmp_path / "fp8", block=BLOCK)
    save_dequantized_checkpoint(tmp_path / "fp8", tmp_path / "ref")

    # the layout of the releases: per-expert fp8 weights, each with its scale grid; skipped ones float
    stored = tensors(tmp_path / "fp8")
    quantized = {k for k, t in stored.items() if t.dtype == FP8_DTYPE}
    assert {k for k in quantized if EXPERT.search(k)}, "the routed experts are stored per expert, in fp8"
    for name in quantized:
        assert stored[name + "_scale_inv"].dtype == torch.float32
        assert tuple(stored[name + "_scale_inv"].shape) == scale_shape(stored[name].shape, BLOCK)
    assert not any(
        k.startswith(("lm_head", "model.embed_tokens")) or k.endswith("gate.weight") for k in quantized
    )
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    fmt = read_fp8_config(config)
    assert fmt is not None and fmt.block == BLOCK and fmt.modules_to_not_convert == DEFAULT_SKIP

    loaded = load_fp8(tmp_path / "fp8")
    source.load_state_dict(stock_from_pretrained(tmp_path / "ref").state_dict())  # its dequantized weights
    assert_logits_close(logits(loaded, source.config.vocab_size), logits(source, source.config.vocab_size))


def test_sharded_fp8_checkpoint(tmp_path):
    """Several shards: every scale beside its weight, the index naming both, and it loads."""
    source = tiny_model("qwen3_moe")
    save_fp8_checkpoint(source, tmp_path / "fp8", block=BLOCK, max_shard_size="20KB")
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())
    shards = sorted((tmp_path / "fp8").glob("*.safetensors"))
    assert len(shards) > 1
    stored = {}
    for file in shards:
        with safe_open(str(file), "pt") as f:
            stored.update({k: (file.name, f.get_slice(k).get_dtype()) for k in f.keys()})  # noqa: SIM118
    assert index["weight_map"] == {k: file for k, (file, _) in stored.items()}
    for name, (file, dtype) in stored.items():
        if dtype == "F8_E4M3":
            assert stored[name + "_scale_inv"][0] == file
    save_dequantized_checkpoint(tmp_path / "fp8", tmp_path / "ref")
    loaded = load_fp8(tmp_path / "fp8")
    vocab = source.config.vocab_size
    assert_logits_close(logits(loaded, vocab), logits(stock_from_pretrained(tmp_path / "ref"), vocab))


def test_bf16_release_layout(tmp_path):
    """The releases keep the unquantized tensors in bf16 and say so in config.json; transformers
    then dequantizes into bf16 (fp32 product, one rounding), exactly as the reference is written.
    Both models are compared in float32, where the same bf16 numbers sum alike up to order."""
    source = tiny_model("qwen3_moe")
    save_fp8_checkpoint(source, tmp_path / "fp8", block=BLOCK, dtype=torch.bfloat16)
    save_dequantized_checkpoint(tmp_path / "fp8", tmp_path / "ref", dtype=torch.bfloat16)
    stored = tensors(tmp_path / "fp8")
    assert {t.dtype for t in stored.values()} == {FP8_DTYPE, torch.float32, torch.bfloat16}
    loaded, reference = load_fp8(tmp_path / "fp8"), stock_from_pretrained(tmp_path / "ref")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    vocab = source.config.vocab_size
    assert_logits_close(logits(loaded.float(), vocab), logits(reference.float(), vocab))


@pytest.mark.parametrize(
    ("family", "overrides"), [("deepseek_v3", {}), ("qwen3_moe", {"moe_intermediate_size": 20})]
)
def test_partial_blocks_are_written_to_the_spec(family, overrides, tmp_path):
    """Dimensions that are not multiples of the block (deepseek_v3's 24-row kv_a_proj_with_mqa,
    20-wide experts) get partial last blocks, and every weight dequantizes within fp8 precision of
    the source's (half an e4m3 step: 2^-4 of the value, 2^-10 of its block's scale near zero)."""
    source = tiny_model(family, **overrides)
    source.save_pretrained(tmp_path / "stock")
    save_fp8_checkpoint(source, tmp_path / "fp8", block=BLOCK)
    stock, stored = tensors(tmp_path / "stock"), tensors(tmp_path / "fp8")
    assert set(stored) == set(stock) | {k + "_scale_inv" for k, t in stored.items() if t.dtype == FP8_DTYPE}
    partial = 0
    for name, weight in stock.items():
        if stored[name].dtype != FP8_DTYPE:
            assert torch.equal(stored[name], weight), name
            continue
        scale_inv = stored[name + "_scale_inv"]
        partial += any(n % b for n, b in zip(weight.shape, BLOCK))
        out = dequantize_blocks(stored[name], scale_inv, BLOCK)
        scale = scale_inv.repeat_interleave(BLOCK[0], 0)[: weight.shape[0]]
        scale = scale.repeat_interleave(BLOCK[1], 1)[:, : weight.shape[1]]
        assert bool(((out - weight).abs() <= (weight.abs() * 2**-4 + scale * 2**-10) * (1 + 1e-6)).all()), (
            name
        )
    assert partial > 0


def test_partial_blocks_in_stock_transformers(tmp_path):
    """Whether stock transformers reads partial blocks to the spec. 5.23 does not on CPU: its
    dequantization derives the block from the scale grid (rows // grid rows), so 24 rows in a
    2-row grid of 16-row blocks read as 12-row blocks (silently wrong), and a grid that does not
    divide the rows, as DeepSeek-V3's real kv_a_proj_with_mqa (576 rows, 5 scale rows), fails to
    load. Recorded as an expected failure while it lasts; moeprune must not read FP8 through it."""
    source = tiny_model("deepseek_v3")  # kv_a_proj_with_mqa: 24 rows
    save_fp8_checkpoint(source, tmp_path / "fp8", block=BLOCK)
    save_dequantized_checkpoint(tmp_path / "fp8", tmp_path / "ref")
    vocab = source.config.vocab_size
    try:
        loaded = load_fp8(tmp_path / "fp8")
    except RuntimeError as exc:
        pytest.xfail(f"transformers {transformers.__version__} refuses partial fp8 blocks: {exc}")
    expected = logits(stock_from_pretrained(tmp_path / "ref"), vocab)
    try:
        assert_logits_close(logits(loaded, vocab), expected)
    except AssertionError as exc:
        pytest.xfail(f"transformers {transformers.__version__} misreads partial fp8 blocks: {exc}")
