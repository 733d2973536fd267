"""Hand-computed checks of every expert criterion (formulas.md, "Expert criteria")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from moeprune.criteria import (
    CRITERIA,
    compute_scores,
    get_criterion,
    list_criteria,
    unseen_note,
)
from moeprune.criteria.data import UNIFIED_FORM
from moeprune.errors import MoePruneError
from moeprune.observe.stats import ExpertStats, LayerStats

pytestmark = pytest.mark.unit  # fast, small inputs: `pytest -m unit` runs them all in about a minute

# Tokens of one layer with 4 experts, hidden size 2: (expert, E_i(h_t), g_i(t), h_t).
# Expert 2 is never reached.
TOKENS = [
    (0, (3.0, 4.0), 0.5, (3.0, 4.0)),  # ||E|| 5, cos 1  -> 1 - cos = 0
    (0, (0.0, 2.0), 0.25, (2.0, 0.0)),  # ||E|| 2, cos 0  -> 1 - cos = 1
    (1, (1.0, 0.0), 0.5, (1.0, 0.0)),  # ||E|| 1, cos 1  -> 0
    (1, (1.0, 0.0), 0.5, (-1.0, 0.0)),  # ||E|| 1, cos -1 -> 2
    (1, (4.0, 0.0), 0.5, (0.0, 1.0)),  # ||E|| 4, cos 0  -> 1
    (3, (0.0, -3.0), 0.75, (0.0, 1.0)),  # ||E|| 3, cos -1 -> 2
]


def accumulate(tokens: list, layer: int = 7, num_experts: int = 4) -> LayerStats:
    """What the observer does, one token at a time (add_moments before bumping count)."""
    s = LayerStats.zeros(layer, num_experts, 2, 3)
    for e, y, g, h in tokens:
        y_t, h_t = torch.tensor(y, dtype=torch.float64), torch.tensor(h, dtype=torch.float64)
        norm = float(y_t.norm())
        cos = float(torch.dot(y_t, h_t) / (norm * h_t.norm()))
        s.add_moments(e, 1, y_t, torch.zeros(2, dtype=torch.float64))
        s.count[e] += 1
        s.weight_sum[e] += g
        s.norm_sum[e] += norm
        s.weighted_norm_sum[e] += g * norm
        s.tenp_sum[e] += g * norm * (1 - cos)
    return s


def stats_of(*layers: LayerStats) -> ExpertStats:
    return ExpertStats(layers=list(layers))


def one_layer(name: str, stats) -> tuple[np.ndarray, list[int]]:
    (result,) = compute_scores(name, stats=stats)
    assert result.layer == 7 and result.scores.dtype == np.float64
    return result.scores, result.order


def test_registry() -> None:
    assert list_criteria() == [
        "random",
        "magnitude",
        "aimer",
        "frequency",
        "seer",
        "ean",
        "reap",
        "mone",
        "tenp",
        "man",
        "msan",
    ]
    assert get_criterion("aimer").prune_first == "highest"
    assert all(CRITERIA.get(n).prune_first == "lowest" for n in list_criteria() if n != "aimer")
    assert {c.name for c in CRITERIA if c.needs_data} == {
        "frequency",
        "seer",
        "ean",
        "reap",
        "mone",
        "tenp",
        "man",
        "msan",
    }
    assert {c.name for c in CRITERIA if c.needs_weights} == {"magnitude", "aimer"}


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(MoePruneError, match="unknown criterion 'foo'.*random.*aimer.*tenp"):
        get_criterion("foo")
    with pytest.raises(MoePruneError, match="choose one of: random, magnitude"):
        compute_scores("foo", num_experts=[4])


def test_frequency() -> None:
    # counts: expert 0 two tokens, 1 three, 2 none, 3 one
    scores, order = one_layer("frequency", stats_of(accumulate(TOKENS)))
    np.testing.assert_array_equal(scores, [2, 3, 0, 1])
    assert order == [2, 3, 0, 1]


def test_seer_ties_broken_by_expert_id() -> None:
    # 0.5 + 0.25 = 0.75; 3 x 0.5 = 1.5; 0; 0.75  -> experts 0 and 3 tie, 0 goes first
    scores, order = one_layer("seer", stats_of(accumulate(TOKENS)))
    np.testing.assert_allclose(scores, [0.75, 1.5, 0.0, 0.75])
    assert order == [2, 0, 3, 1]


def test_ean() -> None:
    # 5 + 2 = 7; 1 + 1 + 4 = 6; 0; 3
    scores, order = one_layer("ean", stats_of(accumulate(TOKENS)))
    np.testing.assert_allclose(scores, [7.0, 6.0, 0.0, 3.0])
    assert order == [2, 3, 1, 0]


def test_reap() -> None:
    # (0.5*5 + 0.25*2)/2 = 1.5; 0.5*(1+1+4)/3 = 1.0; 0 (no token); 0.75*3/1 = 2.25
    scores, order = one_layer("reap", stats_of(accumulate(TOKENS)))
    np.testing.assert_allclose(scores, [1.5, 1.0, 0.0, 2.25])
    assert order == [2, 1, 0, 3]


def test_tenp() -> None:
    # 0.5*5*0 + 0.25*2*1 = 0.5; 0.5*1*0 + 0.5*1*2 + 0.5*4*1 = 3; 0; 0.75*3*2 = 4.5
    scores, order = one_layer("tenp", stats_of(accumulate(TOKENS)))
    np.testing.assert_allclose(scores, [0.5, 3.0, 0.0, 4.5])
    assert order == [2, 0, 1, 3]


def test_man_msan() -> None:
    # norms: expert 0 {5, 2}, 1 {1, 1, 4}, 2 none, 3 {3}
    # MAN: 7/2 = 3.5; 6/3 = 2; 0 (no token, as reap); 3
    # MSAN: (25 + 4)/2 = 14.5; (1 + 1 + 16)/3 = 6; 0; 9
    man, man_order = one_layer("man", stats_of(accumulate(TOKENS)))
    msan, msan_order = one_layer("msan", stats_of(accumulate(TOKENS)))
    np.testing.assert_allclose(man, [3.5, 2.0, 0.0, 3.0], rtol=1e-12)
    np.testing.assert_allclose(msan, [14.5, 6.0, 0.0, 9.0], rtol=1e-12)
    assert man_order == msan_order == [2, 1, 3, 0]


def test_man_msan_rank_differently() -> None:
    # expert 0: norms 1, 2, 3 (outputs spread in two dimensions) -> MAN 2, MSAN 14/3;
    # expert 1: one token of norm 2.1 -> MAN 2.1, MSAN 4.41; expert 2 unseen -> 0 for both
    # (pruned first, as reap does). MAN prunes 0 before 1, MSAN 1 before 0: squaring weighs
    # expert 0's rare large output.
    tokens = [
        (0, (1.0, 0.0), 0.5, (1.0, 0.0)),
        (0, (0.0, -2.0), 0.5, (1.0, 0.0)),
        (0, (3.0, 0.0), 0.5, (1.0, 0.0)),
        (1, (0.0, 2.1), 0.5, (1.0, 0.0)),
    ]
    stats = stats_of(accumulate(tokens, num_experts=3))
    man, man_order = one_layer("man", stats)
    msan, msan_order = one_layer("msan", stats)
    np.testing.assert_allclose(man, [2.0, 2.1, 0.0], rtol=1e-12)
    np.testing.assert_allclose(msan, [14 / 3, 2.1**2, 0.0], rtol=1e-12)
    assert man_order == [2, 0, 1] and msan_order == [2, 1, 0]


def unified_reference(tokens: list, expert: int, b: int, alpha: int, beta: int) -> float:
    """S(b, alpha, beta) straight from the tokens: (1/n)^b sum g^alpha ||E||^beta, 0 if n = 0."""
    rows = [(g, math.hypot(*y)) for e, y, g, _ in tokens if e == expert]
    if not rows:
        return 0.0
    return (1 / len(rows)) ** b * sum(g**alpha * norm**beta for g, norm in rows)


@pytest.mark.parametrize("name", sorted(UNIFIED_FORM))
def test_unified_form_gives_each_criterion(name: str) -> None:
    scores, _ = one_layer(name, stats_of(accumulate(TOKENS)))
    expected = [unified_reference(TOKENS, e, *UNIFIED_FORM[name]) for e in range(4)]
    np.testing.assert_allclose(scores, expected, rtol=1e-12)


def test_mone_hand_and_numpy() -> None:
    # expert 0: mean (1.5, 3); var = ((1.5^2+1.5^2)/1, (1+1)/1) = (4.5, 2); ||sqrt var|| = sqrt(6.5);
    #   phi_freq = 0.75/2 = 0.375 -> 0.375 sqrt(6.5)
    # expert 1: mean (2, 0); var = ((1+1+4)/2, 0) = (3, 0) -> sqrt(3); phi_freq 0.5 -> sqrt(3)/2
    # expert 2: unseen -> 0; expert 3: one token, unbiased variance undefined -> 0
    scores, order = one_layer("mone", stats_of(accumulate(TOKENS)))
    np.testing.assert_allclose(scores, [0.375 * math.sqrt(6.5), math.sqrt(3) / 2, 0.0, 0.0], rtol=1e-12)
    assert order == [2, 3, 1, 0]
    for e in (0, 1):
        ys = np.array([y for i, y, _, _ in TOKENS if i == e])
        gs = np.array([g for i, _, g, _ in TOKENS if i == e])
        expected = np.linalg.norm(np.sqrt(ys.var(axis=0, ddof=1))) * gs.mean()
        assert scores[e] == pytest.approx(expected, rel=1e-12)


def test_domains_merge_without_mutating_inputs() -> None:
    # splitting the tokens over two domains gives the single-domain scores (sums add, moments merge)
    a, b = accumulate(TOKENS[::2]), accumulate(TOKENS[1::2])
    before = [t.clone() for t in (a.count, a.mean, a.m2, b.count, b.mean, b.m2)]
    full = stats_of(accumulate(TOKENS))
    for name in ("frequency", "seer", "ean", "reap", "mone", "man", "msan"):
        merged, _ = one_layer(name, [stats_of(a), stats_of(b)])
        single, _ = one_layer(name, full)
        np.testing.assert_allclose(merged, single, rtol=1e-12, atol=1e-15)
    after = (a.count, a.mean, a.m2, b.count, b.mean, b.m2)
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_tenp_multi_domain_normalisation() -> None:
    # domain A [3, 4, 0] / 5 = [0.6, 0.8, 0]; domain B [0, 60, 80] / 100 = [0, 0.6, 0.8];
    # domain C is all zero (norm 0) and adds nothing. I_mix = [0.6, 1.4, 0.8]
    # (raw sums [3, 64, 80] would rank 0, 1, 2 instead).
    def domain(values: list[float]) -> ExpertStats:
        s = LayerStats.zeros(7, 3, 2, 3)
        s.tenp_sum[:] = torch.tensor(values, dtype=torch.float64)
        return stats_of(s)

    doms = [domain([3, 4, 0]), domain([0, 60, 80]), domain([0, 0, 0])]
    scores, order = one_layer("tenp", doms)
    np.testing.assert_allclose(scores, [0.6, 1.4, 0.8], rtol=1e-12)
    assert order == [0, 2, 1]
    assert float(doms[1].layers[0].tenp_sum[2]) == 80.0  # inputs untouched


@dataclass
class FakeWeights:
    layer: int
    experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.experts[expert]


def _expert(gate: list, up: list, down: list, scale: float = 1.0, dtype=torch.float32) -> tuple:
    return tuple(torch.tensor(x, dtype=dtype) * scale for x in (gate, up, down))


# I = 1, d = 2: gate [1, 2], up [1, 2], down [2, 1]; N = 6 elements per expert.
HAND_EXPERTS = FakeWeights(
    layer=3,
    experts=[
        _expert([[1, -1]], [[1, 1]], [[1], [-1]]),  # all |w| = 1
        _expert([[2, 0]], [[0, 0]], [[0], [0]]),  # one non-zero
        _expert([[3, 0]], [[0, 4]], [[0], [0]]),  # l1 7, l2 5
        _expert([[3, 0]], [[0, 4]], [[0], [0]], scale=8.0, dtype=torch.bfloat16),  # expert 2 x 8
    ],
)


def test_magnitude() -> None:
    # mean |w|: 6/6 = 1; 2/6; 7/6; 56/6
    (r,) = compute_scores("magnitude", weights=[HAND_EXPERTS])
    assert r.layer == 3
    np.testing.assert_allclose(r.scores, [1.0, 2 / 6, 7 / 6, 56 / 6], rtol=1e-12)
    assert r.order == [1, 0, 2, 3]


def test_aimer_hand_and_prunes_highest_first() -> None:
    # l1 / (sqrt(6) l2): 6/(sqrt6 sqrt6) = 1 (upper bound); 2/(sqrt6*2) = 1/sqrt6 (lower bound);
    # 7/(sqrt6*5); expert 3 = expert 2 scaled by 8 -> same score (tie, lower id first; a power of two
    # keeps the fp64 arithmetic exact, other scales agree only to rounding)
    (r,) = compute_scores("aimer", weights=[HAND_EXPERTS])
    s6 = math.sqrt(6)
    np.testing.assert_allclose(r.scores, [1.0, 1 / s6, 7 / (5 * s6), 7 / (5 * s6)], rtol=1e-12)
    assert r.order == [0, 2, 3, 1]


def test_aimer_scale_invariant_and_bounded() -> None:
    gen = torch.Generator().manual_seed(0)
    base = [tuple(torch.randn(*shape, generator=gen) for shape in ((5, 4), (5, 4), (4, 5))) for _ in range(3)]
    scaled = [tuple(t * c for t in ws) for ws, c in zip(base, (7.3, 0.01, 1e3))]
    (a,) = compute_scores("aimer", weights=[FakeWeights(0, base)])
    (b,) = compute_scores("aimer", weights=[FakeWeights(0, scaled)])
    np.testing.assert_allclose(a.scores, b.scores, rtol=1e-6)
    n = 60
    assert np.all(a.scores >= 1 / math.sqrt(n)) and np.all(a.scores <= 1)


def test_weight_layers_selection_and_zero_expert() -> None:
    other = FakeWeights(5, HAND_EXPERTS.experts[:2])
    results = compute_scores("magnitude", weights=[HAND_EXPERTS, other], layers=[5])
    assert [r.layer for r in results] == [5]
    zero = FakeWeights(9, [_expert([[0, 0]], [[0, 0]], [[0], [0]])])
    with pytest.raises(MoePruneError, match="decoder layer 9"):
        compute_scores("aimer", weights=[zero])


def test_random_is_seeded_and_per_layer() -> None:
    a = compute_scores("random", num_experts=[16, 16], layers=[1, 2], seed=0)
    b = compute_scores("random", num_experts=[16, 16], layers=[1, 2], seed=0)
    c = compute_scores("random", num_experts=[16, 16], layers=[1, 2], seed=1)
    assert [r.order for r in a] == [r.order for r in b]
    assert a[0].order != c[0].order
    assert a[0].order != a[1].order  # layers differ
    for r in a:
        assert sorted(r.order) == list(range(16))
        assert r.order == [int(i) for i in np.argsort(r.scores)]
    # the shapes may also come from statistics
    (s,) = compute_scores("random", stats=stats_of(accumulate(TOKENS)), seed=0)
    assert s.layer == 7 and sorted(s.order) == [0, 1, 2, 3]


def test_missing_inputs() -> None:
    with pytest.raises(
        MoePruneError, match="criterion 'reap' needs calibration data: give data files"
    ) as caught:
        compute_scores("reap")
    assert caught.value.options == ("data",)  # the command line names --data
    with pytest.raises(MoePruneError, match="'aimer' needs the model's expert weights"):
        compute_scores("aimer", stats=stats_of(accumulate(TOKENS)))
    with pytest.raises(MoePruneError, match="'random' needs the number of experts"):
        compute_scores("random")
    with pytest.raises(MoePruneError, match="no MoE layer at decoder layer"):
        compute_scores("ean", stats=stats_of(accumulate(TOKENS)), layers=[0])


def test_non_finite_score_names_layer() -> None:
    s = accumulate(TOKENS)
    s.weight_sum[1] = float("nan")
    with pytest.raises(MoePruneError, match="decoder layer 7 for experts \\[1\\]"):
        compute_scores("seer", stats=stats_of(s))


def test_unseen_note() -> None:
    notes = unseen_note(stats_of(accumulate(TOKENS), accumulate(TOKENS[:2], layer=9, num_experts=3)))
    assert len(notes) == 2 and notes[1].startswith("Decoder layer 9: 2 of 3 experts (1, 2)")
    assert notes[0].startswith("Decoder layer 7: 1 of 4 experts (2)")
    assert "pruned first" in notes[0]
    # an expert reached in one domain is not unseen overall
    seen_elsewhere = accumulate([(2, (1.0, 0.0), 1.0, (1.0, 0.0))])
    assert unseen_note([stats_of(accumulate(TOKENS)), stats_of(seen_elsewhere)]) == []
    assert unseen_note(stats_of(accumulate(TOKENS[:5], num_experts=2))) == []
