"""`check_mixed_seeds`: a mixed search (evo, gradient) at a sparsity is refused before loading only
when none of mixed's recipes meets it, not when the uniform shares alone miss it. 16-wide experts
on a width step of 16 cannot be narrowed, so the uniform genes exist at no sparsity; 2 of 8 experts
per layer (sparsity 0.25) is still met exactly by the drop recipe; 0.8 by none (every layer keeps
at least its top-2 experts with weights: 0.75 at most)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moeprune.config import PruneConfig
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.search.mixed_search import check_mixed_seeds
from moeprune.surgery.mixed import MixedOptions, planned_genes
from moeprune.surgery.planning import check_config

pytestmark = pytest.mark.integration  # the CLI case prunes a tiny checkpoint


def _config(sparsity: float, allocation: str = "evo") -> PruneConfig:
    return check_config(
        PruneConfig(
            criterion="frequency",
            sparsity=sparsity,
            method="mixed",
            allocation=allocation,
            options=MixedOptions(width_multiple=16),
        )  # fmt: skip
    )


def test_a_search_runs_where_a_recipe_meets_the_sparsity_and_is_refused_where_none_does():
    moe = MoEModel(tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[]))  # 8 experts, 16 wide
    with pytest.raises(MoePruneError, match="less than one block of 16"):
        planned_genes(moe, _config(0.25, "uniform"))  # the uniform shares cannot narrow
    check_mixed_seeds(moe, _config(0.25))  # the drop recipe: 2 of 8 per layer, exactly the budget
    genes, widths = planned_genes(moe, _config(0.25))  # planned as that drop recipe
    assert [(g.whole, g.narrowed, g.novice, g.dropped) for g in genes] == [(6, 0, 0, 2)] * 3
    assert widths == [[], [], []]
    with pytest.raises(MoePruneError, match="no mixed recipe meets sparsity 0.8"):
        check_mixed_seeds(moe, replace(_config(0.25), sparsity=0.8))


def test_the_cli_runs_the_search_the_uniform_shares_cannot_reach(tmp_path):
    """Refused before loading until the recipes were asked too; now the search runs from them."""
    import json

    from helpers import run_cli, save_tiny_qwen, write_arithmetic

    save_tiny_qwen(tmp_path / "model")
    data = write_arithmetic(tmp_path / "calib.jsonl")
    run_cli("prune", tmp_path / "model", "--output", tmp_path / "out", "--data", data, "--search-data", data,
            "--criterion", "frequency", "--method", "mixed", "--allocation", "evo", "--width-multiple", "16",
            "--sparsity", "0.3", "--population", "2", "--elites", "1", "--generations", "1", "--quiet")  # fmt: skip
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    kept = report["parameters_after"]["routed_experts"] / report["parameters_before"]["routed_experts"]
    assert abs(kept - 0.7) <= 0.5 / 24  # within half a 16-wide expert of the budget (step 16)
