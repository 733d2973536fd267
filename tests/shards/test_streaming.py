"""Scoring and drop surgery straight on the safetensors files equal the in-memory path, per family."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

import moeprune
from helpers import assert_logits_close, stock_from_pretrained
from moeprune.checkpoint.files import INDEX
from moeprune.criteria import compute_scores
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel, supported_families
from moeprune.models.factory import tiny_model
from moeprune.models.reshape import drop_experts
from moeprune.plan import ModelShape, Plan
from moeprune.shards.layout import meta_model
from moeprune.shards.reader import checkpoint_layers
from moeprune.shards.rewrite import rewrite_checkpoint
from moeprune.shards.weight_scores import _Sums, score_checkpoint

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

TOKENS = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(3))
SHARDED = ("qwen3_moe", "gpt_oss", "mixtral")  # per-expert, fused and renamed naming, several shards


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """checkpoint(family, sharded=False): tiny_model(family) saved once per module (read-only)."""

    saved: dict[tuple[str, bool], Path] = {}

    def get(family: str, sharded: bool = False) -> Path:
        if (family, sharded) not in saved:
            path = tmp_path_factory.mktemp(f"{family}{'-sharded' if sharded else ''}")
            tiny_model(family).save_pretrained(path, **({"max_shard_size": "30KB"} if sharded else {}))
            saved[family, sharded] = path
        return saved[family, sharded]

    return get


@contextmanager
def weights_never_loaded() -> Iterator[None]:
    """Inside: from_pretrained fails and from_config only works on the meta device."""

    def refuse(*args, **kwargs):
        raise AssertionError("streaming loaded the model")

    real = PreTrainedModel._from_config.__func__

    def meta_only(cls, *args, **kwargs):
        assert torch.get_default_device().type == "meta", "model built outside the meta device"
        return real(cls, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))
        patch.setattr(PreTrainedModel, "_from_config", classmethod(meta_only))
        yield


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A writable copy of a module-shared checkpoint."""
    dst.mkdir(exist_ok=True)
    for item in src.iterdir():
        (dst / item.name).write_bytes(item.read_bytes())
    return dst


def assert_same_scores(path: Path, model, criteria=("aimer", "magnitude")) -> None:
    layers = MoEModel(model).layers
    for criterion in criteria:
        with weights_never_loaded():
            streamed = score_checkpoint(path, criterion)
        loaded = compute_scores(criterion, weights=layers)
        assert [s.layer for s in streamed] == [s.layer for s in loaded]
        for a, b in zip(streamed, loaded):
            np.testing.assert_allclose(a.scores, b.scores, rtol=1e-6, atol=0)
            assert a.order == b.order


def streamed_layers_or_skip(path: Path, family: str):
    """The checkpoint's layers read by streaming, or a skip when streaming refuses the family's
    stored layout in its one line (transformers converts those tensors when loading)."""
    try:
        with weights_never_loaded():
            return checkpoint_layers(path)
    except MoePruneError as exc:
        assert "load the model instead" in str(exc) and "\n" not in str(exc)
        pytest.skip(f"{family}: streaming refused: {exc}")


@pytest.mark.parametrize("family", supported_families())
def test_streamed_experts_and_scores_equal_in_memory(family, checkpoints):
    path = checkpoints(family)
    model = tiny_model(family)  # the very weights that were saved
    sources = streamed_layers_or_skip(path, family)
    layers = MoEModel(model).layers
    assert [(s.layer, s.num_experts) for s in sources] == [(m.index, m.num_experts) for m in layers]
    for source, layer in zip(sources, layers):
        for e in range(layer.num_experts):
            for streamed, loaded in zip(source.expert_weights(e), layer.expert_weights(e)):
                assert streamed is loaded is None or torch.equal(streamed, loaded)  # None: no gate
    assert_same_scores(path, model)


@pytest.mark.parametrize("family", SHARDED)
def test_sharded_and_bf16_checkpoints_stream(family, checkpoints, tmp_path):
    assert (checkpoints(family, sharded=True) / INDEX).is_file()
    assert_same_scores(checkpoints(family, sharded=True), tiny_model(family), ("aimer",))
    model = tiny_model(family).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    assert_same_scores(tmp_path, model)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # per-expert and fused naming
def test_parallel_scoring_equals_one_worker(family, checkpoints):
    """Workers only split the experts: each expert is summed by one thread with the same blocks,
    so the scores are bit-identical, and torch's thread count is given back."""
    threads = torch.get_num_threads()
    one = score_checkpoint(checkpoints(family, sharded=True), "aimer", workers=1)
    three = score_checkpoint(checkpoints(family, sharded=True), "aimer", workers=3)
    assert torch.get_num_threads() == threads
    for a, b in zip(one, three, strict=True):
        assert np.array_equal(a.scores, b.scores) and a.order == b.order


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])  # per-expert and fused naming
def test_reading_byte_ranges_equals_summing_the_mapped_tensors(family, checkpoints, tmp_path):
    """Scores read each expert's byte ranges with plain reads: the same values, in the same
    blocks, as the memory-mapped tensors, so the sums are bit-identical (bf16 and fp32)."""
    model = tiny_model(family).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    for path in (checkpoints(family), tmp_path):
        sums = _Sums()
        for source in checkpoint_layers(path):
            for e in range(source.num_experts):
                mapped = [t for name in ("gate_up_proj", "down_proj") for t in source.stored_parts(name, e)]
                assert sums.of_stored(source, e) == sums.of_tensors(mapped)


def test_reads_without_preadv_give_the_same_scores(checkpoints, monkeypatch):
    """Where os.preadv is missing (Windows), a locked seek + read gives identical sums."""
    path = checkpoints("qwen3_moe", sharded=True)
    with_preadv = score_checkpoint(path, "aimer", workers=2)
    monkeypatch.delattr(os, "preadv")
    without = score_checkpoint(path, "aimer", workers=2)
    assert all(np.array_equal(a.scores, b.scores) for a, b in zip(with_preadv, without, strict=True))


def test_truncated_shard_is_reported(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints("olmoe"), tmp_path / "cut")
    layer = checkpoint_layers(path)[-1]
    key, start, _ = layer.stored_ranges("down_proj", layer.num_experts - 1)[0]
    shard = path / layer.stored_tensor(key).file
    shard.write_bytes(shard.read_bytes()[: start + 16])  # cut inside the last expert's weights
    with pytest.raises(MoePruneError, match="is truncated"):
        score_checkpoint(path, "aimer")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_block_sums_are_accurate(dtype):
    """fp32 cascaded block sums stay within 1e-6 of exact fp64 sums over millions of values of
    mixed magnitudes (a naive fp32 running sum of 3M squares is off by ~1e-4)."""
    g = torch.Generator().manual_seed(0)
    parts = [
        (torch.randn(3_000_001, generator=g) * torch.logspace(-3, 1, 3_000_001)).to(dtype),
        torch.randn(777, 13, generator=g).to(dtype),
    ]
    l1, sq, n = _Sums().of_tensors(parts)
    exact = torch.cat([p.reshape(-1).double() for p in parts])
    assert n == exact.numel()
    assert l1 == pytest.approx(float(exact.abs().sum()), rel=1e-6)
    assert sq == pytest.approx(float(exact.square().sum()), rel=1e-6)


def uniform_removals(moe: MoEModel) -> dict[int, list[int]]:
    """Two experts per layer, different ones per layer, one from each half (balanced for 2 groups)."""
    return {m.index: [j % 4, 4 + (j + 1) % 4] for j, m in enumerate(moe.layers)}


def drop_plan(moe: MoEModel, removals: dict[int, list[int]], method: str = "drop") -> Plan:
    return Plan.from_removals(
        ModelShape.of(moe),
        removals=[removals[m.index] for m in moe.layers],
        criterion="aimer",
        allocation="uniform",
        method=method,
        novices=method == "novice",  # a novice plan keeps every expert, routed
        sparsity=0.25,
    )


def reload(path: Path):
    return stock_from_pretrained(path, dtype=torch.float32)


def pruned_in_memory(family: str, removals: dict[int, list[int]], out: Path) -> Path:
    model = tiny_model(family)
    drop_experts(MoEModel(model), removals)
    model.save_pretrained(out)
    return out


def assert_same_model(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    with torch.no_grad():
        assert_logits_close(a(TOKENS).logits, b(TOKENS).logits)


@pytest.mark.parametrize("family", supported_families())
def test_rewrite_equals_in_memory_drop(family, checkpoints, tmp_path):
    src = checkpoints(family, sharded=family in SHARDED)
    streamed_layers_or_skip(src, family)
    moe = meta_model(src)
    if any(m.kept_whole for m in moe.layers):  # tests/shards/test_no_load_special_layers.py
        pytest.skip(f"{family}: kept-whole (hash-routed) layers take per-layer counts")
    removals = uniform_removals(moe)
    plan = drop_plan(moe, removals)
    out = rewrite_checkpoint(src, tmp_path / "streamed", plan)
    expected = reload(pruned_in_memory(family, removals, tmp_path / "in_memory"))
    streamed = reload(out)
    assert_same_model(streamed, expected)
    assert getattr(streamed.config.get_text_config(), moe.spec.count_field) == 6
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((tmp_path / "in_memory" / "config.json").read_text())
    assert Plan.load(out / "plan.json").layers == plan.layers
    assert (out / "generation_config.json").read_text() == (src / "generation_config.json").read_text()


def test_rewrite_with_hub_alias_of_the_count_field(checkpoints, tmp_path):
    """Hub Qwen3-MoE configs say `num_experts` (an alias of `num_local_experts`): the count must follow."""
    src = copy_checkpoint(checkpoints("qwen3_moe"), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    (src / "config.json").write_text(json.dumps(config))
    moe = meta_model(src)
    removals = uniform_removals(moe)
    out = rewrite_checkpoint(src, tmp_path / "out", drop_plan(moe, removals))
    assert_same_model(reload(out), reload(pruned_in_memory("qwen3_moe", removals, tmp_path / "mem")))


@pytest.mark.parametrize("family", SHARDED)
def test_rewritten_index_matches_shards(family, checkpoints, tmp_path):
    src = checkpoints(family, sharded=True)
    moe = meta_model(src)
    out = rewrite_checkpoint(src, tmp_path / "out", drop_plan(moe, uniform_removals(moe)))
    index = json.loads((out / INDEX).read_text())
    stored, total = {}, 0
    for file in set(index["weight_map"].values()):
        tensors = load_file(out / file)
        stored.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    assert stored == index["weight_map"]
    assert index["metadata"]["total_size"] == total
    with safe_open(str(out / sorted(set(stored.values()))[0]), framework="pt") as fh:
        assert fh.metadata() == {"format": "pt"}


def test_rewrite_copies_other_files_and_never_loads(tmp_path):
    src = tmp_path / "src"
    tiny_model("olmoe").save_pretrained(src)
    (src / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    with weights_never_loaded():
        moe = meta_model(src)
        out = rewrite_checkpoint(
            src,
            tmp_path / "out",
            drop_plan(moe, uniform_removals(moe)),
            extra=lambda tmp: (tmp / "report.json").write_text("{}"),
        )
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 128}'
    assert (out / "report.json").is_file() and (out / "plan.json").is_file()


# ------------------------------------------------------------------------------------- bad input
def test_data_criterion_is_refused(checkpoints):
    with pytest.raises(MoePruneError, match="calibration data"):
        score_checkpoint(checkpoints("olmoe"), "reap")


def test_random_criterion_needs_no_weights(checkpoints):
    scores = score_checkpoint(checkpoints("olmoe"), "random", seed=3)
    assert [len(s.scores) for s in scores] == [8, 8, 8]


def test_missing_and_weightless_paths_are_refused(tmp_path):
    with pytest.raises(MoePruneError, match="does not exist"):
        score_checkpoint(tmp_path / "nowhere", "aimer")
    tiny_model("olmoe").config.save_pretrained(tmp_path)
    with pytest.raises(MoePruneError, match="no safetensors weights"):
        checkpoint_layers(tmp_path)


def test_unknown_expert_tensors_are_refused(checkpoints, tmp_path):
    """A per-expert tensor the model has no parameter for (like FP8 scales) is not silently copied."""
    copy_checkpoint(checkpoints("qwen3_moe"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"] = torch.ones(1)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MoePruneError, match="weight_scale_inv"):
        checkpoint_layers(tmp_path)


def test_unsupported_plans_are_refused(checkpoints, tmp_path):
    src = checkpoints("olmoe")
    moe = meta_model(src)
    uneven = {m.index: [0] * (j > 0) for j, m in enumerate(moe.layers)}
    cases = [
        (drop_plan(moe, uneven), "uniform drop plans only"),
        (drop_plan(moe, uniform_removals(moe), method="novice"), "'drop' plans"),
    ]
    other = drop_plan(moe, uniform_removals(moe))
    other.model_type = "mixtral"
    cases.append((other, "mixtral"))
    for plan, message in cases:
        with pytest.raises(MoePruneError, match=message):
            rewrite_checkpoint(src, tmp_path / "out", plan)
    assert not (tmp_path / "out").exists()


def test_unbalanced_group_removal_is_refused(checkpoints, tmp_path):
    src = checkpoints("deepseek_v3")
    moe = meta_model(src)
    plan = drop_plan(moe, {m.index: [0, 1] for m in moe.layers})  # both from group 0
    with pytest.raises(MoePruneError, match="unbalanced"):
        rewrite_checkpoint(src, tmp_path / "out", plan)


def test_output_folder_rules(checkpoints, tmp_path):
    src = checkpoints("olmoe")
    moe = meta_model(src)
    plan = drop_plan(moe, uniform_removals(moe))
    (tmp_path / "taken").mkdir()
    with pytest.raises(MoePruneError, match="already exists"):
        rewrite_checkpoint(src, tmp_path / "taken", plan)
    with pytest.raises(MoePruneError, match="input checkpoint"):
        rewrite_checkpoint(src, src, plan, overwrite=True)
    assert rewrite_checkpoint(src, tmp_path / "taken", plan, overwrite=True) == tmp_path / "taken"


def test_moeprune_format_is_refused(tmp_path):
    model = tiny_model("olmoe")
    drop_experts(MoEModel(model), {0: [1], 1: [], 2: [2, 3]})
    assert moeprune.save_pretrained(model, tmp_path) == "moeprune"
    with pytest.raises(MoePruneError, match="moeprune's own format"):
        score_checkpoint(tmp_path, "aimer")
