"""Option objects: the deprecation path that folds old keyword arguments into them."""

from __future__ import annotations

import pytest

from moeprune.config import DataOptions, RunOptions, split_legacy

pytestmark = pytest.mark.unit  # no model


def test_legacy_keywords_land_in_their_objects_with_a_warning():
    data, run = DataOptions(samples=7), RunOptions()
    with pytest.warns(DeprecationWarning) as caught:
        new_data, new_run = split_legacy(
            {"max_length": 64, "progress": False}, "prune",
            options=(data, {"max_length": "max_length", "data_seed": "seed"}), run=(run, {"progress": "progress"}),
        )  # fmt: skip
    assert [str(w.message) for w in caught] == [
        "prune(max_length=...) is deprecated: pass options=DataOptions(max_length=...)",
        "prune(progress=...) is deprecated: pass run=RunOptions(progress=...)",
    ]
    assert (new_data.samples, new_data.max_length, new_run.progress) == (7, 64, False)
    assert (data.max_length, run.progress) == (512, True)  # the caller's objects are not modified


def test_nothing_legacy_returns_the_same_objects_and_unknown_is_a_type_error():
    data = DataOptions()
    assert split_legacy({}, "prune", options=(data, {})) == [data]
    with pytest.raises(TypeError, match="prune\\(\\) got an unexpected keyword argument 'sampels'"):
        split_legacy({"sampels": 3}, "prune", options=(data, {"samples": "samples"}))
