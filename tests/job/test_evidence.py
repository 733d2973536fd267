"""Both pipelines leave the same evidence beside a result, and carry the input's other files.

A result is what a user deploys: it must load with its tokenizer and chat template whether or not
the prune read any text, and a `--no-load` result must hold the same plan, recipe, report, model
card, log and plot as an in-memory one (they were two writers once, and drifted apart).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from moeprune.cli.main import main
from moeprune.config import Recipe
from moeprune.plan import Plan

pytestmark = pytest.mark.integration  # prunes tiny checkpoints end to end

CARRIED = {"chat_template.jinja": "{{ messages }}\n", "LICENSE": "a licence\n", "preprocessor_config.json": "{}\n"}
EVIDENCE = {"plan.json", "recipe.json", "report.json", "report.md", "README.md", "moeprune.log", "density.png"}


def run(*args) -> None:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def release(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint with what releases ship beside the weights, and a model card of its own."""
    path = tmp_path_factory.mktemp("release") / "model"
    shutil.copytree(tiny_checkpoint, path)
    for name, text in CARRIED.items():
        (path / name).write_text(text)
    (path / "README.md").write_text("# the input's own model card\n")
    return path


@pytest.fixture(scope="module")
def results(release, data, tmp_path_factory) -> dict[str, Path]:
    """One uniform drop per pipeline, each with a weight-only criterion (no text read) and a data one."""
    root, out = tmp_path_factory.mktemp("results"), {}
    for pipeline in ("in-memory", "no-load"):
        for criterion, extra in (("aimer", []), ("reap", ["--data", data, "--samples", "8"])):
            name = f"{pipeline}-{criterion}"
            out[name] = root / name
            run("prune", release, "--output", out[name], "--criterion", criterion, "--sparsity", "0.25",
                "--pipeline", pipeline, "--quiet", *extra)  # fmt: skip
    return out


def test_every_result_holds_the_same_files(results, release):
    """The same evidence, weights, config and input files, from either pipeline, with or without data."""
    sets = {name: sorted(p.name for p in folder.iterdir()) for name, folder in results.items()}
    first = next(iter(sets.values()))
    assert all(files == first for files in sets.values()), sets
    assert set(first) >= EVIDENCE
    tokenizer_files = {p.name for p in release.iterdir() if p.name.startswith(("tokenizer", "special_tokens"))}
    assert tokenizer_files and tokenizer_files <= set(first)


def test_input_files_carried_and_model_card_replaced(results, release):
    for folder in results.values():
        for name, text in CARRIED.items():
            assert (folder / name).read_text() == text, name
        card = (folder / "README.md").read_text()
        assert "pruned with moeprune" in card and "the input's own model card" not in card
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert tokenizer("def f(): pass")["input_ids"] == AutoTokenizer.from_pretrained(release)(
            "def f(): pass"
        )["input_ids"]


def test_recipe_records_the_pipeline_and_repeats_the_run(results, release, tmp_path):
    for name, folder in results.items():
        recipe = Recipe.load(folder)
        assert recipe.pipeline == name.rsplit("-", 1)[0]
        assert recipe.config.criterion == name.rsplit("-", 1)[1]
        document = json.loads((folder / "recipe.json").read_text())
        assert document["format"] == "moeprune-recipe" and document["format_version"] == 1
    first = results["no-load-reap"]
    again = tmp_path / "again"
    run("prune", release, "--output", again, "--config", first / "recipe.json", "--quiet")
    assert Plan.load(again / "plan.json").layers == Plan.load(first / "plan.json").layers
    assert Recipe.load(again).pipeline == "no-load"


def test_recipe_written_before_it_had_a_format_still_reads(results):
    """recipe.json files of earlier runs (no format keys, no pipeline) keep loading as in-memory recipes."""
    document = json.loads((results["in-memory-reap"] / "recipe.json").read_text())
    for key in ("format", "format_version", "pipeline"):
        del document[key]
    recipe = Recipe.from_json(document)
    assert recipe.pipeline == "in-memory" and recipe.config.criterion == "reap"
    assert Recipe.from_json(recipe.to_json()) == recipe
