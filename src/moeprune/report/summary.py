"""The few lines a person reads after a command, and the same lines at the head of report.md.

`prune_facts` picks the key facts out of report.json (a `PruneReport`, or its dictionary: what was done, what `--criterion auto`
picked and the runner-up, experts no calibration token reached, searched versus uniform fitness,
parameters and bytes before and after, the saved dtype, where each file is); `format_lines`
words them. Tests check the facts, so the wording can change freely. Nothing here computes a
number that report.json does not already hold, except percentages of two numbers it holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from moeprune.allocate.fitness import FITNESSES, higher_is_better
from moeprune.allocate.registry import ALLOCATIONS
from moeprune.criteria.super_experts import NOT_CHECKED
from moeprune.models.adapter import kept_whole_note
from moeprune.models.expert_parallel import ep_sizes, format_ep_sizes
from moeprune.quant.support import needs_package, package_missing
from moeprune.report.document import PRUNE, PruneReport, as_report
from moeprune.report.parts import DiskBytes, ParameterCounts, SearchStop, SearchUniform, Serving
from moeprune.search.registry import UNIFORM
from moeprune.surgery.registry import METHODS

MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "generation_config.json")
EVIDENCE_FILES = (
    "report.md",
    "report.json",
    "plan.json",
    "recipe.json",
    "search.json",
    "moeprune.log",
    "README.md",
)


def change(before: float, after: float) -> float:
    """Relative change in percent (negative: a saving)."""
    return round(100.0 * (after - before) / before, 2) if before else 0.0


def _auto(report: PruneReport) -> dict | None:
    auto = report.criterion_auto
    if not auto:
        return None
    fitness, table = auto.fitness, auto.table
    ranked = sorted(table, key=lambda row: row[fitness], reverse=FITNESSES.get(fitness).higher_is_better)
    runner = next((row for row in ranked if row["criterion"] != auto.chosen), None)
    chosen = next(row for row in table if row["criterion"] == auto.chosen)
    return {
        "fitness": fitness,
        "chosen": auto.chosen,
        "chosen_value": chosen[fitness],
        "runner_up": runner["criterion"] if runner else None,
        "runner_up_value": runner[fitness] if runner else None,
    }


def _search(report: PruneReport) -> dict | None:
    search = report.search
    if search is None or search.fitness_value is None:
        return None
    stopped = search.stopped or SearchStop()
    # mixed + evo has no uniform allocation: its baseline is the best seed (a single-surgery recipe)
    seeds = {k: v["fitness_value"] for k, v in (search.seeds or {}).items()}
    best_seed = max(
        seeds, key=lambda k: seeds[k] * (1 if higher_is_better(str(search.fitness)) else -1), default=None
    )
    return {
        "fitness": search.fitness,
        "searched": search.fitness_value,
        "uniform": seeds[best_seed] if best_seed else (search.uniform or SearchUniform()).fitness_value,
        "baseline": f"best seed, {best_seed}" if best_seed else "uniform",
        "generations": stopped.generations_run,
        "stopped": stopped.reason,
        "evaluations": search.evaluations,
        "steps": search.steps,
    }


def _files(folder: Path) -> dict[str, list[str]]:
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    weights = [n for n in names if n.endswith((".safetensors", ".py")) or n in MODEL_FILES]  # .py: its code
    groups = {
        "model": weights,
        "evidence": [n for n in EVIDENCE_FILES if n in names],
        "plots": [n for n in names if n.endswith(".png")],
        "tokenizer": [n for n in names if n.startswith(("tokenizer", "special_tokens", "vocab", "merges"))],
    }
    grouped = {n for group in groups.values() for n in group}
    # what else the folder holds: the input's files carried over (chat template, processor configs, ...)
    groups["also"] = [n for n in names if n not in grouped and not n.startswith(".")]
    return groups


def _counts(before: ParameterCounts | None, after: ParameterCounts | None, key: str) -> dict:
    """One parameter count before and after, and its change (None where the report lacks it)."""
    old, new = getattr(before, key, None), getattr(after, key, None)
    pct = change(old, new) if old is not None and new is not None else None
    return {"before": old, "after": new, "change_pct": pct}


def _ep_sizes(report: PruneReport) -> list[int] | None:
    """The EP degrees the result's per-layer expert counts all divide (None: counts unknown)."""
    rows = report.kept_per_layer or []
    counts = [r.experts_after if r.experts_after is not None else r.experts_before for r in rows]
    return ep_sizes(counts) if counts else None


def prune_facts(report: PruneReport | Mapping, folder: str | Path | None = None) -> dict:
    """The summary's facts, from report.json (and the output folder's listing, when it exists)."""
    report = as_report(report)
    before, after = report.parameters_before, report.parameters_after
    serving, disk = report.serving or Serving(), report.disk_bytes or DiskBytes()
    facts = {
        "command": report.command if report.command is not None else PRUNE,
        "model": report.model,
        "output": report.output,
        "criterion": report.criterion,
        "allocation": report.allocation,
        "method": report.method,
        "reroute": report.reroute,
        "sparsity": report.sparsity,
        "sparsity_unit": report.sparsity_unit or "experts",
        "auto": _auto(report),
        "search": _search(report),
        "repair": report.repair.line() if report.repair else None,
        "portfolio": report.portfolio.line() if report.portfolio else None,
        "unseen_experts": sum(len(ids) for ids in report.unseen.values()),
        "unseen_per_layer": report.unseen,
        "parameters": _counts(before, after, "total"),
        "routed_parameters": _counts(before, after, "routed_experts"),
        "bytes": {
            "before": disk.before,
            "after": disk.after,
            "change_pct": (
                change(disk.before, disk.after)
                if disk.before is not None and disk.after is not None
                else None
            ),
        },
        "neurons_per_expert": report.surgery.intermediate_size if report.surgery else None,
        "vllm_parameters": serving.vllm_parameters,
        "vllm_refused": serving.vllm_refused,
        "vllm_native": serving.vllm_native,
        "model_type": report.model_type,
        "save_dtype": report.save_dtype,
        "format": report.format,
        "target": report.target.to_json() if report.target else None,
        "release_layers": list(report.release_layers or []),
        "kept_whole": kept_whole_note(report.kept_whole or {}),
        "super_experts": report.super_experts,
        "super_experts_note": report.super_experts_note,
        "precision": (report.quantization or {}).get("precision"),
        "novice_fits": report.novice_fits.to_json() if report.novice_fits else None,
        "ep_sizes": _ep_sizes(report),
    }
    if folder is not None:
        facts["files"] = _files(Path(folder))
    return facts


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _pct(value: float | None) -> str:
    return "" if value is None else f" ({value:+.1f}%)"


def _unit(facts: dict) -> str:
    return "routed experts" if facts["sparsity_unit"] == "experts" else "routed-expert parameters"


def format_lines(facts: dict) -> list[str]:
    """The console summary of a prune (the head of its report.md)."""
    how = " without loading it" if facts["command"] == "prune --no-load" else ""
    lines = [
        f"pruned {facts['model']}{how}: criterion {facts['criterion']}, allocation {facts['allocation']}, "
        f"method {facts['method']}{' --reroute ' + facts['reroute'] if facts.get('reroute') else ''}, sparsity {facts['sparsity']:g} of the {_unit(facts)}"
    ]
    lines += _choice_lines(facts)
    lines += novice_fit_lines(facts.get("novice_fits"))
    if facts.get("portfolio"):
        lines.append(f"  auto            {facts['portfolio']}")
    if facts.get("repair"):
        lines.append(f"  repair          {facts['repair']}")
    if facts["unseen_experts"]:
        where = "; ".join(
            f"layer {layer}: {', '.join(map(str, ids))}" for layer, ids in facts["unseen_per_layer"].items()
        )
        lines.append(f"  unseen experts  {facts['unseen_experts']} got no calibration token ({where})")
    if facts.get("super_experts_note"):
        lines.append(f"  super experts   {facts['super_experts_note']}")
    for note in facts.get("release_layers") or []:
        lines.append(f"  beside stack    {note}")
    if facts.get("kept_whole"):
        lines.append(f"  fixed layers    {facts['kept_whole']}")
    if facts["neurons_per_expert"]:
        lines.append(
            f"  experts         every routed expert narrowed to {facts['neurons_per_expert']} neurons"
        )
    p, r = facts["parameters"], facts["routed_parameters"]
    if p["before"] is not None:
        lines.append(
            f"  parameters      {p['before']:,} -> {p['after']:,}{_pct(p['change_pct'])}; routed experts "
            f"{r['before']:,} -> {r['after']:,}{_pct(r['change_pct'])}"
        )
    b = facts["bytes"]
    if b["before"] is not None:
        lines.append(
            f"  weights on disk {_size(b['before'])} -> {_size(b['after'])}{_pct(b['change_pct'])}, "
            f"saved as {facts['save_dtype']} ({facts['format']} format)"
        )
    package = needs_package(facts["save_dtype"])
    if package and package_missing(package):
        lines.append(
            f"  loading it      transformers and vLLM read this format with the {package} package, not installed "
            'here: pip install "moeprune[quantized]"'
        )
    target = facts.get("target")
    if target:
        lines.append(target_line(target))
    lines += _precision_lines(facts)
    lines += _serving_lines(facts)
    lines.append(f"  output          {facts['output']}")
    for kind, names in (facts.get("files") or {}).items():
        if names:
            lines.append(f"    {kind:<14}{', '.join(names)}")
    return lines


def _choice_lines(facts: dict) -> list[str]:
    """What chose the plan: the criterion auto picked, the search and its gain over its baseline."""
    lines = []
    auto = facts["auto"]
    if auto:
        runner = (
            f"; runner-up {auto['runner_up']} ({auto['fitness']} {auto['runner_up_value']:.6g})"
            if auto["runner_up"]
            else ""
        )
        lines.append(
            f"  criterion auto  picked {auto['chosen']} ({auto['fitness']} {auto['chosen_value']:.6g}){runner}"
        )
    search = facts["search"]
    if search:
        gain = search["searched"] - search["uniform"]
        how = (
            f"{search['steps']} gradient steps"
            if search.get("steps")
            else f"{search['generations']} generations, {search['evaluations']} evaluations, "
            f"stopped by {search['stopped']}"
        )
        lines.append(
            f"  search          {search['fitness']} {search['searched']:.6g} searched vs {search['uniform']:.6g} "
            f"{search.get('baseline', 'uniform')} ({gain:+.4g}); {how}"
        )
    return lines


def _precision_lines(facts: dict) -> list[str]:
    """prune --quantize auto:...: each layer's experts in its chosen scheme, and how it was chosen."""
    lines: list[str] = []
    precision = facts.get("precision")
    if precision:
        chosen = ", ".join(f"{layer} {scheme}" for layer, scheme in precision["chosen"].items())
        grid = precision.get("sparsity_grid") or []
        if grid and "search_fitness" in precision:  # the joint evo search, seeded with the grid
            seeds = precision.get("seed_fitness") or {}
            lines.append(
                f"  per-layer bits  experts and schemes searched together (evo from {len(seeds)} grid seeds): "
                f"{precision['fitness']} {precision['search_fitness']:.4g} on the search data"
            )
        elif grid:  # no --sparsity: it was chosen with the schemes
            tried = ", ".join(f"{row['sparsity']:.4g}" for row in grid)
            lines.append(
                f"  per-layer bits  sparsity {facts['sparsity']:g} chosen among {tried} (best combined fitness)"
            )
        if precision.get("no_expert_removed"):
            lines.append(f"  per-layer bits  {precision['no_expert_removed']}")
        lines.append(
            f"  per-layer bits  experts of layer {chosen}; {_size(precision['written_bytes'])} written, "
            f"{_size(precision['predicted_bytes'])} predicted, target {_size(precision['target_bytes'])}"
        )
    return lines


def _serving_lines(facts: dict) -> list[str]:
    """How vLLM serves the result: its parameters there, or why the plugin refuses it; EP degrees."""
    lines = []
    if facts["vllm_parameters"]:
        served, before = facts["vllm_parameters"], facts["parameters"]["before"]
        versus = f"{change(before, served):+.1f}% vs before; " if before else ""
        lines.append(f"  in vLLM         {served:,} parameters ({versus}experts served in width groups)")
    elif facts.get("vllm_refused"):
        # the refusal's reason, without the list of served families and the ways to load it, said here
        reason = (
            facts["vllm_refused"]
            .split(";")[0]
            .split(" (it serves")[0]
            .removeprefix("moeprune's vLLM plugin ")
        )
        lines.append(
            f"  in vLLM         not served: moeprune's plugin {reason} "
            "(load it with transformers, trust_remote_code=True, or moeprune.load_pretrained)"
        )
    if facts.get("ep_sizes"):
        lines.append(
            f"  expert parallel {format_ep_sizes(facts['ep_sizes'])} (each divides every layer's expert count)"
        )
    if facts.get("vllm_native"):
        lines.append(f"  novices served  {facts['vllm_native']}")
    return lines


def novice_fit_lines(fits: dict | None, shown: int = 5) -> list[str]:
    """Low-rank novices' errors relative to constant ones, calibration beside held-out tokens
    (averaged over the layers' novices), and the first `shown` novices with too few tokens."""
    if not fits:
        return []
    rows = fits.get("layers") or []

    def mean(key: str) -> str:
        pairs = [(r[key], r["novices"]) for r in rows if r.get(key) is not None]
        total = sum(n for _, n in pairs)
        return f"{sum(v * n for v, n in pairs) / total:.3g}" if total else "-"

    novices, constant = sum(r["novices"] for r in rows), sum(r["constant"] for r in rows)
    lines = [
        f"  novice fits     rank {fits.get('rank')}: error / constant novice's {mean('calibration')} on "
        f"calibration vs {mean('held_out')} held out ({fits.get('held_out')}; unshrunk fit "
        f"{mean('unshrunk_held_out')}); {constant} of {novices} kept constant"
    ]
    few = fits.get("too_few") or []
    lines += [f"  too few tokens  {line}" for line in few[:shown]]
    if len(few) > shown:
        lines.append(f"  too few tokens  and {len(few) - shown} more (report.json: novice_fits.too_few)")
    return lines


def target_line(target: dict) -> str:
    """The size target, what was written for it and the sparsity solved (and the step below it)."""
    below = (
        f"; {target['step_below']:.6g} would need {_size(target['step_below_bytes'])}"
        if target.get("step_below") is not None
        else ""
    )
    return (
        f"  target size     {_size(target['target_bytes'])}: {_size(target['written_bytes'])} of "
        f"{target['format']} weights written, sparsity {target['sparsity']:.6g} solved{below}"
    )


def score_lines(document: dict, output: str | Path) -> list[str]:
    """The console summary of `moeprune score`."""
    layers = document["layers"]
    experts = sum(len(layer["scores"]) for layer in layers)
    lines = [
        f"scored {experts} routed experts in {len(layers)} MoE layers with {document['criterion']} "
        f"(pruned first: {document['prune_first']} scores)"
    ]
    if document.get("tokens"):
        lines.append(f"  calibration     {document['tokens']:,} tokens")
    unseen = document.get("unseen") or {}
    if unseen:
        count = sum(len(ids) for ids in unseen.values())
        where = "; ".join(f"layer {layer}: {', '.join(map(str, ids))}" for layer, ids in unseen.items())
        lines.append(f"  unseen experts  {count} got no calibration token ({where})")
    found = document.get("super_experts")
    if found is None:
        lines.append(f"  super experts   {NOT_CHECKED}")
    else:
        where = "; ".join(f"layer {layer}: {', '.join(map(str, ids))}" for layer, ids in found.items())
        lines.append(f"  super experts   {where or 'none found'} (kept by moeprune prune by default)")
    lines.append(f"  output          {output}")
    return lines


def eval_lines(doc: dict, files: Sequence[str | Path] = ()) -> list[str]:
    """The console summary of `moeprune eval`: per model, per data file, the headline metrics."""
    lines = [f"evaluated {len(doc['models'])} model(s) against {doc['reference']}"]
    ref_size = (doc.get("reference_size") or {}).get("parameters", {}).get("total")
    for entry in doc["models"]:
        size = (entry.get("size") or {}).get("parameters", {}).get("total")
        grown = f", parameters {size:,}{_pct(change(ref_size, size))}" if size and ref_size else ""
        lines.append(f"  {entry['label']}{grown}")
        for source, per in entry["per_data"].items():
            parts = [
                f"{key} {per[key]:.4g}"
                for key in ("esap", "kl", "nll", "ppl")
                if isinstance(per.get(key), float)
            ]
            for mode, acc in (per.get("accept") or {}).items():
                if acc.get("accept_rate") is not None:  # undefined when nothing was drafted
                    parts.append(f"{mode} acceptance {acc['accept_rate']:.3f}")
            lines.append(f"    {Path(source).name:<22}{', '.join(parts) or 'no per-file metric'}")
    for path in files:
        lines.append(f"  wrote           {path}")
    return lines


def _uniform_drop(allocation: str, method: str) -> bool:
    """A demo row of the stock baseline: an allocation fixed by the budget (uniform) and a method
    that removes whole experts (drop), asked of the entries the row names."""
    known = allocation in ALLOCATIONS and method in METHODS
    return known and ALLOCATIONS.get(allocation).fixed and METHODS.get(method).whole_experts


def demo_lines(results: dict, output: str | Path) -> list[str]:
    """The console summary of `moeprune demo`, under its comparison table."""
    rows = results["rows"]
    lines = [
        f"demo: {len(rows) - 1} pruned variants of {results['model']} ({results['mode']} mode) "
        f"compared on {', '.join(results['domains'])} in {results['timing_s']['total']:.0f} s"
    ]
    for sparsity in sorted({r["sparsity"] for r in rows if r["sparsity"]}):
        peers = [r for r in rows if r["sparsity"] == sparsity]
        best = max(peers, key=lambda r: r["esap"])
        uniform = max(
            (r for r in peers if _uniform_drop(r["allocation"], r["method"])),
            key=lambda r: r["esap"],
            default=None,
        )
        than = f"; best uniform drop {uniform['esap']:.4f} ({uniform['criterion']})" if uniform else ""
        lines.append(
            f"  at {sparsity:.0%}  best ESAP {best['esap']:.4f}: {best['criterion']}, {best['allocation']}, "
            f"{best['method']}{than}"
        )
    for search in results.get("searches", []):
        if UNIFORM in search and "seeds" not in search:  # drop counts: against the criterion's uniform plan
            reference, name = search[UNIFORM]["fitness_value"], UNIFORM
        else:  # mixed genes: against the best recipe it started from (its seeds)
            sign = 1 if search.get("higher_is_better", True) else -1
            name, seed = max(search["seeds"].items(), key=lambda item: sign * item[1]["fitness_value"])
            reference = seed["fitness_value"]
        how = search.get("allocation_method", "evo")
        how = f"mixed {how}" if "seeds" in search else how
        lines.append(
            f"  search    {search['criterion']} {how} at {search['sparsity']:.0%}: {search['fitness']} "
            f"{search['fitness_value']:.4f} searched vs {reference:.4f} {name} on the search data"
        )
    if results.get("super_experts"):
        named = "; ".join(f"layer {k}: {v}" for k, v in results["super_experts"].items())
        lines.append(f"  super experts kept in every row ({named})")
    folder = Path(output)
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    lines.append(f"  output    {folder}: {', '.join(names)}")
    return lines
