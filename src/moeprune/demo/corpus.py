"""A local multi-domain corpus (code, prose, math) built only from what ships with Python.

Why: nothing can be downloaded, yet the demo and the quality tests need a trained MoE and
calibration / search / evaluation data from clearly different domains.

- code: functions of the standard library's pure-Python modules (prompt = header and docstring,
  answer = the body).
- prose: docstrings of those modules, the ``__doc__`` texts of a few always-present C modules and
  the reference topics that pydoc ships (``pydoc_data.topics``); prompt = first sentence,
  answer = the continuation.
- math: generated multi-step arithmetic word problems with worked answers.

Every example has a *source* (a stdlib file, a documented object, a word-problem frame). A salted
hash of the source decides its split, so ``train`` / ``search`` / ``eval`` never share a source;
a prompt that still occurs in two splits is kept only in the first of them. Output files are
``{domain}_{split}.jsonl`` with one ``{"prompt": ..., "answer": ...}`` object per line, plus
``manifest.json`` (Python version, counts, sha256 and sources of every file).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import os
import random
import re
import sys
import sysconfig
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

CORPUS_VERSION = 2
DOMAINS = ("code", "prose", "math")
SPLITS = ("train", "search", "eval")
# Cumulative thresholds of the source hash in [0, 1): 80% train, 10% search, 10% eval.
_SPLIT_EDGES = (0.8, 0.9, 1.0)
DEFAULT_SIZES: dict[str, int] = {"train": 6000, "search": 200, "eval": 200}

# Stdlib folders left out: tests and optional / removed-in-newer-Pythons packages (so the corpus
# does not depend on what a distribution chose to install), tables (encodings) and site-packages.
_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "lib2to3",
        "distutils",
        "ensurepip",
        "pydoc_data",  # read as data by _object_docs
        "encodings",
        "lib-dynload",
    }
)
# C modules whose docstrings are compiled in, so present on every CPython.
_DOC_MODULES = ("builtins", "math", "itertools", "time", "gc", "cmath")  # not sys: its hooks vary per process

_CODE_LINES = (3, 40)
_MAX_CODE_CHARS = 1500
_MAX_PROSE_CHARS = 1200
_MIN_PROSE_ANSWER = 40
_SENTENCE_END = re.compile(r"(?<=[\w)\]'\"`])[.!?:](?=\s)|\n\s*\n")

Example = tuple[str, str, str]  # (source, prompt, answer)


def split_of(source: str, seed: int) -> str:
    """Split of a source: a salted hash, so the assignment is stable and independent of order."""
    digest = hashlib.sha256(f"{seed}\0{source}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return next(s for s, edge in zip(SPLITS, _SPLIT_EDGES) if u < edge)


# ----------------------------------------------------------------------------------------------
# Material from the standard library


def _stdlib_files() -> list[tuple[str, Path]]:
    """(relative name, path) of the stdlib's pure-Python modules, sorted; empty if not found."""
    root = Path(sysconfig.get_paths().get("stdlib", ""))
    if not root.is_dir():
        return []
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def _parse(path: Path) -> tuple[list[str], ast.Module] | None:
    try:
        text = path.read_text(encoding="utf-8")
        return text.splitlines(), ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None


def _dedent(lines: list[str], col: int) -> list[str]:
    prefix = " " * col
    return [line[col:] if line.startswith(prefix) else line for line in lines]


def _code_example(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, str] | None:
    """Header (+ docstring) as prompt, the rest of the function as answer."""
    first, last = node.lineno, node.end_lineno or node.lineno
    if not _CODE_LINES[0] <= last - first + 1 <= _CODE_LINES[1]:
        return None
    body = node.body
    has_doc = ast.get_docstring(node, clean=False) is not None
    if has_doc and len(body) < 2:
        return None
    cut = body[1 if has_doc else 0].lineno
    func = _dedent(lines[first - 1 : last], node.col_offset)
    prompt, answer = func[: cut - first], func[cut - first :]
    if not prompt or not answer or any("\t" in line for line in func):
        return None
    prompt_text, answer_text = "\n".join(prompt) + "\n", "\n".join(answer) + "\n"
    if len(prompt_text) + len(answer_text) > _MAX_CODE_CHARS:
        return None
    return prompt_text, answer_text


def _prose_example(text: str) -> tuple[str, str] | None:
    """First sentence (or paragraph) as prompt, the continuation as answer."""
    text = text.strip()
    if len(text) > _MAX_PROSE_CHARS:  # cut at a paragraph (else line) boundary
        head = text[:_MAX_PROSE_CHARS]
        cut = head.rfind("\n\n")
        text = head[:cut] if cut > _MAX_PROSE_CHARS // 3 else head[: max(head.rfind("\n"), 1)]
        text = text.rstrip()
    match = next((m for m in _SENTENCE_END.finditer(text) if m.start() >= 20), None)
    if match is None:
        return None
    cut = match.start() + (1 if text[match.start()] in ".!?:" else 0)
    prompt, answer = text[:cut], text[cut:].rstrip()
    if len(answer.strip()) < _MIN_PROSE_ANSWER:
        return None
    return prompt, answer


_Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _defs(body: list) -> Iterator[_Def]:
    """Functions and classes reachable through statement bodies (much faster than ``ast.walk``)."""
    for node in body:
        if isinstance(node, _Def):
            yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            yield from _defs(getattr(node, field, []))


def _stdlib_examples() -> tuple[list[Example], list[Example]]:
    """Code and prose examples from the stdlib's sources; a file is the source of both."""
    code: list[Example] = []
    prose: list[Example] = []
    for rel, path in _stdlib_files():
        parsed = _parse(path)
        if parsed is None:
            continue
        lines, tree = parsed
        nodes = list(_defs(tree.body))
        for node in nodes:
            if not isinstance(node, ast.ClassDef) and (ex := _code_example(lines, node)):
                code.append((rel, *ex))
        docs = (ast.get_docstring(n, clean=True) for n in [tree, *nodes])
        prose.extend((rel, *ex) for doc in docs if doc and (ex := _prose_example(doc)))
    return code, prose


def _object_docs() -> Iterator[tuple[str, str]]:
    """(source, text) of compiled-in docstrings and of pydoc's bundled reference topics."""
    for mod_name in _DOC_MODULES:
        try:
            module = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(module).items()):
            # only the module's own objects: hooks such as sys.excepthook are replaced per process
            # (pytest, IPython), which would make the corpus depend on who builds it
            if name.startswith("_") or not callable(obj) or getattr(obj, "__module__", None) != mod_name:
                continue
            members = [obj]
            if isinstance(obj, type):  # the class's own methods, not inherited ones
                members += [v for k, v in sorted(vars(obj).items()) if not k.startswith("_")]
            for member in members:
                doc = getattr(member, "__doc__", None)
                if isinstance(doc, str):
                    yield f"doc:{mod_name}.{name}", doc
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    for name in sorted(topics):
        paragraphs = re.split(r"\n\s*\n", topics[name])
        chunk: list[str] = []
        for para in [*paragraphs, None]:  # None flushes the last chunk
            if para is None or (chunk and sum(map(len, chunk)) + len(para) > _MAX_PROSE_CHARS):
                if chunk:
                    yield f"topic:{name}", "\n\n".join(chunk)
                chunk = []
            if para is not None and para.strip():
                chunk.append(para)


def _doc_examples() -> list[Example]:
    import inspect

    return [(src, *ex) for src, doc in _object_docs() if (ex := _prose_example(inspect.cleandoc(doc)))]


# ----------------------------------------------------------------------------------------------
# Generated arithmetic word problems

_NAMES = (  # noqa: SIM905 - a compact word list reads better than 32 quoted lines
    "Ada Ben Cleo Dev Emma Finn Gia Hugo Iris Jon Kai Lena Milo Nora Omar Pia "
    "Quinn Rosa Sam Tara Umar Vera Wes Xena Yuri Zoe Alma Boris Chen Dana Eli Fatima"
).split()
_ITEMS = "apples pencils stickers marbles cookies books stamps shells cards coins eggs plums".split()  # noqa: SIM905
_THINGS = ["bike", "game", "lamp", "jacket", "kite", "radio", "watch", "tent"]
_Problem = tuple[str, str, str]  # (frame, prompt, answer)


def _shopping(r: random.Random, name: str) -> _Problem:
    item, item2 = r.sample(_ITEMS, 2)
    a, p, b, q = r.randint(2, 9), r.randint(2, 12), r.randint(2, 9), r.randint(2, 12)
    cost1, cost2 = a * p, b * q
    total = cost1 + cost2
    bill = next(v for v in (20, 50, 100, 200) if v >= total)
    prompt = (
        f"{name} buys {a} {item} at {p} dollars each and {b} {item2} at {q} dollars each. "
        f"{name} pays with a {bill} dollar bill. How much change does {name} get?"
    )
    answer = (
        f"The {item} cost {a} * {p} = {cost1} dollars. The {item2} cost {b} * {q} = {cost2} dollars. "
        f"Together that is {cost1} + {cost2} = {total} dollars. "
        f"The change is {bill} - {total} = {bill - total} dollars. The answer is {bill - total}."
    )
    return f"shopping:{name}:{item}", prompt, answer


def _boxes(r: random.Random, name: str) -> _Problem:
    item = r.choice(_ITEMS)
    a, b, c = r.randint(3, 40), r.randint(2, 9), r.randint(2, 12)
    got = b * c
    d = r.randint(1, a + got - 1)
    prompt = (
        f"{name} has {a} {item}. {name} gets {b} boxes with {c} {item} in each box "
        f"and then gives away {d} {item}. How many {item} does {name} have now?"
    )
    answer = (
        f"The boxes hold {b} * {c} = {got} {item}. With them {name} has {a} + {got} = {a + got}. "
        f"After giving away {d}: {a + got} - {d} = {a + got - d}. The answer is {a + got - d}."
    )
    return f"boxes:{name}:{item}", prompt, answer


def _sharing(r: random.Random, name: str) -> _Problem:
    item = r.choice(_ITEMS)
    friends, each, kept = r.randint(2, 8), r.randint(2, 9), r.randint(1, 9)
    total = friends * each + kept
    trays = next(t for t in (2, 3, 4, 5, 6, 1) if total % t == 0)
    per_tray = total // trays
    prompt = (
        f"{name} packs {trays} trays with {per_tray} {item} on each tray. {name} keeps {kept} "
        f"and shares the rest equally among {friends} friends. How many {item} does each friend get?"
    )
    answer = (
        f"There are {trays} * {per_tray} = {total} {item}. After keeping {kept}, "
        f"{total} - {kept} = {total - kept} are left. Each friend gets {total - kept} / {friends} "
        f"= {each}. The answer is {each}."
    )
    return f"sharing:{name}:{item}", prompt, answer


def _travel(r: random.Random, name: str) -> _Problem:
    v, t1, w, t2 = r.randint(20, 90), r.randint(1, 5), r.randint(20, 90), r.randint(1, 5)
    d1, d2 = v * t1, w * t2
    prompt = (
        f"{name} drives at {v} km per hour for {t1} hours and then at {w} km per hour "
        f"for {t2} hours. How many km does {name} drive in total?"
    )
    answer = (
        f"First {v} * {t1} = {d1} km. Then {w} * {t2} = {d2} km. "
        f"In total {d1} + {d2} = {d1 + d2} km. The answer is {d1 + d2}."
    )
    return f"travel:{name}", prompt, answer


def _savings(r: random.Random, name: str) -> _Problem:
    thing = r.choice(_THINGS)
    a, weeks = r.randint(3, 30), r.randint(2, 12)
    saved = a * weeks
    spent = r.randint(1, saved - 1)
    prompt = (
        f"{name} saves {a} dollars every week for {weeks} weeks and then spends {spent} dollars "
        f"on a {thing}. How many dollars does {name} have left?"
    )
    answer = (
        f"{name} saves {a} * {weeks} = {saved} dollars. After buying the {thing}, "
        f"{saved} - {spent} = {saved - spent} dollars are left. The answer is {saved - spent}."
    )
    return f"savings:{name}:{thing}", prompt, answer


def _orchard(r: random.Random, name: str) -> _Problem:
    rows, cols = r.randint(2, 12), r.randint(2, 12)
    trees = rows * cols
    dead, new = r.randint(1, trees - 1), r.randint(1, 20)
    left = trees - dead
    prompt = (
        f"{name} plants {rows} rows of {cols} trees. {dead} trees die and {name} plants "
        f"{new} new trees. How many trees are there now?"
    )
    answer = (
        f"{name} plants {rows} * {cols} = {trees} trees. After {dead} die, {trees} - {dead} = {left} "
        f"remain. With the new ones there are {left} + {new} = {left + new}. The answer is {left + new}."
    )
    return f"orchard:{name}", prompt, answer


def _ages(r: random.Random, name: str) -> _Problem:
    other = r.choice([n for n in _NAMES if n != name])
    a, b, c = r.randint(4, 40), r.randint(1, 30), r.randint(1, 20)
    older = a + b
    total = a + c + older + c
    prompt = (
        f"{name} is {a} years old. {other} is {b} years older than {name}. "
        f"In {c} years, what will be the sum of their ages?"
    )
    answer = (
        f"{other} is {a} + {b} = {older} years old. In {c} years {name} will be {a} + {c} = {a + c} "
        f"and {other} will be {older} + {c} = {older + c}. The sum is {a + c} + {older + c} = {total}. "
        f"The answer is {total}."
    )
    return f"ages:{name}:{other}", prompt, answer


def _half(r: random.Random, name: str) -> _Problem:
    item = r.choice(_ITEMS)
    a = 2 * r.randint(5, 60)
    half = a // 2
    b = r.randint(1, half - 1)
    prompt = (
        f"{name}'s shop has {a} {item}. It sells half of them on Monday and {b} on Tuesday. "
        f"How many {item} are left?"
    )
    answer = (
        f"Half of {a} is {a} / 2 = {half}, so {half} are left after Monday. "
        f"After Tuesday {half} - {b} = {half - b} are left. The answer is {half - b}."
    )
    return f"half:{name}:{item}", prompt, answer


_TEMPLATES: tuple[Callable[[random.Random, str], _Problem], ...] = (
    _shopping,
    _boxes,
    _sharing,
    _travel,
    _savings,
    _orchard,
    _ages,
    _half,
)


def _math_examples(seed: int, sizes: Mapping[str, int]) -> list[Example]:
    """Generate problems until every split is full; the frame (template, names, item) is the source."""
    r = random.Random(f"math-{seed}")
    need = dict(sizes)
    seen: set[str] = set()
    out: list[Example] = []
    for _ in range(50 * sum(need.values()) + 1000):
        if not any(need.values()):
            break
        frame, prompt, answer = r.choice(_TEMPLATES)(r, r.choice(_NAMES))
        split = split_of(f"math:{frame}", seed)
        if need[split] > 0 and prompt not in seen:
            seen.add(prompt)
            need[split] -= 1
            out.append((f"math:{frame}", prompt, answer + "\n"))
    return out


# ----------------------------------------------------------------------------------------------
# Assembly


def _assign(
    examples: list[Example], seed: int, sizes: Mapping[str, int], domain: str
) -> dict[str, list[Example]]:
    """Split by source, drop prompts already used by an earlier split, shuffle, cap."""
    by_split: dict[str, list[Example]] = {s: [] for s in SPLITS}
    for ex in sorted(set(examples)):
        by_split[split_of(ex[0], seed)].append(ex)
    used: set[str] = set()
    r = random.Random(f"{domain}-{seed}")
    for split in SPLITS:
        unique: dict[str, Example] = {}
        for ex in by_split[split]:
            if ex[1] not in used:
                unique.setdefault(ex[1], ex)
        chosen = list(unique.values())
        r.shuffle(chosen)
        by_split[split] = chosen[: sizes[split]]
        used.update(unique)
    return by_split


def _write_jsonl(path: Path, rows: list[Example]) -> str:
    data = "".join(json.dumps({"prompt": p, "answer": a}, ensure_ascii=False) + "\n" for _, p, a in rows)
    path.write_text(data, encoding="utf-8")
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


def build_corpus(out_dir: str | os.PathLike, seed: int = 0, sizes: Mapping[str, int] | None = None) -> dict:
    """Write ``{domain}_{split}.jsonl`` for code / prose / math and return the manifest.

    ``sizes`` caps the examples per domain and split (default ``DEFAULT_SIZES``); code and prose may
    hold fewer when the stdlib is small. The result depends only on ``seed``, ``sizes`` and the
    Python version (recorded in ``manifest.json`` with counts, sha256 and sources per file).
    """
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    code, prose = _stdlib_examples()
    domains = {"code": code, "prose": prose + _doc_examples(), "math": _math_examples(seed, sizes)}
    manifest: dict = {
        "corpus_version": CORPUS_VERSION,
        "python": sys.version,
        "implementation": sys.implementation.name,
        "seed": seed,
        "sizes": sizes,
        "files": {},
        "sources": {},
    }
    for domain, examples in domains.items():
        split_rows = _assign(examples, seed, sizes, domain)
        manifest["sources"][domain] = {s: sorted({ex[0] for ex in rows}) for s, rows in split_rows.items()}
        for split, rows in split_rows.items():
            name = f"{domain}_{split}.jsonl"
            manifest["files"][name] = {"count": len(rows), "sha256": _write_jsonl(out / name, rows)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def load_split(corpus_dir: str | os.PathLike, domain: str, split: str) -> list[dict[str, str]]:
    """Rows of one ``{domain}_{split}.jsonl`` file."""
    path = Path(corpus_dir) / f"{domain}_{split}.jsonl"
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
