"""Speculative decoding with a pruned model as draft and the full model as target.

Why: the acceptance rate says how often the pruned model's next token would be the full
model's, measured the way a deployment would use it (Leviathan et al. 2023; Chen et al. 2023).
Each round the draft proposes ``gamma`` tokens from q; the target scores them all in one call
and token x is accepted with probability min(1, p(x)/q(x)). The first rejected token is replaced
by a draw from norm(max(0, p - q)); when every draft is accepted a bonus token comes from p. The
output then has exactly the target's distribution. Greedy mode drafts argmax q and accepts while
argmax p agrees (a rejection emits argmax p).

Both models keep a KV cache (`IncrementalLogits`): each call feeds only the tokens past the
longest prefix the cache already holds, and a rejected draft is rolled back with `Cache.crop`.
Whether a model's cache rolls back correctly is not assumed: on its first sequence the cached
logits (fed in two parts, with one rollback) are compared with a full recomputation, and a model
whose cache disagrees or cannot be cropped (linear-attention recurrent states) recomputes the
whole sequence every call, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from moeprune.errors import MoePruneError
from moeprune.runtime.device import input_device
from moeprune.runtime.finite import NonFiniteError, all_finite, kind, locate_nonfinite

MODES = ("greedy", "sampled")


@dataclass
class SpecStats:
    """Counts over every round of every prompt of one mode."""

    gamma: int
    drafted: int = 0  # drafted tokens the target verified
    accepted: int = 0
    target_calls: int = 0
    generated: int = 0  # tokens emitted (accepted, corrections and bonus tokens)
    position_drafted: list[int] = field(default_factory=list)  # per draft position j < gamma
    position_accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.position_drafted = self.position_drafted or [0] * self.gamma
        self.position_accepted = self.position_accepted or [0] * self.gamma

    def record_round(self, drafted: int, accepted: int) -> None:
        """One verification: `drafted` proposals of which the first `accepted` were accepted."""
        self.drafted += drafted
        self.accepted += accepted
        self.target_calls += 1
        for j in range(drafted):
            self.position_drafted[j] += 1
            self.position_accepted[j] += int(j < accepted)

    def to_dict(self) -> dict:
        """Plain-key summary: accept_rate = accepted / drafted (None when nothing was drafted: one
        new token leaves no room for a draft); per-call means; per-position rates."""
        calls = max(self.target_calls, 1)
        return {
            "gamma": self.gamma,
            "accept_rate": self.accepted / self.drafted if self.drafted else None,
            "mean_accepted_per_call": self.accepted / calls,
            "tokens_per_call": self.generated / calls,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "target_calls": self.target_calls,
            "generated": self.generated,
            "accept_rate_per_position": [
                a / d if d else None for a, d in zip(self.position_accepted, self.position_drafted)
            ],
        }


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 probabilities on the CPU (the seeded generator lives there)."""
    return torch.softmax(logits.float().cpu() / temperature, dim=-1)


def _logits(model: nn.Module, ids: list[int], last: int) -> torch.Tensor:
    """Next-token logits [last, V] of the final `last` positions of one sequence (no cache)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], device=input_device(model)), use_cache=False)
    return out.logits[0, -last:]


def _agree(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Cached and recomputed logits agree up to the rounding of the model's dtype (a wrong cache
    is off by O(1))."""
    tolerance = 1e-4 if want.dtype in (torch.float32, torch.float64) else 3e-2
    scale = float(want.float().abs().max()) + 1.0
    return bool(((got.float() - want.float()).abs() <= tolerance * scale).all())


class IncrementalLogits:
    """`_logits` for a sequence that grows and is sometimes cut back, through the model's KV cache.

    The cache holds `seen`; a call feeds only the tokens past the longest common prefix of `seen`
    and the new sequence (keeping at least `last` positions to compute), after cropping the
    cache back to that prefix. A sliding-window layer can only roll back what was fed since its
    last crop, so a longer rollback (a new prompt sharing a prefix) starts a fresh cache. The
    first call of at least 3 tokens checks the cache against a full recomputation (two parts,
    one rollback); if it disagrees or raises, every later call recomputes (`cached` False).
    """

    def __init__(self, model: nn.Module, use_cache: bool = True, label: str = "the model") -> None:
        self.model = model
        self.label = label  # names the model when its logits are NaN or infinite
        self.cached: bool | None = None if use_cache else False  # None: not probed yet
        self.cache: Any = None
        self.seen: list[int] = []
        self.fed_since_crop = 0

    def __call__(self, ids: list[int], last: int) -> torch.Tensor:
        logits = self._logits(ids, last)
        if not all_finite(logits):  # NaN probabilities would make sampling fail or accept anything
            where = locate_nonfinite(self.model, torch.tensor([ids]))
            raise NonFiniteError(
                f"{self.label} produced {kind(logits)} logits while decoding (a sequence of {len(ids)} tokens)"
            ).located(where)
        return logits

    def _logits(self, ids: list[int], last: int) -> torch.Tensor:
        if self.cached is None and len(ids) >= 3:
            self.cached = self._probe(ids)
        if not self.cached:
            return _logits(self.model, ids, last)
        keep = 0
        limit = min(len(self.seen), len(ids) - last)
        while keep < limit and self.seen[keep] == ids[keep]:
            keep += 1
        if len(self.seen) - keep > self.fed_since_crop:
            keep = 0  # further back than any cache layer can surely roll back: start afresh
        return self._feed(ids, keep, last)

    def _feed(self, ids: list[int], keep: int, last: int) -> torch.Tensor:
        if keep == 0:
            self.cache, self.fed_since_crop = self._fresh_cache(), 0
        elif keep < len(self.seen):
            self.cache.crop(keep - len(self.seen))  # negative: tokens to remove from the end
            self.fed_since_crop = 0
        new = torch.tensor([ids[keep:]], device=input_device(self.model))
        with torch.no_grad():
            out = self.model(input_ids=new, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.seen, self.fed_since_crop = list(ids), self.fed_since_crop + len(ids) - keep
        return out.logits[0, -last:]

    def _fresh_cache(self) -> Any:
        """An empty cache recording past states from the start, so sliding-window layers can roll
        back even once the window is full (None: the model makes its own)."""
        config = getattr(self.model, "config", None)
        if config is None:
            return None
        cache = DynamicCache(config=config)
        cache.activate_past_recording()
        for layer in getattr(cache, "layers", ()):
            if isinstance(layer, DynamicSlidingWindowLayer):
                _return_visible_states_only(layer)
        return cache

    def _probe(self, ids: list[int]) -> bool:
        full = _logits(self.model, ids, len(ids))
        try:
            head = self._feed(ids[:-1], 0, len(ids) - 1)
            if not _rolls_back(self.cache):
                return False
            tail = self._feed(ids, len(ids) - 2, 2)  # crops the cache back by one token first
            return _agree(head, full[:-1]) and _agree(tail, full[-2:])
        except (RuntimeError, ValueError, TypeError, AttributeError):
            return False
        finally:
            self.cache, self.seen, self.fed_since_crop = None, [], 0


def _rolls_back(cache: Any) -> bool:
    """Whether every layer of the cache is of a kind whose `crop` moeprune has checked (full and
    sliding-window attention). Others are not used even when a short probe agrees: the indexed
    layers of sparse-attention models (DeepSeek-V3.2, GLM-5, HY-V4) keep index state that `crop`
    does not roll back, which a one-token probe on a short prompt does not reveal."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return False
    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers)


def _return_visible_states_only(layer: DynamicSlidingWindowLayer) -> None:
    """Compatibility shim for transformers 5.16 and 5.17 (5.18 and later slice themselves, and then
    this changes nothing): there a sliding-window layer that records its past returns every state
    it holds since its last crop, although the attention mask covers only the last
    ``window - 1 + new`` positions, so a second forward without a crop in between fails (gpt_oss,
    llama4_text). Slicing the returned states to what the mask covers is what 5.18 does."""
    update = layer.update

    def visible(key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        keys, values = update(key_states, value_states, *args, **kwargs)
        shown = layer.sliding_window - 1 + key_states.shape[-2]
        return keys[..., -shown:, :], values[..., -shown:, :]

    # the shim is this per-instance override of the method; transformers declares no hook for it
    layer.update = visible  # type: ignore[method-assign]


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    if generator is None:
        return int(probs.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); when p <= q everywhere (p == q up to rounding) fall back to p."""
    rest = (p - q).clamp_min(0)
    total = rest.sum()
    return rest / total if total > 0 else p


def _draft(
    draft: IncrementalLogits, ids: list[int], n: int, temperature: float, generator: torch.Generator | None
) -> tuple[list[int], list[torch.Tensor]]:
    """n tokens from the draft, each with the distribution q it was drawn from."""
    tokens: list[int] = []
    dists: list[torch.Tensor] = []
    for _ in range(n):
        q = _probs(draft(ids + tokens, 1)[0], temperature)
        tokens.append(_sample(q, generator))
        dists.append(q)
    return tokens, dists


def _verify(
    tokens: list[int], q: list[torch.Tensor], p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """(accepted count, next token): the accept/resample rule, or greedy agreement without generator."""
    for j, (x, qj) in enumerate(zip(tokens, q)):
        pj = p[j]
        if generator is None:
            if int(pj.argmax()) != x:
                return j, int(pj.argmax())
            continue
        ratio = float(pj[x]) / float(qj[x])
        if float(torch.rand((), generator=generator)) >= ratio:
            return j, _sample(_residual(pj, qj), generator)
    return len(tokens), _sample(p[len(tokens)], generator)  # bonus token from p


@dataclass(frozen=True)
class SpecOptions:
    """How speculative decoding runs, one object from `acceptance` down to each prompt's decoding.

    `gamma` tokens are drafted per target call; at most `max_new_tokens` are generated per prompt,
    fewer after `eos_token_id`; the sampled mode divides logits by `temperature`; `use_cache`
    False recomputes every sequence in full (the reference the KV cache is checked against).
    """

    gamma: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    eos_token_id: int | None = None
    use_cache: bool = True


def speculative_generate(
    draft: nn.Module | IncrementalLogits,
    target: nn.Module | IncrementalLogits,
    prompt: Sequence[int],
    options: SpecOptions | None = None,
    *,
    generator: torch.Generator | None = None,
    stats: SpecStats | None = None,
) -> list[int]:
    """Continue `prompt` by up to `options.max_new_tokens` tokens; sampled with `generator`, else greedy.

    Stops after an EOS. The last round drafts fewer tokens when fewer remain, so the output is
    never longer than asked and every drafted token is verified. `draft` and `target` may be
    `IncrementalLogits` already (their caches then carry over between prompts; `use_cache` then
    does not apply).
    """
    options = options or SpecOptions()
    gamma, max_new_tokens, temperature = options.gamma, options.max_new_tokens, options.temperature
    eos_token_id, use_cache = options.eos_token_id, options.use_cache
    _check(gamma, max_new_tokens, temperature, prompt)
    stats = stats if stats is not None else SpecStats(gamma)
    small, large = (
        m if isinstance(m, IncrementalLogits) else IncrementalLogits(m, use_cache, label)
        for m, label in zip((draft, target), ("the draft", "the target"))
    )
    ids = list(prompt)
    new: list[int] = []
    while len(new) < max_new_tokens and (eos_token_id is None or eos_token_id not in new):
        n = min(gamma, max_new_tokens - len(new) - 1)
        tokens, q = _draft(small, ids + new, n, temperature, generator)
        p = _probs(large(ids + new + tokens, n + 1), temperature)
        accepted, nxt = _verify(tokens, q, p, generator)
        emitted = _until_eos([*tokens[:accepted], nxt], eos_token_id)
        stats.record_round(n, accepted)
        stats.generated += len(emitted)
        new += emitted
    return new


def _until_eos(tokens: list[int], eos_token_id: int | None) -> list[int]:
    if eos_token_id is not None and eos_token_id in tokens:
        return tokens[: tokens.index(eos_token_id) + 1]
    return tokens


def _check(gamma: int, max_new_tokens: int, temperature: float, prompt: Sequence[int]) -> None:
    if gamma < 1:
        raise MoePruneError(f"draft length gamma must be at least 1, got {gamma}")
    if max_new_tokens < 1:
        raise MoePruneError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not temperature > 0:
        raise MoePruneError(f"temperature must be positive, got {temperature}")
    if not prompt:
        raise MoePruneError("speculative decoding needs a non-empty prompt")


def acceptance(
    draft: nn.Module,
    target: nn.Module,
    prompts: Sequence[Sequence[int]],
    options: SpecOptions | None = None,
    *,
    modes: Sequence[str] = MODES,
    seed: int = 0,
    labels: tuple[str, str] = ("the draft", "the target"),
) -> dict[str, dict]:
    """Acceptance statistics per mode over `prompts`; the sampled mode uses one seeded generator.
    `options` (SpecOptions) sets the draft length, tokens per prompt, temperature, EOS and the KV
    cache. NaN or infinite logits from either model raise NonFiniteError naming it by its `labels`."""
    options = options or SpecOptions()
    gamma, max_new_tokens, use_cache = options.gamma, options.max_new_tokens, options.use_cache
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise MoePruneError(f"unknown speculative mode(s) {unknown}; choose from {', '.join(MODES)}")
    results = {}
    for mode in modes:
        generator = torch.Generator().manual_seed(seed) if mode == "sampled" else None
        stats = SpecStats(gamma)
        small, large = (IncrementalLogits(m, use_cache, label) for m, label in zip((draft, target), labels))
        for prompt in prompts:
            speculative_generate(small, large, prompt, options, generator=generator, stats=stats)
        kv_cache = {"draft": bool(small.cached), "target": bool(large.cached)}
        results[mode] = {
            **stats.to_dict(),
            "prompts": len(prompts),
            "max_new_tokens": max_new_tokens,
            "kv_cache": kv_cache,
        }
    return results
