"""`--method auto`'s part of the report: the table marks a run that went on within the noise of its
rung's leader and each finalist's fitness before and after repair, the summary line names the
repaired winner, and portfolio.png draws the repaired finalists (a constructed contest)."""

from __future__ import annotations

import pytest

from moeprune.report.parts import Portfolio
from moeprune.report.plots import plot_portfolio
from moeprune.report.prune_report import _portfolio_table

pytestmark = pytest.mark.unit


def _part() -> Portfolio:
    recipes = [
        {"label": "plain", "runs": [{"budget": 1.0, "esap": 0.70, "seconds": 0.1}]},
        {
            "label": "leader",
            "runs": [
                {"budget": 1 / 3, "esap": 0.7958, "seconds": 3.0},
                {"budget": 1.0, "esap": 0.7968, "seconds": 10.0},
            ],
            "repaired": {"before": 0.7968, "after": 0.7968},
        },
        {
            "label": "novices",
            "runs": [
                {
                    "budget": 1 / 3,
                    "esap": 0.7941,
                    "seconds": 2.8,
                    "within_noise": {"leader": "leader", "gap": 0.0017, "standard_error": 0.008},
                },
                {"budget": 1.0, "esap": 0.7950, "seconds": 8.0},
            ],
            "repaired": {"before": 0.7950, "after": 0.8500},
        },
        {"label": "stopped", "runs": [{"budget": 1 / 9, "esap": 0.5, "seconds": 1.0}]},
    ]
    return Portfolio("esap", "novices", 1.0, recipes, "rule", 30.0)


class _Report:
    portfolio = _part()


def test_the_table_marks_runs_that_went_on_within_the_noise_and_the_repaired_finalists():
    rows = {line.split(" |")[0].strip("| "): line for line in _portfolio_table(_Report()) if line.startswith("| ")}
    assert "(went on: 0.0017 behind leader, standard error 0.0080)" in rows["novices (chosen)"]
    assert "repaired: 0.795 -> 0.85" in rows["novices (chosen)"]
    assert "repaired: 0.7968 -> 0.7968" in rows["leader"]
    assert "went on" not in rows["leader"] and "repaired" not in rows["stopped"]


def test_the_summary_line_says_the_winner_was_best_after_repair():
    line = _part().line()
    assert line.startswith("novices (esap 0.7950 on the search data) beat 3 other recipes in 30 s")
    assert "of the 2 best repaired, it was best after repair (0.8500)" in line


def test_portfolio_png_draws_each_finalist_after_repair(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    drawn = []
    original = plt.Axes.scatter

    def scatter(self, x, y, *args, **kwargs):
        if kwargs.get("marker") == "*":
            drawn.append((list(x), list(y)))
        return original(self, x, y, *args, **kwargs)

    monkeypatch.setattr(plt.Axes, "scatter", scatter)
    path = plot_portfolio(tmp_path / "portfolio.png", _part())
    assert path.is_file()
    # one star per finalist at its recipe's seconds so far and its fitness after repair, and the legend's
    assert ([13.0], [0.7968]) in drawn and ([10.8], [0.85]) in drawn and ([], []) in drawn
