"""The model card (`README.md`) of every pruned output, drawn from its report.json.

Derived, never edited by hand: `moeprune report OUT` redraws it from the JSON at any time. It
says what the model is (base, criterion, allocation, method, sparsity), what it kept per layer,
what it costs (parameters and bytes before and after), what was measured, how to load it in
transformers, moeprune and vLLM, and the exact command that reproduces it.
"""

from __future__ import annotations

from typing import Any

_UNIT = {"experts": "of the routed experts", "routed-expert parameters": "of the routed-expert parameters"}


def _n(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "—" if value is None else str(value)


def _mib(value: Any) -> str:
    return f"{value / 2**20:,.1f} MiB" if isinstance(value, int | float) else "—"


def _saving(before: Any, after: Any) -> str:
    if not isinstance(before, int | float) or not isinstance(after, int | float) or not before:
        return "—"
    return f"{100 * (1 - after / before):.1f} %"


def _widths(row: dict) -> str:
    low, high = row.get("min_intermediate_size"), row.get("intermediate_size")
    return "—" if not high else str(high) if low == high else f"{low}–{high}"


def layer_table(report: dict) -> list[str]:
    before = {row["layer"]: row for row in report.get("layers_before", [])}
    lines = ["| layer | experts kept | novices | neurons per expert | top-k |", "|---|---|---|---|---|"]
    for row in report.get("layers_after", []):
        old = before.get(row["layer"], {})
        kept = f"{row['experts'] - row.get('novices', 0)} of {old.get('experts', '—')}"
        neurons = f"{_widths(row)} of {old.get('intermediate_size', '—')}"
        lines.append(f"| {row['layer']} | {kept} | {row.get('novices', 0)} | {neurons} | {row['top_k']} |")
    return lines


def size_table(report: dict) -> list[str]:
    before, after = report.get("parameters_before", {}), report.get("parameters_after", {})
    rows = [
        ("parameters", "total"),
        ("routed-expert parameters", "routed_experts"),
        ("active parameters per token", "active_per_token"),
    ]
    lines = ["| | before | after | saving |", "|---|---|---|---|"]
    for label, key in rows:
        lines.append(
            f"| {label} | {_n(before.get(key))} | {_n(after.get(key))} | {_saving(before.get(key), after.get(key))} |"
        )
    disk = report.get("disk_bytes", {})
    if disk:
        lines.append(
            f"| weights on disk | {_mib(disk.get('before'))} | {_mib(disk.get('after'))} | "
            f"{_saving(disk.get('before'), disk.get('after'))} |"
        )
    return lines


def measured(report: dict) -> list[str]:
    lines = []
    search = report.get("search")
    if search:
        uniform = search.get("uniform", {})
        lines.append(
            f"- EvoESAP ({search.get('fitness')} on the search data): searched allocation "
            f"{search.get('fitness_value'):.4f}, uniform {uniform.get('fitness_value', float('nan')):.4f} "
            f"({search.get('evaluations', '—')} candidates evaluated)."
        )
    auto = report.get("criterion_auto")
    if auto:
        ranked = sorted(auto["table"], key=lambda r: r.get(auto["fitness"]) or 0, reverse=True)
        shown = ", ".join(f"{r['criterion']} {r.get(auto['fitness']):.4f}" for r in ranked[:3])
        lines.append(f"- Criterion chosen automatically by {auto['fitness']} of its uniform plan: {shown}.")
    for note in report.get("unseen_experts", []):
        lines.append(f"- {note}")
    return lines or [
        "- Nothing beyond the sizes above (run `moeprune eval` to measure divergence and acceptance)."
    ]


def how_to_load(report: dict, name: str) -> list[str]:
    if report.get("format") == "stock":
        return [
            "A stock checkpoint of its family: every tool loads it unchanged.",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM",
            f'model = AutoModelForCausalLM.from_pretrained("{name}")',
            "```",
            "",
            f"```bash\nvllm serve {name}\n```",
        ]
    padded = report.get("serving", {}).get("vllm_padded_parameters")
    refused = report.get("serving", {}).get("vllm_refused")
    lines = [
        "moeprune's format (per-layer expert counts, novices or per-expert widths; "
        "docs/checkpoint-format.md in moeprune): tensors keep the family's usual names.",
        "",
        "```python",
        "# with moeprune installed",
        "import moeprune",
        f'model = moeprune.load_pretrained("{name}")',
        "# without moeprune: the folder's modeling_moeprune.py",
        "from transformers import AutoModelForCausalLM",
        f'model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)',
        "```",
        "",
        *(
            [f"vLLM: {refused}."]
            if refused
            else [
                "vLLM, with moeprune installed beside it (its plugin builds each layer with its own expert count):",
                "",
                f"```bash\nvllm serve {name}\n```",
            ]
        ),
    ]
    if padded:
        lines += [
            "",
            f"vLLM pads each layer's experts to the widest one with zero neurons: it holds {_n(padded)} "
            f"parameters, against {_n(report.get('parameters_after', {}).get('total'))} stored here.",
        ]
    return lines


def model_card(report: dict, name: str = ".") -> str:
    """README.md of a pruned output folder."""
    unit = _UNIT.get(report.get("sparsity_unit", ""), "")
    lines = [
        f"# {name}: {report.get('model_type')} pruned with moeprune",
        "",
        f"- Base model: `{report.get('model')}` ({report.get('model_type')})",
        f"- Criterion: {report.get('criterion')}; allocation: {report.get('allocation')}; method: {report.get('method')}",
        f"- Sparsity: {report.get('sparsity')} {unit}"
        + (
            f"; every layer keeps a multiple of {report['expert_multiple']} experts"
            if report.get("expert_multiple", 1) > 1
            else ""
        ),
        f"- Saved as: {report.get('format')} format, {report.get('save_dtype')}",
        "",
        "## Size",
        "",
        *size_table(report),
        "",
        "## Kept per layer",
        "",
        *layer_table(report),
        "",
        "## Measured",
        "",
        *measured(report),
        "",
        "## Loading",
        "",
        *how_to_load(report, name),
        "",
        "## Reproduce",
        "",
        f"```bash\n{report.get('command_line') or '(made through the Python API: see recipe.json)'}\n```",
        "",
    ]
    return "\n".join(lines)
