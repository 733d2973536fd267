"""Data files read into records (text, prompt/answer pairs, chat messages), before any tokenizer.

Formats: JSONL, ``.txt`` (documents separated by blank lines), Parquet, Arrow IPC (file or stream)
and ``datasets.save_to_disk`` folders, read with pyarrow (no ``datasets`` dependency); a plain
folder loads its supported files in name order. ``FILE:WEIGHT`` mixes sources.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeprune.errors import DataError

ACCEPTED_FORMATS = ".jsonl, .txt, .parquet, .arrow, or a datasets.save_to_disk folder"


# --------------------------------------------------------------------------- source specs


def parse_source(spec: str) -> tuple[str, float]:
    """Split ``"path"`` or ``"path:WEIGHT"``; an existing path containing ':' is taken whole."""
    if not spec:
        raise DataError("empty data source: pass a file or folder path, optionally as PATH:WEIGHT")
    if ":" not in spec or Path(spec).exists():
        return spec, 1.0
    path, _, tail = spec.rpartition(":")
    try:
        weight = float(tail)
    except ValueError:
        return spec, 1.0  # not a weight: the ':' belongs to the path, which is reported missing later
    if not (math.isfinite(weight) and weight > 0):
        raise DataError(f"data source {spec!r}: the weight must be a positive number, got {tail!r}")
    return path, weight


# --------------------------------------------------------------------------- records


@dataclass
class Record:
    """One parsed sample before tokenization."""

    kind: str  # "text", "pair" or "chat"
    source: str  # file path
    where: str  # location for error messages ("file, line 3")
    text: str = ""
    prompt: str = ""
    answer: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)

    def is_empty(self) -> bool:
        parts = [self.text, self.prompt, self.answer, *(m["content"] for m in self.messages)]
        return not any(p.strip() for p in parts)


def _record_kind(keys: Sequence[str]) -> str | None:
    """Which layout a row uses; the most structured one wins when several fit."""
    if "messages" in keys:
        return "chat"
    if "prompt" in keys and "answer" in keys:
        return "pair"
    return "text" if "text" in keys else None


def _string(obj: dict[str, Any], key: str, where: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: '{key}' must be a string, got {_type_name(value)}")
    return value


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _messages(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise DataError(
            f"{where}: 'messages' must be a list of {{role, content}} objects, got {_type_name(value)}"
        )
    for n, msg in enumerate(value, start=1):
        if not isinstance(msg, dict) or not {"role", "content"} <= msg.keys():
            raise DataError(f"{where}: message {n} must be an object with 'role' and 'content'")
        for key in ("role", "content"):
            _string(msg, key, f"{where}, message {n}")
    return [dict(m) for m in value]


def _record_from_object(obj: Any, source: str, where: str) -> Record:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {_type_name(obj)}")
    kind = _record_kind(list(obj))
    if kind is None:
        raise DataError(
            f"{where}: needs a 'text', 'prompt' and 'answer', or 'messages' field; found {sorted(obj)}"
        )
    if kind == "chat":
        return Record(kind, source, where, messages=_messages(obj["messages"], where))
    if kind == "pair":
        prompt, answer = _string(obj, "prompt", where), _string(obj, "answer", where)
        return Record(kind, source, where, prompt=prompt, answer=answer)
    return Record(kind, source, where, text=_string(obj, "text", where))


# --------------------------------------------------------------------------- readers


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig").replace("\r\n", "\n")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (bad byte at offset {exc.start})") from None


def _read_jsonl(path: Path) -> list[Record]:
    records = []
    # split on "\n" only: JSON strings may hold raw U+2028 that str.splitlines would cut
    for lineno, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        records.append(_record_from_object(obj, str(path), where))
    return records


def _read_txt(path: Path) -> list[Record]:
    docs = (d.strip() for d in re.split(r"\n[ \t]*\n", _read_text(path)))
    return [
        Record("text", str(path), f"{path}, document {n}", text=d)
        for n, d in enumerate(filter(None, docs), 1)
    ]


def _records_from_table(table: Any, path: Path) -> list[Record]:
    kind = _record_kind(table.column_names)
    if kind is None:
        raise DataError(
            f"{path}: needs a 'text', 'prompt' and 'answer', or 'messages' column; "
            f"found columns {table.column_names}"
        )
    columns = {"chat": ["messages"], "pair": ["prompt", "answer"], "text": ["text"]}[kind]
    rows = table.select(columns).to_pylist()
    return [_record_from_object(row, str(path), f"{path}, row {n}") for n, row in enumerate(rows, start=1)]


def _read_parquet(path: Path) -> list[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: cannot read as Parquet ({exc})") from None
    return _records_from_table(table, path)


def _read_arrow(path: Path) -> list[Record]:
    """Arrow IPC in either layout: the file format first, then the stream format (save_to_disk's)."""
    import pyarrow as pa

    errors = []
    for open_ipc in (pa.ipc.open_file, pa.ipc.open_stream):
        try:  # the map stays open while the table references it
            table = open_ipc(pa.memory_map(str(path))).read_all()
        except pa.ArrowInvalid as exc:
            errors.append(str(exc))
            continue
        return _records_from_table(table, path)
    raise DataError(f"{path}: cannot read as Arrow IPC file or stream ({'; '.join(errors)})")


_READERS = {".jsonl": _read_jsonl, ".txt": _read_txt, ".parquet": _read_parquet, ".arrow": _read_arrow}


def _read_file(path: Path) -> list[Record]:
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(
            f"{path}: unknown data format {path.suffix or '(no extension)'!r}; accepted: {ACCEPTED_FORMATS}"
        )
    return [] if path.stat().st_size == 0 else reader(path)


def _save_to_disk_files(folder: Path) -> list[Path]:
    """The Arrow files a ``datasets.save_to_disk`` folder lists in its state.json."""
    try:
        state = json.loads(_read_text(folder / "state.json"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataError(f"{folder}/state.json: not a datasets.save_to_disk state file ({exc!r})") from None
    files = [folder / name for name in names]
    for f in files:
        if not f.is_file():
            raise DataError(f"{folder}: state.json lists {f.name}, which does not exist")
    return files


def _folder_files(folder: Path) -> list[Path]:
    if (folder / "dataset_dict.json").exists():
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
        raise DataError(
            f"{folder} holds several splits ({', '.join(splits)}): pass one split folder, e.g. {folder}/train"
        )
    if (folder / "state.json").exists():
        return _save_to_disk_files(folder)
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in _READERS)


@dataclass
class Source:
    path: str
    weight: float
    files: list[Path]
    records: list[Record]


def read_source(path_str: str, weight: float) -> Source:
    path = Path(path_str)
    if not path.exists():
        raise DataError(f"data path {path} does not exist")
    files = _folder_files(path) if path.is_dir() else [path]
    records = [r for f in files for r in _read_file(f)]
    if not records:
        raise DataError(f"{path} contains no samples (accepted: {ACCEPTED_FORMATS})")
    return Source(path_str, weight, files, records)
