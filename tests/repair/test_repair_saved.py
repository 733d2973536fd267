"""A repaired uniform drop is still a stock checkpoint: `moeprune prune --repair` writes the same
tensor names and shapes as the plain drop, stock transformers loads it with the logits of
moeprune's loader and of the repaired model in memory, the experts' gate/up weights are the plain
drop's, and report.json and the model card say what was trained and the fitness before and after."""

from __future__ import annotations

import json

import pytest
import torch

import moeprune
from helpers import run_cli, stock_from_pretrained, stored_tensors
from moeprune.checkpoint import load_model
from moeprune.config import DataOptions, PruneConfig, RepairConfig, RunOptions

pytestmark = pytest.mark.integration  # prunes, saves and reloads a tiny model

PRUNE = ["--criterion", "reap", "--sparsity", "0.5", "--samples", "16", "--max-length", "64", "--quiet"]
REPAIR = ["--repair", "--repair-steps", "30", "--repair-eval-every", "10", "--repair-lr", "0.01"]
IDS = torch.tensor([list(b"def add(a, b): return a + b"), list(b"Question 3: what is 3 plus 3?")[:27]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.fixture(scope="module")
def outputs(tiny_checkpoint, data, tmp_path_factory):
    root = tmp_path_factory.mktemp("repair_saved")
    run_cli("prune", tiny_checkpoint, "--output", root / "plain", *PRUNE, "--data", data)
    run_cli("prune", tiny_checkpoint, "--output", root / "repaired", *PRUNE, *REPAIR, "--data", data)
    return root / "plain", root / "repaired"


def test_repaired_drop_stays_stock_with_the_plain_drops_tensors(outputs):
    plain, repaired = outputs
    report = json.loads((repaired / "report.json").read_text())
    assert report["format"] == "stock" and "moeprune" not in json.loads(
        (repaired / "config.json").read_text()
    )
    before, after = stored_tensors(plain), stored_tensors(repaired)
    assert {n: t.shape for n, t in before.items()} == {n: t.shape for n, t in after.items()}
    experts = [n for n in before if ".experts." in n]
    assert experts and all(torch.equal(before[n], after[n]) for n in experts if "down_proj" not in n)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert any(n.endswith("mlp.gate.weight") for n in changed), "no router was trained"
    # routers, norms, and the down projections a folded gain scaled: nothing else
    assert all(n.endswith(("mlp.gate.weight", "norm.weight", "down_proj.weight")) for n in changed), changed
    for layer in {n.split(".experts.")[0] for n in experts}:  # a layer's down projections: one gain each
        downs = [n for n in experts if n.startswith(layer + ".") and "down_proj" in n]
        ratios = torch.cat([(after[n] / before[n]).flatten() for n in downs])
        assert torch.allclose(ratios, ratios[0].expand_as(ratios), rtol=1e-5), layer
    part = report["repair"]
    assert part["kept"] and part["after"] > part["before"] and part["fitness"] == "esap"
    assert {row["part"] for row in part["trained"]} == {"routers", "gains", "norms"}
    card = (repaired / "README.md").read_text()
    assert "Repair" in card and f"{part['before']:.4f} before, {part['after']:.4f} after" in card
    recipe = json.loads((repaired / "recipe.json").read_text())
    assert recipe["config"]["repair"]["enabled"] and recipe["config"]["repair"]["steps"] == 30


def test_repaired_drop_reloads_in_stock_transformers_with_equal_logits(outputs):
    _, repaired = outputs
    assert torch.equal(_logits(stock_from_pretrained(repaired)), _logits(moeprune.load_pretrained(repaired)))


def test_the_api_repairs_as_the_cli_and_its_save_reloads_exactly(tiny_checkpoint, data, outputs, tmp_path):
    _, repaired = outputs
    model, tokenizer = load_model(tiny_checkpoint)
    config = PruneConfig(
        "reap", 0.5, repair=RepairConfig(enabled=True, steps=30, eval_every=10, learning_rate=0.01)
    )
    result = moeprune.prune(model, config, data=str(data), tokenizer=tokenizer,
                            options=DataOptions(samples=16, max_length=64), run=RunOptions(progress=False))  # fmt: skip
    assert result.report.repair is not None and result.report.repair.kept
    moeprune.save_pretrained(model, tmp_path / "api")
    assert torch.equal(_logits(stock_from_pretrained(tmp_path / "api")), _logits(model))
    assert torch.equal(_logits(model), _logits(moeprune.load_pretrained(repaired)))  # the CLI's result


def test_the_dry_run_says_what_repair_will_train(tiny_checkpoint, data, tmp_path):
    result = run_cli("prune", tiny_checkpoint, "--output", tmp_path / "out", *PRUNE, *REPAIR, "--data", data,
                     "--dry-run")  # fmt: skip
    line = next(x for x in result.output.splitlines() if x.startswith("repair"))
    assert "routers, gains, novices, norms; at most 30 steps (lr 0.01" in line and not (tmp_path / "out").exists()
