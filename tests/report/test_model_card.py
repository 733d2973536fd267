"""The model card opens with the Hub's YAML metadata, valid and true to the report, and
`moeprune report OUT` redraws the card from report.json."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner
from test_document_json import FACTS, HEAD, NO_LOAD_DROP, TAIL

from moeprune.cli import main
from moeprune.report.document import PruneReport
from moeprune.report.model_card import front_matter, hub_id, model_card

pytestmark = pytest.mark.unit  # JSON documents only

SNAPSHOT = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen3-30B-A3B/snapshots/0123abcd"


def _metadata(card: str) -> tuple[dict, str]:
    """The YAML block between the opening `---` lines (parsed strictly) and the body after it."""
    assert card.startswith("---\n")
    head, body = card[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


@pytest.mark.parametrize(
    "model,expected",
    [
        (SNAPSHOT, "Qwen/Qwen3-30B-A3B"),
        (SNAPSHOT + "/", "Qwen/Qwen3-30B-A3B"),
        ("/cache/hub/models--gpt2/snapshots/e7da7f2", "gpt2"),  # an id without an organisation
        ("/cache/hub/models--deepseek-ai--DeepSeek-V3/snapshots/abc/../x", None),
        ("Qwen/Qwen3-30B-A3B", None),  # as recorded, a relative local folder: it may not be the Hub's
        ("/data/models/qwen", None),
        (None, None),
    ],
)
def test_the_base_model_is_a_hub_id_only_when_known(model, expected):
    assert hub_id(model) == expected


def test_front_matter_is_the_hubs_metadata():
    report = {**HEAD, **FACTS, **TAIL, "model": SNAPSHOT}  # allocation evo, method drop, moeprune format
    meta, body = _metadata(model_card(report, "out"))
    assert meta == {
        "base_model": "Qwen/Qwen3-30B-A3B",
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["moe", "pruned", "moeprune", "reap", "evo", "drop", "custom_code"],
    }
    assert "base_model_relation" not in meta  # the Hub has no value for pruning
    assert body.startswith("\n# out: qwen3_moe pruned with moeprune\n")
    assert f"- Base model: `{SNAPSHOT}` (qwen3_moe)" in body  # every line of the card before stays


def test_a_stock_result_from_a_local_folder_has_no_base_model_and_no_custom_code():
    report = {**HEAD, **FACTS, **TAIL, "format": "stock", "method": "tenp", "criterion": "tenp"}
    meta, _ = _metadata(model_card(report, "out"))
    assert "base_model" not in meta
    assert meta["tags"] == ["moe", "pruned", "moeprune", "tenp", "evo"]  # one tag per name


def test_scalars_that_yaml_would_misread_are_quoted():
    """An id or a name that YAML reads as a number, a boolean or a mapping stays a string."""
    odd = {**HEAD, **FACTS, **TAIL, "model": "/c/models--1e3--no/snapshots/r", "criterion": "yes",
           "allocation": "a: b", "method": "#x"}  # fmt: skip
    meta, _ = _metadata("\n".join(front_matter(PruneReport.from_json(odd))) + "\n")
    assert meta["base_model"] == "1e3/no"
    assert meta["tags"][3:] == ["yes", "a: b", "#x", "custom_code"]


def test_moeprune_report_redraws_the_card(tmp_path):
    document = {**HEAD, **FACTS, **TAIL, "model": SNAPSHOT, "output": str(tmp_path)}
    (tmp_path / "report.json").write_text(json.dumps(document))
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert f"wrote {tmp_path / 'README.md'}" in result.output
    assert (tmp_path / "README.md").read_text() == model_card(document, str(tmp_path))


def test_moeprune_report_leaves_a_no_load_outputs_readme_alone(tmp_path):
    """A prune without loading writes no card: its README.md is the base model's, copied."""
    (tmp_path / "report.json").write_text(json.dumps({**NO_LOAD_DROP, "output": str(tmp_path)}))
    (tmp_path / "README.md").write_text("the base model's card\n")
    result = CliRunner().invoke(main, ["report", str(tmp_path)])  # nothing else to draw: exit 2
    assert (tmp_path / "README.md").read_text() == "the base model's card\n"
    assert "README.md" not in result.output


CHECK = {"verdict": "match", "vllm_version": "0.32.0", "dtype": "float32", "prompt_sources": ["p.jsonl"],
         "prompts": 8, "new_tokens": 16, "top_k": 5, "tokens_compared": 128, "ties": 0,
         "max_logprob_difference": 3.1e-06, "logprob_atol": 0.0002, "vllm_tokens_per_s": 1315.1,
         "reference": "base", "reference_tokens_per_s": 1356.1, "throughput_ratio": 0.97}  # fmt: skip


def test_a_serve_check_round_trips_and_is_in_the_card():
    document = {**HEAD, **FACTS, **TAIL, "serve_check": CHECK}
    assert json.dumps(PruneReport.from_json(document).to_json()) == json.dumps(document)
    card = model_card(document, "out")
    line = next(line for line in card.splitlines() if "serve-check" in line)
    assert line.startswith(
        "- Served by vLLM as moeprune loads it (`moeprune serve-check`, float32, vLLM 0.32.0)"
    )
    assert "128 compared, all equal" in line and "within 3.1e-06" in line and "(tolerance 0.0002)" in line
    assert "0.97x the base model's 1,356.1" in line


def test_a_failed_serve_check_says_where_in_the_card():
    failed = {**CHECK, "verdict": "mismatch", "first_difference": "prompt 2, generated token 5: ...",
              "first_difference_at": [2, 5], "max_logprob_difference": 0.4}  # fmt: skip
    card = model_card({**HEAD, **FACTS, **TAIL, "serve_check": failed}, "out")
    assert "vLLM does NOT serve it as moeprune loads it" in card
    assert "first difference at prompt 2, generated token 5" in card


def test_the_card_gives_what_vllm_holds_in_bytes_of_the_saved_dtype():
    """Parameters times the saved dtype's size: 1,048,576 bf16 parameters are 2.0 MiB; a dtype
    without a fixed size per parameter (a kept quantization) gives the parameters alone."""
    base = {**HEAD, **FACTS, **TAIL, "serving": {"vllm_parameters": 1_048_576}}
    card = model_card(PruneReport.from_json({**base, "save_dtype": "bfloat16"}), "out")
    assert "it holds 1,048,576 parameters (2.0 MiB in bfloat16)" in card
    card = model_card(PruneReport.from_json({**base, "save_dtype": "float32"}), "out")
    assert "it holds 1,048,576 parameters (4.0 MiB in float32)" in card
    card = model_card(PruneReport.from_json({**base, "save_dtype": "float8_e4m3fn (fp8, 128x128 blocks)"}), "out")
    assert "it holds 1,048,576 parameters, against" in card
