"""Tests for moeprune.data: formats, answer masks, mixing, truncation, packing and batching."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from moeprune.data.loading import CalibrationData, load_data, parse_source
from moeprune.errors import DataError

pytestmark = pytest.mark.unit  # fast, small inputs: `pytest -m unit` runs them all in about a minute

CHAT = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
# renders the final assistant turn with an extra think block: earlier turns are not prefix-stable
UNSTABLE_CHAT = (
    "{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' and loop.last %}<think></think>"
    "{% endif %}{{ m.content }}<|end|>{% endfor %}"
)
SPECIALS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]


def make_tokenizer(append_eos: bool = False, chat_template: str | None = CHAT) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer without merges (one token per byte) that prepends BOS."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    single = "<s> $A </s>" if append_eos else "<s> $A"
    ids = [(t, tok.token_to_id(t)) for t in ("<s>", "</s>")]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=ids)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=chat_template,
    )


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def answer_runs(tok: PreTrainedTokenizerFast, ids: list[int], mask: list[bool]) -> list[str]:
    """Decoded text of each contiguous run of answer tokens."""
    runs, current = [], []
    for token, marked in zip(ids, mask):
        if marked:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tok.decode(r) for r in runs]


PAIRS = [{"prompt": f"Question {i}: what is {i}+{i}?", "answer": f" It is {2 * i}, ü."} for i in range(6)]
CHATS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"hi {i}"},
            {"role": "assistant", "content": "a"},  # 'a' also occurs in the '<|assistant|>' header
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": f"answer {i} ✓"},
        ]
    }
    for i in range(4)
]
TEXTS = [{"text": f"plain document number {i}"} for i in range(5)]


# --------------------------------------------------------------------------- sources


def test_parse_source(tmp_path: Path) -> None:
    assert parse_source("data.jsonl") == ("data.jsonl", 1.0)
    assert parse_source("data.jsonl:2.5") == ("data.jsonl", 2.5)
    assert parse_source("C:\\data.jsonl") == ("C:\\data.jsonl", 1.0)  # tail is no number: part of the path
    odd = write_jsonl(tmp_path / "odd:3", TEXTS)
    assert parse_source(str(odd)) == (str(odd), 1.0)  # existing file wins over the weight reading
    for bad in ("x.jsonl:0", "x.jsonl:-1", "x.jsonl:nan"):
        with pytest.raises(DataError, match="positive"):
            parse_source(bad)


# --------------------------------------------------------------------------- answer masks


def test_prompt_answer_mask_covers_exactly_the_answer(tok, tmp_path: Path) -> None:
    data = load_data([str(write_jsonl(tmp_path / "p.jsonl", PAIRS))], tok)
    assert not data.text_only and len(data.samples) == len(PAIRS)
    for sample, row in zip(data.samples, PAIRS):
        assert sample.input_ids[0] == tok.bos_token_id
        assert answer_runs(tok, sample.input_ids, sample.answer_mask) == [row["answer"]]
        prompt = [t for t, m in zip(sample.input_ids, sample.answer_mask) if not m]
        assert tok.decode(prompt) == "<s>" + row["prompt"]


def test_appended_eos_goes_after_the_answer(tmp_path: Path) -> None:
    tok = make_tokenizer(append_eos=True)
    data = load_data([str(write_jsonl(tmp_path / "p.jsonl", PAIRS[:1]))], tok)
    sample = data.samples[0]
    assert sample.input_ids.count(tok.eos_token_id) == 1 and sample.input_ids[-1] == tok.eos_token_id
    assert answer_runs(tok, sample.input_ids, sample.answer_mask) == [PAIRS[0]["answer"] + "</s>"]


def test_text_only_marks_every_token(tok, tmp_path: Path) -> None:
    data = load_data([str(write_jsonl(tmp_path / "t.jsonl", TEXTS))], tok)
    assert data.text_only
    assert all(all(s.answer_mask) for s in data.samples)
    assert tok.decode(data.samples[2].input_ids) == "<s>" + TEXTS[2]["text"]


def test_chat_marks_assistant_content_and_closing_tokens_only(tok, tmp_path: Path) -> None:
    data = load_data([str(write_jsonl(tmp_path / "c.jsonl", CHATS))], tok)
    assert not data.text_only and not data.notes
    for i, sample in enumerate(data.samples):
        assert tok.decode(sample.input_ids) == tok.apply_chat_template(CHATS[i]["messages"], tokenize=False)
        assert answer_runs(tok, sample.input_ids, sample.answer_mask) == ["a<|end|>", f"answer {i} ✓<|end|>"]


def test_chat_turns_rendered_unstably_are_context_only(tmp_path: Path) -> None:
    tok = make_tokenizer(chat_template=UNSTABLE_CHAT)
    data = load_data([str(write_jsonl(tmp_path / "c.jsonl", CHATS[:1]))], tok)
    sample = data.samples[0]
    # the last turn's '<think></think>' is template output before the content: header, not answer
    assert answer_runs(tok, sample.input_ids, sample.answer_mask) == ["answer 0 ✓<|end|>"]
    assert any("context only" in n for n in data.notes)


def test_chat_without_template_is_a_data_error(tmp_path: Path) -> None:
    tok = make_tokenizer(chat_template=None)
    with pytest.raises(DataError, match=r"c\.jsonl, line 1: cannot render"):
        load_data([str(write_jsonl(tmp_path / "c.jsonl", CHATS[:1]))], tok)


# --------------------------------------------------------------------------- formats


def test_txt_documents_split_on_blank_lines(tok, tmp_path: Path) -> None:
    path = tmp_path / "docs.txt"
    path.write_text("first doc\nsecond line\n\n\n  \nsecond doc\n\nthird\n", encoding="utf-8")
    data = load_data([str(path)], tok)
    texts = [tok.decode(s.input_ids, skip_special_tokens=True) for s in data.samples]
    assert texts == ["first doc\nsecond line", "second doc", "third"]
    assert data.text_only


def write_arrow(path: Path, table: pa.Table, stream: bool) -> Path:
    writer_cls = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, writer_cls(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def write_save_to_disk(folder: Path, table: pa.Table) -> Path:
    """The layout datasets.save_to_disk writes: Arrow stream shards listed in state.json."""
    folder.mkdir()
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    half = table.num_rows // 2
    for name, part in zip(names, (table.slice(0, half), table.slice(half))):
        write_arrow(folder / name, part, stream=True)
    (folder / "dataset_info.json").write_text("{}")
    state = {"_data_files": [{"filename": n} for n in names], "_split": "train"}
    (folder / "state.json").write_text(json.dumps(state))
    return folder


WRITERS = {
    "parquet": lambda d, t: (pq.write_table(t, d / "x.parquet"), d / "x.parquet")[1],
    "arrow-file": lambda d, t: write_arrow(d / "x.arrow", t, stream=False),
    "arrow-stream": lambda d, t: write_arrow(d / "x.arrow", t, stream=True),
    "save_to_disk": lambda d, t: write_save_to_disk(d / "ds", t),
}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
@pytest.mark.parametrize("rows", [PAIRS, CHATS, TEXTS], ids=["pairs", "chats", "texts"])
def test_table_formats_match_jsonl(tok, tmp_path: Path, fmt: str, rows: list[dict]) -> None:
    reference = load_data([str(write_jsonl(tmp_path / "x.jsonl", rows))], tok)
    path = WRITERS[fmt](tmp_path, pa.Table.from_pylist(rows))
    data = load_data([str(path)], tok)
    assert [(s.input_ids, s.answer_mask) for s in data.samples] == [
        (s.input_ids, s.answer_mask) for s in reference.samples
    ]
    assert data.text_only == reference.text_only


def test_table_without_known_columns_lists_them(tok, tmp_path: Path) -> None:
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"question": ["q"], "label": [1]}), path)
    with pytest.raises(DataError, match=r"found columns \['question', 'label'\]"):
        load_data([str(path)], tok)


def test_null_in_table_names_the_row(tok, tmp_path: Path) -> None:
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"text": ["fine", None]}), path)
    with pytest.raises(DataError, match=r"x\.parquet, row 2: 'text' must be a string, got null"):
        load_data([str(path)], tok)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ('{"text": "unterminated', "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"title": "x"}', "needs a 'text'.*found \\['title'\\]"),
        ('{"prompt": "only a prompt"}', "needs a 'text'.*found \\['prompt'\\]"),
        ('{"text": 5}', "'text' must be a string, got int"),
        ('{"messages": "hi"}', "'messages' must be a list"),
        ('{"messages": [{"role": "user"}]}', "message 1 must be an object with 'role' and 'content'"),
    ],
)
def test_malformed_jsonl_line_names_file_and_line(tok, tmp_path: Path, bad_line: str, problem: str) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "ok"}\n\n' + bad_line + "\n", encoding="utf-8")  # blank line 2 is skipped
    with pytest.raises(DataError, match=rf"broken\.jsonl, line 3: {problem}"):
        load_data([str(path)], tok)


def test_missing_empty_and_unknown_sources(tok, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_data([str(tmp_path / "nope.jsonl")], tok)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="empty.jsonl contains no samples"):
        load_data([str(tmp_path / "empty.jsonl")], tok)
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(DataError, match="contains no samples"):
        load_data([str(tmp_path / "empty.parquet")], tok)
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="folder contains no samples"):
        load_data([str(tmp_path / "folder")], tok)
    (tmp_path / "x.csv").write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"unknown data format '\.csv'; accepted: \.jsonl"):
        load_data([str(tmp_path / "x.csv")], tok)


def test_empty_samples_are_skipped_and_all_empty_fails(tok, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": ""}, {"text": "real"}, {"prompt": " ", "answer": ""}])
    data = load_data([str(path)], tok)
    assert len(data.samples) == 1 and data.skipped == 2
    only_empty = write_jsonl(tmp_path / "e.jsonl", [{"text": "  "}])
    with pytest.raises(DataError, match="no usable samples in"):
        load_data([str(only_empty)], tok)


# --------------------------------------------------------------------------- mixing and options


def sources_of(data: CalibrationData) -> Counter[str]:
    return Counter(Path(s.source).stem for s in data.samples)


def test_weighted_mixing_gives_exact_counts(tok, tmp_path: Path) -> None:
    paths = [write_jsonl(tmp_path / f"{n}.jsonl", [{"text": f"{n} {i}"} for i in range(20)]) for n in "abc"]
    data = load_data([f"{paths[0]}:3", f"{paths[1]}:1"], tok, num_samples=8)
    assert sources_of(data) == {"a": 6, "b": 2}
    data = load_data([str(p) for p in paths], tok, num_samples=10)  # 3.33 each: largest remainder
    assert sources_of(data) == {"a": 4, "b": 3, "c": 3}
    data = load_data([str(p) for p in paths], tok)  # no num_samples: everything
    assert sources_of(data) == {"a": 20, "b": 20, "c": 20}


def test_short_source_gives_all_it_has(tok, tmp_path: Path) -> None:
    small = write_jsonl(tmp_path / "small.jsonl", TEXTS[:2])
    big = write_jsonl(tmp_path / "big.jsonl", [{"text": f"t{i}"} for i in range(20)])
    data = load_data([str(small), str(big)], tok, num_samples=10)
    assert sources_of(data) == {"small": 2, "big": 5}
    assert any("only 2 usable samples for a share of 5" in n for n in data.notes)


def test_weights_without_num_samples_are_ignored_with_a_note(tok, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", TEXTS)
    data = load_data([f"{path}:5"], tok)
    assert len(data.samples) == len(TEXTS) and any("ignored" in n for n in data.notes)


def test_truncation_keeps_the_first_tokens_and_counts(tok, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "x" * 20}, {"text": "abc"}, *PAIRS[:1]])
    full = load_data([str(path)], tok)
    data = load_data([str(path)], tok, max_length=8)
    assert data.truncated == 2 and [s.truncated for s in data.samples] == [True, False, True]
    for cut, whole in zip(data.samples, full.samples):
        assert cut.input_ids == whole.input_ids[:8] and cut.answer_mask == whole.answer_mask[:8]
    assert any("no answer tokens" in n for n in data.notes)  # the long prompt left no answer


def test_packing_makes_full_rows_and_carries_masks(tok, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    plain = load_data([str(path)], tok)
    data = load_data([str(path)], tok, max_length=16, packing=True)
    assert data.packed and data.truncated == 0
    assert [len(s.input_ids) for s in data.samples[:-1]] == [16] * (len(data.samples) - 1)
    assert 0 < len(data.samples[-1].input_ids) <= 16
    concat = [(t, m) for s in plain.samples for t, m in zip(s.input_ids, s.answer_mask)]
    assert [(t, m) for s in data.samples for t, m in zip(s.input_ids, s.answer_mask)] == concat
    assert data.num_tokens() == plain.num_tokens()


def test_batches_pad_right_and_mask_padding(tok, tmp_path: Path) -> None:
    data = load_data([str(write_jsonl(tmp_path / "p.jsonl", PAIRS[:3] + TEXTS[:2]))], tok)
    batches = list(data.batches(batch_size=2, pad_token_id=tok.pad_token_id))
    assert [b.sample_index.tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    for batch in batches:
        for row, index in enumerate(batch.sample_index.tolist()):
            sample, n = data.samples[index], len(data.samples[index].input_ids)
            assert batch.input_ids[row, :n].tolist() == sample.input_ids
            assert batch.answer_mask[row, :n].tolist() == sample.answer_mask
            assert batch.attention_mask[row].tolist() == [1] * n + [0] * (batch.input_ids.shape[1] - n)
            assert (batch.input_ids[row, n:] == tok.pad_token_id).all()
            assert not batch.answer_mask[row, n:].any()


def test_seed_determinism_and_fingerprint(tok, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"sample {i}"} for i in range(50)])

    def selection(data: CalibrationData) -> list[list[int]]:
        return [s.input_ids for s in data.samples]

    first = load_data([str(path)], tok, num_samples=5, seed=1)
    again = load_data([str(path)], tok, num_samples=5, seed=1)
    other = load_data([str(path)], tok, num_samples=5, seed=2)
    assert first.fingerprint == again.fingerprint and selection(first) == selection(again)
    assert first.fingerprint != other.fingerprint and selection(first) != selection(other)
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(path.read_bytes())
    assert load_data([str(moved)], tok, num_samples=5, seed=1).fingerprint == first.fingerprint
    assert load_data([str(path)], tok, num_samples=5, seed=1, max_length=64).fingerprint != first.fingerprint
    moved.write_bytes(path.read_bytes() + b'{"text": "one more"}\n')
    assert load_data([str(moved)], tok, num_samples=5, seed=1).fingerprint != first.fingerprint


def test_chat_with_default_system_prompt_and_newline_closers(tmp_path: Path) -> None:
    """A ChatML template that injects a system turn: header and injected text stay unmarked."""
    chatml = (
        "{% if messages[0].role != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    tok = make_tokenizer(chat_template=chatml)
    data = load_data([str(write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]["messages"][1:]}]))], tok)
    sample = data.samples[0]
    assert answer_runs(tok, sample.input_ids, sample.answer_mask) == [
        "a<|im_end|>\n",
        "answer 0 ✓<|im_end|>\n",
    ]
