"""Local calibration / search data → token batches with an attention mask and an answer mask.

The answer mask says which tokens belong to the answer (a position is scored when
the *next* token is an answer token; the shift is the fitness code's job, not ours):

- ``{"text": ...}`` records and ``.txt`` documents: every token is answer (``text_only``).
- ``{"prompt": ..., "answer": ...}``: the prompt is tokenized with the tokenizer's special tokens
  (e.g. BOS), the answer without, and only the answer tokens are marked. Special tokens the
  tokenizer *appends* (an EOS) go after the answer and are marked with it, so they never sit
  between prompt and answer.
- ``{"messages": [...]}``: rendered with the tokenizer's chat template. An assistant turn's tokens
  are the token difference between the renderings of ``messages[:i]`` and ``messages[:i+1]``; of
  those, the role header the template emits before the content is *not* marked (it is fixed by the
  template, predicting it measures nothing), while the content and the turn's closing template
  tokens (e.g. ``<|im_end|>``) are (stopping is part of answering). The header is found by
  rendering the turn with a placeholder content; if that fails the whole difference is marked.
  Templates that render a turn differently once later messages follow (e.g. Qwen3 strips reasoning
  from history) make that turn context only; ``CalibrationData.notes`` counts them.

Files are read by data/files.py; tokenizing, mixing by weight, packing and fingerprints are here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moeprune.config import DataOptions
from moeprune.data.files import Record, Source, parse_source, read_source
from moeprune.errors import DataError

if TYPE_CHECKING:  # importing transformers is slow; only the type is needed here
    from transformers import PreTrainedTokenizerBase


_FINGERPRINT_VERSION = "moeprune-data-v1"  # bump when the tokenization / selection rules change
_PLACEHOLDER = "MoePruneAnswerPlaceholder"
_LOG = logging.getLogger(__name__)


@dataclass
class Sample:
    """One tokenized sample (or, with packing, one packed row)."""

    input_ids: list[int]
    answer_mask: list[bool]  # True where the token belongs to the answer (scored / counted)
    source: str  # file path it came from (packed rows: the distinct files joined by " + ")
    truncated: bool


@dataclass
class Batch:
    """Right-padded tensors of consecutive samples."""

    input_ids: torch.Tensor  # long [B, L]
    attention_mask: torch.Tensor  # long [B, L] 1 for real tokens
    answer_mask: torch.Tensor  # bool [B, L] False on padding
    sample_index: torch.Tensor  # long [B] index into CalibrationData.samples

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on another device (the model's)."""
        return Batch(
            *(
                t.to(device)
                for t in (self.input_ids, self.attention_mask, self.answer_mask, self.sample_index)
            )
        )


@dataclass
class CalibrationData:
    """Tokenized samples plus what a report needs to say about them.

    With ``packed`` True, samples are packed rows of ``max_length`` tokens, so ``sample_index``
    of a batch refers to rows, not to the original records.
    """

    samples: list[Sample]
    fingerprint: str  # sha256 hex over file contents + options (stable across runs)
    truncated: int  # number of samples cut at max_length
    text_only: bool  # True when no sample had a prompt/answer split (every token counts as answer)
    sources: list[str]
    skipped: int = 0  # empty samples left out
    packed: bool = False
    notes: list[str] = field(default_factory=list)  # shortfalls and oddities worth reporting

    def num_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.samples)

    def check_vocabulary(self, model) -> None:
        """One clear line, before any forward, when a token id is past the model's embedding (a
        tokenizer from another model): the embedding lookup would otherwise fail mid-run."""
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        rows = getattr(embedding, "num_embeddings", None)
        largest = max((max(s.input_ids) for s in self.samples if s.input_ids), default=-1)
        if rows is not None and largest >= rows:
            raise DataError(
                f"the data's token ids reach {largest} but the model's vocabulary has {rows} tokens: the "
                f"tokenizer does not belong to this model (data: {', '.join(self.sources) or 'given'}); pass the "
                "model's own tokenizer"
            )

    def batches(self, batch_size: int, pad_token_id: int | None) -> Iterator[Batch]:
        """Batches in sample order, right padded. A ``None`` pad id pads with 0: padding is masked anyway."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        pad = 0 if pad_token_id is None else pad_token_id
        for start in range(0, len(self.samples), batch_size):
            yield _collate(self.samples[start : start + batch_size], start, pad)


def _collate(samples: list[Sample], first_index: int, pad: int) -> Batch:
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    answer = torch.zeros((len(samples), width), dtype=torch.bool)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        ids[row, :n] = torch.tensor(sample.input_ids, dtype=torch.long)
        attention[row, :n] = 1
        answer[row, :n] = torch.tensor(sample.answer_mask, dtype=torch.bool)
    index = torch.arange(first_index, first_index + len(samples), dtype=torch.long)
    return Batch(ids, attention, answer, index)


# --------------------------------------------------------------------------- tokenization


class _Encoder:
    """Turns records into (input_ids, answer_mask) with one Hugging Face tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.suffix = self._appended_specials()
        self.context_only_turns = 0  # assistant turns the template renders unstably (see module doc)

    def ids(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _appended_specials(self) -> list[int]:
        """Special tokens the tokenizer adds *after* the text (e.g. EOS), found with a probe."""
        plain, full = self.ids("a", False), self.ids("a", True)
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[start + len(plain) :]
        return []

    def encode(self, rec: Record) -> tuple[list[int], list[bool]]:
        if rec.kind == "text":
            ids = self.ids(rec.text, True)
            return ids, [True] * len(ids)
        if rec.kind == "pair":
            return self._encode_pair(rec)
        return self._encode_chat(rec)

    def _encode_pair(self, rec: Record) -> tuple[list[int], list[bool]]:
        prompt, n = self.ids(rec.prompt, True), len(self.suffix)
        if n and prompt[-n:] == self.suffix:
            prompt = prompt[:-n]
        answer = self.ids(rec.answer, False) + self.suffix
        return prompt + answer, [False] * len(prompt) + [True] * len(answer)

    def _render(self, messages: list[dict[str, Any]], where: str) -> str:
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as exc:  # templates raise anything: jinja errors, ValueError for a missing template
            raise DataError(
                f"{where}: cannot render 'messages' with the tokenizer's chat template ({exc})"
            ) from None
        if not isinstance(text, str):
            raise DataError(f"{where}: the chat template did not render to a string")
        return text

    def _encode_chat(self, rec: Record) -> tuple[list[int], list[bool]]:
        messages, where = rec.messages, rec.where
        full = self._render(messages, where)
        ids = self.ids(full, False)  # templates write BOS etc. themselves
        mask = [False] * len(ids)
        turn_start = 0  # char offset in `full` where the current turn begins
        for i, msg in enumerate(messages):
            prefix = full if i == len(messages) - 1 else self._render(messages[: i + 1], where)
            stable = full.startswith(prefix)
            if msg["role"] == "assistant" and not stable:
                self.context_only_turns += 1
            elif msg["role"] == "assistant":
                content_start = self._content_start(messages, i, full, turn_start, where)
                lo, hi = len(self.ids(full[:content_start], False)), len(self.ids(prefix, False))
                hi = min(hi, len(ids))
                mask[lo:hi] = [True] * max(0, hi - lo)
            if stable:
                turn_start = len(prefix)
        return ids, mask

    def _content_start(
        self, messages: list[dict[str, Any]], i: int, full: str, turn_start: int, where: str
    ) -> int:
        """Char offset in `full` where turn i's content begins: after the template's role header."""
        probe = self._render([*messages[:i], {**messages[i], "content": _PLACEHOLDER}], where)
        pos = probe.find(_PLACEHOLDER)
        return pos if pos >= turn_start and probe[:pos] == full[:pos] else turn_start


# --------------------------------------------------------------------------- selection


def _quotas(total: int, weights: list[float]) -> list[int]:
    """round(total * w_i / sum w) per source, by largest remainder so they sum to exactly total."""
    raw = [total * w / sum(weights) for w in weights]
    quotas = [math.floor(r) for r in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: (quotas[i] - raw[i], i))
    for i in by_remainder[: total - sum(quotas)]:
        quotas[i] += 1
    return quotas


@dataclass
class _Picked:
    record: Record
    input_ids: list[int]
    answer_mask: list[bool]


def _pick(
    records: list[Record], quota: int | None, rng: random.Random, encoder: _Encoder
) -> tuple[list[_Picked], int]:
    """Encode records in a seeded shuffled order until `quota` usable ones (all records if None).

    Returns them in file order, plus how many empty records were passed over.
    """
    order = list(range(len(records)))
    if quota is not None:
        rng.shuffle(order)
    picked: dict[int, _Picked] = {}
    empty = 0
    for index in order:
        if quota is not None and len(picked) == quota:
            break
        rec = records[index]
        ids, mask = ([], []) if rec.is_empty() else encoder.encode(rec)
        if ids:
            picked[index] = _Picked(rec, ids, mask)
        else:
            empty += 1
    return [picked[i] for i in sorted(picked)], empty


def _pack(samples: list[Sample], max_length: int) -> list[Sample]:
    """Concatenate samples in order and cut into rows of exactly max_length (the last may be shorter)."""
    ids = [t for s in samples for t in s.input_ids]
    mask = [m for s in samples for m in s.answer_mask]
    owner = [k for k, s in enumerate(samples) for _ in s.input_ids]
    rows = []
    for start in range(0, len(ids), max_length):
        end = start + max_length
        sources = dict.fromkeys(samples[k].source for k in owner[start:end])
        rows.append(Sample(ids[start:end], mask[start:end], " + ".join(sources), truncated=False))
    return rows


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fingerprint(sources: list[Source], options: dict[str, Any]) -> str:
    """Covers file bytes (not names, so moved copies match), weights and options; not the tokenizer."""
    payload = {
        "version": _FINGERPRINT_VERSION,
        "options": options,
        "sources": [{"weight": s.weight, "files": [_sha256_file(f) for f in s.files]} for s in sources],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _check_options(num_samples: int | None, max_length: int) -> None:
    if num_samples is not None and num_samples < 1:
        raise DataError(f"num_samples must be at least 1, got {num_samples}")
    if max_length < 1:
        raise DataError(f"max_length must be at least 1, got {max_length}")


def load_data(
    sources: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    *,
    num_samples: int | None = None,
    max_length: int = 512,
    seed: int = 0,
    packing: bool = False,
) -> CalibrationData:
    """Read, tokenize and mix local data sources (``"path"`` or ``"path:WEIGHT"``).

    With ``num_samples=N`` source i gives round(N * w_i / sum w) samples drawn by a seeded shuffle
    (a source with fewer usable samples gives all it has, noted in ``notes``). Without it every
    sample of every source is used in file order and weights are ignored. Samples longer than
    ``max_length`` keep their first ``max_length`` tokens; with ``packing`` samples are instead
    concatenated and cut into rows of ``max_length`` tokens (nothing is truncated, ``sample_index``
    then refers to rows). The tokenizer is any Hugging Face tokenizer.
    """
    _check_options(num_samples, max_length)
    specs = [parse_source(str(s)) for s in sources]
    if not specs:
        raise DataError("no data sources given")
    loaded = [read_source(path, weight) for path, weight in specs]
    quotas = _quotas(num_samples, [s.weight for s in loaded]) if num_samples else [None] * len(loaded)
    encoder = _Encoder(tokenizer)
    notes: list[str] = []
    if num_samples is None and any(s.weight != 1.0 for s in loaded):
        notes.append("source weights are ignored without num_samples: every sample of every source is used")
    picked: list[_Picked] = []
    skipped = 0
    for i, (src, quota) in enumerate(zip(loaded, quotas)):
        taken, empty = _pick(src.records, quota, random.Random(f"{seed}:{i}"), encoder)
        picked += taken
        skipped += empty
        if quota is not None and len(taken) < quota:
            notes.append(
                f"{src.path}: only {len(taken)} usable samples for a share of {quota}; took all of them"
            )
    if not picked:
        raise DataError(f"no usable samples in {', '.join(s.path for s in loaded)} ({skipped} empty)")
    samples, truncated = _samples(picked, None if packing else max_length)
    notes += _summary_notes(skipped, encoder.context_only_turns, samples)
    if packing:
        samples = _pack(samples, max_length)
    for note in notes:
        _LOG.warning(note)
    options = {"num_samples": num_samples, "max_length": max_length, "seed": seed, "packing": packing}
    return CalibrationData(
        samples=samples,
        fingerprint=_fingerprint(loaded, options),
        truncated=truncated,
        text_only=all(p.record.kind == "text" for p in picked),
        sources=[s.path for s in loaded],
        skipped=skipped,
        packed=packing,
        notes=notes,
    )


def _samples(picked: list[_Picked], max_length: int | None) -> tuple[list[Sample], int]:
    """Samples cut to max_length (None: uncut), and how many were cut."""
    samples = []
    for p in picked:
        cut = max_length is not None and len(p.input_ids) > max_length
        end = max_length if cut else len(p.input_ids)
        samples.append(Sample(p.input_ids[:end], p.answer_mask[:end], p.record.source, cut))
    return samples, sum(s.truncated for s in samples)


def _summary_notes(skipped: int, context_only_turns: int, samples: list[Sample]) -> list[str]:
    no_answer = sum(not any(s.answer_mask) for s in samples)
    candidates = [
        (skipped, f"{skipped} empty samples skipped"),
        (
            context_only_turns,
            f"{context_only_turns} assistant turns are context only: the chat template renders them "
            "differently once later messages follow",
        ),
        (no_answer, f"{no_answer} samples have no answer tokens (empty answer or cut at max_length)"),
    ]
    return [text for count, text in candidates if count]


def calibration_sets(
    tokenizer, options: DataOptions, *, per_domain: bool = False, why: str = ""
) -> list[CalibrationData]:
    """One mixed set, or one set per source when the criterion normalises per calibration domain
    (TENP), each source taking its weight's share of the samples."""
    if not options.sources:
        raise DataError(f"{why or 'this'} needs calibration data: give data files", options=("data",))

    def load(sources: Sequence[str], samples: int | None) -> CalibrationData:
        return load_data(
            sources,
            tokenizer,
            num_samples=samples,
            max_length=options.max_length,
            seed=options.seed,
            packing=options.packing,
        )

    if not per_domain or len(options.sources) == 1:
        return [load(options.sources, options.samples)]
    weights = [parse_source(s)[1] for s in options.sources]
    shares = [
        None if options.samples is None else max(1, round(options.samples * w / sum(weights)))
        for w in weights
    ]
    return [load([source], share) for source, share in zip(options.sources, shares)]
