"""search.json as one typed document (search/document.py): what every search writes round-trips to
the same JSON, key for key and in order, and the readers' fields come from the right keys."""

from __future__ import annotations

import json

import pytest
from test_search import _data, _moe, _search

from moeprune.errors import MoePruneError
from moeprune.search.document import SearchDocument

pytestmark = pytest.mark.unit


def _round_trip(document: dict) -> SearchDocument:
    text = json.dumps(document)
    parsed = SearchDocument.from_json(json.loads(text))
    assert json.dumps(parsed.to_json()) == text  # the same JSON, in the same order
    return parsed


def test_an_evo_search_json_round_trips_and_reads_typed():
    _, doc = _search(_moe("qwen2_moe"), _data(), 6, fitness="nll")
    parsed = _round_trip(doc)
    assert parsed.generations == doc["generations"] and parsed.fitness == "nll"
    assert parsed.uniform_allocation == doc["uniform"]["allocation"] and sum(parsed.uniform_allocation) == 6
    assert parsed.found["allocation"] == doc["allocation"] and parsed.speed["raced_evaluations"] == []
    assert parsed.teacher_cache == doc["teacher_cache"] and parsed.steps is None


def test_every_search_shape_keeps_its_keys_in_order():
    common = {"evaluations": 3, "stopped": {"reason": "steps"}, "search_samples": 4}
    gradient_mixed = SearchDocument(
        head={"allocation_method": "gradient", "space": "forms"},
        fitness="kl",
        higher_is_better=False,
        config={"steps": 2},
        found={"layers": [1], "genes": [[1, 1, 0, 0, 4]]},
        fitness_value=0.5,
        references={
            "trained": {"fitness_value": 0.6},
            "seeds": {},
            "start": "drop",
            "uniform": {"genes": []},
        },
        steps=2,
        history={"training": [{"step": 0}], "form_logits": {"1": [[0.0]]}},
        timings_s={"total": 1.0},
        criterion="reap",
        **common,
    ).to_json()
    assert list(gradient_mixed) == [
        "allocation_method", "space", "fitness", "higher_is_better", "config", "layers", "genes",
        "fitness_value", "trained", "seeds", "start", "uniform", "evaluations", "steps", "stopped",
        "training", "form_logits", "search_samples", "timings_s", "criterion",
    ]  # fmt: skip
    parsed = _round_trip(gradient_mixed)
    assert parsed.generations is None and parsed.uniform_allocation is None  # mixed: uniform genes
    assert parsed.head == {"allocation_method": "gradient", "space": "forms"} and parsed.criterion == "reap"
    mixed_evo = SearchDocument(
        fitness="esap", higher_is_better=True, space="mixed genes", config={"population": 4},
        found={"genes": [[2, 0, 0, 2, 8]]}, fitness_value=-1.0, references={"seeds": {"drop": {}}},
        history={"generations": [{"generation": 0, "best_genes": [[2, 0, 0, 2, 8]]}]},
        speed={"speedups": {"resume_mode": "plain"}}, **common,
    ).to_json()  # fmt: skip
    assert list(mixed_evo) == [
        "fitness", "higher_is_better", "space", "config", "genes", "fitness_value", "seeds", "evaluations",
        "stopped", "generations", "search_samples", "speedups",
    ]  # fmt: skip
    assert _round_trip(mixed_evo).generations == [{"generation": 0, "best_genes": [[2, 0, 0, 2, 8]]}]


def test_a_document_without_the_spine_is_refused_by_name():
    with pytest.raises(
        MoePruneError, match="without evaluations, stopped: every search writes a SearchDocument"
    ):
        SearchDocument.from_json(
            {"fitness": "kl", "higher_is_better": False, "config": {}, "fitness_value": 1.0}
        )
