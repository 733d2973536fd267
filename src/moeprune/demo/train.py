"""Train a tiny MoE language model on the local corpus, cache it, and measure what it learned.

Why: the demo and the quality tests need an MoE whose experts carry real, specialised knowledge,
and nothing can be downloaded. A few minutes on two CPU cores suffice for a 4-layer Qwen3-MoE
(the default) or a 5-layer DeepSeek-V3-architecture model (`demo_spec("deepseek_v3")`).

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from moeprune.data.tokenizer import train_bpe_tokenizer
from moeprune.demo.corpus import CORPUS_VERSION, DOMAINS, build_corpus, load_split
from moeprune.demo.heldout import RouteCounter, encode_rows, greedy_samples, heldout_stats
from moeprune.runtime.cache import cache_root
from moeprune.runtime.progress import progress_bar

TRAINER_VERSION = 1
CORPUS_SUBDIR = "corpus"
TRAINING_JSON = "training.json"
_LATER_FIELDS = ("shared_experts", "dense_layers", "dense_intermediate", "bias_rate")
FAMILIES = ("qwen3_moe", "olmoe", "deepseek_v3")  # the architectures a demo model can have
# Whether the router renormalises its top-k gates: each family's own choice (OLMoE does not), so the
# demo models cover softmax routing with and without renormalisation, and sigmoid routing.
_NORM_TOPK = {"qwen3_moe": True, "olmoe": False, "deepseek_v3": True}


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
    # Added with the DeepSeek-architecture model (they enter spec_dict only when set, so the
    # models cached before them keep their key):
    shared_experts: int = 0  # always-on shared experts beside the routed ones
    dense_layers: int = 0  # leading decoder layers with a dense MLP (DeepSeek's first_k_dense_replace)
    dense_intermediate: int = 256  # their MLP width
    bias_rate: float = 0.0  # step of the auxiliary-loss-free balance of routers with a selection bias

    def corpus_sizes(self) -> dict[str, int]:
        return {"train": self.corpus_train, "search": self.corpus_heldout, "eval": self.corpus_heldout}

    def spec_dict(self) -> dict[str, Any]:
        """The fields that determine the model: the later fields only where they differ from their
        default, so a model trained before they existed keeps its cache key and record."""
        later = {f.name: f.default for f in dataclasses.fields(self) if f.name in _LATER_FIELDS}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in later or v != later[k]}

    def key(self) -> str:
        """Short hash of the spec and of everything else the result depends on."""
        blob = json.dumps(
            {
                "spec": self.spec_dict(),
                "corpus": CORPUS_VERSION,
                "trainer": TRAINER_VERSION,
                "python": sys.version,  # the stdlib, hence the corpus, can change in any release
                # a family that does not renormalise (changed after its first models were cached)
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
# The DeepSeek architecture: a sigmoid router whose selection adds a bias that no gradient trains (balanced as
# DeepSeek-V3 trains it, without an auxiliary loss), a shared expert, a dense first layer, MLA.
DEEPSEEK = DemoModelSpec(
    family="deepseek_v3",
    layers=5,
    kv_heads=4,  # MLA: one key/value head per query head
    experts=16,
    top_k=4,
    moe_intermediate=64,
    shared_experts=1,
    dense_layers=1,
    dense_intermediate=256,
    bias_rate=0.01,
)
DEEPSEEK_FIXTURE = dataclasses.replace(
    FIXTURE,
    family="deepseek_v3",
    layers=3,
    kv_heads=FIXTURE.heads,
    moe_intermediate=32,
    shared_experts=1,
    dense_layers=1,
    dense_intermediate=128,
    bias_rate=0.01,
)


def demo_spec(family: str = "qwen3_moe", quick: bool = False) -> DemoModelSpec:
    """The demo model of an architecture: the full one, or the quick one (the test fixture's size)."""
    if family == "deepseek_v3":
        return DEEPSEEK_FIXTURE if quick else DEEPSEEK
    if family not in FAMILIES:
        raise ValueError(f"unsupported family {family!r}; use one of {', '.join(FAMILIES)}")
    base = FIXTURE if quick else DEMO
    return base if family == base.family else dataclasses.replace(base, family=family)


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _family_fields(spec: DemoModelSpec) -> dict[str, Any]:
    """The config fields that spell the MoE block in each family's own names."""
    if spec.family == "deepseek_v3":
        head = spec.hidden // spec.heads
        return {
            "n_routed_experts": spec.experts,
            "n_shared_experts": spec.shared_experts,
            "moe_intermediate_size": spec.moe_intermediate,
            "first_k_dense_replace": spec.dense_layers,
            "intermediate_size": spec.dense_intermediate,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,  # DeepSeek-V3's
            "q_lora_rank": None,
            "kv_lora_rank": 2 * head,
            "qk_rope_head_dim": head // 2,
            "qk_nope_head_dim": head // 2,
            "v_head_dim": head,
        }
    if spec.shared_experts or spec.dense_layers or spec.bias_rate:
        raise ValueError(f"{spec.family} demo models have no shared experts, dense layers or selection bias")
    width = {"qwen3_moe": "moe_intermediate_size", "olmoe": "intermediate_size"}[spec.family]
    return {
        "num_experts": spec.experts,
        "intermediate_size": spec.moe_intermediate,
        "router_aux_loss_coef": spec.aux_loss_coef,
        width: spec.moe_intermediate,
    }


def _build_model(spec: DemoModelSpec, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    if spec.family not in FAMILIES:
        raise ValueError(f"unsupported family {spec.family!r}; use one of {', '.join(FAMILIES)}")
    config = AutoConfig.for_model(
        spec.family,
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        num_experts_per_tok=spec.top_k,
        norm_topk_prob=_NORM_TOPK[spec.family],
        output_router_logits=False,  # training asks for them per call; inference need not pay
        max_position_embeddings=spec.seq_len,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **_family_fields(spec),
    )
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(config)


@torch.no_grad()
def balance_selection_bias(counter: RouteCounter, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balance: after each step, raise the selection bias of the
    experts that got fewer tokens than the mean and lower it for those that got more, by `rate`."""
    for layer, counts in zip(counter.layers, counter.counts):
        bias = getattr(layer.router, "e_score_correction_bias", None)
        if bias is not None:
            bias += rate * torch.sign(counts.mean() - counts).to(bias.dtype)


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
        aux_loss = hasattr(model.config, "router_aux_loss_coef")  # else balanced by the selection bias
        counter = RouteCounter(model)
        bar = progress_bar(range(spec.steps), desc=f"training demo MoE ({spec.family})", enabled=progress)
        with counter:
            for _ in bar:
                x = _batch(streams, spec.batch, spec.seq_len, g)
                counter.reset()
                out = model(input_ids=x, labels=x, output_router_logits=aux_loss)
                opt.zero_grad(set_to_none=True)
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                if spec.bias_rate:
                    balance_selection_bias(counter, spec.bias_rate)
                aux = float(out.aux_loss.detach()) if aux_loss else 0.0
                ce = float(out.loss.detach()) - spec.aux_loss_coef * aux
                # max/mean selections of the busiest expert over the layers: 1.0 is perfect balance
                load = max(float(c.max() / c.mean().clamp_min(1e-9)) for c in counter.counts)
                losses.append({"ce": round(ce, 4), "aux": round(aux, 4), "max_load": round(load, 3)})
                bar.set_postfix(ce=f"{ce:.3f}", aux=f"{aux:.3f}", load=f"{load:.2f}")
        train_seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        model.eval()
        stats = heldout_stats(model, tokenizer, corpus_dir, "eval")
        samples = greedy_samples(model, tokenizer, corpus_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    record = {
        "spec": spec.spec_dict(),
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
# Cache


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
