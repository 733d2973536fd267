"""Uniform neuron shrink written straight to the safetensors shards equals in-memory surgery, per family."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from test_streaming import assert_same_model, streamed_layers_or_skip

from helpers import stock_from_pretrained
from moeprune.checkpoint.files import INDEX
from moeprune.cli.main import main
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel, supported_families
from moeprune.models.classes import text_config_key
from moeprune.models.factory import tiny_model
from moeprune.observe.stats import ExpertStats, LayerStats
from moeprune.plan import Plan
from moeprune.shards.layout import meta_model
from moeprune.shards.neurons import rewrite_neuron_checkpoint
from moeprune.shards.reader import SafetensorsExperts
from moeprune.surgery.neurons import neuron_plan, shared_multiplier, stock_width_expressible
from moeprune.surgery.plans import apply_plan_physical, resolve_plan

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

SHARDED = {"qwen3_moe": torch.bfloat16, "gpt_oss": torch.bfloat16, "mixtral": torch.float32}
WIDTH, KEPT, SPARSITY = 24, 16, 1 / 3  # 24 -> 16 neurons: derived shared experts get zero padding


def random_stats(moe: MoEModel, seed: int = 0) -> ExpertStats:
    """Neuron statistics that make every expert keep different neurons (the source is irrelevant here)."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for m in moe.layers:
        s = LayerStats.zeros(m.index, m.num_experts, m.hidden_size, m.intermediate_size, neurons=True)
        s.count += 3
        s.neuron_proj_sum.copy_(torch.rand(s.neuron_proj_sum.shape, generator=gen, dtype=torch.float64))
        s.neuron_l2_sum.copy_(torch.rand(s.neuron_l2_sum.shape, generator=gen, dtype=torch.float64))
        layers.append(s)
    return ExpertStats(layers=layers, tokens=3, data_fingerprint="random")


def reload(path: Path):
    return stock_from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("family", supported_families())
def test_rewrite_equals_in_memory_uniform_shrink(family, tmp_path):
    spec = MoEModel(tiny_model(family)).spec
    model = tiny_model(family, **{spec.intermediate_field: WIDTH}).to(SHARDED.get(family, torch.float32))
    src = tmp_path / "src"
    model.save_pretrained(src, **({"max_shard_size": "30KB"} if family in SHARDED else {}))
    streamed_layers_or_skip(src, family)
    moe = meta_model(src)
    if any(m.kept_whole for m in moe.layers):  # hash layers: the neuron methods refuse (test_fixed_layers)
        pytest.skip(f"{family}: a kept-whole (hash-routed) layer")
    stats = random_stats(moe)
    plan = neuron_plan(moe, stats, SPARSITY)
    assert {c for lp in plan.layers for c in lp.neurons.values()} == {KEPT}
    keep = resolve_plan(moe, plan, stats).keep
    out = tmp_path / "streamed"
    if not stock_width_expressible(moe):  # Llama-4: the shared expert's width is the same field
        with pytest.raises(MoePruneError, match=f"{family}.*packed format"):
            rewrite_neuron_checkpoint(src, out, plan, keep)
        assert not out.exists()
        return
    if family == "longcat_flash":  # its zero experts' rows stored by transformers' save: refused in one line
        with pytest.raises(MoePruneError, match="zero experts") as refused:
            rewrite_neuron_checkpoint(src, out, plan, keep)
        assert "\n" not in str(refused.value) and not out.exists()
        return
    rewrite_neuron_checkpoint(src, out, plan, keep)
    assert len({tuple(ids.tolist()) for by_expert in keep.values() for ids in by_expert.values()}) > 1

    apply_plan_physical(MoEModel(model), plan, stats)  # in-memory shrink_uniform, same kept neurons
    model.save_pretrained(tmp_path / "in_memory")
    streamed = reload(out)
    assert_same_model(streamed, reload(tmp_path / "in_memory"))
    assert getattr(streamed.config.get_text_config(), spec.intermediate_field) == KEPT
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((tmp_path / "in_memory" / "config.json").read_text())
    if spec.shared_width_derived:  # 24 x 1 shared neurons -> 16 x 2, the 8 new ones zero
        key = text_config_key(streamed.config)  # a wrapper keeps its language model's fields apart
        assert (config[key] if key else config)[shared_multiplier(moe)] == 2
    assert Plan.load(out / "plan.json").layers == plan.layers
    if family in SHARDED:
        index = json.loads((out / INDEX).read_text())
        tensors = {k: t for f in set(index["weight_map"].values()) for k, t in load_file(out / f).items()}
        assert set(tensors) == set(index["weight_map"])
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
        assert {t.dtype for t in tensors.values() if t.is_floating_point()} == {SHARDED[family]}


def plan_and_keep(src: Path, sparsity: float = 0.5):
    moe = meta_model(src)
    stats = random_stats(moe)
    plan = neuron_plan(moe, stats, sparsity)
    return moe, plan, resolve_plan(moe, plan, stats).keep


def test_bad_plans_are_refused_and_write_nothing(tmp_path):
    src = tmp_path / "src"
    tiny_model("olmoe").save_pretrained(src)
    moe, plan, keep = plan_and_keep(src)
    out = tmp_path / "out"

    uneven = copy.deepcopy(plan)
    uneven.layers[1].neurons = {e: 16 if e else 8 for e in range(8)}  # TENP-like: per-expert widths
    unaligned = copy.deepcopy(plan)
    for lp in unaligned.layers:
        lp.neurons = dict.fromkeys(lp.neurons, 6)
    dropping = copy.deepcopy(plan)
    dropping.layers[0].kept, dropping.layers[0].dropped = list(range(1, 8)), [0]
    cases = [
        (uneven, keep, "different neuron counts"),
        (unaligned, keep, "multiple of 8"),
        (dropping, keep, "drops experts"),
        (plan, {i: {e: ids[:4] for e, ids in by.items()} for i, by in keep.items()}, "increasing ids"),
        (plan, {i: dict(list(by.items())[:3]) for i, by in keep.items()}, "all 8"),
    ]
    for bad, bad_keep, message in cases:
        with pytest.raises(MoePruneError, match=message):
            rewrite_neuron_checkpoint(src, out, bad, bad_keep)
        assert not out.exists()
    with pytest.raises(MoePruneError, match="input checkpoint"):
        rewrite_neuron_checkpoint(src, src, plan, keep, overwrite=True)


def test_plan_keeping_every_neuron_copies_the_weights(tmp_path):
    """A sparsity too small to remove 8 neurons leaves the plan empty: in memory nothing changes, here too."""
    src = tmp_path / "src"
    tiny_model("deepseek_v3").save_pretrained(src)
    _, plan, keep = plan_and_keep(src, sparsity=0.05)
    assert keep == {} and all(not lp.neurons for lp in plan.layers)
    out = rewrite_neuron_checkpoint(src, tmp_path / "out", plan, keep)
    assert load_file(out / "model.safetensors").keys() == load_file(src / "model.safetensors").keys()
    assert_same_model(reload(out), reload(src))
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_rewrite_reads_one_expert_at_a_time(tmp_path, monkeypatch):
    """Each expert's tensors are read once and the cut expert is released before the next one."""
    src = tmp_path / "src"
    tiny_model("qwen3_moe").save_pretrained(src)
    _, plan, keep = plan_and_keep(src)
    reads: list[tuple[int, str, int]] = []
    real = SafetensorsExperts.expert_tensor

    def counted(self, name, expert):
        reads.append((self.layer, name, expert))
        return real(self, name, expert)

    monkeypatch.setattr(SafetensorsExperts, "expert_tensor", counted)
    rewrite_neuron_checkpoint(src, tmp_path / "out", plan, keep)
    assert sorted(reads) == sorted(
        {(i, n, e) for i in keep for n in ("gate_up_proj", "down_proj") for e in range(8)}
    )


# ------------------------------------------------------------------------------------- command line
def run(*args, ok: bool = True):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def test_cli_no_load_neurons_equals_in_memory_prune(tiny_checkpoint, data, tmp_path):
    common = ["--method", "neurons", "--sparsity", "0.5", "--data", data, "--neuron-importance", "l2", "--quiet",
              "--allow-super-experts"]  # the stock layout (guarded super experts: moeprune's format)  # fmt: skip
    run("prune", tiny_checkpoint, "--output", tmp_path / "mem", "--criterion", "reap", *common)
    result = run("prune", tiny_checkpoint, "--output", tmp_path / "streamed", "--criterion", "reap", "--no-load",
                 *common)  # fmt: skip
    assert "8 neurons" in result.output
    streamed, mem = tmp_path / "streamed", tmp_path / "mem"
    assert_same_model(reload(streamed), reload(mem))
    assert json.loads((streamed / "config.json").read_text())["moe_intermediate_size"] == 8
    assert Plan.load(streamed / "plan.json") == Plan.load(mem / "plan.json")
    report = json.loads((streamed / "report.json").read_text())
    expected = json.loads((mem / "report.json").read_text())
    for key in ("method", "sparsity", "surgery", "parameters_before", "parameters_after", "layers_after"):
        assert report[key] == expected[key], key
    assert report["data"]["tokens"] == expected["data"]["tokens"]
    kept = report["kept_neurons"]
    assert kept["importance"] == "l2" and kept["ids_total"] == 4 * 8 * 8
    assert all(len(row) == 8 and row == sorted(row) for rows in kept["ids"].values() for row in rows)
    assert (streamed / "tokenizer_config.json").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--method", "tenp", "--criterion", "reap"), "drop or neurons method"),
        (("--method", "novice", "--criterion", "reap"), "drop or neurons method"),
        (("--method", "neurons", "--criterion", "auto"), "named criterion"),
    ],
)
def test_cli_no_load_refuses_other_methods(tiny_checkpoint, data, tmp_path, args, message):
    out = tmp_path / "out"
    result = run("prune", tiny_checkpoint, "--output", out, "--sparsity", "0.5", "--data", data, "--no-load", *args,
                 "--quiet", ok=False)  # fmt: skip
    assert result.exit_code == 2 and message in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_cli_no_load_neurons_refuses_llama4_before_observing(tmp_path, data):
    src = tmp_path / "llama4"
    tiny_model("llama4_text").save_pretrained(src)
    result = run("prune", src, "--output", tmp_path / "out", "--criterion", "reap", "--method", "neurons",
                 "--sparsity", "0.5", "--data", data, "--no-load", "--quiet", ok=False)  # fmt: skip
    assert result.exit_code == 2 and "llama4_text" in result.output and "packed format" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--method", "drop", "--sparsity", "0.95"), "top_k"),  # more experts than top-k allows
        (("--method", "neurons", "--sparsity", "0.999"), "lower the sparsity"),
        (("--method", "drop", "--sparsity", "0.25", "--overwrite", "SAME"), "is the input"),
    ],
)
def test_no_load_fails_before_any_scoring(tiny_checkpoint, data, tmp_path, monkeypatch, args, message):
    """Cheap checks (budget, neuron width, output folder) run before hours of observation."""
    from moeprune.job import no_load as shard_prune

    def never(*args, **kwargs):
        raise AssertionError("scored or observed before the cheap checks")

    monkeypatch.setattr(shard_prune, "score_without_loading", never)
    src = tmp_path / "src"
    src.mkdir()
    for item in tiny_checkpoint.iterdir():
        (src / item.name).write_bytes(item.read_bytes())
    out = src if "SAME" in args else tmp_path / "out"
    args = tuple(a for a in args if a != "SAME")
    result = run("prune", src, "--output", out, "--criterion", "reap", "--data", data, "--no-load", *args,
                 "--quiet", ok=False)  # fmt: skip
    assert result.exit_code == 2 and message in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
