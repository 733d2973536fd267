"""moeprune eval / report: metric identities, pruning quality on the trained fixture, routing by
original id, sizes, the Markdown/JSON report, plots and bad input."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from moeprune.checkpoint import load_model, save_pretrained
from moeprune.cli.main import main
from moeprune.config import DataOptions, PruneConfig, RunOptions
from moeprune.criteria import score_experts
from moeprune.data.loading import calibration_sets
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.errors import MoePruneError
from moeprune.evaluate import EvalOptions, Loaded, evaluate_loaded, parse_metrics
from moeprune.evaluate.routing import original_ids
from moeprune.evaluate.size import disk_bytes, measure_peak
from moeprune.job import PruneRequest, prune_checkpoint
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.models.reshape import drop_experts
from moeprune.plan import Plan
from moeprune.report.eval_plots import _importance_profile, draw_directory, plot_score_profiles
from moeprune.report.eval_report import to_markdown
from moeprune.surgery.parameters import plan_routed_parameters
from moeprune.surgery.planning import apply_plan, build_plan

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end
QUIET = RunOptions(progress=False)

PNG = b"\x89PNG"


def run(*args: object, code: int = 0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


def _options(sources: list[Path], metrics: str, samples: int | None = 16, **kwargs) -> EvalOptions:
    data = DataOptions(sources=[str(s) for s in sources], samples=samples, max_length=128, batch_size=8)
    return EvalOptions(data=data, metrics=parse_metrics(metrics), spec_prompts=3, spec_tokens=12, **kwargs)


# ---------------------------------------------------------------------------------------------- tiny


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> tuple[Path, Path]:
    """A prompt/answer file and a text-only file."""
    folder = tmp_path_factory.mktemp("data")
    pairs, text = folder / "pairs.jsonl", folder / "plain.jsonl"
    pairs.write_text(
        "\n".join(
            json.dumps({"prompt": f"What is {i} + {i}?", "answer": f" It is {2 * i}."}) for i in range(10)
        )
    )
    text.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) for i in range(6)))
    return pairs, text


@pytest.fixture(scope="module")
def tiny_pruned(tiny_dir, tiny_data, tmp_path_factory) -> Path:
    """A stock-format pruned copy (uniform, 25%), with plan.json beside it."""
    out = tmp_path_factory.mktemp("pruned") / "freq25"
    data = DataOptions(sources=[str(tiny_data[0])], samples=8, max_length=64)
    prune_checkpoint(PruneRequest(
        tiny_dir, out, PruneConfig(criterion="frequency", sparsity=0.25), data=data, run=QUIET
    ))
    return out


def test_parse_metrics():
    assert parse_metrics("all") == parse_metrics(None) == parse_metrics("") != ()
    assert parse_metrics("kl, ESAP,layer_error") == ("esap", "kl", "layer-error")
    with pytest.raises(Exception, match="unknown metric"):
        parse_metrics("esap,bleu")


def test_routing_maps_experts_by_original_id(tiny_dir, tiny_pruned, tiny_data):
    """A stock checkpoint forgets original ids; plan.json beside it restores them."""
    plan = Plan.load(tiny_pruned / "plan.json")
    model, _ = load_model(tiny_pruned)
    ids = original_ids(MoEModel(model), tiny_pruned)
    assert ids == {lp.layer: lp.kept for lp in plan.layers}
    assert ids != {m.index: m.expert_ids for m in MoEModel(model).layers}  # positions are not ids

    out = tiny_pruned.parent / "routing.json"
    run(
        "eval",
        tiny_pruned,
        "-r",
        tiny_dir,
        "--data",
        tiny_data[0],
        "--metrics",
        "routing",
        "--output",
        out,
        "--quiet",
    )
    doc = json.loads(out.read_text())
    routing = doc["models"][0]["per_data"][str(tiny_data[0])]["routing"]
    for layer, lp in zip(routing["layers"], plan.layers):
        assert layer["experts"] == list(range(8))
        for e in lp.dropped:
            assert layer["model"][e] == 0.0
        assert sum(layer["model"]) == pytest.approx(2.0, abs=1e-5) == sum(layer["reference"])
        assert 0 < layer["tv"] <= 1 and 0 <= layer["dropped_mass"] <= layer["tv"] + 1e-9


def test_moeprune_format_carries_its_ids(tiny_dir, tmp_path):
    model, tokenizer = load_model(tiny_dir)
    drop_experts(MoEModel(model), {0: [1, 2, 3], 1: [7]})
    assert save_pretrained(model, tmp_path / "nonuni", tokenizer) == "moeprune"
    loaded, _ = load_model(tmp_path / "nonuni")
    ids = original_ids(MoEModel(loaded), tmp_path / "nonuni")
    assert ids[0] == [0, 4, 5, 6, 7] and ids[1] == [0, 1, 2, 3, 4, 5, 6]


def test_eval_cli_writes_json_and_markdown(tiny_dir, tiny_pruned, tiny_data, tmp_path):
    out = tmp_path / "rep" / "report.json"
    run("eval", tiny_pruned, "--reference", tiny_dir, "--data", tiny_data[0], "--data", tiny_data[1],
        "--samples", 6, "--spec-prompts", 2, "--spec-tokens", 6, "--gamma", 3, "--output", out, "--quiet")  # fmt: skip
    doc = json.loads(out.read_text())
    entry = doc["models"][0]
    assert entry["plan"]["criterion"] == "frequency" and entry["plan"]["sparsity"] == 0.25
    for source in map(str, tiny_data):
        per = entry["per_data"][source]
        for key in ("esap", "kl", "nll", "ppl", "accept_rate", "routing", "layer_error"):
            assert key in per, key
        assert 0 < per["esap"] < 1 and per["kl"] > 0
        assert per["ppl"] == pytest.approx(math.exp(per["nll"]), rel=0.5)  # token- vs sample-weighted
        assert (
            set(per["accept"]) == {"greedy", "sampled"}
            and len(per["accept"]["sampled"]["accept_rate_per_position"]) == 3
        )
    assert doc["models"][0]["per_data"][str(tiny_data[1])]["text_only"] is True
    assert any("text only" in n and "all tokens" in n for n in doc["notes"])
    assert any("first half" in n for n in doc["notes"])
    size = entry["size"]
    assert size["parameters"]["routed_experts"] < doc["reference_size"]["parameters"]["routed_experts"]
    assert size["disk_bytes"] == sum(p.stat().st_size for p in tiny_pruned.iterdir() if p.is_file())
    md = out.with_suffix(".md").read_text()
    assert "| pairs.jsonl | ESAP ↑ | 1 |" in md and "## Size" in md and "## Plans" in md
    assert out.with_name("report_acceptance.png").read_bytes()[:4] == PNG
    run(
        "eval", tiny_pruned, "-r", tiny_dir, "--data", tiny_data[0], "--output", out, "--quiet", code=2
    )  # exists


def test_compare_puts_models_side_by_side(tiny_dir, tiny_pruned, tiny_data):
    result = run("eval", "--compare", tiny_dir, tiny_pruned, "-r", tiny_dir, "--data", tiny_data[0],
                 "--metrics", "esap,kl,size", "--samples", 4, "--quiet")  # fmt: skip
    header = next(line for line in result.stdout.splitlines() if line.startswith("| data"))
    assert header == f"| data | metric | reference | {tiny_dir.name} | {tiny_pruned.name} |"
    esap_row = next(line for line in result.stdout.splitlines() if "ESAP" in line)
    assert esap_row.split("|")[4].strip() == "1"  # the reference against itself
    bad = run("eval", tiny_dir, tiny_pruned, "-r", tiny_dir, "--data", tiny_data[0], code=2)
    assert "--compare" in bad.output


def test_different_vocabularies_are_refused(tiny_dir, tiny_data, tmp_path):
    other = tmp_path / "other"
    tiny_model("qwen3_moe", vocab_size=300).save_pretrained(other)
    result = run("eval", other, "-r", tiny_dir, "--data", tiny_data[0], "--metrics", "esap", code=2)
    assert "300 tokens" in result.output and "259" in result.output and "vocabulary" in result.output

    same_size = Loaded("b", tiny_model("qwen3_moe", vocab_size=259), tokenizer=_shuffled_tokenizer())
    ref = Loaded("a", tiny_model("qwen3_moe", vocab_size=259), tokenizer=byte_tokenizer())
    with pytest.raises(Exception, match="different tokenizers"):
        evaluate_loaded([same_size], ref, _options([tiny_data[0]], "esap"))


def _shuffled_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer with the same size but other ids (two byte tokens swapped)."""
    spec = json.loads(byte_tokenizer().backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    (a, ia), (b, ib) = list(vocab.items())[10:12]
    vocab[a], vocab[b] = ib, ia
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))


def test_bad_input_is_one_clear_line(tiny_dir, tiny_pruned, tmp_path):
    result = run("eval", tiny_pruned, "-r", tiny_dir, "--metrics", "esap", code=2)
    assert "--data" in result.output
    result = run("eval", tiny_pruned, "-r", tiny_dir, "--data", tmp_path / "nope.jsonl", code=2)
    assert "does not exist" in result.output
    result = run("eval", tiny_pruned, "-r", tiny_dir, "--metrics", "size", "--limit", "3", code=2)
    assert "--lm-eval-tasks" in result.output
    result = run("report", tmp_path, code=2)
    assert "nothing to draw" in result.output


def test_size_alone_needs_no_data(tiny_dir, tiny_pruned):
    out = run("eval", tiny_pruned, "-r", tiny_dir, "--metrics", "size", "--quiet").stdout
    assert "total parameters" in out and "Per data file" not in out


def test_size_measurements(tiny_dir):
    files = disk_bytes(tiny_dir)
    assert files["weight_bytes"] == (tiny_dir / "model.safetensors").stat().st_size <= files["disk_bytes"]
    # 64 MB: above glibc's largest dynamic mmap threshold (32 MB), so the buffer is always a fresh
    # mapping whose touched pages raise the resident set; a 16 MB buffer could be served from heap
    # memory earlier tests freed, and the peak would then not move
    buffer, info = measure_peak(lambda: torch.ones(16_000_000))
    assert buffer.numel() == 16_000_000
    if info["load_peak_bytes"] is not None:
        assert 56e6 < info["load_peak_bytes"] < 100e6


def test_report_redraws_plots(tiny_dir, tiny_pruned, tiny_data, tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    run("eval", tiny_pruned, "-r", tiny_dir, "--data", tiny_data[0], "--metrics", "accept,esap", "--samples", 3,
        "--spec-tokens", 4, "--output", folder / "eval.json", "--quiet", "--no-plots")  # fmt: skip
    (folder / "eval.md").unlink()
    run("score", tiny_dir, "--criterion", "aimer", "--output", folder / "aimer.json")
    run("score", tiny_dir, "--criterion", "frequency", "--data", tiny_data[0], "--samples", 4, "--output",
        folder / "frequency.json", "--quiet")  # fmt: skip
    history = [
        {"generation": g, "best": 0.5 + g / 10, "mean": 0.4 + g / 10, "fitnesses": [0.4, 0.5]}
        for g in range(3)
    ]
    (folder / "search.json").write_text(json.dumps({"fitness": "esap", "generations": history}))
    written = {p.name for p in draw_directory(folder)}
    assert written == {
        "eval.md",
        "eval_acceptance.png",
        "density.png",
        "score_profiles.png",
        "search_curve.png",
    }
    for name in written - {"eval.md"}:
        assert (folder / name).read_bytes()[:4] == PNG
    assert "ESAP" in (folder / "eval.md").read_text()


def test_score_profiles_by_importance(tmp_path):
    docs = {
        "frequency": {"prune_first": "smallest", "layers": [{"layer": 0, "scores": [5.0, 1.0, 3.0, 0.0]}]},
        "aimer": {"prune_first": "largest", "layers": [{"layer": 0, "scores": [0.9, 0.5, 0.6, 0.7]}]},
    }
    assert plot_score_profiles(tmp_path / "p.png", docs).read_bytes()[:4] == PNG
    assert _importance_profile([5.0, 1.0, 3.0, 0.0], "smallest") == [1.0, 0.6, 0.2, 0.0]
    assert _importance_profile([0.9, 0.5, 0.6, 0.7], "largest") == pytest.approx([1.0, 0.75, 0.5, 0.0])


# ---------------------------------------------------------------------------------------------- trained


@pytest.fixture(scope="module")
def trained(trained_moe):
    """The trained fixture loaded once, and its corpus folder."""
    model_dir, corpus = trained_moe
    model, tokenizer = load_model(model_dir)
    return Loaded("reference", model, tokenizer, path=str(model_dir)), corpus


def test_metrics_of_a_model_against_itself_are_identities(trained):
    reference, corpus = trained
    twin = Loaded("twin", copy.deepcopy(reference.model), reference.tokenizer, path=reference.path)
    options = _options([corpus / "math_eval.jsonl"], "all", samples=8)
    doc = evaluate_loaded([twin], reference, options)
    per = doc["models"][0]["per_data"][str(corpus / "math_eval.jsonl")]
    assert per["esap"] == pytest.approx(1.0, abs=1e-6)
    assert per["kl"] == 0.0
    assert per["nll"] == per["reference_nll"] and per["ppl"] == per["reference_ppl"]
    for mode in ("greedy", "sampled"):
        assert per["accept"][mode]["accept_rate"] == 1.0
        assert per["accept"][mode]["accepted"] == per["accept"][mode]["drafted"] > 0
    assert all(layer["tv"] == 0.0 and layer["max_abs_change"] == 0.0 for layer in per["routing"]["layers"])
    assert all(layer["l2"] == 0.0 for layer in per["layer_error"]["layers"])
    assert doc["models"][0]["size"]["parameters"] == doc["reference_size"]["parameters"]


def test_pruned_esap_is_between_0_and_1_and_falls_with_sparsity(trained):
    reference, corpus = trained
    moe = MoEModel(reference.model)
    data = DataOptions(
        sources=[str(corpus / "math_search.jsonl"), str(corpus / "code_search.jsonl")], samples=32
    )
    sets = calibration_sets(reference.tokenizer, data)
    criterion, scores, _ = score_experts(moe, "frequency", sets, progress=False)
    pruned = []
    for sparsity in (0.25, 0.5):
        model = copy.deepcopy(reference.model)
        config = PruneConfig(criterion.name, sparsity)
        apply_plan(MoEModel(model), build_plan(moe, criterion, scores, config=config))
        pruned.append(Loaded(f"frequency-{sparsity}", model, reference.tokenizer))
    options = _options(
        [corpus / "math_eval.jsonl", corpus / "prose_eval.jsonl"], "esap,kl,layer-error", samples=24
    )
    doc = evaluate_loaded(pruned, reference, options)
    for source in doc["data"]["files"]:
        quarter, half = (m["per_data"][source] for m in doc["models"])
        assert 0 < half["esap"] < quarter["esap"] < 1, source
        assert half["kl"] > quarter["kl"] > 0, source
        assert (
            half["layer_error"]["layers"][-1]["relative"]
            > quarter["layer_error"]["layers"][-1]["relative"]
            > 0
        )
    assert "| math_eval.jsonl | ESAP ↑ | 1 |" in to_markdown(doc)


@pytest.mark.parametrize("method", ["novice", "tenp"])
def test_packed_models_are_evaluated(tiny_dir, tiny_data, tmp_path, method):
    """moeprune-format (packed) results go through every metric; a novice keeps routing, so the
    first MoE layer selects exactly as the reference does."""
    pruned = tmp_path / method
    data = DataOptions(sources=[str(tiny_data[0])], samples=8, max_length=64)
    criterion = "mone" if method == "novice" else "tenp"
    prune_checkpoint(PruneRequest(
        tiny_dir,
        pruned,
        PruneConfig(criterion=criterion, sparsity=0.5, method=method),
        data=data,
        run=QUIET,
    ))
    out = tmp_path / "rep" / "report.json"
    run("eval", pruned, "--reference", tiny_dir, "--data", tiny_data[0], "--samples", 6, "--spec-prompts", 2,
        "--spec-tokens", 6, "--output", out, "--quiet")  # fmt: skip
    entry = json.loads(out.read_text())["models"][0]
    plan = json.loads((pruned / "plan.json").read_text())
    routers = {str(lp["layer"]): len(lp["kept"]) for lp in plan["layers"]}  # novices stay routed
    assert entry["size"]["experts_per_layer"] == routers
    per = entry["per_data"][str(tiny_data[0])]
    assert 0 < per["esap"] < 1
    first = per["routing"]["layers"][0]
    if method == "novice":
        assert first["tv"] == 0.0 and first["dropped_mass"] == 0.0
    assert all(0 <= layer["tv"] <= 1 for layer in per["routing"]["layers"])
    original, _ = load_model(tiny_dir)  # E and A from the plan on the full model, another code path
    expected = plan_routed_parameters(MoEModel(original), Plan.load(pruned / "plan.json"))
    for key in ("routed_experts", "active_routed_experts"):
        assert entry["size"]["parameters"][key] == expected[key], key
    with pytest.raises(MoePruneError, match="cannot be pruned again"):  # packed: renumbering unsupported
        prune_checkpoint(PruneRequest(
            pruned,
            tmp_path / "again",
            PruneConfig(criterion="frequency", sparsity=0.25),
            data=data,
            run=QUIET,
        ))
    assert not (tmp_path / "again").exists()
