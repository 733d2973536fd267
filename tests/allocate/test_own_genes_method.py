"""A method with its own search genes is one module. This file is that module: `quarters` declares
per-layer forms as its genes (`Method.genes = FORMS`) and its own options (a quarter of each
layer's experts made novices by default) and plan builder; nothing else names it. The uniform
allocation plans it, and the searches registered for (evo, forms) and (gradient, forms) run it
(search/registry.py `search_for`), through the one verb `moeprune.prune`. With `--quantize auto:`
(`moeprune prune`, the file-level job) it takes its schemes per layer: at a given sparsity its
`planned_keeps` price the choice, without one the joint search picks its forms and schemes
together; llm-compressor's oneshot is stood in for (tests/helpers.py `oneshot_stand_in`: the
quant_env tests check the bytes it writes)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace

import pytest
import torch
from test_observe import calibration
from test_search import _data

import moeprune
from helpers import oneshot_stand_in, prune_auto_halfway, run_cli, save_tiny_qwen, write_arithmetic
from moeprune.config import PruneConfig, SearchConfig, setting
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.plan import Plan
from moeprune.quantize import stage as stage_module
from moeprune.quantize.keeps import kept_precision_bytes, plan_keeps
from moeprune.quantize.options import QuantizeOptions
from moeprune.search.registry import search_for
from moeprune.shards.weight_bytes import cast_weight_bytes
from moeprune.surgery import METHODS
from moeprune.surgery.mixed import MixedOptions, plan_mixed
from moeprune.surgery.planning import check_config
from moeprune.surgery.registry import FORMS, PlanRequest

pytestmark = pytest.mark.integration  # small prunes of a tiny model: three in memory, two quantizing

NAME = "quarters"


@dataclass(frozen=True)
class QuarterOptions(MixedOptions):
    """Its own default: a quarter of each layer's experts become novices."""

    mixed_novice: float = setting(
        0.25, "quarters: share of each layer's experts made novices.", minimum=0, maximum=1
    )


def quarters_plan(request: PlanRequest) -> Plan:
    """The forms the genes say (a search's, else the uniform shares), labelled as this method."""
    plan = plan_mixed(request)  # the forms' plan arithmetic is the mixed method's (surgery/mixed.py)
    plan.method = request.method
    plan.extra["quarters"] = {"searched": request.removed is not None}
    return plan


@pytest.fixture
def quarters(monkeypatch):
    """Registered for this test only (the registry is global; the generated docs list its entries).
    Its size hooks (feasible, planned bytes, target steps) are the forms' ones."""
    base = METHODS.get("mixed")
    spec = replace(
        base, name=NAME, help="a quarter novices (a test method)", options=QuarterOptions, fn=quarters_plan
    )
    assert spec.genes == FORMS
    monkeypatch.setitem(METHODS._specs, NAME, spec)


def _prune(allocation: str, search: SearchConfig | None = None):
    config = PruneConfig("reap", 0.4, allocation=allocation, method=NAME, search=search or SearchConfig())
    model = tiny_model("qwen3_moe")
    result = moeprune.prune(
        model,
        config,
        data=calibration((20, 17, 15, 12)),
        search_data=_data(),
        run=moeprune.RunOptions(progress=False),
    )
    return config, result


def test_uniform_plans_its_own_default(quarters):
    config, result = _prune("uniform")
    assert search_for(check_config(config)) is None
    plan = result.plan
    assert (
        plan.method == NAME and result.report.method == NAME and plan.extra["quarters"] == {"searched": False}
    )
    assert plan.extra["mixed_options"]["mixed_novice"] == 0.25  # its options class, resolved once
    assert all(len(lp.novice) == 2 for lp in plan.layers)  # a quarter of 8 experts per layer


@pytest.mark.parametrize(
    ("allocation", "search"),
    [
        ("evo", SearchConfig(population=4, elites=2, generations=2, seed=3)),
        ("gradient", SearchConfig(steps=3, seed=3)),
    ],
)
def test_searches_over_its_forms(quarters, allocation, search):
    config, result = _prune(allocation, search)
    entry = search_for(check_config(config))
    assert entry is not None and (entry.allocation, entry.genes) == (allocation, FORMS)
    plan, doc = result.plan, result.search
    assert plan.method == NAME and plan.extra["quarters"] == {"searched": True}
    assert doc is not None and result.report.search is not None
    # the plan is the searched genes: its per-layer forms are the ones search.json reports
    assert len(plan.extra["mixed_genes"]) == len(plan.layers)
    for lp, g in zip(plan.layers, plan.extra["mixed_genes"]):
        assert len(lp.novice) == g["novice"] and len(lp.dropped) == g["dropped"]


SCHEMES = ("w4a16", "w8a16")
GROUP = 8  # divides the tiny model's hidden size (32) and the narrowed widths (multiples of 8 of 32)


def _quantized(root, monkeypatch, *args) -> tuple[list, int, dict, MoEModel]:
    """`moeprune prune --method quarters --quantize auto:w4a16,w8a16 ARGS` of a tiny 3-layer
    qwen3_moe (8 experts 32 wide), the target halfway between every layer at w4a16 and at w8a16
    (its dry run's figures); returns the common arguments, the target, report.json and the model."""
    model, _ = save_tiny_qwen(root / "model", moe_intermediate_size=32)
    data = write_arithmetic(root / "calib.jsonl")
    quantize = f"--quantize auto:{','.join(SCHEMES)} --quant-method rtn --quant-group-size {GROUP}"
    common = [root / "model", "--data", data, "--criterion", "frequency", "--method", NAME, *quantize.split()]
    common += ["--quant-python", sys.executable, *args]
    monkeypatch.setattr(stage_module, "quantize_folder", oneshot_stand_in)
    target, _ = prune_auto_halfway(common, root / "out")
    return common, target, json.loads((root / "out" / "report.json").read_text()), MoEModel(model)


def _table_total(root, moe: MoEModel, plan: Plan, chosen: dict[str, str]) -> int:
    """The bytes of the saved plan's keeps at the chosen schemes, priced from the plan alone."""
    size = cast_weight_bytes(root / "model", moe, torch.float32)
    options = QuantizeOptions(SCHEMES[0], "rtn", GROUP, candidates=SCHEMES)
    table = kept_precision_bytes(size, moe, SCHEMES, options, 4, plan_keeps(moe, plan))
    return table.total([chosen[str(lp.layer)] for lp in plan.layers])


def test_quantize_auto_at_a_sparsity_prices_its_planned_keeps(quarters, tmp_path, monkeypatch):
    _, target, report, moe = _quantized(tmp_path, monkeypatch, "--sparsity", "0.4")
    plan = Plan.load(tmp_path / "out" / "plan.json")
    precision = report["quantization"]["precision"]
    assert plan.method == NAME and plan.extra["quarters"] == {"searched": False}
    assert all(len(lp.novice) == 2 for lp in plan.layers)  # its own default, a quarter novices
    assert report["quantization"]["layer_schemes"] == precision["chosen"]
    assert set(precision["chosen"].values()) == set(SCHEMES)  # the target leaves a real choice
    # the choice's bytes are those of what the plan keeps (its uniform plan: exact), within T
    assert _table_total(tmp_path, moe, plan, precision["chosen"]) == precision["predicted_bytes"] <= target


def test_quantize_auto_searches_its_forms_with_the_schemes(quarters, tmp_path, monkeypatch):
    settings = "--allocation evo --population 4 --elites 2 --generations 2 --seed 0"
    evo = ["--search-data", tmp_path / "calib.jsonl", *settings.split()]
    common, target, report, moe = _quantized(tmp_path, monkeypatch, *evo)
    out = tmp_path / "out"
    plan, search = Plan.load(out / "plan.json"), json.loads((out / "search.json").read_text())
    precision = report["quantization"]["precision"]
    assert plan.method == NAME and plan.extra["quarters"] == {"searched": True}
    assert report["quantization"]["layer_schemes"] == precision["chosen"]
    assert [precision["chosen"][str(lp.layer)] for lp in plan.layers] == search["chosen_schemes"]
    for lp, (w, n, v, d, _) in zip(plan.layers, search["genes"]):  # the plan is the searched forms
        assert len(lp.dropped) == d and len(lp.novice) == v and len(lp.kept) == w + n + v
    assert _table_total(tmp_path, moe, plan, precision["chosen"]) == search["predicted_bytes"] <= target
    dry = run_cli("prune", *common, "--output", tmp_path / "d", "--target-size", target, "--dry-run").output
    assert "evo over mixed forms" in dry
