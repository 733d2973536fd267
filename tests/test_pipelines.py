"""Pipelines by execution mode: what each declares, the refusals made from the registry, and the
command line choosing one by name (`--pipeline no-load` is `--no-load`)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from moeprune.cli.main import main
from moeprune.config import DataOptions, PruneConfig, SearchConfig
from moeprune.errors import MoePruneError
from moeprune.job.pipelines import (
    EVO_SETTINGS,
    GRADIENT_SETTINGS,
    PIPELINES,
    score_pipeline,
    score_unread_settings,
    unread_settings,
)
from moeprune.surgery import METHODS

pytestmark = pytest.mark.integration  # the last test prunes a tiny checkpoint twice


def test_in_memory_runs_every_method_and_no_load_what_a_stock_checkpoint_expresses():
    assert PIPELINES.names() == ["in-memory", "no-load"]
    for method in METHODS:  # auto takes no allocation: each of its recipes has its own
        allocation = method.allocations[0] if method.portfolio is None else None
        PIPELINES.get("in-memory").check(PruneConfig("reap", 0.5, allocation=allocation, method=method.name))
    no_load = PIPELINES.get("no-load")
    no_load.check(PruneConfig("reap", 0.5, method="neurons"))
    with pytest.raises(MoePruneError, match="runs the drop or neurons method with the uniform allocation") as caught:
        no_load.check(PruneConfig("reap", 0.5, method="tenp"))
    assert "the tenp method with the trapezoid allocation needs the in-memory pipeline" in str(caught.value)
    no_load.check(PruneConfig("reap", 0.5, allocation="global"))  # per-layer counts: moeprune's format
    with pytest.raises(MoePruneError, match="the drop method with the evo allocation needs the in-memory pipeline"):
        no_load.check(PruneConfig("reap", 0.5, allocation="evo"))
    # a combination no pipeline runs is refused by the one check of the config, before the pipeline's
    with pytest.raises(MoePruneError, match="the neurons method goes with the uniform allocation, not global"):
        no_load.check(PruneConfig("reap", 0.5, allocation="global", method="neurons"))
    with pytest.raises(MoePruneError, match="needs a named criterion"):
        no_load.check(PruneConfig("auto", 0.5))


def test_unread_settings_name_what_each_run_would_ignore():
    plain = dict(unread_settings(PIPELINES.get("in-memory"), PruneConfig("reap", 0.5)))
    assert plain[("search_data", SearchConfig)] == "without --allocation evo or gradient or --criterion auto"
    # a stray search flag names the one allocation that reads it (refused before the shared settings)
    order = [settings for settings, _ in unread_settings(PIPELINES.get("in-memory"), PruneConfig("reap", 0.5))]
    assert plain[GRADIENT_SETTINGS] == "without --allocation gradient" and plain[EVO_SETTINGS] == "without --allocation evo"
    assert order.index(GRADIENT_SETTINGS) < order.index(("search_data", SearchConfig))
    assert plain[("important_fraction", "slope")] == "without --method tenp"
    assert plain[("neuron_importance", "width_multiple")] == "without --method neurons or tenp or mixed"
    searched = unread_settings(PIPELINES.get("in-memory"), PruneConfig("reap", 0.5, allocation="evo"))
    assert not any(SearchConfig in settings for settings, _ in searched)
    assert dict(searched)[GRADIENT_SETTINGS] == "without --allocation gradient"  # --gradient-steps with evo
    trained = dict(unread_settings(PIPELINES.get("in-memory"), PruneConfig("reap", 0.5, allocation="gradient")))
    assert trained[EVO_SETTINGS] == "without --allocation evo" and "resume" in EVO_SETTINGS
    assert GRADIENT_SETTINGS not in trained
    no_load = [s for settings, _ in unread_settings(PIPELINES.get("no-load"), PruneConfig("reap", 0.5)) for s in settings]
    assert {"resume", "save_dtype", "max_shard_size"} <= set(no_load)
    assert "dry_run" not in no_load  # the no-load pipeline plans its work too


def test_score_pipeline_follows_the_options_and_streaming_reads_weights_only():
    assert score_pipeline(False, DataOptions()).name == "in-memory"
    assert score_pipeline(False, DataOptions(sequential=True)).name == "layer-by-layer"
    streaming = score_pipeline(True, DataOptions())
    assert streaming.name == "streaming"
    streaming.check("aimer")
    with pytest.raises(MoePruneError, match="--streaming reads weights only; 'reap' needs data"):
        streaming.check("reap")
    weights_only = dict(score_unread_settings(score_pipeline(False, DataOptions()), "aimer"))
    assert weights_only[("data", "samples", "max_length", "batch_size", "packing", "tokenizer_path")] == (
        "with criterion aimer (it reads weights only)"
    )


def test_pipeline_option_is_the_no_load_flag(tiny_checkpoint, data, tmp_path):
    common = ["prune", str(tiny_checkpoint), "--criterion", "reap", "--sparsity", "0.25", "--data", str(data),
              "--samples", "12", "--quiet"]  # fmt: skip
    for name, flags in (("flag", ["--no-load"]), ("option", ["--pipeline", "no-load"])):
        done = CliRunner().invoke(main, [*common, "--output", str(tmp_path / name), *flags], catch_exceptions=False)
        assert done.exit_code == 0, done.output
    reports = [json.loads((tmp_path / n / "report.json").read_text()) for n in ("flag", "option")]
    assert reports[0]["command"] == reports[1]["command"] == "prune --no-load"
    assert (tmp_path / "flag" / "plan.json").exists() is (tmp_path / "option" / "plan.json").exists()
    assert reports[0]["removed_per_layer"] == reports[1]["removed_per_layer"]
    assert reports[0]["scores"] == reports[1]["scores"]
