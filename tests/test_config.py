"""Option objects: the deprecation path that folds old keyword arguments into them."""

from __future__ import annotations

import pytest

from moeprune.checkpoint.files import parse_size
from moeprune.config import DataOptions, PruneConfig, RunOptions, parse_target_size, split_legacy
from moeprune.errors import MoePruneError

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


# ----------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("123456", 123_456),
        (123_456, 123_456),
        ("500MB", 500 * 10**6),
        ("500mb", 500 * 10**6),
        ("40GiB", 40 * 2**30),
        ("40gib", 42_949_672_960),
        ("1.5 TB", 1_500_000_000_000),
        ("2KiB", 2048),
        ("1kB", 1000),
        (" 7 B ", 7),
        ("0.5GiB", 536_870_912),
    ],
)
def test_target_sizes_read_decimal_and_binary_units_in_any_case(text, expected):
    assert parse_target_size(text) == expected


@pytest.mark.parametrize("text", ["2K", "40G", "5 GBs", "ten MB", "1e9", "-3MB", "", "GB", "5 PB", True, 1.5])
def test_anything_else_is_refused_in_one_line_naming_the_target(text):
    with pytest.raises(MoePruneError) as caught:
        parse_target_size(text)
    assert "\n" not in str(caught.value) and caught.value.options == ("target_size",)


def test_a_zero_target_is_not_a_size_and_the_shard_size_keeps_its_words():
    with pytest.raises(MoePruneError, match="the target size must be positive, got '0MB'"):
        parse_target_size("0MB")
    assert parse_size("5GB") == 5 * 10**9
    with pytest.raises(MoePruneError, match="shard size '2K' is not a size"):  # was a KeyError
        parse_size("2K")


def test_a_config_with_a_target_round_trips_and_one_without_keeps_its_keys():
    with_target = PruneConfig("reap", target_size="40GiB")
    assert PruneConfig.from_dict(with_target.to_dict()) == with_target
    assert PruneConfig.from_dict({"criterion": "reap", "target_size": 123456}).target_size == 123456
    assert "target_size" not in PruneConfig("reap", 0.5).to_dict()  # recipes of a sparsity: the same keys
    with pytest.raises(MoePruneError, match="config.target_size must be int or str, got 1.5"):
        PruneConfig.from_dict({"criterion": "reap", "target_size": 1.5})
