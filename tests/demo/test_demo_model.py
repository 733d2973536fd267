"""The local corpus, the tokenizers and the trained fixture MoE (moeprune.demo)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from moeprune.data.tokenizer import BOS, EOS, PAD, byte_tokenizer, train_bpe_tokenizer
from moeprune.demo import corpus as corpus_mod
from moeprune.demo import train as train_mod
from moeprune.demo.corpus import DOMAINS, SPLITS, build_corpus, load_split
from moeprune.demo.heldout import RouteCounter, heldout_stats, unigram_nll
from moeprune.demo.train import FIXTURE, DemoModelSpec, get_demo_model

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

# Floors the fixture must clear (measured values are in the comments).
NLL_MARGIN_NATS = 1.0  # unigram minus model NLL on the eval split (measured ~3.0)
ENTROPY_FLOOR = 0.5  # times log(n_experts), per layer (measured ~0.93)
USED_FLOOR = 0.75  # fraction of experts that receive eval tokens (measured 1.0)
DOMAIN_MI_FLOOR = 0.05  # nats, best layer: experts specialise by domain (measured ~0.15-0.3)

TEXTS = ["def f(x):\n\treturn x + 1  # naïve ✓\n", "Ünïcode, emoji 🙂 and  spaces\n\n", "", " leading"]


# ----------------------------------------------------------------------------------------------
# Corpus


def test_corpus_is_deterministic(trained_moe: tuple[Path, Path], tmp_path: Path) -> None:
    """A fresh build with the fixture's seed and sizes reproduces the cached corpus byte for byte."""
    _, corpus_dir = trained_moe
    cached = json.loads((corpus_dir / "manifest.json").read_text())
    fresh = build_corpus(tmp_path, seed=FIXTURE.seed, sizes=FIXTURE.corpus_sizes())
    assert fresh["files"] == cached["files"]
    assert fresh["python"] == cached["python"]
    for name, info in fresh["files"].items():
        assert (tmp_path / name).read_bytes() == (corpus_dir / name).read_bytes(), name
        assert info["count"] > 0, name


def test_corpus_files_are_valid_prompt_answer_jsonl(trained_moe: tuple[Path, Path]) -> None:
    _, corpus_dir = trained_moe
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    assert set(manifest["files"]) == {f"{d}_{s}.jsonl" for d in DOMAINS for s in SPLITS}
    for domain in DOMAINS:
        for split in SPLITS:
            lines = (corpus_dir / f"{domain}_{split}.jsonl").read_text(encoding="utf-8").splitlines()
            assert len(lines) == manifest["files"][f"{domain}_{split}.jsonl"]["count"] > 0
            for line in lines:
                row = json.loads(line)
                assert set(row) == {"prompt", "answer"}
                assert row["prompt"].strip() and row["answer"].strip()
    assert len(load_split(corpus_dir, "math", "train")) == FIXTURE.corpus_train
    assert "The answer is" in load_split(corpus_dir, "math", "eval")[0]["answer"]


def test_corpus_splits_are_disjoint(trained_moe: tuple[Path, Path]) -> None:
    """No prompt and no source (stdlib file, documented object, word-problem frame) in two splits."""
    _, corpus_dir = trained_moe
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    for domain in DOMAINS:
        prompts = {s: {r["prompt"] for r in load_split(corpus_dir, domain, s)} for s in SPLITS}
        sources = {s: set(manifest["sources"][domain][s]) for s in SPLITS}
        for i, a in enumerate(SPLITS):
            for b in SPLITS[i + 1 :]:
                assert not prompts[a] & prompts[b], (domain, a, b)
                assert not sources[a] & sources[b], (domain, a, b)
        assert all(sources[s] for s in SPLITS), domain
    # a stdlib file feeds code and prose from the same split, so neither leaks into the other
    for split in SPLITS:
        files = {s for s in manifest["sources"]["prose"][split] if s.endswith(".py")}
        other = {s for t in SPLITS if t != split for s in manifest["sources"]["code"][t]}
        assert not files & other


def test_split_depends_on_seed_only_through_the_hash() -> None:
    sources = [f"mod{i}.py" for i in range(300)]
    first = [corpus_mod.split_of(s, 0) for s in sources]
    assert first == [corpus_mod.split_of(s, 0) for s in sources]
    assert first != [corpus_mod.split_of(s, 1) for s in sources]
    assert {s: first.count(s) for s in SPLITS}["train"] > 200


# ----------------------------------------------------------------------------------------------
# Tokenizers


@pytest.mark.parametrize("make", [byte_tokenizer, lambda: train_bpe_tokenizer(TEXTS * 20, 300)])
def test_tokenizer_round_trips_and_adds_bos(make, tmp_path: Path) -> None:
    tok = make()
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, EOS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for t in (tok, reloaded):
        for text in TEXTS:
            ids = t(text).input_ids
            assert ids[0] == t.bos_token_id
            assert t.decode(ids, skip_special_tokens=True) == text
            assert t(text, add_special_tokens=False).input_ids == ids[1:]
        chat = t.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False
        )
        assert chat == f"{BOS}<|user|>\nhi{EOS}\n<|assistant|>\nyo{EOS}\n"


def test_byte_tokenizer_vocab() -> None:
    tok = byte_tokenizer()
    assert len(tok) == 259
    assert len(tok("é", add_special_tokens=False).input_ids) == 2  # two UTF-8 bytes


def test_trained_tokenizer_respects_vocab_size(trained_moe: tuple[Path, Path]) -> None:
    model_dir, corpus_dir = trained_moe
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert 259 < len(tok) <= FIXTURE.vocab
    row = load_split(corpus_dir, "code", "eval")[0]
    text = row["prompt"] + row["answer"]
    ids = tok(text).input_ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    rows = [r["prompt"] + r["answer"] for r in load_split(corpus_dir, "code", "eval")]
    tokens = sum(len(tok(t, add_special_tokens=False).input_ids) for t in rows)
    assert tokens < 0.7 * sum(
        len(t.encode()) for t in rows
    )  # BPE merges actually compress (bytes/token > 1.4)


# ----------------------------------------------------------------------------------------------
# Training machinery


def test_loss_includes_router_load_balancing() -> None:
    """transformers adds router_aux_loss_coef * aux_loss to the loss: the trainer relies on it."""
    tok = byte_tokenizer()
    model = train_mod._build_model(DemoModelSpec(layers=1, hidden=32, experts=4, moe_intermediate=16), tok)
    x = torch.randint(3, len(tok), (2, 12))
    with torch.no_grad():
        plain = model(input_ids=x, labels=x).loss
        out = model(input_ids=x, labels=x, output_router_logits=True)
    assert out.aux_loss > 0
    assert torch.allclose(out.loss, plain + model.config.router_aux_loss_coef * out.aux_loss, atol=1e-6)


def test_unigram_nll_matches_hand_computation() -> None:
    # train targets (bos dropped): counts a=2, b=1 of vocab 3 -> add-one probs 3/6, 2/6, 1/6
    nll = unigram_nll([[2, 0, 0, 1]], [[2, 0, 1]], vocab_size=3)
    assert nll == pytest.approx(-(math.log(3 / 6) + math.log(2 / 6)) / 2)


def test_cache_is_atomic_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed build leaves nothing behind; a finished one is reused without training again."""
    calls = []

    def fake_train(spec, corpus_dir, out_dir, progress=True, threads=None):
        calls.append(out_dir)
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")
        if len(calls) == 1:
            raise RuntimeError("interrupted")
        (Path(out_dir) / train_mod.TRAINING_JSON).write_text("{}")
        return Path(out_dir)

    monkeypatch.setattr(train_mod, "train_demo_model", fake_train)
    with pytest.raises(RuntimeError):
        get_demo_model(FIXTURE, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    killed = tmp_path / f".tmp-demo-{FIXTURE.key()}-99999999-abcdef12"  # no such pid: removed
    running = tmp_path / f".tmp-demo-{FIXTURE.key()}-{os.getpid()}-abcdef12"  # a live build: kept
    killed.mkdir()
    running.mkdir()
    path = get_demo_model(FIXTURE, cache_dir=tmp_path)
    assert path == tmp_path / f"demo-{FIXTURE.key()}" and (path / train_mod.TRAINING_JSON).exists()
    assert get_demo_model(FIXTURE, cache_dir=tmp_path) == path and len(calls) == 2
    get_demo_model(FIXTURE, cache_dir=tmp_path, rebuild=True)
    assert len(calls) == 3 and sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, running.name])
    monkeypatch.setenv("MOEPRUNE_CACHE", str(tmp_path))
    assert get_demo_model(FIXTURE) == path and len(calls) == 3


def test_spec_key_tracks_every_field() -> None:
    assert DemoModelSpec().key() == DemoModelSpec().key()
    assert DemoModelSpec(steps=1).key() != DemoModelSpec().key()
    assert FIXTURE.key() != train_mod.DEMO.key()
    # fields added later enter the key only when set: older cached models keep theirs
    assert "shared_experts" not in FIXTURE.spec_dict()
    assert dataclasses.replace(FIXTURE, shared_experts=1).key() != FIXTURE.key()
    assert train_mod.DEEPSEEK_FIXTURE.spec_dict()["bias_rate"] == train_mod.DEEPSEEK_FIXTURE.bias_rate


def test_demo_specs_per_family() -> None:
    assert train_mod.demo_spec() is train_mod.DEMO and train_mod.demo_spec(quick=True) is FIXTURE
    assert train_mod.demo_spec("deepseek_v3", quick=True) is train_mod.DEEPSEEK_FIXTURE
    assert train_mod.demo_spec("olmoe").family == "olmoe"
    with pytest.raises(ValueError, match="unsupported family"):
        train_mod.demo_spec("mixtral")


def test_route_counter_counts_what_the_router_selects() -> None:
    """Counts equal the top-k of the DeepSeek router recomputed by hand (sigmoid + selection bias),
    masked tokens left out; the balance step moves each bias by the sign of (mean - count)."""
    from moeprune.models.factory import tiny_model

    model = tiny_model("deepseek_v3", n_group=1, topk_group=1)
    counter = RouteCounter(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    inputs: list[torch.Tensor] = []
    handles = [m.router.register_forward_hook(lambda _m, a, _o: inputs.append(a[0])) for m in counter.layers]
    counter.mask = torch.tensor([True] * 10 + [False] * 4)
    with counter, torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    for layer, hidden, counts in zip(counter.layers, inputs, counter.counts):
        router = layer.router
        scores = (hidden.reshape(-1, hidden.shape[-1]).float() @ router.weight.float().T).sigmoid()
        chosen = (scores + router.e_score_correction_bias).topk(model.config.num_experts_per_tok).indices
        expected = torch.bincount(chosen[:10].reshape(-1), minlength=layer.num_experts).double()
        assert torch.equal(counts, expected)
        assert counts.sum() == 10 * model.config.num_experts_per_tok
    before = [layer.router.e_score_correction_bias.clone() for layer in counter.layers]
    train_mod.balance_selection_bias(counter, 0.5)
    for layer, counts, old in zip(counter.layers, counter.counts, before):
        step = torch.where(counts < counts.mean(), 0.5, torch.where(counts > counts.mean(), -0.5, 0.0))
        assert torch.allclose(layer.router.e_score_correction_bias, old + step.float())


# ----------------------------------------------------------------------------------------------
# The trained fixture has learned


@pytest.fixture(scope="module")
def eval_stats(trained_moe: tuple[Path, Path]) -> dict:
    """Held-out statistics recomputed from the saved checkpoint, loaded the stock way."""
    model_dir, corpus_dir = trained_moe
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.model_type == FIXTURE.family
    return heldout_stats(model, tok, corpus_dir, "eval")


def test_checkpoint_reloads_exactly(trained_moe: tuple[Path, Path], eval_stats: dict) -> None:
    """Statistics from the reloaded checkpoint equal those measured right after training."""
    model_dir, _ = trained_moe
    recorded = json.loads((model_dir / train_mod.TRAINING_JSON).read_text())
    assert recorded["spec"] == FIXTURE.spec_dict()  # a model cached before the later fields matches
    assert eval_stats["nll"] == pytest.approx(recorded["eval"]["nll"], abs=1e-4)
    assert recorded["losses"][-1]["ce"] < recorded["losses"][0]["ce"] - 2


def test_model_beats_unigram_on_heldout_text(eval_stats: dict) -> None:
    assert eval_stats["tokens"] > 5000
    assert eval_stats["nll"] < eval_stats["unigram_nll"] - NLL_MARGIN_NATS, eval_stats
    for domain, stats in eval_stats["per_domain"].items():
        assert stats["nll"] < eval_stats["unigram_nll"] - NLL_MARGIN_NATS / 2, domain


def test_experts_are_not_collapsed(eval_stats: dict) -> None:
    routing = eval_stats["routing"]
    assert len(routing["entropy"]) == FIXTURE.layers
    assert routing["max_entropy"] == pytest.approx(math.log(FIXTURE.experts))
    for layer, (entropy, used) in enumerate(zip(routing["entropy"], routing["used_fraction"])):
        assert entropy > ENTROPY_FLOOR * math.log(FIXTURE.experts), (layer, entropy)
        assert used >= USED_FLOOR, (layer, used)
    assert max(routing["domain_mi"]) > DOMAIN_MI_FLOOR, routing["domain_mi"]


def test_deepseek_architecture_trains_with_its_selection_bias(trained_moe: tuple[Path, Path], tmp_path: Path) -> None:
    """The `--family deepseek_v3` demo model: a dense first layer, a shared expert, a sigmoid router
    whose selection bias only the balance rule moves (each entry a whole number of rate steps)."""
    spec = dataclasses.replace(train_mod.DEEPSEEK_FIXTURE, steps=24, warmup=4)
    out = train_mod.train_demo_model(spec, trained_moe[1], tmp_path / "m", progress=False, threads=1)
    model = AutoModelForCausalLM.from_pretrained(out)
    config = model.config
    assert config.model_type == "deepseek_v3" and config.first_k_dense_replace == 1
    assert config.n_shared_experts == 1 and config.n_routed_experts == spec.experts
    record = json.loads((out / train_mod.TRAINING_JSON).read_text())
    assert record["spec"] == spec.spec_dict() and record["losses"][-1]["ce"] < record["losses"][0]["ce"] - 1
    assert all(loss["aux"] == 0.0 and loss["max_load"] >= 1.0 for loss in record["losses"])
    assert len(record["eval"]["routing"]["entropy"]) == spec.layers - spec.dense_layers
    biases = [layer.mlp.gate.e_score_correction_bias for layer in model.model.layers[1:]]
    for bias in biases:
        steps = bias.double() / spec.bias_rate
        assert torch.allclose(steps, steps.round(), atol=1e-3) and steps.abs().max() <= spec.steps
        assert bias.abs().sum() > 0
