"""Size targets in a PruneConfig: how they are read, refused, and written in the recipe."""

from __future__ import annotations

import pytest

from moeprune.checkpoint.files import parse_size
from moeprune.config import PruneConfig, SearchConfig, parse_target_size
from moeprune.errors import MoePruneError

pytestmark = pytest.mark.unit  # no model


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


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"steps": 0}, "search steps must be an integer >= 1, got 0"),
        ({"temperature": 0.0}, "search temperature must be a number > 0, got 0.0"),
        ({"samples": -1}, "search samples must be an integer >= 0, got -1"),
        ({"patience": 0}, "search patience must be an integer >= 1, got 0"),
        ({"population": True}, "search population must be an integer >= 1, got True"),
    ],
)
def test_search_settings_outside_their_declared_bounds_are_one_line(settings, says):
    """The bounds the flags are made from (config/fields.py `setting`) refuse a config made in
    Python too (`check_bounds`); patience's None (never stop early) stays allowed."""
    with pytest.raises(MoePruneError, match=f"^{says}$"):
        SearchConfig(**settings)
    assert SearchConfig(patience=None).patience is None
