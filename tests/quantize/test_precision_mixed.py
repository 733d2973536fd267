"""`prune --method mixed --quantize auto:w4a16,w8a16 --target-size T --allocation evo` without
`--sparsity`: each layer's mixed forms and its scheme searched together (quantize/mixed.py,
quantize/mixed_space.py), llm-compressor's oneshot stood in for (the bytes it writes are
test_precision_mixed_oneshot.py's quant_env test): runs everywhere.

What must hold: every candidate the space makes keeps the mixed rules and T, and the repair leaves
no single growth that would still fit; a candidate's bytes are the kept-bytes table of the plan
`prune` builds from its genes (the plan keeps the genes' widths exactly); the winner is at least as
fit as every seed; the result prunes the winner's genes and quantizes with its schemes; what the
joint search cannot run is refused in one line before loading.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest
import torch

from helpers import oneshot_stand_in, run_cli, save_tiny_qwen, write_arithmetic
from moeprune.allocate.limits import layer_limits
from moeprune.config import SearchConfig
from moeprune.criteria import scoring
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.plan import Plan
from moeprune.quantize import stage as stage_module
from moeprune.quantize.keeps import kept_precision_bytes, plan_keeps, scheme_bytes
from moeprune.quantize.mixed_space import _GROW, MixedPrecisionSpace
from moeprune.quantize.options import QuantizeOptions
from moeprune.quantize.tables import LayerKeep
from moeprune.shards.weight_bytes import cast_weight_bytes
from moeprune.surgery.mixed import MixedOptions, stepped_costs

pytestmark = pytest.mark.integration

SCHEMES = ("w4a16", "w8a16")
GROUP = 16
OPTIONS = QuantizeOptions("w4a16", "rtn", GROUP, candidates=SCHEMES)


def _save_tiny(folder) -> MoEModel:
    """3 MoE layers of 8 experts 64 wide (top-2): narrowed widths 16, 32 or 48 on the group of 16."""
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    model = tiny_model("qwen3_moe", vocab_size=len(tokenizer), num_hidden_layers=3, mlp_only_layers=[],
                       moe_intermediate_size=64)  # fmt: skip
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return MoEModel(model)


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> MixedPrecisionSpace:
    folder = tmp_path_factory.mktemp("precision-mixed-space")
    moe = _save_tiny(folder)
    size = cast_weight_bytes(folder, moe, torch.float32)
    per = scheme_bytes(size, moe, SCHEMES, OPTIONS, 4)
    costs = stepped_costs(moe, layer_limits(moe), 0.25, MixedOptions(width_multiple=GROUP))
    return MixedPrecisionSpace(tuple(costs), (0, 1, 2), per, _halfway(moe, size))


def _halfway(moe: MoEModel, size) -> int:
    """Halfway between every expert whole at w4a16 (fits) and at w8a16 (does not)."""
    whole = [LayerKeep((64,) * 8)] * 3
    every = {s: kept_precision_bytes(size, moe, SCHEMES, OPTIONS, 4, whole).total([s] * 3) for s in SCHEMES}
    return (every["w4a16"] + every["w8a16"]) // 2


def test_a_candidate_is_priced_by_hand_from_the_byte_tables(space):
    candidate = ((3, 2, 2, 1, 32, 1), (8, 0, 0, 0, 64, 0), (2, 4, 0, 2, 16, 0))
    base, w8 = space.per["w4a16"], space.per["w8a16"]
    by_hand = base.total - sum(lay.experts * lay.expert() for lay in base.layers)
    lay0, lay2 = base.layers[0], base.layers[2]
    by_hand += 2 * lay0.novice - lay0.router_row - 2 * lay2.router_row  # novices kept, dropped routing gone
    by_hand += 3 * w8.layers[0].expert() + 2 * w8.layers[0].expert(32)
    by_hand += 8 * base.layers[1].expert()
    by_hand += 2 * lay2.expert() + 4 * lay2.expert(16)
    assert space.bytes(candidate) == by_hand
    assert space.valid(candidate)
    assert not space.valid(((3, 2, 2, 1, 24, 1), *candidate[1:]))  # 24 is off the width step of 16


def test_every_mutant_keeps_the_rules_and_t_and_the_repair_leaves_no_growth_that_fits(space):
    rng = np.random.default_rng(0)
    over = ((8, 0, 0, 0, 64, 1),) * 3  # every expert whole at w8a16: over T
    assert space.bytes(over) > space.target
    start = space.repair(over, rng)
    assert start is not None and space.feasible(start)
    seen = {start}
    for _ in range(150):
        child = space.mutate(list(seen)[int(rng.integers(len(seen)))], SearchConfig(), rng)
        assert space.feasible(child), child
        seen.add(child)
    assert len(seen) > 20
    for candidate in list(seen)[:40]:  # tight: no single growth of one layer still fits T
        for i in range(3):
            for move in _GROW:
                grown = space._moved(candidate[i], space.costs[i], move)
                if grown is not None:
                    trial = (*candidate[:i], grown, *candidate[i + 1 :])
                    assert not space.feasible(trial), (candidate, i, move)
    assert {g[5] for c in seen for g in c} == {0, 1}  # both schemes are explored


# -- through prune: the winner's genes pruned, its schemes quantized ---------------------------
@pytest.fixture(scope="module")
def joint(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("precision-mixed")
    moe = _save_tiny(root / "model")
    size = cast_weight_bytes(root / "model", moe, torch.float32)
    data = write_arithmetic(root / "calib.jsonl")
    common = [root / "model", "--data", data, "--criterion", "frequency", "--method", "mixed",
              "--quantize", "auto:w4a16,w8a16", "--quant-method", "rtn", "--quant-group-size", str(GROUP),
              "--quant-python", sys.executable, "--quiet"]  # fmt: skip
    evo = ["--search-data", data, "--allocation", "evo", "--population", "6", "--elites", "2",
           "--generations", "4", "--seed", "0"]  # fmt: skip
    target = _halfway(moe, size)
    out: dict = {"common": common, "evo": evo, "root": root, "target": target}
    passes = []
    observe = scoring.observe_distributed

    def counted(*args, **kwargs):
        passes.append(1)
        return observe(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stage_module, "quantize_folder", oneshot_stand_in)
        patch.setattr(scoring, "observe_distributed", counted)
        out["dry"] = run_cli(
            "prune", *common, *evo, "--output", root / "d", "--target-size", str(target), "--dry-run"
        ).output
        run_cli("prune", *common, *evo, "--output", root / "evo", "--target-size", str(target))
    folder = root / "evo"
    out.update({k: json.loads((folder / f"{k}.json").read_text()) for k in ("report", "search", "recipe")})
    out["plan"] = Plan.load(folder / "plan.json")
    out["priced"], out["passes"] = (moe, size), len(passes)
    return out


def test_prune_keeps_the_winner_genes_widths_and_schemes(joint):
    report, search, plan = joint["report"], joint["search"], joint["plan"]
    precision = report["quantization"]["precision"]
    assert search["fitness_value"] >= max(s["fitness_value"] for s in search["seeds"].values())
    assert search["predicted_bytes"] == precision["predicted_bytes"] <= joint["target"]
    assert report["quantization"]["layer_schemes"] == precision["chosen"]
    assert [precision["chosen"][str(i)] for i in range(3)] == search["chosen_schemes"]
    for lp, (w, n, v, d, width) in zip(plan.layers, search["genes"]):
        assert len(lp.dropped) == d and len(lp.novice) == v and len(lp.kept) == w + n + v
        assert sorted(lp.neurons.values()) == [width] * n  # the genes' widths, no fill moved them
    moe, size = joint["priced"]
    keeps = plan_keeps(moe, plan)  # what the saved plan keeps, read from the plan alone
    table = kept_precision_bytes(size, moe, SCHEMES, OPTIONS, 4, keeps)
    assert table.total(search["chosen_schemes"]) == search["predicted_bytes"]
    assert joint["recipe"]["config"]["sparsity"] is None  # a rerun searches again
    assert "search    evo over mixed forms" in joint["dry"]
    assert any(name.startswith("quantize only w4a16") for name in search["seeds"])  # it fits T
    assert joint["passes"] == 1  # prune reuses the search's observation of the full model


def test_a_winner_that_keeps_every_expert_whole_is_quantize_only(joint, monkeypatch):
    """The "quantize only" point of the joint mixed search is pruned as nothing removed."""
    real = stage_module.run_joint_mixed

    def whole(*args):
        return dataclasses.replace(real(*args), genes=[(8, 0, 0, 0, 64)] * 3)

    monkeypatch.setattr(stage_module, "run_joint_mixed", whole)
    monkeypatch.setattr(stage_module, "quantize_folder", oneshot_stand_in)
    root = joint["root"]
    run_cli("prune", *joint["common"], *joint["evo"], "--generations", "1", "--output", root / "only",
            "--target-size", str(joint["target"]))  # fmt: skip
    report = json.loads((root / "only" / "report.json").read_text())
    assert report["sparsity"] == 0.0 and set(report["removed_per_layer"].values()) == {0}
    assert "no expert removed" in report["quantization"]["precision"]["no_expert_removed"]
    assert report["parameters_after"] == report["parameters_before"]
    recipe = json.loads((root / "only" / "recipe.json").read_text())["config"]
    assert recipe["method"] == "mixed" and recipe["sparsity"] is None  # a rerun searches the forms again


def test_rank_r_novices_are_searched_priced_and_saved(joint):
    """With --novice-rank 1 every expert is fitted once; the winner's novices are priced with their
    factors (d + 2d values each) and saved at rank 1."""
    root = joint["root"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stage_module, "quantize_folder", oneshot_stand_in)
        run_cli("prune", *joint["common"], *joint["evo"], "--novice-rank", "1", "--output", root / "rank",
                "--target-size", str(joint["target"]))  # fmt: skip
    search = json.loads((root / "rank" / "search.json").read_text())
    plan = Plan.load(root / "rank" / "plan.json")
    assert search["novice_rank"] == 1 and plan.extra.get("novice_rank") == 1
    moe, size = joint["priced"]
    keeps = plan_keeps(moe, plan)  # what the saved plan keeps, read from the plan alone
    table = kept_precision_bytes(size, moe, SCHEMES, OPTIONS, 4, keeps, novice_rank=1)
    assert table.total(search["chosen_schemes"]) == search["predicted_bytes"] <= joint["target"]
    assert all(s["predicted_bytes"] <= joint["target"] for s in search["seeds"].values())


def test_experts_one_width_step_wide_are_searched_as_whole_novice_or_dropped(tmp_path):
    """16-wide experts on the group of 16 cannot be narrowed: the uniform mixed plan exists at no
    sparsity, and the search runs from mixed's drop and novice recipes instead."""
    save_tiny_qwen(tmp_path / "model")
    data = write_arithmetic(tmp_path / "calib.jsonl")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stage_module, "quantize_folder", oneshot_stand_in)
        run_cli("prune", tmp_path / "model", "--data", data, "--search-data", data, "--criterion", "frequency",
                "--method", "mixed", "--allocation", "evo", "--population", "4", "--elites", "2",
                "--generations", "2", "--quantize", "auto:w4a16,w8a16", "--quant-method", "rtn",
                "--quant-group-size", "16", "--quant-python", sys.executable, "--quiet",
                "--target-size", "127300", "--output", tmp_path / "out")  # fmt: skip
    search = json.loads((tmp_path / "out" / "search.json").read_text())
    assert all(n == 0 for _, n, _, _, _ in search["genes"])
    assert any(v or d for _, _, v, d, _ in search["genes"]) and search["predicted_bytes"] <= 127300
    assert {name.split()[0] for name in search["seeds"]} <= {"drop", "novice", "quantize"}


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--allocation", "uniform"], "give --allocation evo"),
        (
            ["--search-data", "DATA", "--allocation", "evo", "--target-size", "1000"],
            "no mixed plan the shares reach fits",
        ),
    ],
)
def test_what_the_joint_mixed_search_cannot_run_is_refused_before_loading(joint, extra, says):
    root = joint["root"]
    extra = [root / "calib.jsonl" if a == "DATA" else a for a in extra]
    args = [*joint["common"], "--target-size", str(joint["target"]), *extra]
    result = run_cli("prune", *args, "--output", root / "refused", ok=False)
    assert result.exit_code == 2 and says in result.output and len(result.output.strip().splitlines()) == 1
    assert not (root / "refused").exists()
