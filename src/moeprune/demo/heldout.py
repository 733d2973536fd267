"""What a trained demo model learned: held-out NLL per domain, routing balance and specialisation.

Measured right after training (training.json) and again by the tests on the reloaded checkpoint;
the routers' selections are counted from their own outputs (`RouteCounter`), which training also
reads to balance a selection bias.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moeprune.demo.corpus import DOMAINS, load_split
from moeprune.models import MoEModel


def encode_rows(tokenizer: PreTrainedTokenizerBase, rows: Sequence[dict[str, str]]) -> list[list[int]]:
    """``bos prompt answer eos`` per row; prompt and answer are tokenized apart, as data loaders do."""
    prompts = tokenizer([r["prompt"] for r in rows]).input_ids
    answers = tokenizer([r["answer"] for r in rows], add_special_tokens=False).input_ids
    return [p + a + [tokenizer.eos_token_id] for p, a in zip(prompts, answers)]


class RouteCounter:
    """Counts the experts each MoE layer's router selects, from the routers' own outputs.

    The routers are found by moeprune's model discovery, and their selection read from the index
    tensor they return, so a selection bias, groups or renormalisation are counted as they route.
    Use as a context manager; `counts` holds one [experts] float64 tensor per MoE layer.
    """

    def __init__(self, model: PreTrainedModel):
        self.layers = MoEModel(model).layers
        self.counts = [torch.zeros(m.num_experts, dtype=torch.float64) for m in self.layers]
        self.mask: torch.Tensor | None = None  # tokens to count (flattened), None: all
        self._handles: list = []

    def __enter__(self) -> RouteCounter:
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, i: int):
        def hook(_module, _inputs, output) -> None:
            index = next(t for t in output if isinstance(t, torch.Tensor) and not t.is_floating_point())
            index = index.reshape(-1, index.shape[-1])
            if self.mask is not None:
                index = index[self.mask]
            self.counts[i] += torch.bincount(index.reshape(-1).cpu(), minlength=len(self.counts[i])).double()

        return hook

    def reset(self) -> None:
        for c in self.counts:
            c.zero_()


@torch.no_grad()
def greedy_samples(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, corpus_dir: Path, new_tokens: int = 48
) -> list[dict[str, str]]:
    """Greedy continuations of the first eval prompt of each domain: learning you can read."""
    out = []
    for domain in DOMAINS:
        row = load_split(corpus_dir, domain, "eval")[0]
        ids = tokenizer(row["prompt"], return_tensors="pt").input_ids
        # transformers' PreTrainedModel does not declare generate (GenerationMixin adds it to causal LMs)
        gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)  # type: ignore[operator]
        text = cast(str, tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))  # one sequence
        out.append({"domain": domain, "prompt": row["prompt"], "expected": row["answer"], "generated": text})
    return out


def _entropy(counts: torch.Tensor) -> float:
    p = counts.double() / counts.sum().clamp_min(1)
    return float(-(p[p > 0] * p[p > 0].log()).sum())


def unigram_nll(train: Sequence[Sequence[int]], heldout: Sequence[Sequence[int]], vocab_size: int) -> float:
    """Token-weighted NLL (nats) of an add-one-smoothed unigram model fitted on ``train``.

    Like the LM, it predicts every token but the first (bos) of each sequence.
    """
    counts = torch.ones(vocab_size, dtype=torch.float64)
    for seq in train:
        counts += torch.bincount(torch.tensor(seq[1:], dtype=torch.long), minlength=vocab_size)
    logp = counts.log() - counts.sum().log()
    targets = torch.tensor([t for seq in heldout for t in seq[1:]], dtype=torch.long)
    return float(-logp[targets].mean())


@torch.no_grad()
def heldout_stats(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    corpus_dir: str | os.PathLike,
    split: str = "eval",
    batch_size: int = 16,
) -> dict:
    """NLL per token (model and unigram baseline) and routing statistics on a held-out split.

    Sequences are ``bos prompt answer eos``, cut at ``max_position_embeddings``. Routing entropy
    is that of each MoE layer's expert-selection frequencies (nats; ``log(n_experts)`` when
    perfectly balanced); ``domain_mi`` is the mutual information between domain and selected
    expert (nats; 0 when experts ignore the domain), a measure of specialisation.
    """
    max_len = model.config.max_position_embeddings
    counter = RouteCounter(model)
    n_experts = len(counter.counts[0])
    seqs = {
        d: [s[:max_len] for s in encode_rows(tokenizer, load_split(corpus_dir, d, split))] for d in DOMAINS
    }
    counts: torch.Tensor | None = None  # [layer, domain, expert]
    per_domain: dict[str, dict[str, Any]] = {}  # domain -> {"nll": float, "tokens": int}
    for di, domain in enumerate(DOMAINS):
        total_nll, total_tokens = 0.0, 0
        ordered = sorted(seqs[domain], key=len)
        for i in range(0, len(ordered), batch_size):
            chunk = ordered[i : i + batch_size]
            width = max(map(len, chunk))
            ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, seq in enumerate(chunk):
                ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
            counter.reset()
            counter.mask = mask.reshape(-1).bool()
            with counter:
                out = model(input_ids=ids, attention_mask=mask)
            logp = out.logits[:, :-1].float().log_softmax(-1)
            nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
            target_mask = mask[:, 1:].bool()
            total_nll += float(nll[target_mask].sum())
            total_tokens += int(target_mask.sum())
            if counts is None:
                counts = torch.zeros(len(counter.counts), len(DOMAINS), n_experts, dtype=torch.float64)
            for layer, chosen in enumerate(counter.counts):
                counts[layer, di] += chosen
        per_domain[domain] = {"nll": total_nll / max(total_tokens, 1), "tokens": total_tokens}
    assert counts is not None, "empty held-out split"
    total_tokens = sum(v["tokens"] for v in per_domain.values())
    train = [s for d in DOMAINS for s in encode_rows(tokenizer, load_split(corpus_dir, d, "train"))]
    heldout = [s for d in DOMAINS for s in seqs[d]]
    per_layer = counts.sum(1)
    domain_weights = counts.sum(2) / counts.sum(2).sum(1, keepdim=True)  # [layer, domain]
    return {
        "split": split,
        "tokens": total_tokens,
        "nll": sum(v["nll"] * v["tokens"] for v in per_domain.values()) / total_tokens,
        "unigram_nll": unigram_nll(train, heldout, len(tokenizer)),
        "per_domain": per_domain,
        "routing": {
            "max_entropy": math.log(n_experts),
            "entropy": [_entropy(c) for c in per_layer],
            "used_fraction": [float((c > 0).double().mean()) for c in per_layer],
            "domain_mi": [
                _entropy(per_layer[layer])
                - sum(
                    float(domain_weights[layer, d]) * _entropy(counts[layer, d]) for d in range(len(DOMAINS))
                )
                for layer in range(counts.shape[0])
            ],
        },
    }
