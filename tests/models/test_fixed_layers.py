"""Layers that cannot lose an expert are kept whole: DeepSeek-V4's hash layers route by token id.

DeepSeek-V4's first `mlp_layer_types == "hash_moe"` layers send each token to the experts a fixed
token -> experts table names; removing one would leave those tokens unrouted. Discovery marks
them from the router's signature (its forward takes `input_ids`), every allocation spreads the
budget over the other layers, the result (different counts per layer) is written in moeprune's
format and reloads with the masked original's logits, and inspect, plan.json and the report say
which layers stayed whole and why. Before, the whole family was refused.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import moeprune
from helpers import run_cli
from moeprune.allocate.limits import expert_allocation, layer_limits
from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.errors import MoePruneError, UnsupportedModelError
from moeprune.models import MoEModel
from moeprune.models.factory import moe_families, tiny_model
from moeprune.models.reshape import drop_experts, mask_experts
from moeprune.surgery.planning import build_plan

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif("deepseek_v4" not in moe_families(), reason="this transformers has no deepseek_v4"),
]

HASH = "routes by token id (hash routing)"


def hash_model(mlp_layer_types=("hash_moe", "moe", "moe", "moe"), vocab_size: int = 96, seed: int = 0):
    """A tiny DeepSeek-V4 whose hash layers send each token to two distinct random experts (the
    factory randomises floating tensors only: its zero table would send every token to expert 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(
            "deepseek_v4",
            seed=seed,
            mlp_layer_types=list(mlp_layer_types),
            num_hidden_layers=len(mlp_layer_types),
            vocab_size=vocab_size,
        )
    generator = torch.Generator().manual_seed(seed + 1)
    for layer in MoEModel(model).fixed_layers:
        table = layer.router.tid2eid
        rows = [
            torch.randperm(layer.num_experts, generator=generator)[: table.shape[1]]
            for _ in range(len(table))
        ]
        table.copy_(torch.stack(rows))
    return model


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(0))


def test_hash_layers_are_found_from_the_router_signature_and_kept_whole():
    model = hash_model(("hash_moe", "hash_moe", "moe", "moe"))
    moe = MoEModel(model)
    assert [m.index for m in moe.layers] == [0, 1, 2, 3]
    assert [m.index for m in moe.fixed_layers] == [0, 1]  # the config's hash_moe layers
    assert all(HASH in (m.kept_whole or "") for m in moe.fixed_layers)
    assert moe.kept_whole_note().startswith("layers 0-1 route by token id (hash routing): kept whole")
    # the family's structure is read off a learned router: its selection bias, which hash routers lack
    assert moe.spec.selection_bias == "e_score_correction_bias"
    assert [p for _, p, _ in moe.layers[0].routing_tensors()] == ["weight"]
    limits = layer_limits(moe)
    assert limits.caps[:2] == [0, 0] and limits.caps[2:] == [6, 6]
    assert limits.budget(0.5) == 8  # half of the prunable layers' 16 experts, not of all 32


def test_any_router_taking_input_ids_is_kept_whole_whatever_the_family():
    """Decided by the signature, not the family name: give olmoe's first router a token-id forward."""
    model = tiny_model("olmoe")
    moe = MoEModel(model)
    router = moe.layers[0].router

    class TokenRouter(type(router)):  # type: ignore[misc]
        def forward(self, hidden_states, input_ids=None):  # noqa: ARG002 - the signature is the point
            return super().forward(hidden_states)

    router.__class__ = TokenRouter
    assert [m.index for m in moe.fixed_layers] == [moe.layers[0].index]
    assert layer_limits(moe).caps[0] == 0 and all(c > 0 for c in layer_limits(moe).caps[1:])


def test_every_layer_hashed_is_refused_in_one_line():
    with pytest.raises(UnsupportedModelError, match="every MoE layer's router routes by token id") as refused:
        MoEModel(hash_model(("hash_moe", "hash_moe")))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("allocation", ["uniform", "global"])
def test_allocations_never_remove_experts_of_hash_layers(allocation):
    moe = MoEModel(hash_model(("hash_moe", "hash_moe", "moe", "moe")))
    crit = get_criterion("magnitude")
    scores = compute_scores("magnitude", weights=moe.layers)
    for sparsity in (0.25, 0.5, 0.75):
        removed = expert_allocation(moe, crit, scores, sparsity, allocation, layer_limits(moe))
        assert removed[:2] == [0, 0]
        assert sum(removed) == round(sparsity * 16)  # the whole budget, spread over layers 2 and 3
        plan = build_plan(moe, crit, scores, config=PruneConfig("magnitude", sparsity, allocation=allocation))
        assert [len(plan.layer(i).kept) for i in (0, 1)] == [8, 8]
        assert set(plan.extra["kept_whole"]) == {"0", "1"}
        assert HASH in plan.extra["kept_whole"]["0"]
    if allocation == "uniform":
        assert expert_allocation(moe, crit, scores, 0.5, allocation, layer_limits(moe)) == [0, 0, 4, 4]


def test_masks_and_drops_refuse_a_hash_layer():
    moe = MoEModel(hash_model())
    with pytest.raises(MoePruneError, match="decoder layer 0 is kept whole"), mask_experts(moe, {0: [1]}):
        pass
    with pytest.raises(MoePruneError, match="decoder layer 0 is kept whole"):
        drop_experts(moe, {0: [1]})
    assert moe.layers[0].num_experts == 8


def test_neuron_methods_refuse_in_one_line():
    moe = MoEModel(hash_model())
    crit = get_criterion("magnitude")
    with pytest.raises(MoePruneError, match="cannot keep a layer whole") as refused:
        build_plan(
            moe,
            crit,
            compute_scores("magnitude", weights=moe.layers),
            config=PruneConfig("magnitude", 0.3, method="neurons"),
        )
    assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from moeprune.data.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    folder = tmp_path_factory.mktemp("hash") / "in"
    hash_model(vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    path = tmp_path_factory.mktemp("hashdata") / "data.jsonl"
    rows = [
        {"text": f"the quick brown fox {i} jumps over the lazy dog; def f(x): return x * {i}\n" * 2}
        for i in range(12)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


@pytest.mark.parametrize(
    "method, allocation", [("drop", "uniform"), ("drop", "global"), ("novice", "global")]
)
def test_prune_save_reload_equals_the_masked_original(checkpoint, calibration, tmp_path, method, allocation):
    out = tmp_path / "out"
    result = run_cli("prune", checkpoint, "--output", out, "--criterion", "frequency", "--sparsity", "0.5",
                     "--method", method, "--allocation", allocation, "--data", calibration, "--samples", "8")  # fmt: skip
    assert "fixed layers    layer 0 routes by token id (hash routing): kept whole" in result.output
    plan = json.loads((out / "plan.json").read_text())
    first = plan["layers"][0]
    assert (
        first["layer"] == 0
        and first["kept"] == list(range(8))
        and not first["dropped"]
        and not first["novice"]
    )
    assert sum(len(lp["dropped"]) + len(lp["novice"]) for lp in plan["layers"]) == 12  # 50% of layers 1-3
    assert HASH in plan["extra"]["kept_whole"]["0"]
    report = json.loads((out / "report.json").read_text())
    assert report["format"] == "moeprune" and report["kept_whole"] == plan["extra"]["kept_whole"]
    assert "layer 0 routes by token id (hash routing): kept whole" in (out / "report.md").read_text()
    assert (
        "- Fixed layers: layer 0 routes by token id (hash routing): kept whole"
        in (out / "README.md").read_text()
    )
    original = moeprune.load_pretrained(checkpoint).eval()
    ids = torch.randint(3, original.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    reloaded = moeprune.load_pretrained(out).eval()
    assert MoEModel(reloaded).layers[0].num_experts == 8
    if method == "drop":
        with mask_experts(MoEModel(original), {lp["layer"]: lp["dropped"] for lp in plan["layers"]}):
            expected = logits(original, ids)
        assert torch.equal(logits(reloaded, ids), expected)
    else:  # novices: every weight-holding expert of layer 0 is still there, bit for bit
        assert torch.equal(
            reloaded.model.layers[0].mlp.experts.down_proj, original.model.layers[0].mlp.experts.down_proj
        )
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert torch.equal(logits(stock, ids), logits(reloaded, ids))


def test_target_size_keeps_hash_layers_whole(checkpoint, calibration, tmp_path):
    out = tmp_path / "out"
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    run_cli("prune", checkpoint, "--output", out, "--criterion", "frequency", "--target-size", str(size - 40_000),
            "--data", calibration, "--samples", "8")  # fmt: skip
    plan = json.loads((out / "plan.json").read_text())
    assert (
        plan["layers"][0]["kept"] == list(range(8)) and sum(len(lp["dropped"]) for lp in plan["layers"]) > 0
    )


def test_inspect_and_refusals_say_which_layers_are_kept_whole(checkpoint, calibration, tmp_path):
    shown = run_cli("inspect", checkpoint).output
    assert "layer 0 routes by token id (hash routing): kept whole" in shown
    info = json.loads(run_cli("inspect", checkpoint, "--json").output)
    assert list(info["kept_whole"]) == ["0"]
    narrowed = run_cli("prune", checkpoint, "--output", tmp_path / "nl", "--no-load", "--criterion", "frequency",
                       "--sparsity", "0.5", "--method", "neurons", "--data", calibration, ok=False)  # fmt: skip
    assert narrowed.exit_code == 2 and "cannot keep a layer whole (layer 0 routes by token id" in narrowed.output
    assert len(narrowed.output.strip().splitlines()) == 1 and not (tmp_path / "nl").exists()


def test_no_load_keeps_hash_layers_whole_and_writes_moeprune_format(checkpoint, calibration, tmp_path):
    """The shards rewritten without loading: the same plan as in memory (data observed layer by
    layer), layer 0 copied whole, the result reloading to the masked original's logits."""
    plans = {}
    for name, flags in (("memory", []), ("streamed", ["--no-load"])):
        run_cli("prune", checkpoint, "--output", tmp_path / name, "--criterion", "frequency", "--sparsity", "0.5",
                "--data", calibration, "--samples", "8", "--quiet", *flags)  # fmt: skip
        plans[name] = json.loads((tmp_path / name / "plan.json").read_text())
    assert [lp["kept"] for lp in plans["streamed"]["layers"]] == [lp["kept"] for lp in plans["memory"]["layers"]]
    assert plans["streamed"]["layers"][0]["kept"] == list(range(8))
    assert HASH in plans["streamed"]["extra"]["kept_whole"]["0"]
    report = json.loads((tmp_path / "streamed" / "report.json").read_text())
    assert report["format"] == "moeprune" and report["kept_whole"] == plans["streamed"]["extra"]["kept_whole"]
    original = moeprune.load_pretrained(checkpoint).eval()
    reloaded = moeprune.load_pretrained(tmp_path / "streamed").eval()
    with mask_experts(MoEModel(original), {lp["layer"]: lp["dropped"] for lp in plans["streamed"]["layers"]}):
        expected = logits(original, IDS)
    assert torch.equal(logits(reloaded, IDS), expected)
