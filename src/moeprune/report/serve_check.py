"""Records what `moeprune serve-check` measured in the output it checked: report.json's
`serve_check` part and the model card drawn from it.

Why here and not in moeprune.evaluate: the check is measured before the report stage, and this
stage owns report.json and the card. Each file is replaced atomically; an output without a prune
report (any stock checkpoint) is left untouched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moeprune.errors import MoePruneError
from moeprune.report.document import NO_LOAD, PruneReport
from moeprune.report.model_card import model_card
from moeprune.report.parts import ServeCheck
from moeprune.runtime.atomic import write_json, write_text

REPORT = "report.json"
CARD = "README.md"


def record_serve_check(folder: str | Path, document: Mapping[str, Any]) -> list[Path]:
    """Put `document` (serve_check's result) into folder's report.json and redraw its model card
    (not for a prune without loading: its README.md is the base model's); the files written."""
    folder = Path(folder)
    path = folder / REPORT
    if not path.is_file():
        return []
    try:
        report = PruneReport.from_json(json.loads(path.read_text()))
    except (ValueError, MoePruneError):  # not a prune report: left as it is
        return []
    report.serve_check = ServeCheck.from_json(document)
    write_json(path, report.to_json())
    if report.command == NO_LOAD:
        return [path]
    write_text(folder / CARD, model_card(report, report.output or str(folder)))
    return [path, folder / CARD]


def serve_check_lines(folder: str | Path, document: Mapping[str, Any], files: list[Path]) -> list[str]:
    """The console summary of a serve-check: the verdict first, then its figures."""
    check = ServeCheck.from_json(document)
    verdict = "match" if check.verdict == "match" else f"MISMATCH at {check.first_difference}"
    lines = [
        f"serve-check {folder}: {verdict}",
        f"  engines        vLLM {check.vllm_version} against moeprune.load_pretrained, {check.dtype}",
        f"  tokens         {check.prompts} prompts x {check.new_tokens} greedy tokens: {check.tokens_compared} "
        f"compared{f', {check.ties} ties within rounding' if check.ties else ''}",
        f"  logprobs       top-{check.top_k}: largest difference {check.max_logprob_difference:.3g} "
        f"(tolerance {check.logprob_atol:g})",
        f"  vLLM speed     {check.vllm_tokens_per_s:,.1f} tokens/s",
    ]
    if check.throughput_ratio is not None and check.reference_tokens_per_s is not None:
        lines[-1] += (
            f"; base model {check.reference_tokens_per_s:,.1f} tokens/s, ratio {check.throughput_ratio:.2f}"
        )
    written = ", ".join(str(p) for p in files) if files else "nothing (no prune report.json in the folder)"
    lines.append(f"  recorded in    {written}")
    return lines
