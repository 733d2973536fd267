"""Device placement: a model accelerate had to spill to CPU/disk is refused with a clear error."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import moeprune
from helpers import REORDER_RTOL, assert_logits_close
from moeprune.checkpoint import check_not_offloaded, load_model
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import save_tiny_model, tiny_model
from moeprune.models.reshape import drop_experts
from moeprune.runtime.device import Placement, input_device, precision_lost

pytestmark = pytest.mark.unit  # fast, small inputs: `pytest -m unit` runs them all in about a minute

pytest.importorskip("accelerate")


def test_disk_offloaded_model_is_refused(tmp_path):
    """Offloaded modules keep meta weights outside their own forward; moeprune reads expert
    weights directly, so it must refuse rather than compute with empty tensors."""
    path = save_tiny_model("qwen3_moe", tmp_path / "checkpoint")
    config = AutoModelForCausalLM.from_pretrained(path).config
    device_map = {
        "model.embed_tokens": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    device_map |= {f"model.layers.{i}": "disk" if i == 0 else "cpu" for i in range(config.num_hidden_layers)}
    offloaded = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, device_map=device_map, offload_folder=str(tmp_path / "offload")
    )
    with pytest.raises(
        MoePruneError, match=r"offloaded \d+ modules .*first: model\.layers\.0\..*sequential observation"
    ):
        check_not_offloaded(offloaded)


def test_device_map_auto_loads_every_weight(tmp_path):
    """device_map='auto' places every weight (on the CPU without GPUs, on the GPUs with them):
    nothing offloaded, the same logits. On a GPU cuBLAS sums in another order than the CPU's BLAS
    (TF32 off): a few ulps per term, so 1e-4 relative there; the CPU's own reordering bound here."""
    path = save_tiny_model("olmoe", tmp_path / "checkpoint")
    placed, _ = load_model(path, dtype=torch.float32, device_map="auto")
    plain, _ = load_model(path, dtype=torch.float32)
    assert not any(p.is_meta for p in placed.parameters())
    tokens = torch.arange(12).reshape(2, 6)
    where = input_device(placed)
    with torch.no_grad():
        got = placed(tokens.to(where)).logits.cpu()
        assert_logits_close(got, plain(tokens).logits, rtol=1e-4 if where.type == "cuda" else REORDER_RTOL)


def test_device_map_is_refused_for_moeprune_format(tmp_path):
    """moeprune's own format loads on one device; asking accelerate to split it fails clearly."""
    model = tiny_model("olmoe")
    moe = MoEModel(model)
    drop_experts(moe, {moe.layers[0].index: [0]})  # uneven counts: moeprune's format
    path = tmp_path / "checkpoint"
    assert moeprune.save_pretrained(model, path) == "moeprune"
    with pytest.raises(MoePruneError, match="moeprune's own format.*choose one device"):
        load_model(path, device_map="auto")


def test_device_auto_is_refused_under_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(MoePruneError, match="under torchrun each rank holds its own copy"):
        Placement.choose("auto", None)


def test_device_auto_without_gpus_is_plain_cpu(monkeypatch):
    """No GPU: no accelerate device map at all (which moeprune-format checkpoints could not take)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Placement.choose("auto", None) == Placement(torch.device("cpu"), torch.float32, None)


def test_precision_lost_names_the_fix_only_when_bits_go():
    assert precision_lost(torch.float32, torch.float32) is None
    assert precision_lost(torch.float32, torch.bfloat16) is None  # asked to shrink: no bits wasted
    assert precision_lost(torch.bfloat16, torch.float32) == (
        "the model runs in bf16 and is saved as fp32: the saved weights hold bf16-rounded values; "
        "pass --dtype fp32 to keep every bit, or --save-dtype bf16 to write the bytes they hold"
    )
    assert precision_lost(torch.bfloat16, torch.float16) is not None  # 8 vs 11 mantissa bits
    assert precision_lost(torch.float16, torch.bfloat16) is not None  # 5 vs 8 exponent bits
