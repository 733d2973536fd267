"""The command line end to end on tiny local checkpoints and data: outputs, formats and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

import moeprune
from helpers import assert_logits_close
from moeprune.cli.main import main
from moeprune.models import MoEModel

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint


def run(*args: str, ok: bool = True):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def test_help_lists_commands():
    out = run("--help").output
    for command in ("inspect", "score", "prune"):
        assert command in out


def test_inspect_folder_json(checkpoint):
    info = json.loads(run("inspect", checkpoint, "--json").output)
    assert info["family"] == "qwen3_moe" and info["moe_layers"] == [0, 1, 2, 3]
    assert info["layers"][0]["experts"] == 8 and info["layers"][0]["top_k"] == 2
    params = info["parameters"]
    assert (
        params["active_per_token"]
        == params["total"] - params["routed_experts"] + params["active_routed_experts"]
    )
    assert params["active_routed_experts"] * 4 == params["routed_experts"]  # top-2 of 8 experts


def test_score_writes_contract_json(checkpoint, data, tmp_path):
    out = tmp_path / "scores.json"
    run("score", checkpoint, "--criterion", "reap", "--data", data, "--output", out, "--quiet")
    doc = json.loads(out.read_text())
    assert doc["criterion"] == "reap" and doc["prune_first"] == "lowest" and doc["tokens"] > 0
    assert [layer["layer"] for layer in doc["layers"]] == [0, 1, 2, 3]
    for layer in doc["layers"]:
        assert sorted(layer["order"]) == list(range(8))
        ranked = [layer["scores"][e] for e in layer["order"]]
        assert ranked == sorted(ranked)  # lowest pruned first
    run(
        "score", checkpoint, "--criterion", "aimer", "--output", tmp_path / "aimer.json"
    )  # weights only, no data
    assert json.loads((tmp_path / "aimer.json").read_text())["prune_first"] == "highest"


def test_prune_uniform_drop_reloads_with_stock_transformers(checkpoint, data, tmp_path):
    out = tmp_path / "pruned"
    run(
        "prune",
        checkpoint,
        "--output",
        out,
        "--criterion",
        "frequency",
        "--sparsity",
        "0.25",
        "--data",
        data,
        "--quiet",
    )
    report = json.loads((out / "report.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert report["format"] == "stock" and report["budget_experts_removed"] == 8
    assert (
        report["parameters_after"]["routed_experts"] * 4 == report["parameters_before"]["routed_experts"] * 3
    )
    assert all(len(layer["dropped"]) == 2 for layer in plan["layers"])
    model = AutoModelForCausalLM.from_pretrained(out)
    assert [m.num_experts for m in MoEModel(model).layers] == [6, 6, 6, 6]
    # the dropped experts are the least used ones according to the scores the report carries
    for layer, scores in zip(plan["layers"], report["scores"]["layers"]):
        assert sorted(layer["dropped"]) == sorted(scores["order"][:2])


@pytest.mark.parametrize("criterion", ["man", "msan"])
def test_prune_with_the_mean_norm_criteria(checkpoint, data, tmp_path, criterion):
    out = tmp_path / criterion
    run("prune", checkpoint, "--output", out, "--criterion", criterion, "--sparsity", "0.25", "--data", data,
        "--samples", "8", "--quiet")  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert report["criterion"] == criterion and report["budget_experts_removed"] == 8
    for layer, scores in zip(plan["layers"], report["scores"]["layers"]):
        ranked = [scores["scores"][e] for e in scores["order"]]
        assert ranked == sorted(ranked) and sorted(layer["dropped"]) == sorted(scores["order"][:2])


def test_prune_global_allocation_and_reload(checkpoint, data, tmp_path):
    out = tmp_path / "global"
    run("prune", checkpoint, "--output", out, "--criterion", "reap", "--sparsity", "0.5", "--allocation", "global",
        "--data", data, "--quiet")  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert sum(report["removed_per_layer"].values()) == 16
    model = moeprune.load_pretrained(out)
    counts = [m.num_experts for m in MoEModel(model).layers]
    assert sum(counts) == 16 and min(counts) >= 2
    assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--criterion", "nope", "--sparsity", "0.5"], "'nope' is not one of 'random'"),
        (["--criterion", "reap", "--sparsity", "0.5"], "needs calibration data: give data files (--data)"),
        (["--criterion", "aimer", "--sparsity", "0.9"], "outside the feasible range"),
        (["--criterion", "frequency", "--sparsity", "0.5", "--data", "missing.jsonl"], "does not exist"),
        (
            ["--criterion", "frequency", "--sparsity", "0.5", "--device", "banana"],
            "unknown device 'banana'; use cpu, cuda, cuda:N or auto (--device)",
        ),
        (
            [
                "--criterion",
                "frequency",
                "--sparsity",
                "0.5",
                "--allocation",
                "evo",
                "--search-data",
                "nope.jsonl",
            ],
            "search data path nope.jsonl does not exist",
        ),
        (
            [
                "--criterion",
                "frequency",
                "--sparsity",
                "0.5",
                "--allocation",
                "evo",
                "--search-data",
                __file__,
                "--population",
                "2",
                "--elites",
                "4",
            ],
            "population (2) must be >= elites (4)",
        ),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(checkpoint, tmp_path, args, message):
    out = tmp_path / "never"
    result = run("prune", checkpoint, "--output", out, *args, ok=False)
    assert result.exit_code == 2 and message in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_malformed_data_names_file_and_line(checkpoint, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    result = run(
        "score", checkpoint, "--criterion", "ean", "--data", bad, "--output", tmp_path / "s.json", ok=False
    )
    assert result.exit_code == 2 and "bad.jsonl" in result.output and "line 2" in result.output


def test_existing_output_is_refused_unless_overwrite(checkpoint, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    result = run("prune", checkpoint, "--output", out, "--criterion", "aimer", "--sparsity", "0.25", ok=False)
    assert result.exit_code == 2 and "--overwrite" in result.output
    assert (out / "keep.txt").read_text() == "precious"
    run(
        "prune",
        checkpoint,
        "--output",
        out,
        "--criterion",
        "aimer",
        "--sparsity",
        "0.25",
        "--overwrite",
        "--quiet",
    )
    assert (out / "plan.json").is_file() and not (out / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["exists"]  # no temporary folder left behind


def test_non_moe_and_missing_model_paths(tmp_path):
    result = run("inspect", tmp_path / "nothing", ok=False)
    assert result.exit_code == 2 and "does not exist" in result.output


@pytest.mark.parametrize(
    "method, extra",
    [("novice", []), ("neurons", ["--neuron-importance", "l2"]), ("tenp", ["--slope", "0.5"])],
)
def test_prune_methods_end_to_end(checkpoint, data, tmp_path, method, extra):
    out = tmp_path / method
    run("prune", checkpoint, "--output", out, "--criterion", "reap", "--sparsity", "0.5", "--method", method,
        "--data", data, "--quiet", *extra)  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    before, after = report["parameters_before"], report["parameters_after"]
    assert plan["method"] == method and report["allocation"] == (
        "trapezoid" if method == "tenp" else "uniform"
    )
    if method == "novice":  # half the experts become d-vectors: routed parameters shrink by about half
        assert all(len(layer["novice"]) == 4 for layer in plan["layers"])
        assert after["routed_experts"] < 0.55 * before["routed_experts"]
    else:  # sparsity = fraction of routed-expert parameters removed
        assert after["routed_experts"] == pytest.approx(0.5 * before["routed_experts"], rel=0.05)
    model = moeprune.load_pretrained(out)
    assert torch.isfinite(model(torch.tensor([[5, 6, 7, 8]])).logits).all()


def test_method_needs_data_and_valid_combinations(checkpoint, tmp_path):
    result = run("prune", checkpoint, "--output", tmp_path / "x", "--criterion", "aimer", "--sparsity", "0.25",
                 "--method", "novice", ok=False)  # fmt: skip
    assert (
        result.exit_code == 2
        and "the novice method needs calibration data: give data files (--data)" in result.output
    )
    result = run("prune", checkpoint, "--output", tmp_path / "y", "--criterion", "aimer", "--sparsity", "0.25",
                 "--method", "tenp", "--allocation", "global", ok=False)  # fmt: skip
    assert result.exit_code == 2 and "trapezoid" in result.output
    assert list(tmp_path.iterdir()) == []


def test_streaming_score_and_no_load_prune_match_in_memory(checkpoint, tmp_path):
    run("score", checkpoint, "--criterion", "aimer", "--output", tmp_path / "mem.json")
    run("score", checkpoint, "--criterion", "aimer", "--streaming", "--output", tmp_path / "stream.json")
    mem, stream = (json.loads((tmp_path / n).read_text()) for n in ("mem.json", "stream.json"))
    for a, b in zip(mem["layers"], stream["layers"]):
        assert a["order"] == b["order"] and a["scores"] == pytest.approx(
            b["scores"], rel=1e-6
        )  # streaming sums fp32 blocks
    run(
        "prune",
        checkpoint,
        "--output",
        tmp_path / "mem",
        "--criterion",
        "aimer",
        "--sparsity",
        "0.25",
        "--quiet",
    )
    run(
        "prune",
        checkpoint,
        "--output",
        tmp_path / "shards",
        "--criterion",
        "aimer",
        "--sparsity",
        "0.25",
        "--no-load",
    )
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "mem")(tokens).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "shards")(tokens).logits
    assert_logits_close(a, b)
    result = run(
        "score", checkpoint, "--criterion", "reap", "--streaming", "--output", tmp_path / "x.json", ok=False
    )
    assert result.exit_code == 2 and "use --sequential" in result.output


def test_sequential_score_and_no_load_prune_with_data(checkpoint, data, tmp_path):
    """Layer-by-layer observation gives the in-memory scores; --no-load then rewrites the shards."""
    run(
        "score",
        checkpoint,
        "--criterion",
        "reap",
        "--data",
        data,
        "--output",
        tmp_path / "mem.json",
        "--quiet",
    )
    run("score", checkpoint, "--criterion", "reap", "--data", data, "--sequential", "--output", tmp_path / "seq.json",
        "--quiet")  # fmt: skip
    mem, seq = (json.loads((tmp_path / n).read_text()) for n in ("mem.json", "seq.json"))
    assert mem["tokens"] == seq["tokens"]
    for a, b in zip(mem["layers"], seq["layers"]):
        assert a["scores"] == pytest.approx(b["scores"], rel=1e-5)
    run("prune", checkpoint, "--output", tmp_path / "pruned", "--criterion", "reap", "--sparsity", "0.25", "--data",
        data, "--no-load", "--quiet")  # fmt: skip
    report = json.loads((tmp_path / "pruned" / "report.json").read_text())
    assert report["data"]["tokens"] == mem["tokens"] and report["budget_experts_removed"] == 8


def test_activations_on_disk_give_the_same_scores(checkpoint, data, tmp_path, monkeypatch):
    """--activations-dir: the cached hidden states go to a temporary folder there (removed after),
    the statistics do not change; without --sequential the option is refused."""
    from moeprune.shards import sequential

    made = []
    mkdtemp = sequential.tempfile.mkdtemp
    monkeypatch.setattr(sequential.tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    args = ("score", checkpoint, "--criterion", "reap", "--data", data, "--sequential", "--quiet")
    run(*args, "--output", tmp_path / "mem.json")
    run(*args, "--activations-dir", tmp_path / "acts", "--output", tmp_path / "disk.json")
    assert len(made) == 1 and Path(made[0]).parent == tmp_path / "acts"
    assert list((tmp_path / "acts").iterdir()) == []  # removed after use
    mem, disk = (json.loads((tmp_path / n).read_text()) for n in ("mem.json", "disk.json"))
    assert [a["scores"] for a in mem["layers"]] == [b["scores"] for b in disk["layers"]]
    result = run("score", checkpoint, "--criterion", "reap", "--data", data, "--activations-dir", tmp_path / "x",
                 "--output", tmp_path / "no.json", ok=False)  # fmt: skip
    assert result.exit_code == 2 and "add --sequential" in result.output


@pytest.mark.parametrize("method", ["drop", "novice"])
def test_prune_evo_search_writes_search_json_and_plots(checkpoint, data, tmp_path, method):
    args = ["prune", checkpoint, "--criterion", "frequency", "--sparsity", "0.5", "--allocation", "evo",
            "--method", method, "--data", data, "--search-data", data, "--search-samples", "8", "--population", "6",
            "--elites", "2", "--generations", "3", "--quiet"]  # fmt: skip
    out = tmp_path / "evo"
    run(*args, "--output", out)
    search = json.loads((out / "search.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert len(search["generations"]) == 3 and search["fitness"] == "esap"
    assert sum(search["allocation"]) == 16 and search["fitness_value"] >= search["uniform"]["fitness_value"]
    removed = [len(layer["dropped"]) + len(layer["novice"]) for layer in plan["layers"]]
    assert removed == search["allocation"]
    assert (out / "density.png").is_file() and (out / "search_curve.png").is_file()
    assert not any(p.name.endswith("search_state.json") for p in tmp_path.iterdir())  # cleaned after success
    # same seed, same result (interrupted-then-resumed equality is tested in test_search/test_evo)
    run(*args, "--output", tmp_path / "again")
    again = json.loads((tmp_path / "again" / "search.json").read_text())
    assert again["allocation"] == search["allocation"]
    result = run(*args, "--output", tmp_path / "nothing", "--resume", ok=False)
    assert result.exit_code == 2 and "nothing to resume" in result.output


def test_prune_mixed_evo_with_low_rank_novices(checkpoint, data, tmp_path):
    """`--method mixed --allocation evo --novice-rank 2` end to end: every expert fitted before the
    search (search.json says the rank and the moments' bytes: 16 d^2 per routed expert), the plan
    records the rank, the saved layers hold rank-2 novices and the plan's kept parameters."""
    import moeprune
    from moeprune.models import MoEModel
    from moeprune.surgery.parameters import routed_parameters

    out = tmp_path / "mixed"
    run("prune", checkpoint, "--output", out, "--criterion", "tenp", "--sparsity", "0.5", "--allocation", "evo",
        "--method", "mixed", "--mixed-novice", "0.25", "--novice-rank", "2", "--data", data, "--search-data", data,
        "--search-samples", "8", "--population", "4", "--elites", "2", "--generations", "2", "--quiet")  # fmt: skip
    search = json.loads((out / "search.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    model = moeprune.load_pretrained(out)
    moe = MoEModel(model)
    d = moe.layers[0].hidden_size
    assert search["novice_rank"] == 2 and search["novice_moments_bytes"] == 16 * d * d * sum(
        len(layer["kept"]) + len(layer["dropped"]) for layer in plan["layers"]
    )
    assert plan["extra"]["novice_rank"] == 2
    assert routed_parameters(moe)["routed_experts"] == plan["extra"]["routed_parameters_kept"]
    layers = json.loads((out / "config.json").read_text()).get("moeprune", {}).get("layers", [])
    assert any(entry["novice"] for entry in layers), layers  # the winner keeps novices here
    assert all(entry.get("novice_rank") == 2 for entry in layers if entry["novice"])


def test_criterion_auto_picks_the_best_uniform_plan(checkpoint, data, tmp_path):
    out = tmp_path / "auto"
    run("prune", checkpoint, "--output", out, "--criterion", "auto", "--sparsity", "0.25", "--data", data,
        "--search-data", data, "--search-samples", "8", "--quiet")  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    table = report["criterion_auto"]["table"]
    assert {row["criterion"] for row in table} == {
        "magnitude",
        "aimer",
        "frequency",
        "seer",
        "ean",
        "reap",
        "mone",
        "tenp",
        "man",
        "msan",
    }
    best = max(table, key=lambda row: row["esap"])
    assert report["criterion"] == best["criterion"] == report["criterion_auto"]["chosen"]
    result = run("prune", checkpoint, "--output", tmp_path / "x", "--criterion", "auto", "--sparsity", "0.25",
                 "--data", data, ok=False)  # fmt: skip
    assert (
        result.exit_code == 2
        and "choosing the criterion automatically needs search data" in result.output
        and "(--search-data)" in result.output
    )


def test_prune_help_documents_every_option_family():
    out = run("prune", "--help").output
    for option in ("auto", "--allocation", "evo", "trapezoid", "--method", "novice", "--search-data", "--fitness",
                   "--resume", "--no-load", "--sequential", "--device", "--important-fraction"):  # fmt: skip
        assert option in out


@pytest.mark.parametrize("allocation", ["uniform", "global", "evo"])
@pytest.mark.parametrize("method", ["drop", "novice"])
def test_expert_multiple_holds_for_every_allocation(checkpoint, data, tmp_path, allocation, method):
    """--expert-multiple 4: every layer keeps 4 or 8 of its 8 experts (weight-holding ones for novices)."""
    out = tmp_path / "out"
    search = ["--search-data", data, "--search-samples", "6", "--population", "6", "--elites", "2",
              "--generations", "3"] if allocation == "evo" else []  # fmt: skip
    run("prune", checkpoint, "--output", out, "--criterion", "frequency", "--sparsity", "0.25", "--data", data,
        "--allocation", allocation, "--method", method, "--expert-multiple", "4", "--quiet", *search)  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    removed = [int(r) for r in report["removed_per_layer"].values()]
    assert sum(removed) == 8 and all(r % 4 == 0 for r in removed), removed
    kept = json.loads((out / "plan.json").read_text())["layers"]
    assert all((len(lp["kept"]) - len(lp["novice"])) % 4 == 0 for lp in kept)


def test_bf16_input_stays_bf16_unless_asked(checkpoint, tmp_path):
    from safetensors.torch import load_file

    bf16 = tmp_path / "bf16"
    model = moeprune.load_pretrained(checkpoint).to(torch.bfloat16)
    model.save_pretrained(bf16)
    (bf16 / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes())
    common = ["--criterion", "aimer", "--sparsity", "0.25", "--quiet"]
    run("prune", bf16, "--output", tmp_path / "same", *common)
    run("prune", bf16, "--output", tmp_path / "fp32", *common, "--save-dtype", "fp32")
    dtypes = {
        name: {t.dtype for t in load_file(tmp_path / name / "model.safetensors").values()}
        for name in ("same", "fp32")
    }
    assert dtypes == {"same": {torch.bfloat16}, "fp32": {torch.float32}}
    assert json.loads((tmp_path / "same" / "report.json").read_text())["save_dtype"] == "bfloat16"


@pytest.mark.parametrize("method", ["drop", "tenp"])
def test_every_output_has_a_model_card(checkpoint, data, tmp_path, method):
    out = tmp_path / "out"
    allocation = ["--allocation", "global"] if method == "drop" else []
    run("prune", checkpoint, "--output", out, "--criterion", "reap", "--sparsity", "0.5", "--method", method,
        "--data", data, "--quiet", *allocation)  # fmt: skip
    card = (out / "README.md").read_text()
    report = json.loads((out / "report.json").read_text())
    assert (
        f"`{checkpoint}`" in card
        and f"Criterion: reap; allocation: {report['allocation']}; method: {method}" in card
    )
    rows = [
        line for line in card.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()
    ]
    assert [int(r.split("|")[1]) for r in rows] == [0, 1, 2, 3]  # one row per MoE layer
    for row, layer in zip(rows, report["layers_after"]):
        kept = layer["experts"] - layer["novices"]
        assert f"| {kept} of 8 |" in row
    total = report["parameters_after"]["total"]
    assert f"{total:,}" in card and "weights on disk" in card
    assert "trust_remote_code=True" in card and "vllm serve" in card  # moeprune format: both ways named
    assert "--criterion reap --sparsity 0.5" in card.replace("'", "")  # the command that made it


def test_patience_ends_the_search_early_and_search_json_says_why(checkpoint, data, tmp_path):
    out = tmp_path / "out"
    run("prune", checkpoint, "--output", out, "--criterion", "frequency", "--sparsity", "0.25", "--data", data,
        "--allocation", "evo", "--search-data", data, "--search-samples", "6", "--population", "6", "--elites", "2",
        "--generations", "30", "--patience", "2", "--quiet")  # fmt: skip
    search = json.loads((out / "search.json").read_text())
    stopped = search["stopped"]
    assert stopped["reason"] == "patience" and stopped["patience"] == 2
    assert stopped["generations_run"] == len(search["generations"]) < 30
    best = [g["best"] for g in search["generations"]]
    assert max(best[-2:]) <= max(best[:-2])  # the last two generations found nothing better
    assert json.loads((out / "report.json").read_text())["search"]["stopped"] == stopped


def test_a_model_id_from_the_local_hugging_face_cache(checkpoint, tmp_path, monkeypatch):
    """MODEL may be a Hub id already in the local cache (nothing is downloaded); else a clear error."""
    import shutil

    snapshot = tmp_path / "hub" / "models--acme--tiny-moe" / "snapshots" / "0123abcd"
    shutil.copytree(checkpoint, snapshot)
    (tmp_path / "hub" / "models--acme--tiny-moe" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-moe" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    info = json.loads(run("inspect", "acme/tiny-moe", "--json").output)
    assert info["family"] == "qwen3_moe" and info["source"] == "acme/tiny-moe"
    plan = run("prune", "acme/tiny-moe", "--output", tmp_path / "out", "--criterion", "aimer", "--sparsity", "0.25",
               "--dry-run").output  # fmt: skip
    assert str(snapshot) in plan
    missing = run("inspect", "acme/not-cached", ok=False)
    assert (
        missing.exit_code == 2
        and "neither a local folder nor a model in the local Hugging Face cache" in missing.output
    )


def test_a_tokenizer_from_another_model_is_one_line_before_observation(data, tmp_path):
    """Token ids past the model's embedding (a byte tokenizer on a 96-token model) would fail
    inside the first forward: refused in one line, exit 2, nothing written."""
    from moeprune.data.tokenizer import byte_tokenizer
    from moeprune.models.factory import save_tiny_model

    source = save_tiny_model("qwen3_moe", tmp_path / "in")  # vocabulary 96
    byte_tokenizer().save_pretrained(source)  # ids up to ~260
    result = run("prune", str(source), "--output", str(tmp_path / "out"), "--criterion", "reap",
                 "--sparsity", "0.25", "--data", str(data), "--samples", "8", ok=False)  # fmt: skip
    assert result.exit_code == 2
    line = result.output.strip().splitlines()[-1]
    assert "vocabulary has 96 tokens" in line and "tokenizer does not belong to this model" in line
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_prune_mixed_evo_records_the_winning_genes(checkpoint, data, tmp_path):
    """--method mixed --allocation evo: search.json, the report and the plan hold the winning genes,
    which beat (or equal) every seed on the search data; the budget is the mixed plan's."""
    out = tmp_path / "mixed"
    run("prune", checkpoint, "--criterion", "reap", "--sparsity", "0.5", "--allocation", "evo", "--method", "mixed",
        "--data", data, "--search-data", data, "--search-samples", "8", "--population", "6", "--elites", "2",
        "--generations", "2", "--quiet", "--output", out)  # fmt: skip
    search = json.loads((out / "search.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    report = json.loads((out / "report.json").read_text())
    assert {"drop", "novice", "tenp", "neurons"} <= set(search["seeds"])
    assert all(search["fitness_value"] >= s["fitness_value"] for s in search["seeds"].values())
    assert plan["extra"]["mixed_genes"] == [dict(zip(("whole", "narrowed", "novice", "dropped", "width"), g))
                                            for g in search["genes"]]  # fmt: skip
    assert report["search"]["genes"] == search["genes"]
    kept, target = plan["extra"]["routed_parameters_kept"], plan["extra"]["routed_parameters_target"]
    assert (
        abs(kept - target) <= 0.5 * plan["extra"]["routed_parameters_total"] / 2 / 8 / 16
    )  # half a neuron row
