"""Low-rank novices (`--method novice --novice-rank 2`) served by vLLM's CPU build as moeprune loads them.

Tiny models as in test_serve_vllm.py, pruned by moeprune's own API with rank-2 novices: Qwen3-MoE
with the uniform allocation and with the global one (different expert counts per layer), and
DeepSeek-V3 (sigmoid routing, selection bias, routed_scaling_factor, a shared expert) uniform.
One subprocess of `.venv-vllm` serves all three in turn (test_serve_vllm.py's driver) and tries
one damaged copy (a novice's factor removed). vLLM's greedy tokens must be
moeprune.load_pretrained's (a differing token only at a tie of transformers' logits, as there) and
its top-5 logprobs transformers' within LOGPROB_ATOL; the low-rank part must matter (the same
results with every novice's U zeroed move those logprobs by far more than LOGPROB_ATOL), and
vLLM holds exactly what the checkpoint stores (novices: d + 2 d R each), as report.json says.

Stock transformers with trust_remote_code loads low-rank results with moeprune's logits exactly:
tests/surgery/test_lowrank.py (test_saved_low_rank_novices_reload_exactly_and_with_stock_transformers).
The novice table itself (serve/vllm/novices.py imports no vLLM) is checked here against the
loader's formula on hand-made numbers, without vLLM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_serve_vllm import (  # noqa: F401  (vllm_python: the fixture)
    DRIVER,
    LOGPROB_ATOL,
    NEW_TOKENS,
    PROMPTS,
    SERVING_MODULES,
    TOP_LOGPROBS,
    VLLM_OPTIONS,
    _greedy_and_logprobs,
    _reference,
    _stored,
    code_calibration,
    drive_vllm,
    vllm_python,
)

import moeprune
from moeprune.config import PruneConfig, RunOptions
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.job import PruneRequest, prune_checkpoint
from moeprune.models.lowrank import LowRankNovice
from moeprune.serve.moeprune_format import FormatError, LayerStructure

RANK = 2
CASES = {  # name: (family, prune settings)
    "qwen3_moe-uniform": ("qwen3_moe", dict(criterion="mone", allocation="uniform")),
    "qwen3_moe-global": ("qwen3_moe", dict(criterion="aimer", allocation="global")),
    "deepseek_v3-uniform": ("deepseek_v3", dict(criterion="mone", allocation="uniform")),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Path]:
    """Every case pruned with rank-2 novices at 25 % (moeprune.job.prune_checkpoint)."""
    root = tmp_path_factory.mktemp("serve_lowrank")
    tokenizer = byte_tokenizer()
    options = code_calibration(root)
    made = {}
    for family in {family for family, _ in CASES.values()}:
        _reference(family, root / family, len(tokenizer))
        tokenizer.save_pretrained(root / family)
    for name, (family, settings) in CASES.items():
        config = PruneConfig(**settings, sparsity=0.25, method="novice", options={"novice_rank": RANK})
        made[name] = root / name
        prune_checkpoint(PruneRequest(root / family, made[name], config, data=options, run=RunOptions(progress=False)))
        if family == "deepseek_v3":  # transformers-written configs leave DeepSeek-V3's routing implicit
            path = made[name] / "config.json"
            written = json.loads(path.read_text())
            assert written.pop("scoring_func") == "sigmoid" and written.pop("topk_method") == "noaux_tc"
            path.write_text(json.dumps(written, indent=2))
    made["damaged"] = _without_a_factor(made["qwen3_moe-uniform"], root / "damaged")
    return made


def _without_a_factor(source: Path, folder: Path) -> Path:
    """`source` with the first novice's novice_v tensor taken out."""
    shutil.copytree(source, folder)
    for shard in folder.glob("*.safetensors"):
        tensors = load_file(shard)
        names = sorted(n for n in tensors if n.endswith(".novice_v"))
        if names:
            del tensors[names[0]]
            save_file(tensors, shard, metadata={"format": "pt"})
            return folder
    raise AssertionError(f"{source} stores no novice_v")


@pytest.fixture(scope="module")
def served(vllm_python, results, tmp_path_factory) -> dict:  # noqa: F811
    """vLLM's tokens, logprobs, allocation and imports for every case, from one subprocess."""
    work = tmp_path_factory.mktemp("vllm_lowrank")
    spec = {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "logprobs": TOP_LOGPROBS,
            "models": [[str(results[name]), VLLM_OPTIONS.get(family, {})] for name, (family, _) in CASES.items()],
            "refuse": [str(results["damaged"])]}  # fmt: skip
    return drive_vllm(vllm_python, work, spec, DRIVER)


@pytest.mark.vllm
def test_results_hold_rank_2_novices(results):
    for name in CASES:
        layers = json.loads((results[name] / "config.json").read_text())["moeprune"]["layers"]
        assert {entry.get("novice_rank") for entry in layers if entry["novice"]} == {RANK}, name
        factors = [t for shard in results[name].glob("*.safetensors") for n, t in load_file(shard).items()
                   if n.endswith((".novice_u", ".novice_v"))]  # fmt: skip
        assert factors and all(t.shape[1] == RANK for t in factors)
        if name.endswith("global"):
            novices = {len(entry["novice"]) for entry in layers}  # router positions stay: novices replace
            assert len(novices) > 1, "global made as many novices in every layer"


def _compare(name: str, result: dict, model) -> tuple[float, int]:
    """Greedy tokens (up to a tie) and top-5 logprobs of vLLM against `model`: the worst
    logprob difference, and the number of prompts whose greedy tokens are exactly equal."""
    worst, equal = 0.0, 0
    for prompt, tokens, steps in zip(PROMPTS, result["tokens"], result["logprobs"]):
        assert len(tokens) == NEW_TOKENS
        greedy, reference = _greedy_and_logprobs(model, prompt, tokens)
        equal += tokens == greedy
        for t, (token, top) in enumerate(zip(tokens, steps)):
            for candidate, logprob in top.items():
                worst = max(worst, abs(logprob - float(reference[t, int(candidate)])))
            if tokens[: t + 1] != greedy[: t + 1]:
                gap = float(reference[t].max() - reference[t, token])
                assert gap <= 2 * LOGPROB_ATOL, (
                    f"{name}, prompt {prompt}: vLLM generated {tokens}, moeprune {greedy}; at step {t} "
                    f"transformers prefers its token by {gap:.4f} (not a tie)"
                )
                break
    return worst, equal


@pytest.mark.vllm
@pytest.mark.parametrize("name", CASES)
def test_vllm_serves_low_rank_novices_like_moeprune(name, served, results):
    path = results[name]
    result = served["models"][str(path)]
    assert result["architecture"] == json.loads((path / "config.json").read_text())["architectures"][0]
    assert result["architecture"].startswith("MoePrune")
    worst, equal = _compare(name, result, moeprune.load_pretrained(path))
    assert worst <= LOGPROB_ATOL, f"{name}: vLLM's logprobs differ from moeprune's by {worst:.2e}"
    # the low-rank part is served: without it (every novice's U zeroed) moeprune's logprobs move far
    constant = moeprune.load_pretrained(path)
    with torch.no_grad():
        zeroed = [p.zero_() for n, p in constant.named_parameters() if n.endswith("novice_u")]
    assert zeroed, f"{name}: moeprune's loader holds no low-rank factors"
    moved = _compare_logprobs(result, constant)
    assert moved > 50 * LOGPROB_ATOL, f"{name}: the low-rank part moves the logprobs by {moved:.2e} only"
    counts = result["routing"]
    assert counts["layer_forwards"] > 0 and counts["routings"] == counts["layer_forwards"], counts
    print(f"{name}: greedy tokens equal on {equal}/{len(PROMPTS)} prompts (the rest at a tie); worst "
          f"|logprob difference| {worst:.2e}; without the low-rank part {moved:.2e}")  # fmt: skip


def _compare_logprobs(result: dict, model) -> float:
    """The worst |vLLM top-5 logprob - model's log-softmax| on vLLM's own tokens (teacher-forced)."""
    worst = 0.0
    for prompt, tokens, steps in zip(PROMPTS, result["tokens"], result["logprobs"]):
        _, reference = _greedy_and_logprobs(model, prompt, tokens)
        for t, top in enumerate(steps):
            worst = max(worst, *(abs(lp - float(reference[t, int(c)])) for c, lp in top.items()))
    return worst


@pytest.mark.vllm
@pytest.mark.parametrize("name", CASES)
def test_vllm_holds_what_the_checkpoint_stores(name, served, results):
    """No padding anywhere (novices keep every expert at full width): vLLM holds the stored
    parameters, low-rank factors included, and report.json's figure for it."""
    from moeprune.serve.vllm.layout import served_parameter_count

    path = results[name]
    allocated = served["models"][str(path)]["allocated"]
    assert allocated is not None, "the driver did not see vLLM load this model"
    held = allocated["parameters"] - allocated["vocab_padding"]
    assert held == served_parameter_count(path) == _stored(path) <= 1.05 * _stored(path)
    assert allocated["width_group_blocks"] == 0
    # report.json counts model.parameters(): transformers keeps DeepSeek-V3's selection bias as a buffer
    biases = sum(t.numel() for shard in path.glob("*.safetensors") for n, t in load_file(shard).items()
                 if n.endswith("e_score_correction_bias"))  # fmt: skip
    assert json.loads((path / "report.json").read_text())["serving"]["vllm_parameters"] + biases == held


@pytest.mark.vllm
def test_vllm_refuses_a_low_rank_result_missing_a_factor(served, results):
    message = served["refused"][str(results["damaged"])]
    assert message is not None, "vLLM served a result whose novice lost its novice_v"
    assert "lacks novice tensors" in message and "novice_v" in message, message


@pytest.mark.vllm
def test_serving_low_rank_novices_imports_only_serving_code(served):
    modules = set(served["moeprune_modules"])
    assert "moeprune.serve.vllm.novices" in modules and modules <= SERVING_MODULES, sorted(modules - SERVING_MODULES)


# ----------------------------------------------------------------------------- without vLLM
def _table(rank: int, hidden: int = 4):
    from moeprune.serve.vllm.novices import NoviceTable

    # five router positions, novices at 1 and 3
    layer = LayerStructure(0, (0, 1, 2, 3, 4), (8, None, 8, None, 8), novice_rank=rank)
    return NoviceTable(layer, hidden, torch.float64)


@pytest.mark.unit
def test_novice_table_adds_the_gated_low_rank_map_of_picked_novices_only():
    """sum over picked novices of g * (c + U V^T h), as moeprune's loader computes it (LowRankNovice)."""
    g = torch.Generator().manual_seed(0)
    table = _table(RANK)
    novices = {p: LowRankNovice(*(torch.randn(s, generator=g, dtype=torch.float64) for s in ((4,), (4, 2), (4, 2))))
               for p in (1, 3)}  # fmt: skip
    for p, novice in novices.items():
        table.load(p, "mean_output", novice.constant)
        table.load(p, "novice_u", novice.u)
        table.load(p, "novice_v", novice.v)
    table.check_loaded()
    h = torch.randn(3, 4, generator=g, dtype=torch.float64)
    ids = torch.tensor([[1, 3], [0, 2], [3, 4]], dtype=torch.int32)  # both novices; none; novice 3 alone
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.4, 0.6]], dtype=torch.float64)
    out = table(weights, ids, h)
    expected = torch.stack([
        0.75 * novices[1](h[:1])[0] + 0.25 * novices[3](h[:1])[0],
        torch.zeros(4, dtype=torch.float64),
        0.4 * novices[3](h[2:])[0],
    ])  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[1], torch.zeros(4, dtype=torch.float64))  # no novice picked: exactly nothing
    assert sum(p.numel() for p in table.parameters()) == 2 * (4 + 2 * 4 * RANK)  # d + 2 d R per novice


@pytest.mark.unit
def test_constant_novice_table_adds_the_gated_mean_outputs():
    """Rank 0 (MoNE): g * mu of each picked novice, and only the constants are held."""
    table = _table(0)
    table.load(1, "mean_output", torch.tensor([1.0, 2.0, 3.0, 4.0]))
    table.load(3, "mean_output", torch.tensor([-1.0, 0.0, 0.5, 8.0]))
    table.check_loaded()
    ids = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 0.25], [0.6, 0.4]], dtype=torch.float64)
    out = table(weights, ids, torch.ones(2, 4, dtype=torch.float64))
    expected = torch.tensor([[-0.25, 0.5, 1.0, 5.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.equal(out, expected)
    assert [n for n, _ in table.named_parameters()] == ["mean_output"]


@pytest.mark.unit
def test_novice_table_refuses_missing_or_misplaced_tensors():
    table = _table(RANK)
    table.load(1, "mean_output", torch.zeros(4))
    with pytest.raises(FormatError, match=r"lacks novice tensors \[\(1, 'novice_u'\)"):
        table.check_loaded()
    with pytest.raises(FormatError, match=r"novice_v has shape \(4, 3\), expected \(4, 2\)"):
        table.load(1, "novice_v", torch.zeros(4, 3))
    with pytest.raises(FormatError, match="novice_rank 0 has no place for"):
        _table(0).load(1, "novice_u", torch.zeros(4, 2))


@pytest.mark.unit
def test_the_plugin_reads_a_low_rank_layout():
    """The plugin's reader keeps the rank (it used to refuse low-rank novices in one sentence)."""
    from moeprune.serve.vllm.layout import read_layout

    section = {"format": "moeprune-checkpoint", "format_version": 3, "base_model_type": "qwen3_moe",
               "layers": [{"layer": 0, "num_experts": 3, "expert_ids": [0, 2, 3], "widths": [16, None, 16],
                           "novice": [1], "novice_rank": 4}]}  # fmt: skip
    layout = read_layout({"num_hidden_layers": 2, "moeprune": section})
    assert layout[0].novice_rank == 4 and layout[0].novices == [1]
