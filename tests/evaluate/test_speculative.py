"""Speculative decoding: the accept/resample rule keeps the target's distribution exactly.

The statistical tests use cheap context-dependent toy LMs over a 3-token vocabulary, so
thousands of decodes run in seconds; the real tiny MoE models check the self-draft identity.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from moeprune.checkpoint import load_model
from moeprune.errors import MoePruneError
from moeprune.evaluate.speculative import (
    IncrementalLogits,
    SpecOptions,
    SpecStats,
    _logits,
    acceptance,
    speculative_generate,
)
from moeprune.models import MoEModel, supported_families
from moeprune.models.factory import reference_families, tiny_model
from moeprune.models.reshape import drop_experts

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

VOCAB = 3
CHI2_26_P001 = 54.05  # chi-square critical value, 26 degrees of freedom, p = 0.001


class ToyLM(nn.Module):
    """Next-token logits from (last token, position parity): context dependent and cheap."""

    def __init__(self, seed: int, scale: float = 1.5) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(scale * torch.randn(VOCAB, 2, VOCAB, generator=g), requires_grad=False)

    def forward(self, input_ids: torch.Tensor, **_: object) -> SimpleNamespace:
        parity = torch.arange(input_ids.shape[-1]) % 2
        return SimpleNamespace(logits=self.table[input_ids, parity.expand_as(input_ids)])


def _exact_joint(model: nn.Module, prompt: list[int], length: int) -> dict[tuple[int, ...], float]:
    """p(x_1..x_length | prompt) for every continuation, by the chain rule."""
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=length):
        prob, ids = 1.0, list(prompt)
        for token in seq:
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            prob *= float(torch.softmax(logits, -1)[token])
            ids.append(token)
        joint[seq] = prob
    return joint


def _chi_square(counts: dict[tuple[int, ...], int], expected: dict[tuple[int, ...], float], n: int) -> float:
    return sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in expected.items())


def test_sampled_output_has_the_target_distribution():
    target, draft = ToyLM(seed=0), ToyLM(seed=1)
    prompt, length, runs = [0], 3, 4000
    generator = torch.Generator().manual_seed(123)
    stats = SpecStats(gamma=2)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(runs):
        out = tuple(
            speculative_generate(
                draft,
                target,
                prompt,
                SpecOptions(max_new_tokens=length, gamma=2),
                generator=generator,
                stats=stats,
            )
        )
        counts[out] = counts.get(out, 0) + 1
    expected = _exact_joint(target, prompt, length)
    assert _chi_square(counts, expected, runs) < CHI2_26_P001
    # the draft really differs: rejections (hence resampling) and bonus tokens both occurred
    assert 0.2 < stats.accepted / stats.drafted < 0.95
    # and the test has power: the draft's own distribution fails it by far
    assert _chi_square(counts, _exact_joint(draft, prompt, length), runs) > 10 * CHI2_26_P001


def test_greedy_equals_target_greedy_decoding():
    target, draft = ToyLM(seed=0), ToyLM(seed=2)
    ids = [1]
    for _ in range(7):
        ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    out = speculative_generate(draft, target, [1], SpecOptions(max_new_tokens=7, gamma=3))
    assert out == ids[1:]


def test_rates_are_counted_per_position():
    stats = SpecStats(gamma=3)
    stats.record_round(3, 1)
    stats.record_round(3, 3)
    stats.record_round(1, 0)
    stats.generated = 2 + 4 + 1
    summary = stats.to_dict()
    assert summary["accept_rate"] == pytest.approx(4 / 7)
    assert summary["accept_rate_per_position"] == [2 / 3, 0.5, 0.5]
    assert summary["mean_accepted_per_call"] == pytest.approx(4 / 3)
    assert summary["tokens_per_call"] == pytest.approx(7 / 3)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_model_drafting_for_itself_accepts_everything(family):
    model = tiny_model(family, vocab_size=64)
    prompts = [[1, 5, 9, 3], [1, 40]]
    results = acceptance(model, model, prompts, SpecOptions(gamma=3, max_new_tokens=8), seed=0)
    for mode in ("greedy", "sampled"):
        r = results[mode]
        assert r["accept_rate"] == 1.0 and r["accepted"] == r["drafted"] > 0
        assert r["generated"] == 16 and all(v == 1.0 for v in r["accept_rate_per_position"])


def test_output_length_and_eos_stop():
    target, draft = ToyLM(seed=0), ToyLM(seed=1)
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 9):
        assert (
            len(speculative_generate(draft, target, [0], SpecOptions(gamma=4, max_new_tokens=n), generator=g))
            == n
        )
    out = speculative_generate(draft, target, [0], SpecOptions(4, 50, eos_token_id=2), generator=g)
    assert out[-1] == 2 and 2 not in out[:-1]


def test_seeded_runs_repeat():
    target, draft = ToyLM(seed=0), ToyLM(seed=1)
    first = acceptance(draft, target, [[0], [1, 2]], SpecOptions(gamma=2, max_new_tokens=12), seed=5)
    again = acceptance(draft, target, [[0], [1, 2]], SpecOptions(gamma=2, max_new_tokens=12), seed=5)
    assert first == again


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gamma=0), "gamma"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=0.0), "temperature"),
    ],
)
def test_bad_arguments(kwargs, message):
    model = ToyLM(seed=0)
    options = SpecOptions(**(dict(max_new_tokens=4, gamma=2) | kwargs))
    with pytest.raises(MoePruneError, match=message):
        speculative_generate(model, model, [0], options)
    with pytest.raises(MoePruneError, match="prompt"):
        speculative_generate(model, model, [], SpecOptions(max_new_tokens=2))
    with pytest.raises(MoePruneError, match="mode"):
        acceptance(model, model, [[0]], modes=["beam"])


# ------------------------------------------------------------------------------------------ KV cache
ROLLBACKS = [  # growing, cut back, new prompts sharing a prefix, longer than gpt_oss's 16-token window
    list(range(3, 30)), list(range(3, 33)), [*range(3, 13), 40, 41], [*range(3, 20), 40, 41, 42, 43],
    [5, 6, 7, 8], list(range(3, 40)), [*range(3, 12), *[50] * 20],
]  # fmt: skip


@pytest.mark.parametrize("family", supported_families())
def test_cached_logits_equal_recomputation_through_rollbacks(family):
    """Growing, cut-back and unrelated sequences, on every family (hybrid stacks with linear
    attention or Mamba states included): the cache gives the recomputed logits, or the probe
    finds it cannot roll back and every call recomputes. Among the hand-made fixtures only
    qwen3_next (linear-attention states) falls back."""
    model = tiny_model(family).eval()
    incremental = IncrementalLogits(model)
    for ids in ROLLBACKS:
        for last in (1, 3):
            torch.testing.assert_close(incremental(ids, last), _logits(model, ids, last), rtol=0, atol=1e-4)
    if family in reference_families():
        assert incremental.cached is (family != "qwen3_next")


def test_a_cache_that_rolls_back_wrongly_is_not_used():
    """The probe compares against a full recomputation: a cache whose crop is a no-op (so the
    rolled-back token stays in it) is detected, and every call recomputes instead."""
    model = tiny_model("qwen3_moe").eval()
    original = DynamicCache.crop
    DynamicCache.crop = lambda self, tokens_to_remove: None
    try:
        incremental = IncrementalLogits(model)
        for ids in ROLLBACKS:
            torch.testing.assert_close(incremental(ids, 2), _logits(model, ids, 2), rtol=0, atol=1e-4)
    finally:
        DynamicCache.crop = original
    assert incremental.cached is False


def test_cache_gives_the_same_acceptance(trained_moe):
    """On a trained model and its pruned draft, with and without the cache, both modes count the
    same acceptances (the logits agree to ~1e-6, far from any decision boundary here)."""
    model_dir, _ = trained_moe
    target, _ = load_model(model_dir)
    draft = copy.deepcopy(target)
    moe = MoEModel(draft)
    drop_experts(moe, {m.index: list(range(0, m.num_experts, 2)) for m in moe.layers})
    prompts = [[5 + i, 17, 23 + 2 * i, 9, 31] for i in range(4)]
    options = SpecOptions(gamma=3, max_new_tokens=12)
    cached = acceptance(draft, target, prompts, options, seed=1)
    plain = acceptance(draft, target, prompts, replace(options, use_cache=False), seed=1)
    for mode in ("greedy", "sampled"):
        assert cached[mode].pop("kv_cache") == {"draft": True, "target": True}
        assert plain[mode].pop("kv_cache") == {"draft": False, "target": False}
        assert cached[mode] == plain[mode]
    assert 0 < cached["greedy"]["accept_rate"] < 1
