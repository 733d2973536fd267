"""`--method auto`'s contest (search/portfolio.py): successive halving on a constructed case, and
the winner of a small portfolio on a tiny model is the best plan by a fitness computed here
independently (the teacher's logits and the plan applied physically to a copy)."""

from __future__ import annotations

import copy

import pytest
import torch

import moeprune.search.forms  # noqa: F401 - the searches register (search/registry.py)
import moeprune.search.gradient  # noqa: F401
import moeprune.search.run  # noqa: F401
from moeprune.allocate.fitness import FitnessAccumulator, TeacherCache
from moeprune.config import PruneConfig
from moeprune.data.loading import load_data
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.search.options import SearchRuntime
from moeprune.search.portfolio import (
    NOISE,
    RUNGS,
    Entry,
    Score,
    Shared,
    contest,
    halving,
    observe_once,
    within_noise,
)
from moeprune.surgery.lowrank import fit_novices
from moeprune.surgery.planning import check_config
from moeprune.surgery.plans import apply_plan_physical

pytestmark = pytest.mark.unit


def test_halving_keeps_the_recipe_that_wins_at_the_full_budget():
    # fitness per recipe at RUNGS (1/9, 1/3, 1): recipe 3 starts second of six and ends best
    table = {
        0: (0.50, 0.52, 0.53),
        1: (0.70, 0.71, 0.72),
        2: (0.40, 0.41, 0.42),
        3: (0.65, 0.78, 0.90),
        4: (0.30, 0.31, 0.32),
        5: (0.20, 0.21, 0.22),
    }
    calls: list[tuple[int, float]] = []

    def evaluate(i: int, fraction: float) -> Score:
        calls.append((i, fraction))
        return Score(0.6 if i == 6 else table[i][RUNGS.index(fraction)])  # no samples: no noise rule

    runs = halving(7, [True] * 6 + [False], evaluate)
    assert calls[0] == (6, 1.0)  # the plan without a search first, once
    best = max(range(7), key=lambda i: max(v for _, v in runs[i]))
    assert best == 3 and runs[3][-1] == (1.0, 0.90)
    assert [i for i, f in calls if f == RUNGS[1]] == [1, 3]  # the best third of six at 1/3
    assert [i for i, f in calls if f == 1.0 and i != 6] == [3]
    assert halving(2, [True, True], lambda i, f: Score(float(i)), higher=False)[0][-1] == (1.0, 0.0)


def test_within_noise_is_the_paired_gap_against_its_standard_error():
    # per-sample gaps leader - other: 0.03, -0.01, 0.01, -0.01 -> mean 0.005,
    # sd = sqrt((0.025^2 + 0.015^2 + 0.005^2 + 0.015^2) / 3) = sqrt(0.0011 / 3) = 0.019149,
    # se = sd / 2 = 0.0095743; 0.005 <= 1 se: within
    leader = Score(0.5, {0: 0.53, 1: 0.49, 2: 0.51, 3: 0.47})
    close = Score(0.495, {0: 0.50, 1: 0.50, 2: 0.50, 3: 0.48})
    assert NOISE == 1.0 and within_noise(leader, close)
    # the same gap on every sample (sd 0): the other is surely behind
    steady = Score(0.49, {k: v - 0.01 for k, v in leader.samples.items()})
    assert not within_noise(leader, steady)
    # lower-is-better fitness: the signs turn; the gaps 0.02, 0.0, -0.02, 0.04 for the other's
    # excess: mean 0.01, sd = sqrt((0.01^2 + 0.01^2 + 0.03^2 + 0.03^2) / 3) = 0.025820,
    # se 0.012910: within; shifted by 0.03 more on each sample (mean 0.04 > 1 se): not
    low = Score(0.1, {0: 0.10, 1: 0.12, 2: 0.14, 3: 0.04})
    other = Score(0.11, {0: 0.12, 1: 0.12, 2: 0.12, 3: 0.08})
    assert within_noise(low, other, higher=False)
    assert not within_noise(low, Score(0.14, {k: v + 0.03 for k, v in other.samples.items()}), higher=False)
    assert not within_noise(leader, Score(0.5, {0: 0.5}))  # fewer than two shared samples


def test_halving_carries_on_a_recipe_within_the_noise_of_the_leader():
    # four searched recipes at 1/9: the best quarter (ceil(4/3) = 2) goes on, and recipe 2, 0.002
    # behind the second on noisy samples but within 1 se of the leader, goes on with them
    noisy = [0.1, -0.1, 0.1, -0.1, 0.05, -0.05]

    def at(value: float, spread: float) -> Score:
        return Score(value, {k: value + spread * g for k, g in enumerate(noisy)})

    rung = {0: at(0.800, 1.0), 1: at(0.799, 1.0), 2: at(0.797, -1.0), 3: at(0.60, 0.0)}
    ran: list[tuple[int, float]] = []

    def evaluate(i: int, fraction: float) -> Score:
        ran.append((i, fraction))
        return rung[i] if fraction == RUNGS[0] else Score(rung[i].value + (0.1 if i == 2 else 0.0))

    heard: list[tuple] = []
    runs = halving(4, [True] * 4, evaluate, log=lambda *said: heard.append(said))
    assert [i for i, f in ran if f == RUNGS[1]] == [0, 1, 2]
    # gaps 0.003 + 2g: mean 0.003; 2g's sd sqrt(0.18 / 5) = 0.189737, se 0.189737 / sqrt(6) = 0.077460
    assert len(heard) == 1 and heard[0][:2] == (2, 0)
    assert heard[0][2:] == pytest.approx((0.003, 0.077460), abs=1e-6)
    assert runs[3] == [(RUNGS[0], 0.60)]
    assert max(range(4), key=lambda i: runs[i][-1][1]) == 2


def test_the_winner_is_the_best_recipe_by_an_independent_fitness(data):
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    moe = MoEModel(
        tiny_model("qwen3_moe", vocab_size=len(tokenizer), num_hidden_layers=3, mlp_only_layers=[])
    )
    sets = [load_data([str(data)], tokenizer, num_samples=12, max_length=64, seed=0)]
    search = load_data([str(data)], tokenizer, num_samples=6, max_length=64, seed=1)
    configs = [
        check_config(PruneConfig(c, 0.5, method=m, allow_super_experts=True))
        for c, m in (("reap", "drop"), ("frequency", "drop"), ("tenp", "novice"), ("reap", "neurons"))
    ]
    runtime = SearchRuntime(batch_size=4, pad_token_id=0, progress=False)
    stats = observe_once(moe, configs, sets, runtime, 0)
    entries = [Entry(f"{c.criterion} {c.method}", c) for c in configs]
    ranked = contest(Shared(moe, stats, sets, search, runtime), entries, lambda _: None)
    # independently: the full model's logits, each recipe's plan cut into a copy, scored here
    batches = list(search.batches(4, 0))
    teacher = TeacherCache()
    with torch.no_grad():
        for b in batches:
            logits = moe.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
            teacher.add(b.sample_index.tolist(), logits, b.input_ids, b.answer_mask, b.attention_mask)
    values = {}
    for entry in entries:
        from moeprune.search.portfolio import run_once

        plan = run_once(
            Shared(moe, stats, sets, search, runtime, teacher=(teacher, batches)), entry.config
        ).plan
        cut = MoEModel(copy.deepcopy(moe.model))
        apply_plan_physical(cut, plan, stats, fit_novices(cut, plan, sets) or None)
        acc = FitnessAccumulator(teacher, "esap", 0)
        with torch.no_grad():
            for b in batches:
                acc.add(b.sample_index.tolist(), cut.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits,
                        b.answer_mask, b.attention_mask)  # fmt: skip
        values[entry.label] = acc.result()
        assert entry.runs[0]["esap"] == pytest.approx(values[entry.label], abs=1e-4)
    assert ranked[0].label == max(values, key=values.__getitem__)
    # every recipe's run, ranked by the independent fitness too
    assert [f.label for f in ranked] == sorted(values, key=lambda label: -values[label])


def _tiny_contest(data, num_samples: int = 6):
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    moe = MoEModel(
        tiny_model("qwen3_moe", vocab_size=len(tokenizer), num_hidden_layers=3, mlp_only_layers=[])
    )
    sets = [load_data([str(data)], tokenizer, num_samples=12, max_length=64, seed=0)]
    search = load_data([str(data)], tokenizer, num_samples=num_samples, max_length=64, seed=1)
    return moe, sets, search, SearchRuntime(batch_size=4, pad_token_id=0, progress=False)


SMALL = {"population": 6, "elites": 2, "generations": 6, "steps": 9}


def _searched(criterion: str, method: str, allocation: str, **options):
    from moeprune.config import SearchConfig

    config = PruneConfig(criterion, 0.5, method=method, allocation=allocation, search=SearchConfig(**SMALL),
                         options=options or None, allow_super_experts=True)  # fmt: skip
    return check_config(config)


def test_a_contest_makes_one_teacher_pass_for_every_search_and_plan(data, monkeypatch):
    from moeprune.search import auto, candidates

    moe, sets, search, runtime = _tiny_contest(data)
    configs = [
        check_config(PruneConfig("reap", 0.5, method="drop", allow_super_experts=True)),
        _searched("reap", "drop", "evo"),
        _searched("reap", "drop", "gradient"),
        _searched("tenp", "mixed", "evo"),
        _searched("tenp", "mixed", "gradient", width_multiple=1),
    ]
    passes = []
    own = candidates.CandidateEvaluator._teacher_pass

    def counted(self, device):
        passes.append(device)
        return own(self, device)

    monkeypatch.setattr(candidates.CandidateEvaluator, "_teacher_pass", counted)
    monkeypatch.setattr(auto, "teacher_pass", lambda *a, **k: pytest.fail("a second kind of teacher pass"))
    stats = observe_once(moe, configs, sets, runtime, 0)
    entries = [Entry(f"{c.criterion} {c.method} {c.allocation}", c) for c in configs]
    contest(Shared(moe, stats, sets, search, runtime), entries, lambda _: None)
    ran = sum(len(e.runs) for e in entries)
    assert ran >= 6 and not any(e.refused for e in entries)  # four searches, one of them on to a larger rung
    assert len(passes) == 1


@pytest.mark.parametrize(("method", "allocation"), [("drop", "evo"), ("mixed", "evo"), ("drop", "gradient")])
def test_a_recipe_going_on_to_a_larger_rung_reaches_the_plan_of_a_fresh_run_there(data, monkeypatch, method,
                                                                                 allocation):  # fmt: skip
    # evo continues its population (fewer evaluations than a fresh run); the gradient reruns
    from moeprune.search import candidates
    from moeprune.search.portfolio import run_once, scaled, teacher_once

    moe, sets, search, runtime = _tiny_contest(data)
    config = _searched("tenp", method, allocation)
    stats = observe_once(moe, [config], sets, runtime, 0)
    calls = []
    own = candidates.CandidateEvaluator.evaluate
    monkeypatch.setattr(
        candidates.CandidateEvaluator, "evaluate", lambda self, *a, **k: calls.append(1) or own(self, *a, **k)
    )

    def shared() -> Shared:
        out = Shared(moe, stats, sets, search, runtime)
        out.prepared = teacher_once(out, "esap")
        out.teacher = out.prepared.scored()
        return out

    contest_shared, carried = shared(), {}
    for fraction in RUNGS:
        calls.clear()
        continued = run_once(contest_shared, scaled(config, fraction), carried)
        continued_calls = len(calls)
    calls.clear()
    fresh = run_once(shared(), config)
    assert continued.plan.to_json() == fresh.plan.to_json()
    assert continued.fitness == fresh.fitness
    assert continued.searched.doc["fitness_value"] == fresh.searched.doc["fitness_value"]
    if allocation == "evo":
        assert bool(carried) and continued_calls < len(calls)  # only the generations the rungs had not run
    else:
        assert not carried and continued_calls == len(calls)
