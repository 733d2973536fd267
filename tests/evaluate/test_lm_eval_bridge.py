"""The lm-eval-harness bridge: a local task on local data (no downloads), in-memory models
(moeprune format included), recovery ratios, and the message when the extra is missing."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeprune.checkpoint import load_model, save_pretrained
from moeprune.cli.main import main
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.errors import MoePruneError
from moeprune.evaluate import EvalOptions, Loaded, evaluate_loaded
from moeprune.evaluate.lm_eval_bridge import LmEvalOptions, recovery, require_lm_eval
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.models.reshape import drop_experts
from moeprune.report.eval_report import to_markdown

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

HAVE_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
needs_lm_eval = pytest.mark.skipif(
    not HAVE_LM_EVAL, reason="lm-eval-harness is not installed (pip install 'moeprune[eval]')"
)
TASK = "moeprune_mini_arith"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """A multiple-choice task YAML reading a local JSONL file through the packaged json builder."""
    folder = tmp_path_factory.mktemp("tasks")
    rows = [
        {"question": f"{a} + {a} =", "choices": [str(2 * a), str(2 * a + 1)], "label": 0} for a in range(6)
    ]
    data = folder / "mini_arith.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return folder


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "ref"
    tokenizer = byte_tokenizer()
    tiny_model("qwen3_moe", vocab_size=len(tokenizer), mlp_only_layers=[]).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def offline(monkeypatch):
    """Nothing may be downloaded: the harness and datasets must work from local files only."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


def test_missing_lm_eval_names_the_extra(monkeypatch, tiny_dir):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    with pytest.raises(MoePruneError, match=r"moeprune\[eval\]"):
        require_lm_eval()
    result = CliRunner().invoke(main, ["eval", str(tiny_dir), "-r", str(tiny_dir), "--metrics", "size",
                                       "--lm-eval-tasks", TASK])  # fmt: skip
    assert result.exit_code == 2 and "pip install 'moeprune[eval]'" in result.output


def test_recovery_ratio():
    model = {"t": {"acc": 0.3, "acc_norm": 0.2}, "u": {"acc": 0.5}}
    reference = {"t": {"acc": 0.6, "acc_norm": 0.0}, "v": {"acc": 1.0}}
    assert recovery(model, reference) == {"t": {"acc": 0.5, "acc_norm": None}}


@needs_lm_eval
def test_in_memory_models_through_the_harness(task_dir, tiny_dir, offline):
    reference, tokenizer = load_model(tiny_dir)
    twin, _ = load_model(tiny_dir)
    uneven, _ = load_model(tiny_dir)
    drop_experts(MoEModel(uneven), {0: [0, 1, 2], 1: [5]})  # per-layer counts differ: moeprune format
    options = EvalOptions(
        metrics=("size",), lm_eval=LmEvalOptions(tasks=[TASK], include=str(task_dir), limit=4)
    )
    doc = evaluate_loaded(
        [Loaded("twin", twin, tokenizer), Loaded("uneven", uneven, tokenizer)],
        Loaded("reference", reference, tokenizer),
        options,
    )
    ref_acc = doc["reference_lm_eval"][TASK]["acc"]
    assert 0 <= ref_acc <= 1
    same, pruned = (m["lm_eval"] for m in doc["models"])
    assert same["results"][TASK]["acc"] == ref_acc
    if ref_acc:
        assert same["recovery"][TASK]["acc"] == 1.0
        assert pruned["recovery"][TASK]["acc"] == pytest.approx(pruned["results"][TASK]["acc"] / ref_acc)
    assert "## lm-eval-harness" in to_markdown(doc)


@needs_lm_eval
def test_cli_with_a_moeprune_format_checkpoint(task_dir, tiny_dir, tmp_path, offline):
    model, tokenizer = load_model(tiny_dir)
    drop_experts(MoEModel(model), {0: [3], 1: [0, 7]})
    assert save_pretrained(model, tmp_path / "uneven", tokenizer) == "moeprune"
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        main,
        ["eval", str(tmp_path / "uneven"), "-r", str(tiny_dir), "--metrics", "size", "--lm-eval-tasks", TASK,
         "--lm-eval-include", str(task_dir), "--limit", "3", "--output", str(out), "--quiet"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert 0 <= doc["models"][0]["lm_eval"]["results"][TASK]["acc"] <= 1


@needs_lm_eval
def test_unknown_task_is_refused_before_loading(task_dir, monkeypatch, offline):
    from moeprune.evaluate import lm_eval_bridge

    local_only = lm_eval_bridge._manager.__wrapped__  # skip indexing the harness's own tasks (slow)
    monkeypatch.setattr(lm_eval_bridge, "_manager", lambda include, defaults: local_only(include, False))
    with pytest.raises(MoePruneError, match="no_such_task_x"):
        lm_eval_bridge.task_manager(LmEvalOptions(tasks=[TASK, "no_such_task_x"], include=str(task_dir)))
