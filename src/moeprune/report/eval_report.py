"""The evaluation report: JSON (the contract) and a Markdown summary drawn from it.

Why the Markdown is derived, never stored separately: ``moeprune report DIR`` can redraw it from
the JSON at any time. Several models are always laid out side by side (one column each, the
reference first), so ``--compare`` is the same table with more columns.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moeprune.errors import MoePruneError
from moeprune.runtime.atomic import write_json, write_text

Getter = Callable[[dict], Any]
DASH = "—"


def _dig(data: Any, *keys: Any) -> Any:
    """data[k1][k2]...; None when any step is missing."""
    for key in keys:
        try:
            data = data[key]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def fmt(value: Any, kind: str = "") -> str:
    """4 significant digits, thousands separators for counts, MiB for bytes, a dash for missing."""
    if value is None or (isinstance(value, float) and value != value):
        return DASH
    if kind == "bytes":
        return f"{value / 2**20:,.2f} MiB"
    if isinstance(value, (bool, str)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]


# ------------------------------------------------------------------------------ per data file

# (label, value in a model's per-file entry, the reference's own value)
_FILE_ROWS: list[tuple[str, Getter, Getter]] = [
    ("ESAP ↑", lambda d: d.get("esap"), lambda d: 1.0),
    ("KL ↓", lambda d: d.get("kl"), lambda d: 0.0),
    ("NLL ↓", lambda d: d.get("nll"), lambda d: d.get("reference_nll")),
    ("PPL ↓", lambda d: d.get("ppl"), lambda d: d.get("reference_ppl")),
    ("accept rate, sampled ↑", lambda d: _dig(d, "accept", "sampled", "accept_rate"), lambda d: None),
    ("accept rate, greedy ↑", lambda d: _dig(d, "accept", "greedy", "accept_rate"), lambda d: None),
    (
        "accepted / target call, sampled",
        lambda d: _dig(d, "accept", "sampled", "mean_accepted_per_call"),
        lambda d: None,
    ),
    (
        "accepted / target call, greedy",
        lambda d: _dig(d, "accept", "greedy", "mean_accepted_per_call"),
        lambda d: None,
    ),
    ("routing TV, mean over layers ↓", lambda d: _dig(d, "routing", "mean_tv"), lambda d: 0.0),
    (
        "hidden-state error, last layer (relative) ↓",
        lambda d: _dig(d, "layer_error", "layers", -1, "relative"),
        lambda d: 0.0,
    ),
]


def _file_section(doc: dict) -> list[str]:
    models = doc["models"]
    rows = []
    for source in _dig(doc, "data", "files") or []:
        per_file = [_dig(m, "per_data", source) or {} for m in models]
        for label, get, ref in _FILE_ROWS:
            values = [get(d) for d in per_file]
            if all(v is None for v in values):
                continue
            rows.append([Path(source).name, label, fmt(ref(per_file[0])), *map(fmt, values)])
    if not rows:
        return []
    header = ["data", "metric", "reference", *(m["label"] for m in models)]
    return ["## Per data file", "", *_table(header, rows)]


def _layer_section(doc: dict, title: str, key: str, field: str) -> list[str]:
    """One row per (file, layer), one column per model: a per-layer quantity."""
    models = doc["models"]
    rows = []
    for source in _dig(doc, "data", "files") or []:
        per_model = [_dig(m, "per_data", source, key, "layers") or [] for m in models]
        for i in range(max(map(len, per_model), default=0)):
            layer = next(layers[i]["layer"] for layers in per_model if len(layers) > i)
            values = [_dig(layers, i, field) for layers in per_model]
            rows.append([Path(source).name, str(layer), *map(fmt, values)])
    if not rows:
        return []
    return [f"## {title}", "", *_table(["data", "layer", *(m["label"] for m in models)], rows)]


# ------------------------------------------------------------------------------ size, plans, lm-eval

_SIZE_ROWS: list[tuple[str, Getter, str]] = [
    ("total parameters", lambda s: _dig(s, "parameters", "total"), ""),
    ("routed-expert parameters", lambda s: _dig(s, "parameters", "routed_experts"), ""),
    ("active parameters per token", lambda s: _dig(s, "parameters", "active_per_token"), ""),
    (
        "experts per MoE layer",
        lambda s: ", ".join(map(str, (s.get("experts_per_layer") or {}).values())) or None,
        "",
    ),
    ("bytes on disk", lambda s: s.get("disk_bytes"), "bytes"),
    ("peak memory to load", lambda s: s.get("load_peak_bytes"), "bytes"),
    ("load time (s)", lambda s: s.get("load_s"), ""),
]


def _size_section(doc: dict) -> list[str]:
    sizes = [doc.get("reference_size") or {}, *(m.get("size") or {} for m in doc["models"])]
    if not any(sizes):
        return []
    rows = [[label, *(fmt(get(s), kind) for s in sizes)] for label, get, kind in _SIZE_ROWS]
    header = ["", "reference", *(m["label"] for m in doc["models"])]
    return ["## Size", "", *_table(header, rows)]


def _plan_section(doc: dict) -> list[str]:
    planned = [m for m in doc["models"] if m.get("plan")]
    if not planned:
        return []
    rows = [
        [
            m["label"],
            *(fmt(m["plan"].get(k)) for k in ("criterion", "allocation", "method", "sparsity")),
            ", ".join(map(str, m["plan"].get("kept_per_layer", {}).values())),
        ]
        for m in planned
    ]
    header = ["model", "criterion", "allocation", "method", "sparsity", "kept experts per layer"]
    return ["## Plans", "", *_table(header, rows)]


def _lm_eval_section(doc: dict) -> list[str]:
    reference = doc.get("reference_lm_eval")
    if not reference:
        return []
    models = doc["models"]
    rows = []
    for task, metrics in reference.items():
        for metric, value in metrics.items():
            cells = []
            for m in models:
                cells += [
                    fmt(_dig(m, "lm_eval", "results", task, metric)),
                    fmt(_dig(m, "lm_eval", "recovery", task, metric)),
                ]
            rows.append([task, metric, fmt(value), *cells])
    header = ["task", "metric", "reference"] + [
        c for m in models for c in (m["label"], f"{m['label']} / ref")
    ]
    engine = f"lm-eval's {doc['lm_eval_engine']} backend" if doc.get("lm_eval_engine") else None
    return ["## lm-eval-harness", "", *([engine, ""] if engine else []), *_table(header, rows)]


def to_markdown(doc: dict) -> str:
    """The human summary of an eval report document."""
    models = ", ".join(f"`{m['label']}` ({m.get('model') or 'in memory'})" for m in doc["models"])
    data = doc.get("data") or {}
    lines = [
        "# moeprune evaluation",
        "",
        f"Reference: `{doc['reference']}`. Models: {models}.",
        f"Metrics: {', '.join(doc.get('metrics', []))}. Samples per file: {fmt(data.get('samples')) if data.get('samples') else 'all'}, "
        f"max length {fmt(data.get('max_length'))}, seed {fmt(data.get('seed'))}.",
        "",
    ]
    spec = doc.get("speculative") or {}
    if any(_dig(m, "per_data", f, "accept") for m in doc["models"] for f in data.get("files", [])):
        lines += [
            f"Speculative decoding: MODEL drafts gamma={spec.get('gamma')} tokens, the reference verifies; "
            f"{spec.get('prompts')} prompts per file, up to {spec.get('max_new_tokens')} new tokens, "
            f"temperature {spec.get('temperature')}.",
            "",
        ]
    lines += _file_section(doc)
    lines += _layer_section(doc, "Routing shift per layer (TV of selection frequencies)", "routing", "tv")
    lines += _layer_section(doc, "Hidden-state error per layer (relative L2)", "layer_error", "relative")
    lines += _size_section(doc) + _plan_section(doc) + _lm_eval_section(doc)
    if doc.get("notes"):
        lines += ["## Notes", "", *(f"- {n}" for n in doc["notes"]), ""]
    return "\n".join(lines).rstrip() + "\n"


def markdown_path(json_path: str | Path) -> Path:
    return Path(json_path).with_suffix(".md")


def write_report(doc: dict, json_path: str | Path) -> tuple[Path, Path]:
    """Write the JSON and, beside it, the Markdown summary (same name, .md)."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(json_path, doc)
    md = markdown_path(json_path)
    write_text(md, to_markdown(doc))
    return json_path, md


def is_eval_report(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("command") == "eval" and isinstance(doc.get("models"), list)


def load_report(path: str | Path) -> dict:
    """Read an eval report JSON; a clear error for anything else."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MoePruneError(f"cannot read eval report {path}: {exc}") from None
    if not is_eval_report(doc):
        raise MoePruneError(f"{path} is not a moeprune eval report (the JSON moeprune eval writes)")
    return doc
