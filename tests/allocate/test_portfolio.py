"""`--method auto`'s contest (search/portfolio.py): successive halving on a constructed case, and
the winner of a small portfolio on a tiny model is the best plan by a fitness computed here
independently (the teacher's logits and the plan applied physically to a copy)."""

from __future__ import annotations

import copy

import pytest
import torch

from moeprune.allocate.fitness import FitnessAccumulator, TeacherCache
from moeprune.config import PruneConfig
from moeprune.data.loading import load_data
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.search.options import SearchRuntime
from moeprune.search.portfolio import RUNGS, Entry, Shared, contest, halving, observe_once
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

    def evaluate(i: int, fraction: float) -> float:
        calls.append((i, fraction))
        return 0.6 if i == 6 else table[i][RUNGS.index(fraction)]

    runs = halving(7, [True] * 6 + [False], evaluate)
    assert calls[0] == (6, 1.0)  # the plan without a search first, once
    best = max(range(7), key=lambda i: max(v for _, v in runs[i]))
    assert best == 3 and runs[3][-1] == (1.0, 0.90)
    assert [i for i, f in calls if f == RUNGS[1]] == [1, 3]  # the best third of six at 1/3
    assert [i for i, f in calls if f == 1.0 and i != 6] == [3]
    assert halving(2, [True, True], lambda i, f: float(i), higher=False)[0][-1] == (1.0, 0.0)


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
    found = contest(Shared(moe, stats, sets, search, runtime), entries, lambda _: None)
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
    assert found.label == max(values, key=values.__getitem__)
