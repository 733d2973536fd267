"""Train a tiny MoE language model on the local corpus, cache it, and measure what it learned.

Why: the demo and the quality tests need an MoE whose experts carry real, specialised knowledge,
and nothing can be downloaded. A few minutes on two CPU cores suffice for a 4-layer Qwen3-MoE.

The trained folder is a normal transformers checkpoint (model, tokenizer, chat template) plus
``training.json`` (spec, losses, time, held-out statistics) and the corpus in ``corpus/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from moeprune.data.tokenizer import train_bpe_tokenizer
from moeprune.demo.corpus import CORPUS_VERSION, DOMAINS, build_corpus, load_split
from moeprune.runtime.progress import progress_bar

TRAINER_VERSION = 1
CORPUS_SUBDIR = "corpus"
TRAINING_JSON = "training.json"
# Config field holding the routed experts' intermediate size, per supported family.
_EXPERT_WIDTH_FIELD = {"qwen3_moe": "moe_intermediate_size", "olmoe": "intermediate_size"}
# Whether the router renormalises its top-k gates: each family's own choice (OLMoE does not), so the
# demo models cover softmax routing with and without renormalisation.
_NORM_TOPK = {"qwen3_moe": True, "olmoe": False}


@dataclasses.dataclass(frozen=True)
class DemoModelSpec:
    """Everything that determines a trained demo model (its hash names the cache folder)."""

    family: str = "qwen3_moe"
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    experts: int = 16
    top_k: int = 2
    moe_intermediate: int = 128
    vocab: int = 2048
    seq_len: int = 256
    steps: int = 500
    batch: int = 12
    lr: float = 3e-3
    warmup: int = 30
    aux_loss_coef: float = 0.03  # 0.01 left 1 of 16 experts unused in two DEMO layers; 0.03 none
    seed: int = 0
    corpus_train: int = 6000  # examples per domain in the train split
    corpus_heldout: int = 200  # examples per domain in each of search and eval

    def corpus_sizes(self) -> dict[str, int]:
        return {"train": self.corpus_train, "search": self.corpus_heldout, "eval": self.corpus_heldout}

    def key(self) -> str:
        """Short hash of the spec and of everything else the result depends on."""
        blob = json.dumps(
            {
                "spec": dataclasses.asdict(self),
                "corpus": CORPUS_VERSION,
                "trainer": TRAINER_VERSION,
                "python": sys.version,  # the stdlib, hence the corpus, can change in any release
                # trainer 1 renormalised every family; a family that does not gets a new name
                **({} if _NORM_TOPK.get(self.family, True) else {"norm_topk_prob": False}),
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


DEMO = DemoModelSpec()
FIXTURE = DemoModelSpec(
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    experts=8,
    top_k=2,
    moe_intermediate=64,
    vocab=512,
    seq_len=128,
    steps=500,
    batch=16,
    lr=4e-3,
    warmup=20,
    corpus_train=1500,
    corpus_heldout=64,
)


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _build_model(spec: DemoModelSpec, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    if spec.family not in _EXPERT_WIDTH_FIELD:
        raise ValueError(f"unsupported family {spec.family!r}; use one of {sorted(_EXPERT_WIDTH_FIELD)}")
    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.moe_intermediate,
        num_experts=spec.experts,
        num_experts_per_tok=spec.top_k,
        norm_topk_prob=_NORM_TOPK[spec.family],
        router_aux_loss_coef=spec.aux_loss_coef,
        output_router_logits=False,  # training asks for them per call; inference need not pay
        max_position_embeddings=spec.seq_len,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # the routed experts' width (OLMoE names it intermediate_size: one keyword, not two)
    fields[_EXPERT_WIDTH_FIELD[spec.family]] = spec.moe_intermediate
    config = AutoConfig.for_model(spec.family, **fields)
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(config)


def encode_rows(tokenizer: PreTrainedTokenizerBase, rows: Sequence[dict[str, str]]) -> list[list[int]]:
    """``bos prompt answer eos`` per row; prompt and answer are tokenized apart, as data loaders do."""
    prompts = tokenizer([r["prompt"] for r in rows]).input_ids
    answers = tokenizer([r["answer"] for r in rows], add_special_tokens=False).input_ids
    return [p + a + [tokenizer.eos_token_id] for p, a in zip(prompts, answers)]


def _streams(tokenizer: PreTrainedTokenizerBase, corpus_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """One shuffled, concatenated token stream per domain of the train split."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for domain in DOMAINS:
        seqs = encode_rows(tokenizer, load_split(corpus_dir, domain, "train"))
        order = torch.randperm(len(seqs), generator=g).tolist()
        out[domain] = torch.tensor([t for i in order for t in seqs[i]], dtype=torch.long)
    return out


def _batch(streams: dict[str, torch.Tensor], batch: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    """Random windows, the domains taking turns by row so every batch mixes them evenly."""
    rows = []
    for i in range(batch):
        stream = streams[DOMAINS[i % len(DOMAINS)]]
        start = int(torch.randint(0, len(stream) - seq_len, (1,), generator=g))
        rows.append(stream[start : start + seq_len])
    return torch.stack(rows)


def _lr_factor(step: int, spec: DemoModelSpec) -> float:
    """Linear warmup, then cosine decay to 10%."""
    if step < spec.warmup:
        return (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def train_demo_model(
    spec: DemoModelSpec,
    corpus_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    progress: bool = True,
    threads: int | None = None,
) -> Path:
    """Train tokenizer and model on the corpus's train split and save them to ``out_dir``.

    Builds the corpus first when ``corpus_dir`` holds none. The loss is the model's own: cross
    entropy plus ``router_aux_loss_coef`` times the family's load-balancing loss (transformers adds
    it when ``output_router_logits=True`` and labels are given). Trains in fp32: bf16 autocast
    made a DEMO training step about 7x slower on CPU (4.5 s against 0.67 s, one thread).
    ``threads`` defaults to ``min(2, cpu_count)``; the previous torch setting is restored.
    """
    corpus_dir, out_dir = Path(corpus_dir), Path(out_dir)
    if not (corpus_dir / "manifest.json").exists():
        build_corpus(corpus_dir, seed=spec.seed, sizes=spec.corpus_sizes())
    threads = threads or min(2, os.cpu_count() or 1)
    start, cpu_start = time.perf_counter(), time.process_time()
    with _torch_threads(threads):
        texts = (r["prompt"] + r["answer"] for d in DOMAINS for r in load_split(corpus_dir, d, "train"))
        tokenizer = train_bpe_tokenizer(texts, spec.vocab)
        streams = _streams(tokenizer, corpus_dir, spec.seed)
        model = _build_model(spec, tokenizer)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, spec))
        g = torch.Generator().manual_seed(spec.seed)
        losses: list[dict[str, float]] = []
        bar = progress_bar(range(spec.steps), desc=f"training demo MoE ({spec.family})", enabled=progress)
        for _ in bar:
            x = _batch(streams, spec.batch, spec.seq_len, g)
            out = model(input_ids=x, labels=x, output_router_logits=True)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            aux = float(out.aux_loss.detach())
            ce = float(out.loss.detach()) - spec.aux_loss_coef * aux
            losses.append({"ce": round(ce, 4), "aux": round(aux, 4)})
            bar.set_postfix(ce=f"{ce:.3f}", aux=f"{aux:.3f}")
        train_seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        model.eval()
        stats = heldout_stats(model, tokenizer, corpus_dir, "eval")
        samples = _greedy_samples(model, tokenizer, corpus_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    record = {
        "spec": dataclasses.asdict(spec),
        "key": spec.key(),
        "train_seconds": round(train_seconds, 1),  # wall: tokenizer, data and training steps
        "cpu_seconds": round(cpu_seconds, 1),  # all threads; compare to judge contention
        "threads": threads,
        "tokens_seen": spec.steps * spec.batch * spec.seq_len,
        "losses": losses,
        "eval": stats,
        "samples": samples,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (out_dir / TRAINING_JSON).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return out_dir


# ----------------------------------------------------------------------------------------------
# Held-out measurement


@torch.no_grad()
def _greedy_samples(
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
    n_experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
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
            out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
            logp = out.logits[:, :-1].float().log_softmax(-1)
            nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
            target_mask = mask[:, 1:].bool()
            total_nll += float(nll[target_mask].sum())
            total_tokens += int(target_mask.sum())
            if counts is None:
                counts = torch.zeros(len(out.router_logits), len(DOMAINS), n_experts, dtype=torch.float64)
            keep = mask.reshape(-1).bool()
            for layer, logits in enumerate(out.router_logits):
                chosen = logits[keep].topk(top_k, dim=-1).indices.reshape(-1)
                counts[layer, di] += torch.bincount(chosen, minlength=n_experts).double()
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


# ----------------------------------------------------------------------------------------------
# Cache


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$MOEPRUNE_CACHE``, else ``$XDG_CACHE_HOME/moeprune`` or ``~/.cache/moeprune``."""
    if cache_dir:
        return Path(cache_dir)
    if os.environ.get("MOEPRUNE_CACHE"):
        return Path(os.environ["MOEPRUNE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moeprune"


def _remove_stale_tmp(root: Path, name: str) -> None:
    """Delete temporary folders of killed builds (the pid in their name no longer runs)."""
    for tmp in root.glob(f".tmp-{name}-*"):
        try:
            os.kill(int(tmp.name.split("-")[-2]), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):  # not ours to judge
            pass


def get_demo_model(
    spec: DemoModelSpec = DEMO,
    cache_dir: str | os.PathLike | None = None,
    rebuild: bool = False,
    progress: bool = True,
    threads: int | None = None,
) -> Path:
    """Folder of the trained model for ``spec``, training it on first use; its corpus is in ``corpus/``.

    Training goes to a temporary sibling folder that replaces the final one in one rename, so an
    interrupted run never leaves a half-written model and a concurrent builder's result is reused.
    """
    root = cache_root(cache_dir)
    final = root / f"demo-{spec.key()}"
    if (final / TRAINING_JSON).exists() and not rebuild:
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(root, final.name)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        train_demo_model(spec, tmp / CORPUS_SUBDIR, tmp, progress=progress, threads=threads)
        if final.exists():  # rebuild, or a leftover without training.json
            trash = root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished first: keep its result
            if not (final / TRAINING_JSON).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
