"""`--method auto`: the best plan that fits the budget, chosen on the user's search data among the
recipes that won somewhere (docs/allocation.md's evidence table).

Measured on two MoE models the project had never seen, at 50 % of routed parameters, the best
recipe changed with the model: drop + gradient was best on one and third on the other, rank-16
novices won on one and lost 0.040 held-out ESAP on the other, and the criterion ordering a mixed
search moved it by 0.044. So auto does not guess: its `portfolio` hook lists those recipes as
configs under the one budget, and the job (job/auto.py) scores each on the search data, with the
searches' own teacher-forced fitness (search/portfolio.py), and builds the winner exactly as if it
had been asked for. Auto builds no plan of its own (`fn` None): the winner's method does.

`--stock` keeps the recipes a stock config expresses (`ResolvedConfig.stock`: a fixed allocation of
whole experts or one width), so the result reloads in stock transformers and serves in any engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from moeprune.config import CALIBRATION, SEARCH_DATA, MethodOptions, PruneConfig
from moeprune.config.fields import setting
from moeprune.criteria import AUTO
from moeprune.surgery.registry import METHODS, PARAMETERS, Method, ResolvedConfig

# The recipe named from the evidence when there is no search data to choose on: TENP's trapezoid
# was the best recipe that needs none on both models (0.838 and 0.766 held-out ESAP at 50 %,
# against REAP uniform drop's 0.742 and 0.619)
NO_SEARCH_DATA = PruneConfig("tenp", None, method="tenp")
NO_SEARCH_DATA_LABEL = "TENP trapezoid (--criterion tenp --method tenp)"

AUTO_METHOD = "auto"  # the method's registered name (the command line's default with search data)

TRAPEZOID_ORDER = "tenp"  # TENP's trapezoid is ordered by its own criterion


@dataclass(frozen=True)
class AutoOptions(MethodOptions):
    """auto's one setting: whether only stock-checkpoint plans compete."""

    stock: bool = setting(
        False,
        "auto: only recipes whose result saves as a stock checkpoint (whole experts dropped or one "
        "width, the same in every layer: it reloads in stock transformers and any engine).",
    )


@dataclass(frozen=True)
class Recipe:
    """One candidate of the portfolio: a label for the report and the config it runs."""

    label: str
    config: PruneConfig


def _recipes(order: str, stock: bool) -> list[tuple[str, dict]]:
    """(label, config fields) of every recipe in one criterion's order, cheapest first."""
    uniform = (f"{order} uniform drop", {"method": "drop", "allocation": "uniform"})
    if stock:
        return [uniform, (f"{order} uniform neurons", {"method": "neurons", "allocation": "uniform"})]
    mixed = {"method": "mixed", "options": {"width_multiple": 1}}
    return [
        uniform,  # the one-pass baseline every search must beat
        (f"{order} drop + gradient", {"method": "drop", "allocation": "gradient"}),
        (f"{order} mixed + gradient", mixed | {"allocation": "gradient"}),
        (f"{order} mixed + evo", {"method": "mixed", "allocation": "evo"}),
    ]


def portfolio(config: PruneConfig, orders: tuple[str, ...] = ()) -> list[Recipe]:
    """The recipes auto tries under `config`'s budget (its sparsity or target size, seeds, search
    and repair settings), cheap ones first: TENP's trapezoid, then in each order the uniform drop,
    drop + gradient, mixed + gradient (widths in steps of 1) and mixed + evo, and mixed + evo with
    rank-16 novices in TENP's order (where they won); `--criterion NAME` keeps that order only.
    `--stock`: the recipes a stock config expresses (uniform drop and uniform neurons per order)."""
    resolved = ResolvedConfig.of(config)
    stock = bool(getattr(resolved.options, "stock", False))  # AutoOptions'
    orders = orders if config.criterion == AUTO else (config.criterion,)
    base = replace(resolved.given(), criterion=orders[0], options=None, allocation=None)
    rows: list[tuple[str, dict]] = []
    if not stock and TRAPEZOID_ORDER in orders:
        rows.append(("tenp trapezoid", {"criterion": TRAPEZOID_ORDER, "method": "tenp"}))
    for order in orders:
        rows += [(label, {"criterion": order} | fields) for label, fields in _recipes(order, stock)]
    if not stock:
        novices = orders[-1] if TRAPEZOID_ORDER not in orders else TRAPEZOID_ORDER
        rows.append(
            (
                f"{novices} mixed + evo, rank-16 novices",
                {
                    "criterion": novices,
                    "method": "mixed",
                    "allocation": "evo",
                    "options": {"novice_rank": 16},
                },
            )
        )
    recipes = [Recipe(label, replace(base, **fields)) for label, fields in rows]
    recipes.sort(key=lambda r: ResolvedConfig.of(r.config).allocator.searches)  # stable: plans first
    return [r for r in recipes if ResolvedConfig.of(r.config).stock or not stock]


METHODS.add(
    Method(
        AUTO_METHOD,
        "the best of a portfolio of recipes (uniform and searched drops, TENP, mixed forms with evo "
        "and gradient, novices) scored on --search-data under the one budget (docs/allocation.md)",
        PARAMETERS,
        ("uniform",),
        needs=(CALIBRATION, SEARCH_DATA),
        options=AutoOptions,
        # the criteria whose orders the recipes are tried in with `--criterion auto`
        portfolio=partial(portfolio, orders=("reap", "tenp")),
    )
)
