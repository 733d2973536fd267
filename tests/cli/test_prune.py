"""`moeprune prune --target-size`: the sparsity solved so the weights written fit, through the
command line on tiny checkpoints (in memory, without loading, fp8 without loading), its refusals
before anything is loaded, its dry-run lines, and the same from Python.

What "fits" means is checked on the files themselves: the safetensors bytes written (tensors and
headers) are at most the target; the tensors are exactly the planned ones (the predicted bytes
less the headers' bound, the input's headers plus a per-tensor slack); the step below the solved
sparsity was predicted not to fit, and a dry run at that sparsity predicts the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeprune.checkpoint.files import tensor_bytes
from moeprune.cli.main import main
from moeprune.cli.options import SettingOption, option_name
from moeprune.config import PruneConfig, RepairConfig
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.errors import MoePruneError
from moeprune.job import PruneRequest, prune_checkpoint
from moeprune.models.factory import tiny_model
from moeprune.quant.testing import save_fp8_checkpoint
from moeprune.report.prune_report import weight_bytes
from moeprune.shards.weight_bytes import header_bound

pytestmark = pytest.mark.integration  # prunes tiny checkpoints end to end


def run(*args, ok: bool = True):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def target_of(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())["target"]


def check_fits(model: Path, out: Path, target: int) -> dict:
    """The written result fits, its tensors are the planned ones, the step below would not fit."""
    got = target_of(out)
    assert got["target_bytes"] == target
    assert got["written_bytes"] == weight_bytes(out) <= target
    assert tensor_bytes(out) == got["predicted_bytes"] - header_bound(model)
    assert got["step_below_bytes"] > target >= got["predicted_bytes"]
    assert got["step_below"] < got["sparsity"]
    return got


def predicted_at(model: Path, tmp_path: Path, sparsity: float, *flags) -> int:
    """The dry run's predicted bytes at a given sparsity (the planning code a target uses)."""
    done = run("prune", model, "--output", tmp_path / "dry", "--sparsity", sparsity, "--dry-run", *flags)
    line = next(x for x in done.output.splitlines() if x.startswith("output") and "predicted" in x)
    return int(line.split("(")[-1].split(" bytes")[0].replace(",", ""))


@pytest.mark.parametrize(
    "flags",
    [
        ("--criterion", "magnitude"),
        ("--criterion", "reap", "--method", "novice"),
        ("--criterion", "reap", "--method", "neurons", "--allow-super-experts"),  # the stock plan, exactly
        ("--criterion", "tenp", "--method", "tenp"),
        ("--criterion", "reap", "--allocation", "global"),
        ("--criterion", "reap", "--method", "mixed", "--mixed-whole", 0.25, "--mixed-novice", 0.125),
        ("--criterion", "reap", "--method", "mixed", "--mixed-whole", 0.25, "--mixed-novice", 0.125,
         "--novice-rank", 2),  # rank-2 novices: d + 4d values each, in the plan and the bytes
        ("--criterion", "reap", "--method", "mixed", "--width-multiple", 4),  # widths in blocks of 4
    ],  # fmt: skip
    ids=["drop", "novice", "neurons", "tenp", "global", "mixed", "mixed-rank", "mixed-multiple"],
)
def test_the_written_weights_fit_and_one_step_less_would_not(tiny_checkpoint, data, tmp_path, flags):
    # in bfloat16 the tiny model is 158,784 bytes of tensors: aim at about 75 % of its files
    target = 130_000 if {"neurons", "mixed"} & set(flags) else 150_000
    common = ("--save-dtype", "bf16", "--data", data, "--samples", 12, *flags)
    run("prune", tiny_checkpoint, "--output", tmp_path / "out", "--target-size", target, "--quiet", *common)
    got = check_fits(tiny_checkpoint, tmp_path / "out", target)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["sparsity"] == got["sparsity"] and got["format"] == "bfloat16"
    dry = ("--save-dtype", "bf16", "--data", data, "--samples", 12, *flags)
    assert predicted_at(tiny_checkpoint, tmp_path, got["sparsity"], *dry) == got["predicted_bytes"]
    if got["step_below"]:  # 0: the unpruned model, a sparsity no dry run takes
        assert predicted_at(tiny_checkpoint, tmp_path, got["step_below"], *dry) == got["step_below_bytes"]
    else:
        assert got["step_below_bytes"] == got["unpruned_bytes"]
    if "--width-multiple" in flags:
        plan = json.loads((tmp_path / "out" / "plan.json").read_text())
        widths = [w for layer in plan["layers"] for w in layer["neurons"].values()]
        assert widths and all(w % 4 == 0 for w in widths), widths


def test_summary_model_card_and_recipe_give_the_target(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    done = run("prune", tiny_checkpoint, "--output", out, "--criterion", "magnitude", "--target-size", "250kB")
    got = target_of(out)
    line = next(x for x in done.output.splitlines() if x.strip().startswith("target size"))
    assert f"250.00 kB: {got['written_bytes'] / 1e3:.2f} kB of float32 weights written" in line
    assert f"sparsity {got['sparsity']:g} solved" in line
    assert line in (out / "report.md").read_text()
    card = (out / "README.md").read_text()
    assert f"({got['written_bytes']:,} bytes) of float32 weights written; sparsity {got['sparsity']:g}" in card
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["config"]["sparsity"] == got["sparsity"] and "target_size" not in recipe["config"]
    assert recipe["target"] == {"target_size": 250_000, "solved_sparsity": got["sparsity"]}
    # the recipe repeats the solved sparsity; a target typed beside it wins over the recipe's
    again = run("prune", tiny_checkpoint, "--output", tmp_path / "again", "--config", out / "recipe.json",
                "--target-size", "200kB", "--quiet")  # fmt: skip
    assert again.exit_code == 0 and target_of(tmp_path / "again")["target_bytes"] == 200_000


def test_no_load_drops_to_a_stock_count_that_fits(tiny_checkpoint, tmp_path):
    # without loading, every layer keeps the same count: 4 layers of 8, so steps of 4 experts of 32
    run("prune", tiny_checkpoint, "--output", tmp_path / "out", "--criterion", "magnitude", "--target-size", "250kB",
        "--no-load", "--quiet")  # fmt: skip
    got = check_fits(tiny_checkpoint, tmp_path / "out", 250_000)
    assert got["format"] == "float32" and (got["sparsity"] * 32) % 4 == 0
    assert got["step_below"] == pytest.approx(got["sparsity"] - 4 / 32)


def test_an_fp8_input_keeps_fp8_and_counts_its_scales(tmp_path):
    tokenizer = byte_tokenizer()
    model = tiny_model("qwen3_moe", vocab_size=len(tokenizer), num_hidden_layers=4, mlp_only_layers=[])
    fp8 = save_fp8_checkpoint(model, tmp_path / "fp8", block=(16, 16), tokenizer=tokenizer)
    target = 150_000
    dry = run("prune", fp8, "--output", tmp_path / "out", "--criterion", "magnitude", "--target-size", target,
              "--no-load", "--dry-run")  # fmt: skip
    lines = dry.output.splitlines()
    fmt = "float8_e4m3fn (fp8, 16x16 blocks)"
    assert f"input     {fmt}, {weight_bytes(fp8) / 1e3:.2f} kB of weights ({weight_bytes(fp8):,} bytes)" in lines
    assert not (tmp_path / "out").exists()
    run("prune", fp8, "--output", tmp_path / "out", "--criterion", "magnitude", "--target-size", target,
        "--no-load", "--quiet")  # fmt: skip
    got = check_fits(fp8, tmp_path / "out", target)
    assert got["format"] == fmt
    assert f"output    {fmt}, predicted {got['predicted_bytes'] / 1e3:.2f} kB of weights" in dry.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    narrowed = run("prune", fp8, "--output", tmp_path / "n", "--criterion", "magnitude", "--target-size", target,
                   "--no-load", "--method", "neurons", ok=False)  # fmt: skip
    assert narrowed.exit_code == 2 and "is planned for the drop method only" in narrowed.output


def test_dry_run_prints_the_formats_the_sizes_and_the_target(tiny_checkpoint, tmp_path):
    plain = run("prune", tiny_checkpoint, "--output", tmp_path / "out", "--criterion", "magnitude",
                "--sparsity", "0.5", "--save-dtype", "bf16", "--dry-run").output.splitlines()  # fmt: skip
    size = weight_bytes(tiny_checkpoint)
    assert f"input     float32, {size / 1e3:.2f} kB of weights ({size:,} bytes)" in plain
    assert any(x.startswith("output    bfloat16, predicted ") for x in plain)
    assert not any(x.startswith("target") for x in plain)
    solved = run("prune", tiny_checkpoint, "--output", tmp_path / "out", "--criterion", "magnitude",
                 "--target-size", "150kB", "--save-dtype", "bf16", "--dry-run").output  # fmt: skip
    assert "target    150.00 kB (150,000 bytes): sparsity " in solved and "the smallest step that fits" in solved
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--target-size", "1kB"), "no drop plan fits in 1.00 kB (1,000 bytes): the smallest reachable is"),
        (("--target-size", "1GB"), "the unpruned model already fits"),
        (("--target-size", "40G"), "target size '40G' is not a size"),
        (("--target-size", "1MB", "--sparsity", "0.5"), "give a sparsity (0.5) or a target size (1MB), not both"),
        ((), "give a sparsity or a target size"),
        (("--target-size", "1kB", "--no-load"), "no drop plan fits in 1.00 kB"),
    ],
)
def test_refusals_come_in_one_line_before_anything_is_written(tiny_checkpoint, tmp_path, flags, message):
    out = tmp_path / "out"
    done = run("prune", tiny_checkpoint, "--output", out, "--criterion", "magnitude", *flags, ok=False)
    assert done.exit_code == 2, done.output
    assert message in done.output and len(done.output.strip().splitlines()) == 1
    assert "--target-size" in done.output
    assert not out.exists()


def test_the_python_api_takes_a_target_and_prune_of_a_loaded_model_says_where(tiny_checkpoint, tmp_path):
    config = PruneConfig("magnitude", target_size=250_000)
    report = prune_checkpoint(PruneRequest(tiny_checkpoint, tmp_path / "out", config), "in-memory")
    assert report["target"]["written_bytes"] <= 250_000 and report["sparsity"] == report["target"]["sparsity"]
    from moeprune.api import prune

    with pytest.raises(MoePruneError, match="prune\\(\\) of a loaded model takes a sparsity"):
        prune(tiny_model("qwen3_moe"), config)


def test_every_option_that_sets_a_prune_config_field_is_made_from_that_field():
    """Each PruneConfig setting is one flag of `prune`, generated from the field (its default,
    required-ness and help), and no other option sets it: a hand-written duplicate fails here."""
    params = main.commands["prune"].params
    settings = [f for f in fields(PruneConfig) if "help" in f.metadata]
    assert {f.name for f in settings} == {
        f.name for f in fields(PruneConfig) if f.init and f.name not in ("search", "repair", "options")
    }
    for setting in settings + [f for f in fields(RepairConfig) if "help" in f.metadata]:  # --repair's too
        flag = setting.metadata["flag"] or "--" + setting.name.replace("_", "-")
        same = [p for p in params if p.name == option_name(setting) or flag in p.opts]
        assert len(same) == 1, (setting.name, same)
        option = same[0]
        assert isinstance(option, SettingOption) and option.setting is setting, setting.name
        # --criterion is the one required field the command fills in when left out (--method auto)
        assert option.required == (setting.default is MISSING and setting.name != "criterion")
        assert option.required or option.default == (None if setting.default is MISSING else setting.default)
        assert option.help.startswith(setting.metadata["help"])


def test_an_entry_registered_after_the_cli_is_a_valid_choice(monkeypatch):
    """A method a plugin (or a test) registers after `moeprune.cli` was imported is accepted by
    --method, and an unknown name is still refused: the choices are the registry's at parse time."""
    import click

    from moeprune.surgery import METHODS

    method = next(p for p in main.commands["prune"].params if p.name == "method")
    with pytest.raises(click.BadParameter):
        method.type.convert("late", method, None)
    monkeypatch.setitem(METHODS._specs, "late", METHODS.get("drop"))
    assert method.type.convert("late", method, None) == "late"
