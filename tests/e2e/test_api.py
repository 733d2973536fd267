"""The one-verb API and the recipe round trip.

The CLI and `moeprune.prune` run the same code on the same arguments, so their pruned models
must give bit-identical logits (same kernels, same order of operations: no tolerance needed).
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import moeprune
from moeprune.checkpoint import load_model
from moeprune.cli.main import main
from moeprune.config import DataOptions, PruneConfig, RunOptions, SearchConfig
from moeprune.errors import MoePruneError

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end


def run(*args, ok: bool = True):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


CASES = {
    "reap-uniform-drop": (PruneConfig(criterion="reap", sparsity=0.5),
                          ["--criterion", "reap", "--sparsity", "0.5"]),
    "mone-global-novice": (PruneConfig(criterion="mone", sparsity=0.25, allocation="global", method="novice"),
                           ["--criterion", "mone", "--sparsity", "0.25", "--allocation", "global",
                            "--method", "novice"]),
    "mone-uniform-novice-rank-2": (PruneConfig(criterion="mone", sparsity=0.25, method="novice",
                                               options={"novice_rank": 2}),
                                   ["--criterion", "mone", "--sparsity", "0.25", "--method", "novice",
                                    "--novice-rank", "2"]),
    "frequency-evo": (PruneConfig(criterion="frequency", sparsity=0.5, allocation="evo",
                                  search=SearchConfig(samples=8, population=4, elites=2, generations=2)),
                      ["--criterion", "frequency", "--sparsity", "0.5", "--allocation", "evo", "--search-samples",
                       "8", "--population", "4", "--elites", "2", "--generations", "2"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_api_on_a_loaded_model_equals_the_cli(tiny_checkpoint, data, tmp_path, case):
    config, flags = CASES[case]
    search = ["--search-data", data] if config.allocation == "evo" else []
    out = tmp_path / "cli"
    run("prune", tiny_checkpoint, "--output", out, *flags, "--data", data, "--samples", "12", "--max-length", "64",
        *search, "--quiet")  # fmt: skip
    model, tokenizer = load_model(tiny_checkpoint)
    result = moeprune.prune(model, config, data=str(data), tokenizer=tokenizer, search_data=str(data) if search else None,
                            options=DataOptions(samples=12, max_length=64), run=RunOptions(progress=False))  # fmt: skip
    assert result.model is model  # in place
    saved = json.loads((out / "plan.json").read_text())
    assert [lp["kept"] for lp in saved["layers"]] == [lp.kept for lp in result.plan.layers]
    reloaded = moeprune.load_pretrained(out)
    ids = torch.tensor([list(b"def add(a, b): return a + b"), list(b"Question 3: what is 3 plus 3?")[:27]])
    assert torch.equal(_logits(model, ids), _logits(reloaded, ids))
    assert result.report.criterion == config.criterion and result.report.method == config.method
    if case.endswith("rank-2"):  # the low-rank novices were fitted, saved and counted (d + 2dR each)
        layers = json.loads((out / "config.json").read_text())["moeprune"]["layers"]
        assert {e.get("novice_rank") for e in layers if e["novice"]} == {2}
        assert any(".novice_u" in name for name, _ in reloaded.named_parameters()) or any(
            "moeprune_novice_u" in name for name, _ in reloaded.named_parameters()
        )


def test_config_round_trips_and_recipe_reproduces_the_output(tiny_checkpoint, data, tmp_path):
    config = PruneConfig(criterion="tenp", sparsity=0.5, method="tenp", options={"slope": 0.25},
                         search=SearchConfig(fitness="kl", patience=3))  # fmt: skip
    assert PruneConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(MoePruneError, match="sparsity"):
        PruneConfig.from_dict({"criterion": "reap"})
    first = tmp_path / "first"
    run("prune", tiny_checkpoint, "--output", first, "--criterion", "reap", "--sparsity", "0.5", "--method",
        "neurons", "--data", data, "--samples", "12", "--quiet")  # fmt: skip
    recipe = json.loads((first / "recipe.json").read_text())
    assert PruneConfig.from_dict(recipe["config"]).method == "neurons"
    again = tmp_path / "again"
    run("prune", tiny_checkpoint, "--output", again, "--config", first / "recipe.json", "--data", data,
        "--samples", "12", "--quiet")  # fmt: skip
    assert (
        json.loads((again / "plan.json").read_text())["layers"]
        == json.loads((first / "plan.json").read_text())["layers"]
    )
    override = tmp_path / "override"  # an option given on the command line wins over the recipe
    run("prune", tiny_checkpoint, "--output", override, "--config", first / "recipe.json", "--sparsity", "0.25",
        "--data", data, "--samples", "12", "--quiet")  # fmt: skip
    report = json.loads((override / "report.json").read_text())
    assert report["sparsity"] == 0.25 and report["method"] == "neurons"


def test_top_level_names_and_error_type():
    """Everything a user's script builds a run from is a top-level name, and moeprune's refusals
    are ValueErrors (caught by `except ValueError` around a call)."""
    import moeprune
    from moeprune.config import SaveOptions

    assert moeprune.SaveOptions is SaveOptions
    assert {"PruneConfig", "SearchConfig", "DataOptions", "SaveOptions", "MoePruneError"} <= set(moeprune.__all__)
    assert issubclass(moeprune.MoePruneError, ValueError)
    with pytest.raises(ValueError, match="unknown keys"):
        moeprune.PruneConfig.from_dict({"criterion": "reap", "sparsity": 0.5, "colour": 1})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read the config"),
        ("{bad", "cannot read the config"),
        ("[1, 2]", "is not a JSON object"),
        ('{"config": {"criterion": "reap", "sparsity": 0.5, "colour": 1}}', "unknown keys ['colour']"),
        (
            '{"config": {"criterion": "reap", "sparsity": 0.5, "search": {"gens": 3}}}',
            "unknown keys ['gens']",
        ),
    ],
)
def test_bad_recipe_is_one_line_before_any_work(tiny_checkpoint, data, tmp_path, content, message):
    recipe = tmp_path / "recipe.json"
    if content is not None:
        recipe.write_text(content)
    out = tmp_path / "out"
    result = run(
        "prune", tiny_checkpoint, "--output", out, "--config", recipe, "--data", data, "--quiet", ok=False
    )
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("moeprune: error:")
    assert not out.exists()


@pytest.mark.parametrize("family, served", [("qwen3_moe", True), ("minimax_m2", False)])
def test_report_says_whether_vllm_serves_a_moeprune_format_result(family, served, data, tmp_path):
    """Per-layer counts need the vLLM plugin: its padded size where it serves the family, else
    its one-sentence refusal, in report.json, the console summary and the model card alike."""
    from moeprune.data.tokenizer import byte_tokenizer
    from moeprune.models.factory import save_tiny_model

    if family not in moeprune.models.supported_families():
        pytest.skip(f"{family} does not work with this transformers")
    tokenizer = byte_tokenizer()
    source = save_tiny_model(family, tmp_path / "in", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(source)
    out = tmp_path / "out"
    result = run("prune", source, "--output", out, "--criterion", "frequency", "--sparsity", "0.25",
                 "--allocation", "global", "--method", "novice", "--data", data, "--samples", "8")  # fmt: skip
    serving = json.loads((out / "report.json").read_text())["serving"]
    card = (out / "README.md").read_text()
    if served:
        assert serving["vllm_parameters"] > 0 and "vllm serve" in card
        assert "served in width groups" in result.output
    else:
        assert "vllm_parameters" not in serving
        assert f"does not serve {family}" in serving["vllm_refused"] and serving["vllm_refused"] in card
        assert "vllm serve" not in card
        assert f"not served: moeprune's plugin does not serve {family}" in result.output


def test_search_settings_are_declared_once():
    """SearchConfig is the one declaration of the search settings: every field is a `moeprune prune`
    flag with the field's default and help, impossible values are refused when the config is made,
    and the search core's old settings class is the same class under a deprecated name."""
    from dataclasses import fields

    from moeprune.cli.options import option_name
    from moeprune.cli.prune import prune as prune_command
    from moeprune.config import SearchConfig

    params = {p.name: p for p in prune_command.params}
    for setting in fields(SearchConfig):
        param = params[option_name(setting)]
        assert param.default == setting.default, setting.name
        assert setting.metadata["help"] in param.help, setting.name
    with pytest.raises(moeprune.MoePruneError, match=r"population \(2\) must be >= elites \(4\)"):
        SearchConfig(population=2, elites=4)
