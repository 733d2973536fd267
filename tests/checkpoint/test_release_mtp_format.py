"""Multi-token-prediction layers of release layouts in results saved in moeprune's format (per-layer
expert counts, novices): kept, dropped to the count of the plan's last MoE layer by their own
plan, stored under the release's names, recorded in config.json's `moeprune` section; moeprune's
loader and the modeling files (trust_remote_code) load the main model with them present."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from test_release_mtp import assert_mtp_kept
from tests.helpers import assert_logits_close, fixed_logits, run_cli
from tests.release_layouts import RELEASES, mtp_keys, write_mtp_release

from moeprune import MoePruneError, load_pretrained
from moeprune.models import MoEModel
from moeprune.models.reshape import drop_experts

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore")]

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("releases")
    made = {family: write_mtp_release(family, root / family) for family in ("qwen3_next", "deepseek_v3")}
    return {**made, "deepseek_v3-fp8": write_mtp_release("deepseek_v3", root / "fp8", fp8=True)}


def _prune(source: Path, out: Path, *args: str) -> tuple[dict, dict]:
    run_cli("prune", str(source), "--output", str(out), "--criterion", "aimer", "--quiet", *args)
    return json.loads((out / "plan.json").read_text()), json.loads((out / "config.json").read_text())


def _check_mtp(source: Path, out: Path, family: str, plan: dict, config: dict) -> list[int]:
    """The MTP layer is kept at the last MoE layer's count, its tensors the input's kept experts
    renumbered (router rows and biases cut in step, the rest as stored), and the section says so."""
    last = max(plan["layers"], key=lambda lp: lp["layer"])
    (layer,) = plan["extra"]["mtp"]["layers"].values()
    kept = layer["kept"]
    groups = config.get("text_config", config).get("n_group") or 1
    weighted = len(last["kept"]) - len(last["novice"])  # as many as the last layer holds weights for,
    assert len(kept) == weighted - weighted % groups < 8  # in whole routing groups
    section = config["moeprune"]["mtp"]
    assert section["num_experts"] == len(kept)
    assert [entry["expert_ids"] for entry in section["layers"]] == [kept]
    assert [entry["prefix"] for entry in section["layers"]] == [layer["prefix"]]
    if RELEASES[family].count_field:
        assert config.get("text_config", config)[RELEASES[family].count_field] == 1  # kept, not 0
    before, after = mtp_keys(source, family), mtp_keys(out, family)
    assert {int(m.group(1)) for k in after if (m := _EXPERT.search(k))} == set(range(len(kept)))
    assert_mtp_kept(before, after, kept)
    return kept


def _check_draft_config(out: Path, drafted: bool, count: int) -> None:
    """The vLLM plugin's MTP draft config (no vLLM needed): the base family's at the MTP count."""
    from transformers import AutoConfig

    from moeprune.serve.vllm_plugin import draft_config

    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    if not drafted:
        with pytest.raises(ValueError, match="serves MTP drafts of deepseek_v3 results only, not qwen3_next"):
            draft_config(config)
        return
    draft = draft_config(config)
    assert (draft.model_type, draft.architectures) == ("deepseek_v3", ["DeepseekV3ForCausalLM"])
    assert draft.n_routed_experts == count and not hasattr(draft, "moeprune")


def _remote_logits(folder: Path) -> torch.Tensor:
    """The result loaded by the modeling files saved with it (stock transformers, trust_remote_code)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    assert type(model).__name__.startswith("MoePrune")
    return fixed_logits(model)


# per-layer counts from the global allocation; the fp8 release keeps its quantization, so its
# result is written from the input's shards (shards/rewrite.py) rather than saved from memory
CASES = ("qwen3_next", "deepseek_v3", "deepseek_v3-fp8")


@pytest.mark.parametrize("case", CASES)
def test_per_layer_counts_keep_the_mtp_layer(releases, tmp_path, case):
    family = case.removesuffix("-fp8")
    source, out = releases[case], tmp_path / "out"
    plan, config = _prune(source, out, "--sparsity", "0.4", "--allocation", "global")
    assert len({len(lp["kept"]) for lp in plan["layers"]}) > 1 and "moeprune" in config  # moeprune's format
    kept = _check_mtp(source, out, family, plan, config)
    note = json.loads((out / "report.json").read_text())["release_layers"][0]
    assert "kept, pruned to" in note
    # whether vLLM drafts with it, said in one line (summary, report, model card)
    drafted = family == "deepseek_v3"
    assert ("vLLM drafts with them through moeprune's plugin" in note) == drafted, note
    assert ("vLLM does not draft with them from this qwen3_next result" in note) == (not drafted), note
    assert note in (out / "README.md").read_text()
    _check_draft_config(out, drafted, len(kept))
    # both loaders build the main model with the MTP tensors on disk: nothing unexpected, and the
    # logits are the input's with the plan's experts dropped
    original = load_pretrained(source)
    drop_experts(MoEModel(original), {lp["layer"]: lp["dropped"] for lp in plan["layers"]})
    expected = fixed_logits(original)
    assert_logits_close(fixed_logits(load_pretrained(out)), expected)
    assert_logits_close(_remote_logits(out), expected)


def test_novice_result_keeps_the_mtp_layer_by_a_drop(tmp_path, data):
    """Novices in the main model; the MTP layer is a draft: a drop to the last layer's count."""
    from moeprune.data.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    source, out = (
        write_mtp_release("deepseek_v3", tmp_path / "in", vocab_size=len(tokenizer)),
        tmp_path / "out",
    )
    tokenizer.save_pretrained(source)
    plan, config = _prune(
        source, out, "--sparsity", "0.25", "--method", "novice", "--data", str(data), "--samples", "4"
    )
    assert any(lp["novice"] for lp in plan["layers"]) and "moeprune" in config
    _check_mtp(source, out, "deepseek_v3", plan, config)
    assert_logits_close(_remote_logits(out), fixed_logits(load_pretrained(out)))


def test_loaders_refuse_mtp_tensors_the_section_does_not_record(releases, tmp_path):
    """The loaders skip exactly the recorded MTP keys: without the record they are unexpected."""
    out = tmp_path / "out"
    _, config = _prune(releases["qwen3_next"], out, "--sparsity", "0.4", "--allocation", "global")
    del config["moeprune"]["mtp"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(MoePruneError, match="unexpected.*mtp"):
        load_pretrained(out)
    with pytest.raises(Exception, match="unexpected tensors.*mtp"):
        _remote_logits(out)


def test_a_damaged_mtp_record_is_refused_in_one_line(releases, tmp_path):
    out = tmp_path / "out"
    _, config = _prune(releases["qwen3_next"], out, "--sparsity", "0.4", "--allocation", "global")
    config["moeprune"]["mtp"]["layers"][0]["expert_ids"].pop()
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(MoePruneError, match="'mtp'.*expert_ids.*damaged"):
        load_pretrained(out)


@pytest.mark.parametrize(
    "kept,novice,groups,expected",
    [
        (6, 0, 1, 6),  # a drop plan: the last layer's kept count
        (8, 3, 1, 5),  # novices hold no weights: 8 - 3
        (8, 3, 2, 4),  # 5 rounded down to whole routing groups
        (8, 7, 4, 4),  # 1 -> top-k 2 -> down to 0 groups is below top-k: up to one group of 4
    ],
)
def test_mtp_count_rule(kept, novice, groups, expected):
    from moeprune.plan import LayerPlan, Plan
    from moeprune.shards.mtp import mtp_count

    def layer(index: int, keep: int) -> LayerPlan:
        return LayerPlan(index, 8, 2, list(range(keep)), list(range(keep, 8)), list(range(novice)))

    plan = Plan("deepseek_v3", [layer(1, 8), layer(2, kept)], "aimer", "global", "novice", 0.25)
    assert mtp_count(plan, groups) == expected
