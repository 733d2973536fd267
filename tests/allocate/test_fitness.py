"""Fitness on teacher-forced data: formulas, shift by one, averaging, precision, cache size."""

from __future__ import annotations

import math

import pytest
import torch

from moeprune.allocate.fitness import (
    FITNESSES,
    FitnessAccumulator,
    TeacherCache,
    answer_positions,
    higher_is_better,
    position_scores,
    score_candidate,
    total_variation,
)
from moeprune.errors import DataError, MoePruneError

pytestmark = pytest.mark.unit  # fast, small inputs: `pytest -m unit` runs them all in about a minute


def _batch(logits: torch.Tensor, answer_mask: torch.Tensor, input_ids: torch.Tensor | None = None):
    """A teacher batch tuple; ids 0..B-1, no padding, token ids 0 unless given."""
    b, s, _ = logits.shape
    ids = torch.zeros(b, s, dtype=torch.long) if input_ids is None else input_ids
    return list(range(b)), logits, ids, answer_mask, torch.ones(b, s, dtype=torch.long)


def _teacher(logits, answer_mask, input_ids=None) -> TeacherCache:
    return TeacherCache.from_logits([_batch(logits, answer_mask, input_ids)])


def _score(teacher, logits, fitness: str, seed: int = 0) -> float:
    return score_candidate(teacher, [(list(range(logits.shape[0])), logits)], fitness, seed)


def test_directions_and_unknown_name():
    assert [higher_is_better(f) for f in FITNESSES.names()] == [True, True, False, False]
    with pytest.raises(MoePruneError, match="unknown fitness"):
        higher_is_better("bleu")


def test_answer_positions_shift_by_one_and_padding():
    answer = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    attention = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])  # row 1 is left-padded
    got = answer_positions(answer, attention)
    # Row 0: tokens 2 and 3 are answers -> predicted at positions 1 and 2.
    # Row 1: tokens 1..4 are answers; token 1 is predicted by position 0, which is padding.
    assert got.tolist() == [[False, True, True, False, False], [False, True, True, True, False]]
    # The last position never counts, even when every token is an answer token.
    assert not answer_positions(torch.ones(1, 4, dtype=torch.bool))[0, -1]


def test_esap_is_one_minus_tv_on_random_distributions():
    g = torch.Generator().manual_seed(0)
    logits_p, logits_q = torch.randn(2, 50, 97, generator=g) * 3
    p, q = logits_p.softmax(-1), logits_q.softmax(-1)
    esap = position_scores("esap", p.log(), logits_q, torch.zeros(50, dtype=torch.long))
    torch.testing.assert_close(esap, 1 - total_variation(p, q), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identical_logits_are_perfect(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 6, 40, generator=g) * 4).to(dtype)
    answer = torch.tensor([[0, 0, 1, 1, 1, 1]] * 3, dtype=torch.bool)
    teacher = _teacher(logits, answer)
    assert _score(teacher, logits, "esap") == pytest.approx(1.0, abs=1e-6)
    assert _score(teacher, logits, "sap") == pytest.approx(1.0, abs=1e-6)
    assert _score(teacher, logits, "kl") == pytest.approx(0.0, abs=1e-6)


def test_hand_built_two_position_example():
    # Vocab 3; sequence of 3 tokens [0, 2, 1], answer tokens 1 and 2, so positions 0 and 1 count.
    # Position 0: p = [.5, .3, .2], q = [.2, .3, .5]; position 1: p = q = [.6, .2, .2].
    p = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.2, 0.2], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])
    answer = torch.tensor([[False, True, True]])
    input_ids = torch.tensor([[0, 2, 1]])
    teacher = _teacher(p.log()[None], answer, input_ids)
    cand = q.log()[None]
    # ESAP: pos 0: min = .2 + .3 + .2 = .7; pos 1: 1.0 -> mean .85
    assert _score(teacher, cand, "esap") == pytest.approx(0.85, abs=1e-6)
    # KL: pos 0: .5 ln(.5/.2) + 0 + .2 ln(.2/.5) = .3 ln 2.5 = 0.274887; pos 1: 0 -> mean 0.137444
    assert _score(teacher, cand, "kl") == pytest.approx(0.3 * math.log(2.5) / 2, abs=1e-6)
    # NLL: targets are tokens 1 -> 2 and 2 -> 1: -ln q0[2] = -ln .5, -ln q1[1] = -ln .2
    assert _score(teacher, cand, "nll") == pytest.approx(-(math.log(0.5) + math.log(0.2)) / 2, abs=1e-6)
    # SAP: pos 1 ratio is 1 for any y; pos 0: y=0 -> .5/.2 -> 1, y=1 -> 1, y=2 -> .2/.5 = .4.
    sap = _score(teacher, cand, "sap", seed=3)
    assert sap in (pytest.approx(1.0, abs=1e-6), pytest.approx(0.7, abs=1e-6))
    # Expected SAP at position 0 is sum_y q(y) min(1, p/q) = ESAP = .7, so over seeds the mean
    # of the two-position score approaches (.7 + 1) / 2.
    mean = sum(_score(teacher, cand, "sap", seed=s) for s in range(200)) / 200
    assert mean == pytest.approx(0.85, abs=0.04)


def test_sap_is_seeded_and_batch_independent():
    g = torch.Generator().manual_seed(2)
    t_logits, c_logits = torch.randn(2, 4, 7, 30, generator=g)
    answer = torch.ones(4, 7, dtype=torch.bool)
    teacher = _teacher(t_logits, answer)
    whole = _score(teacher, c_logits, "sap", seed=5)
    assert whole == _score(teacher, c_logits, "sap", seed=5)
    acc = FitnessAccumulator(teacher, "sap", seed=5)
    for rows in ([3, 1], [0, 2]):  # different grouping and order
        acc.add(rows, c_logits[rows])
    assert acc.result() == pytest.approx(whole, abs=1e-12)


def test_shift_by_one_scores_the_previous_position():
    # Token 2 is the only answer token, so only position 1 counts: logits at every other
    # position may differ arbitrarily without changing the fitness.
    g = torch.Generator().manual_seed(3)
    teacher_logits = torch.randn(1, 4, 11, generator=g)
    answer = torch.tensor([[False, False, True, False]])
    teacher = _teacher(teacher_logits, answer)
    cand = teacher_logits.clone()
    cand[0, [0, 2, 3]] = torch.randn(3, 11, generator=g) * 5
    assert _score(teacher, cand, "kl") == pytest.approx(0.0, abs=1e-7)
    cand[0, 1] += torch.randn(11, generator=g)
    assert _score(teacher, cand, "kl") > 1e-3


def test_each_sample_weighs_the_same():
    # Sample 0 has one answer position, sample 1 has three. Teacher = uniform over 2 tokens.
    # Candidate: sample 0 position is a one-hot-ish mismatch, sample 1 matches everywhere.
    v = 2
    teacher_logits = torch.zeros(2, 4, v)
    answer = torch.tensor([[False, False, False, True], [False, True, True, True]])
    teacher = _teacher(teacher_logits, answer)
    cand = torch.zeros(2, 4, v)
    cand[0, 2] = torch.tensor([0.0, math.log(3.0)])  # q = [.25, .75] -> ESAP .75
    # Per-sample means: .75 and 1.0 -> fitness .875; a token-weighted mean would give .9375.
    assert _score(teacher, cand, "esap") == pytest.approx(0.875, abs=1e-6)


def test_samples_without_answer_positions_are_skipped_and_counted():
    logits = torch.zeros(3, 3, 5)
    answer = torch.tensor([[False, True, True], [True, False, False], [False, False, True]])
    # Sample 1's only answer token is token 0, which no position predicts.
    teacher = _teacher(logits, answer)
    assert teacher.skipped == [1] and len(teacher) == 2
    acc = FitnessAccumulator(teacher, "esap")
    acc.add([0, 1, 2], logits)
    assert acc.skipped == 1 and acc.result() == pytest.approx(1.0)
    empty = _teacher(logits, torch.zeros(3, 3, dtype=torch.bool))
    with pytest.raises(DataError):
        FitnessAccumulator(empty, "kl").result()


def test_missing_or_unknown_samples_are_errors():
    logits = torch.zeros(2, 3, 5)
    teacher = _teacher(logits, torch.ones(2, 3, dtype=torch.bool))
    acc = FitnessAccumulator(teacher, "nll")
    acc.add([0], logits[:1])
    with pytest.raises(MoePruneError, match="scored 1 of 2"):
        acc.result()
    with pytest.raises(MoePruneError, match="not in the teacher cache"):
        acc.add([7], logits[:1])
    with pytest.raises(MoePruneError, match="twice"):
        acc.add([0], logits[:1])


@pytest.mark.parametrize("fitness", FITNESSES.names())
def test_bf16_logits_equal_their_fp32_upcast(fitness):
    g = torch.Generator().manual_seed(4)
    t_logits = (torch.randn(2, 5, 64, generator=g) * 3).to(torch.bfloat16)
    c_logits = (torch.randn(2, 5, 64, generator=g) * 3).to(torch.bfloat16)
    answer = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
    ids = torch.randint(0, 64, (2, 5), generator=g)
    low = _score(_teacher(t_logits, answer, ids), c_logits, fitness, seed=1)
    high = _score(_teacher(t_logits.float(), answer, ids), c_logits.float(), fitness, seed=1)
    assert low == high


def test_candidate_with_other_padding_uses_its_own_masks():
    g = torch.Generator().manual_seed(5)
    t_logits, c_logits = torch.randn(2, 1, 4, 9, generator=g)
    answer = torch.tensor([[False, False, True, True]])
    teacher = _teacher(t_logits, answer)
    expected = _score(teacher, c_logits, "kl")
    # The candidate batch is left-padded by two tokens.
    padded = torch.cat([torch.randn(1, 2, 9, generator=g), c_logits], dim=1)
    pad_answer = torch.cat([torch.zeros(1, 2, dtype=torch.bool), answer], dim=1)
    attention = torch.tensor([[0, 0, 1, 1, 1, 1]])
    acc = FitnessAccumulator(teacher, "kl")
    acc.add([0], padded, pad_answer, attention)
    assert acc.result() == pytest.approx(expected, abs=1e-9)


def test_teacher_cache_stores_only_answer_positions():
    v = 1000
    logits = torch.randn(3, 64, v)
    answer = torch.zeros(3, 64, dtype=torch.bool)
    answer[0, 60:] = True  # 4 answer tokens -> 4 positions
    answer[1, 10:12] = True  # 2
    answer[2, 63] = True  # 1
    teacher = _teacher(logits, answer)
    n = 4 + 2 + 1
    assert teacher.num_positions == n
    assert all(s.log_probs.dtype == torch.float32 for s in teacher.per_sample)
    # fp32 log-probs plus two int64 per position (position, target); the full logits would be 3*64*V*4.
    assert teacher.nbytes == n * v * 4 + n * 16
