"""Expert-parallel degrees: the EP sizes a result's counts allow (inspect, the summary), and
`prune --ep-size N` on a tiny deepseek_v4 (a family whose vLLM 0.33 classes assert that every
layer's expert count divides the EP size: its spec says `ep_divisible`) and a tiny qwen3_moe
(whose vLLM classes do not: the plan is left as it is).

What must hold: `ep_sizes` lists exactly the common divisors up to its limit; for deepseek_v4,
`--ep-size 4` makes 4 the expert multiple (a quarter of 8 experts, 2 per prunable layer, is then
impossible, while without it the same prune runs), a result keeps multiples of 4 and says
"EP sizes 1, 2, 4"; a degree the input's counts do not allow, or a multiple it does not divide, is
refused in one line (exit 2) before anything is written; for qwen3_moe the same flag changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_cli, save_tiny_qwen
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models import MoEModel
from moeprune.models.expert_parallel import MAX_EP_SIZE, ep_sizes
from moeprune.models.factory import tiny_model

pytestmark = pytest.mark.integration  # prunes tiny checkpoints end to end


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ep-size")
    tokenizer = byte_tokenizer()
    v4 = tiny_model("deepseek_v4", vocab_size=len(tokenizer))
    assert [m.num_experts for m in MoEModel(v4).layers] == [8] * 4
    assert MoEModel(v4).spec.ep_divisible
    v4.save_pretrained(root / "v4")
    tokenizer.save_pretrained(root / "v4")
    qwen, _ = save_tiny_qwen(root / "qwen")
    assert not MoEModel(qwen).spec.ep_divisible
    return {"v4": root / "v4", "qwen": root / "qwen", "root": root}


def test_ep_sizes_are_the_common_divisors():
    assert ep_sizes([8, 8, 8]) == [1, 2, 4, 8]
    assert ep_sizes([None, 6, 4, None]) == [1, 2]  # dense layers (None) do not count
    assert ep_sizes([5, 7]) == [1]
    assert ep_sizes([128, 256]) == [1, 2, 4, 8, 16, 32, 64]  # up to MAX_EP_SIZE
    assert MAX_EP_SIZE == 64 and ep_sizes([None]) == []


def _prune(model: Path, out: Path, *flags, ok: bool = True):
    return run_cli("prune", model, "--output", out, "--criterion", "random", *flags, ok=ok)


def _refused_before_writing(result, out: Path, *words: str) -> None:
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert all(w in result.output for w in words), result.output
    assert not out.exists()


def test_ep_size_makes_the_expert_multiple_for_a_family_that_needs_it(models):
    root = models["root"]
    # layer 0 routes by token id (hash routing): kept whole, 8 experts; the others keep 6 without EP
    plain = _prune(models["v4"], root / "plain", "--sparsity", "0.25")
    assert "expert parallel EP sizes 1, 2 " in plain.output
    refused = _prune(models["v4"], root / "quarter", "--sparsity", "0.25", "--ep-size", "4", ok=False)
    assert (
        refused.exit_code == 2
        and "multiples of [4, 4, 4, 4]" in refused.output
        and not (root / "quarter").exists()
    )
    done = _prune(models["v4"], root / "half", "--sparsity", "0.5", "--ep-size", "4")
    assert "expert parallel EP sizes 1, 2, 4 " in done.output
    plan = json.loads((root / "half" / "plan.json").read_text())
    assert [len(lp["kept"]) for lp in plan["layers"]] == [8, 4, 4, 4]
    recipe = json.loads((root / "half" / "recipe.json").read_text())
    assert recipe["config"]["expert_multiple"] == 4 and recipe["config"]["ep_size"] == 4
    assert "expert parallel: EP sizes 1, 2, 4" in run_cli("inspect", root / "half").output


def test_a_degree_the_input_does_not_allow_is_refused_before_loading(models):
    out = models["root"] / "three"
    refused = _prune(models["v4"], out, "--sparsity", "0.5", "--ep-size", "3", ok=False)
    _refused_before_writing(refused, out, "8 experts", "--ep-size", "EP size among [1, 2, 4, 8]")


def test_a_multiple_the_degree_does_not_divide_is_refused(models):
    out = models["root"] / "two"
    refused = _prune(
        models["v4"], out, "--sparsity", "0.5", "--ep-size", "4", "--expert-multiple", "2", ok=False
    )
    _refused_before_writing(refused, out, "--expert-multiple", "--ep-size")


def test_ep_size_leaves_other_families_plans_alone(models):
    root = models["root"]
    done = _prune(models["qwen"], root / "qwen-out", "--sparsity", "0.25", "--ep-size", "4")
    plan = json.loads((root / "qwen-out" / "plan.json").read_text())
    assert [len(lp["kept"]) for lp in plan["layers"]] == [6, 6, 6]
    assert "expert parallel EP sizes 1, 2, 3, 6 " in done.output
