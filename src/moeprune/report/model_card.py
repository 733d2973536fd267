"""The model card (`README.md`) of every pruned output, drawn from its report.json.

Derived, never edited by hand: `moeprune report OUT` redraws it from the JSON at any time. It
says what the model is (base, criterion, allocation, method, sparsity), what it kept per layer,
what it costs (parameters and bytes before and after), what was measured, how to load it in
transformers, moeprune and vLLM, and the exact command that reproduces it.

It opens with the Hub's YAML metadata (`front_matter`), so that a pushed result is found by its
tags and listed under its base model like other compressed releases:

- `base_model`: the base's Hub id, only when it is known for certain: the input was a model of the
  Hugging Face cache (moeprune records the snapshot's path, `.../models--ORG--NAME/snapshots/REV`,
  and the Hub forbids `--` inside ids, so `ORG/NAME` is recovered exactly). A local folder is no
  Hub id (`models/qwen` looks like one and is not), and config.json's `_name_or_path` records
  whatever path the base was last loaded from, so both give no `base_model`: a wrong link is
  worse than none (add it by hand before pushing).
- no `base_model_relation`: the Hub knows `adapter`, `merge`, `quantized` and `finetune` only;
  pruning is none of them and the weights are not quantized, so the key is left out rather than
  chosen falsely (the Hub then files the model under its base's fine-tunes, as it does other
  pruned releases); the `pruned` tag says what it is.
- `library_name: transformers`: a stock result loads with `AutoModelForCausalLM`; a
  moeprune-format one too, with `trust_remote_code=True` (its own modeling files), which the
  `custom_code` tag tells the Hub.
- `tags`: `moe`, `pruned`, `moeprune`, then the criterion, allocation and method names.
- `pipeline_tag: text-generation`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from moeprune.models.adapter import kept_whole_note
from moeprune.quant.support import needs_package
from moeprune.report.document import PruneReport, as_report
from moeprune.report.parts import LayerShape, ParameterCounts, SearchUniform, ServeCheck, Serving

_UNIT = {"experts": "of the routed experts", "routed-expert parameters": "of the routed-expert parameters"}
_DASH = "—"
ELEMENT_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
}  # a full-precision save dtype's bytes per parameter


def _n(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "—" if value is None else str(value)


def _mib(value: Any) -> str:
    return f"{value / 2**20:,.1f} MiB" if isinstance(value, int | float) else "—"


def _saving(before: Any, after: Any) -> str:
    if not isinstance(before, int | float) or not isinstance(after, int | float) or not before:
        return "—"
    return f"{100 * (1 - after / before):.1f} %"


def _widths(row: LayerShape) -> str:
    low, high = row.min_intermediate_size, row.intermediate_size
    return "—" if not high else str(high) if low == high else f"{low}–{high}"


def _or_dash(value: Any) -> Any:
    return _DASH if value is None else value


# `.../models--ORG--NAME/snapshots/REVISION`: the Hugging Face cache's folder of a model
_HUB_SNAPSHOT = re.compile(r"(?:^|[/\\])models--([^/\\]+)[/\\]snapshots[/\\][^/\\]+[/\\]?$")
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9._/-]*")  # a YAML scalar that needs no quotes
_YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "~"}


def hub_id(model: str | None) -> str | None:
    """The Hub id of the base model when its recorded path is a Hugging Face cache snapshot."""
    match = _HUB_SNAPSHOT.search(model or "")
    return match.group(1).replace("--", "/") if match else None


def _yaml(value: str) -> str:
    """A YAML scalar: plain where that reads back as the same string, else double-quoted (JSON's
    escapes are YAML's)."""
    if _PLAIN.fullmatch(value) and value.lower() not in _YAML_WORDS:
        return value
    return json.dumps(value)


def front_matter(report: PruneReport) -> list[str]:
    """The Hub's metadata block that opens README.md (the module docstring says why each key)."""
    base = hub_id(report.model)
    tags = ["moe", "pruned", "moeprune"]
    for name in (report.criterion, report.allocation, report.method):
        if name and name not in tags:
            tags.append(name)
    if report.format == "moeprune":
        tags.append("custom_code")
    return [
        "---",
        *([f"base_model: {_yaml(base)}"] if base else []),
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags:",
        *(f"- {_yaml(tag)}" for tag in tags),
        "---",
        "",
    ]


def layer_table(report: PruneReport) -> list[str]:
    before = {row.layer: row for row in report.layers_before or []}
    lines = ["| layer | experts kept | novices | neurons per expert | top-k |", "|---|---|---|---|---|"]
    for row in report.layers_after or []:
        old = before.get(row.layer)
        kept = f"{row.experts - row.novices} of {_or_dash(old and old.experts)}"
        neurons = f"{_widths(row)} of {_or_dash(old and old.intermediate_size)}"
        lines.append(f"| {row.layer} | {kept} | {row.novices} | {neurons} | {row.top_k} |")
    return lines


def size_table(report: PruneReport) -> list[str]:
    before = report.parameters_before or ParameterCounts()
    after = report.parameters_after or ParameterCounts()
    rows = [
        ("parameters", "total"),
        ("routed-expert parameters", "routed_experts"),
        ("active parameters per token", "active_per_token"),
    ]
    lines = ["| | before | after | saving |", "|---|---|---|---|"]
    for label, key in rows:
        old, new = getattr(before, key), getattr(after, key)
        lines.append(f"| {label} | {_n(old)} | {_n(new)} | {_saving(old, new)} |")
    disk = report.disk_bytes
    if disk:
        lines.append(
            f"| weights on disk | {_mib(disk.before)} | {_mib(disk.after)} | {_saving(disk.before, disk.after)} |"
        )
    return lines


def measured(report: PruneReport) -> list[str]:
    lines = []
    search = report.search
    if search:
        uniform = search.uniform or SearchUniform()
        lines.append(
            f"- EvoESAP ({search.fitness} on the search data): searched allocation "
            f"{search.fitness_value:.4f}, uniform "
            f"{uniform.fitness_value if uniform.fitness_value is not None else float('nan'):.4f} "
            f"({_or_dash(search.evaluations)} candidates evaluated)."
        )
    if report.repair:
        lines.append(f"- Repair (distilled toward the full model after the cut): {report.repair.line()}.")
    auto = report.criterion_auto
    if auto:
        ranked = sorted(auto.table, key=lambda r: r.get(auto.fitness) or 0, reverse=True)
        shown = ", ".join(f"{r['criterion']} {r.get(auto.fitness):.4f}" for r in ranked[:3])
        lines.append(f"- Criterion chosen automatically by {auto.fitness} of its uniform plan: {shown}.")
    for note in report.unseen_experts or []:
        lines.append(f"- {note}")
    if report.super_experts_note:  # the experts with massive activations, and what the plan did with them
        lines.append(f"- Super experts: {report.super_experts_note}.")
    kept_whole = kept_whole_note(report.kept_whole or {})
    if kept_whole:  # layers no plan may touch (hash routing)
        lines.append(f"- Fixed layers: {kept_whole}.")
    for note in report.release_layers or []:  # what the release stores beside the stack
        lines.append(f"- Beside the decoder stack: {note}.")
    if report.serve_check:
        lines.append(serve_check_line(report.serve_check))
    return lines or [
        "- Nothing beyond the sizes above (run `moeprune eval` to measure divergence and acceptance)."
    ]


def serve_check_line(check: ServeCheck) -> str:
    """What `moeprune serve-check` found, as one line of the card's "Measured"."""
    how = f"`moeprune serve-check`, {check.dtype}, vLLM {check.vllm_version}"
    speed = f"vLLM generated {check.vllm_tokens_per_s:,.1f} tokens/s" if check.vllm_tokens_per_s else ""
    if check.throughput_ratio is not None and check.reference_tokens_per_s is not None:
        speed += (
            f", {check.throughput_ratio:.2f}x the base model's {check.reference_tokens_per_s:,.1f} "
            "(same prompts, same vLLM)"
        )
    logprobs = (
        f"top-{check.top_k} logprobs within {check.max_logprob_difference:.2g} of moeprune's "
        f"(tolerance {check.logprob_atol:g})"
    )
    if check.verdict == "match":
        ties = f", {check.ties} ties within rounding" if check.ties else ""
        return (
            f"- Served by vLLM as moeprune loads it ({how}): {check.prompts} prompts x {check.new_tokens} "
            f"greedy tokens, {check.tokens_compared} compared, all equal{ties}; {logprobs}; {speed}."
        )
    return (
        f"- vLLM does NOT serve it as moeprune loads it ({how}): first difference at {check.first_difference}; "
        f"largest logprob difference {check.max_logprob_difference:.3g}; {speed}."
    )


def how_to_load(report: PruneReport, name: str) -> list[str]:
    package = needs_package(report.save_dtype)
    if report.format == "stock":
        return [
            "A stock checkpoint of its family: every tool loads it unchanged"
            + (f" (transformers and vLLM with the `{package}` package installed)." if package else "."),
            "",
            "```python",
            "from transformers import AutoModelForCausalLM",
            f'model = AutoModelForCausalLM.from_pretrained("{name}")',
            "```",
            "",
            f"```bash\nvllm serve {name}\n```",
        ]
    serving = report.serving or Serving()
    served, refused = serving.vllm_parameters, serving.vllm_refused
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
    if served:
        size = ELEMENT_BYTES.get(report.save_dtype or "")
        in_bytes = f" ({_mib(served * size)} in {report.save_dtype})" if size else ""
        lines += [
            "",
            "vLLM serves each layer's experts as a few fused blocks of one width each (experts within 5% "
            f"of a block's width share it, padded with zero neurons): it holds {_n(served)} parameters{in_bytes}, "
            f"against {_n((report.parameters_after or ParameterCounts()).total)} stored here.",
        ]
    return lines


def _target(report: PruneReport) -> list[str]:
    """The size target's line: what was asked, what was written, the sparsity solved for it."""
    t = report.target
    if not t:
        return []
    return [
        f"- Size target: {_mib(t.target_bytes)} ({_n(t.target_bytes)} bytes) of weights; "
        f"{_mib(t.written_bytes)} ({_n(t.written_bytes)} bytes) of {t.format} weights written; "
        f"sparsity {t.sparsity:.6g} solved for it"
    ]


def model_card(report: PruneReport | Mapping, name: str = ".") -> str:
    """README.md of a pruned output folder."""
    report = as_report(report)
    unit = _UNIT.get(report.sparsity_unit or "", "")
    multiple = (
        f"; every layer keeps a multiple of {report.expert_multiple} experts"
        if report.expert_multiple > 1
        else ""
    )
    lines = [
        *front_matter(report),
        f"# {name}: {report.model_type} pruned with moeprune",
        "",
        f"- Base model: `{report.model}` ({report.model_type})",
        f"- Criterion: {report.criterion}; allocation: {report.allocation}; method: {report.method}",
        f"- Sparsity: {report.sparsity} {unit}{multiple}",
        f"- Saved as: {report.format} format, {report.save_dtype}",
        *_target(report),
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
        f"```bash\n{report.command_line or '(made through the Python API: see recipe.json)'}\n```",
        "",
    ]
    return "\n".join(lines)
