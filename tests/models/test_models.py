"""Adapters, routing capture, virtual masks and physical removal on every MoE family.

The families are those of the installed transformers, enumerated at collection time (no list of
names here): each one whose tiny model builds and whose structure discovery accepts it runs the
whole matrix; a refused family must be refused in one line (test_every_family_...)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import moeprune
from helpers import assert_logits_close, stock_from_pretrained
from moeprune.checkpoint import load_config, load_model
from moeprune.errors import MoePruneError, UnsupportedModelError
from moeprune.models import MoEModel
from moeprune.models.factory import moe_families, reference_families, save_tiny_model, tiny_config, tiny_model
from moeprune.models.families import NO_TINY, REFUSED, WORKS, family_status, family_table, supported_families
from moeprune.models.reshape import drop_experts, mask_experts
from moeprune.models.routed import RoutedOptions, override_routed

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

FAMILIES = [pytest.param(f, marks=pytest.mark.family) for f in moe_families()]
TOKENS = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))


def removal_for(moe: MoEModel, uniform: bool) -> dict[int, list[int]]:
    """Two experts per layer (balanced across routing groups); one more in the first layer if not
    uniform. Layers kept whole (hash routing) lose none: nothing may take their experts."""
    removed: dict[int, list[int]] = {}
    for j, layer in enumerate(moe.layers):
        if layer.fixed:
            removed[layer.index] = []
        elif layer.n_group > 1:
            size = layer.num_experts // layer.n_group
            removed[layer.index] = [g * size + (j % size) for g in range(layer.n_group)]
        else:
            removed[layer.index] = [1, 6] if uniform or j != len(moe.fixed_layers) else [1, 3, 6]
    return removed


def logits(model, tokens=TOKENS, attention_mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, attention_mask=attention_mask).logits


def working_model(family: str):
    """The family's tiny model, or a skip naming why the family does not run here."""
    status = family_status(family)
    if status.status != WORKS:
        pytest.skip(f"{family}: {status.status}: {status.detail}")
    return tiny_model(family)


def test_every_family_is_found_or_refused_in_one_line():
    table = family_table()
    assert len(table) == len(moe_families()) >= len(reference_families())
    for status in table:
        assert status.status in (WORKS, REFUSED, NO_TINY)
        assert "\n" not in status.detail and status.detail
        if status.status == WORKS:
            assert status.moe_layers, status
    works = {s.model_type for s in table if s.status == WORKS}
    assert set(reference_families()) <= works
    # families the issue names by hand must not be refused at the door when transformers has them
    named = {"qwen3_5_moe_text", "minimax_m2", "hunyuan_v1_moe", "phimoe", "granitemoe", "glm4_moe_lite"}
    assert named & set(moe_families()) <= works


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_finds_moe_layers_and_expert_weights(family):
    model = working_model(family)
    moe = MoEModel(model)
    config = model.config.get_text_config()  # a wrapper's language model
    assert moe.layers, "no MoE layer found"
    for layer in moe.layers:
        assert layer.num_experts == 8 and layer.hidden_size == 32
        assert 1 <= layer.top_k < layer.num_experts  # the recorded-output test checks k selections per token
        gate, up, down = layer.expert_weights(3)
        inter = layer.intermediate_size
        assert up.shape == (inter, 32) and down.shape == (32, inter)
        assert gate is None if layer.spec.layout == "ungated" else gate.shape == (inter, 32)
        x = torch.randn(5, 32)
        gate_b, up_b, down_b = layer.expert_biases(3)
        g, u = (None if gate is None else x @ gate.T), x @ up.T
        if gate_b is not None:
            g, u = g + gate_b, u + up_b
        expected = layer.activate(g, u) @ down.T + (down_b if down_b is not None else 0)
        torch.testing.assert_close(layer.expert_forward(3, x), expected, rtol=1e-5, atol=1e-6)
    # dense layers are skipped: the tiny configs make some layers dense where the family allows it
    dense_capable = {
        "qwen2_moe",
        "qwen3_moe",
        "deepseek_v2",
        "deepseek_v3",
        "glm4_moe",
        "ernie4_5_moe",
        "llama4_text",
    }
    if family in dense_capable or len(family_status(family).moe_layers) < config.num_hidden_layers:
        assert len(moe.layers) < config.num_hidden_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_expert_outputs_sum_to_the_routed_output(family):
    """Each selected expert's unweighted output, weighted by the router's own g and summed, is the block's routed output."""
    model = working_model(family)
    moe = MoEModel(model)
    reference: dict[int, torch.Tensor] = {}
    weighted = {m.index: TOKENS.numel() * m.top_k for m in moe.layers}  # selections of weighted experts
    handles = []
    for layer in moe.layers:
        if layer.spec.weight_on_input:  # Llama-4 block output = routed + shared expert

            def hook(mod, args, out, layer=layer):
                hidden = args[0].reshape(-1, args[0].shape[-1])
                reference[layer.index] = out[0] - layer.block.shared_expert(hidden)

            handles.append(layer.block.register_forward_hook(hook))
        else:

            def hook(mod, args, out, layer=layer):
                reference[layer.index] = out.detach().clone()
                hidden, index, weights = args[:3]
                weighted[layer.index] = int((index < layer.num_experts).sum())
                if layer.spec.extra_routed:  # zero experts (LongCat): not recorded, so not rebuilt
                    extras = weights * (index >= layer.num_experts).to(weights.dtype)
                    reference[layer.index] -= type(mod).forward(mod, hidden, index, extras)

            handles.append(layer.experts.register_forward_hook(hook))
    logits(model)
    for h in handles:
        h.remove()

    rebuilt = {m.index: torch.zeros_like(reference[m.index]) for m in moe.layers}
    selections = {m.index: 0 for m in moe.layers}

    def record(layer, routed):
        y, g = routed.outputs, routed.weights
        contribution = y if layer.spec.weight_on_input else g.unsqueeze(1) * y
        rebuilt[layer.index].index_add_(0, routed.rows, contribution)
        selections[layer.index] += len(routed.rows)
        assert routed.experts.tolist() == sorted(routed.experts.tolist())

    with override_routed(moe, RoutedOptions(on_layer=record)):
        logits(model)
    for layer in moe.layers:
        assert selections[layer.index] == weighted[layer.index]  # only selected (weighted) experts ran
        assert (rebuilt[layer.index] - reference[layer.index]).abs().max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_virtual_mask_equals_physical_removal(family):
    model = working_model(family)
    moe = MoEModel(model)
    full = logits(model)
    for uniform in (True, False):
        removed = removal_for(moe, uniform)
        with mask_experts(moe, removed):
            masked = logits(model)
        assert (logits(model) - full).abs().max() == 0, "mask was not undone"
        assert (masked - full).abs().max() > 1e-4, "removing experts changed nothing"
        pruned = copy.deepcopy(model)
        pruned_moe = MoEModel(pruned)
        drop_experts(pruned_moe, removed)
        assert (logits(pruned) - masked).abs().max() <= 1e-5
        for layer in pruned_moe.layers:
            assert layer.num_experts == 8 - len(removed[layer.index])
            assert layer.expert_ids == [e for e in range(8) if e not in removed[layer.index]]


@pytest.mark.parametrize("family", FAMILIES)
def test_uniform_drop_reloads_with_stock_transformers(family, tmp_path):
    model = working_model(family)
    moe = MoEModel(model)
    if moe.fixed_layers:  # tests/models/test_fixed_layers.py: moeprune's format, reloaded equal
        pytest.skip(f"{family} keeps layers whole ({moe.kept_whole_note()}): no drop keeps one count")
    drop_experts(moe, removal_for(moe, uniform=True))
    before = logits(model)
    assert moeprune.save_pretrained(model, tmp_path / "pruned") == "stock"
    reloaded = stock_from_pretrained(tmp_path / "pruned", dtype=torch.float32)
    assert MoEModel(reloaded).layers[0].num_experts == 6
    # from_pretrained maps weights from the file, at other alignments than the pruned model's own
    # allocations, which can change BLAS code paths (up to 1e-4 on Gemma-4's logits); in fresh
    # memory the same tensors run the same code, so the logits must be bit-identical
    with torch.no_grad():
        for param in reloaded.parameters():
            param.data = param.data.clone()
    assert torch.equal(logits(reloaded), before)


@pytest.mark.parametrize("family", FAMILIES)
def test_non_uniform_drop_works_in_memory_and_stock_loading_refuses_it(family, tmp_path):
    model = working_model(family)
    moe = MoEModel(model)
    if len(moe.layers) < 2:
        pytest.skip(f"{family}'s tiny model has one MoE layer: no per-layer counts to differ")
    removed = removal_for(moe, uniform=False)
    if len({len(v) for v in removed.values()}) == 1:  # group-limited: vary by whole groups instead
        first = moe.layers[0]
        removed[first.index] = []
    drop_experts(moe, removed)
    assert torch.isfinite(logits(model)).all()
    assert moeprune.save_pretrained(model, tmp_path / "out") == "moeprune"
    with pytest.raises(ValueError, match="trust_remote_code"):  # stock classes never get these shapes
        AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_removing_below_top_k_is_refused():
    moe = MoEModel(tiny_model("olmoe"))
    layer = moe.layers[0]
    with (
        pytest.raises(MoePruneError, match="fewer than its top-k"),
        mask_experts(moe, {layer.index: list(range(7))}),
    ):
        pass
    with pytest.raises(MoePruneError, match="out of range"):
        drop_experts(moe, {layer.index: [8]})


def test_unbalanced_group_removal_is_refused():
    moe = MoEModel(tiny_model("deepseek_v3"))
    layer = moe.layers[0]
    assert layer.n_group == 2
    with pytest.raises(MoePruneError, match="unbalanced"), mask_experts(moe, {layer.index: [0, 1]}):
        pass
    # mask state untouched after the refusal
    assert layer.router.weight.shape[0] == 8


def test_dense_and_unsupported_models_get_clear_errors(tmp_path):
    dense = AutoConfig.for_model(
        "llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=16
    )
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(UnsupportedModelError, match="no MoE layers"):
        load_config(tmp_path / "dense")
    if "muse_spark" not in moe_families():
        pytest.skip("this transformers has no muse_spark")
    tiny_config("muse_spark").save_pretrained(tmp_path / "unusual")
    with pytest.raises(UnsupportedModelError, match="post-expert norm") as refused:  # names the part
        load_config(tmp_path / "unusual")
    assert "\n" not in str(refused.value)
    with pytest.raises(MoePruneError, match="does not exist"):
        load_config(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MoePruneError, match="no config.json"):
        load_config(tmp_path / "empty")


def test_load_model_from_local_folder(tmp_path):
    path = save_tiny_model("qwen3_moe", tmp_path / "m")
    model, tokenizer = load_model(path)
    assert tokenizer is None
    assert_logits_close(logits(model), logits(tiny_model("qwen3_moe")))


@pytest.mark.parametrize("family", ["aria", "qwen3_vl_moe"])
def test_inspect_describes_a_wrapper_by_its_decoder(family):
    """A vision-language wrapper keeps the decoder's fields in its text config (inspect read the
    wrapper's own config and crashed on every such family)."""
    import json

    from click.testing import CliRunner

    from moeprune.cli.main import main

    if family not in supported_families():
        pytest.skip(f"{family} does not work with this transformers")  # e.g. aria on 5.16.1
    result = CliRunner().invoke(main, ["inspect", "--tiny", family, "--json"])
    assert result.exit_code == 0, result.output
    described = json.loads(result.output)
    text = tiny_model(family).config.get_text_config()
    assert described["decoder_layers"] == text.num_hidden_layers
    assert described["moe_layers"] and max(described["moe_layers"]) < text.num_hidden_layers


@pytest.mark.parametrize("family", ["minimax_m2", "granitemoe", "hunyuan_v1_moe"])
def test_inspect_tiny_works_for_families_beyond_the_eleven(family):
    from click.testing import CliRunner

    from moeprune.cli.main import main

    if family not in moe_families():
        pytest.skip(f"{family} is not in this transformers")
    result = CliRunner().invoke(main, ["inspect", "--tiny", family, "--json"])
    assert result.exit_code == 0, result.output
    assert f'"{family}"' in result.output
    refused = CliRunner().invoke(main, ["inspect", "--tiny", "llama"])  # dense: not an MoE family
    assert refused.exit_code == 2 and "not an MoE family" in refused.output


def _wrappers() -> list:
    from moeprune.models.classes import is_wrapper
    from moeprune.models.families import working_families

    return [
        pytest.param(f, marks=pytest.mark.family) for f in working_families() if is_wrapper(tiny_config(f))
    ]


@pytest.mark.parametrize("family", _wrappers())
def test_multimodal_wrapper_keeps_its_towers_and_class(family, tmp_path):
    """A wrapper's language-model experts are pruned; its vision (and audio) towers are saved bit
    for bit, and the result reloads in the same wrapper class with stock transformers."""
    model = working_model(family)
    moe = MoEModel(model)
    prefix = moe.spec.layers
    towers = {
        n: t.detach().clone()
        for n, t in model.state_dict().items()
        if not n.startswith(prefix.rsplit(".", 1)[0])
    }
    if getattr(model.config, "vision_config", None) is not None:  # Gemma-4's default config has none
        assert any("vision" in n or "visual" in n for n in towers), "no tower found beside the language model"
    drop_experts(moe, removal_for(moe, uniform=True))
    before = logits(model)
    assert moeprune.save_pretrained(model, tmp_path / "pruned") == "stock"
    reloaded = stock_from_pretrained(tmp_path / "pruned", dtype=torch.float32)
    assert type(reloaded) is type(model)
    state = reloaded.state_dict()
    assert all(torch.equal(state[n], t) for n, t in towers.items() if n in state)
    assert MoEModel(reloaded).layers[0].num_experts == 6
    assert_logits_close(logits(reloaded), before)


def test_a_layer_keeping_only_its_top_k_experts_saves_and_reloads(tmp_path):
    """75 % of 8 experts, top-2: every layer keeps 2, so its router's logits, weights and indices
    are all [T, 2]; the indices are still found (the integer tensor) and the saved result reloads
    with the logits of the masked model."""
    import moeprune
    from moeprune.config import PruneConfig
    from moeprune.criteria import compute_scores, get_criterion
    from moeprune.models import MoEModel
    from moeprune.models.factory import tiny_model
    from moeprune.surgery.planning import build_plan
    from moeprune.surgery.plans import apply_plan_physical, virtual_plan

    model = tiny_model("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[], num_experts=8, num_experts_per_tok=2)
    moe = MoEModel(model)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    scores = compute_scores("magnitude", weights=moe.layers, num_experts=[8, 8], layers=[m.index for m in moe.layers])
    plan = build_plan(moe, get_criterion("magnitude"), scores, config=PruneConfig("magnitude", 0.75))
    assert all(len(lp.kept) == 2 for lp in plan.layers)
    with torch.no_grad(), virtual_plan(moe, plan):
        masked = model(ids).logits
    apply_plan_physical(moe, plan)
    model.save_pretrained(tmp_path / "kept2")
    with torch.no_grad():
        reloaded = moeprune.load_pretrained(tmp_path / "kept2")(ids).logits
    torch.testing.assert_close(reloaded, masked, rtol=1e-5, atol=1e-5)
