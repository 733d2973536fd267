"""serve-check's comparison on hand-made logits: equal tokens, a real difference, a tie within
rounding, a logprob outside the tolerance, and which difference is named first."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from moeprune.evaluate.serve_check import compare, describe_difference

pytestmark = pytest.mark.unit

ATOL = 1e-3


class TableModel:
    """A stand-in causal LM: the logits at each position of a sequence are looked up by
    (first token of the sequence, position), whatever the tokens in between."""

    def __init__(self, table: dict[tuple[int, int], list[float]]) -> None:
        self.table = table

    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        first = int(ids[0, 0])
        rows = [self.table.get((first, p), [0.0, 0.0, 0.0, 0.0]) for p in range(ids.shape[1])]
        return SimpleNamespace(logits=torch.tensor([rows], dtype=torch.float64))


def logprobs(logits: list[float]) -> list[float]:
    top = math.log(sum(math.exp(v) for v in logits))
    return [v - top for v in logits]


def served(model: TableModel, prompts: list[list[int]], tokens: list[list[int]], nudge=None) -> dict:
    """vLLM's answer as the driver writes it: the given tokens, and the model's own top-2 logprobs
    at each step (moved by `nudge[(prompt, position)]` where given)."""
    steps = []
    for index, (prompt, sequence) in enumerate(zip(prompts, tokens)):
        row = []
        for position in range(len(sequence)):
            values = logprobs(model.table.get((prompt[0], len(prompt) - 1 + position), [0.0] * 4))
            top = sorted(range(4), key=lambda t: -values[t])[:2]
            shift = (nudge or {}).get((index, position), 0.0)
            row.append({str(t): values[t] + shift for t in top})
        steps.append(row)
    return {"tokens": tokens, "logprobs": steps}


# prompt [0]: the argmax is token 1, then 2, then 3; prompt [3]: token 2 twice
MODEL = TableModel({(0, 0): [0, 5, 1, 0], (0, 1): [0, 1, 5, 0], (0, 2): [1, 0, 0, 5],
                    (3, 0): [0, 0, 4, 1], (3, 1): [0, 0, 4, 1]})  # fmt: skip
PROMPTS = [[0], [3]]


def test_equal_tokens_and_logprobs_match():
    tally = compare(served(MODEL, PROMPTS, [[1, 2, 3], [2, 2]]), PROMPTS, MODEL, ATOL)
    assert tally.first is None and tally.tokens_compared == 5 and tally.ties == 0
    assert tally.max_difference < 1e-6


def test_a_different_token_is_named_with_its_position():
    tally = compare(served(MODEL, PROMPTS, [[1, 0, 3], [2, 2]]), PROMPTS, MODEL, ATOL)
    assert tally.first is not None
    assert (tally.first["prompt"], tally.first["position"], tally.first["kind"]) == (0, 1, "token")
    assert (tally.first["vllm_token"], tally.first["moeprune_token"]) == (0, 2)
    assert tally.tokens_compared == 2 + 2  # prompt 0 stops at its difference
    text = describe_difference(tally.first, ATOL)
    assert text.startswith("prompt 0, generated token 1: vLLM generated token 0, moeprune 2")


def test_a_tie_within_rounding_is_no_difference():
    tied = TableModel({**MODEL.table, (0, 1): [0, 1, 5, 5 - ATOL]})  # tokens 2 and 3 within 2 * atol
    tally = compare(served(tied, PROMPTS, [[1, 3, 0], [2, 2]]), PROMPTS, tied, ATOL)
    assert tally.first is None and tally.ties == 1
    assert tally.tokens_compared == 1 + 2  # past the tie, prompt 0's tokens are not compared


def test_a_logprob_outside_the_tolerance_fails_and_the_earliest_difference_is_named():
    nudged = served(MODEL, PROMPTS, [[1, 2, 3], [2, 2]], nudge={(1, 0): 3 * ATOL, (0, 2): 0.5 * ATOL})
    tally = compare(nudged, PROMPTS, MODEL, ATOL)
    assert tally.first is not None and tally.first["kind"] == "logprob"
    assert (tally.first["prompt"], tally.first["position"]) == (1, 0)
    assert tally.max_difference == pytest.approx(3 * ATOL, rel=1e-4)  # moeprune's side is float32
    assert describe_difference(tally.first, ATOL).startswith(
        "prompt 1, generated token 0: vLLM's logprob of token 2"
    )
    # a token difference in an earlier prompt comes first
    nudged["tokens"][0][1] = 0
    tally = compare(nudged, PROMPTS, MODEL, ATOL)
    assert (tally.first["prompt"], tally.first["position"], tally.first["kind"]) == (0, 1, "token")
