"""`moeprune demo`: prune the locally trained demo MoE many ways and compare the results.

One calibration pass feeds every data-driven criterion; every configuration is evaluated on the
held-out split through reversible masks (the model is never copied), against teacher
distributions computed once per domain.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..criteria import compute_scores, get_criterion
from ..data import CalibrationData, load_data
from ..fitness import FitnessAccumulator, TeacherCache
from ..io import atomic_write_dir, check_output_dir, load_model, write_json
from ..models import MoEModel
from ..observe import observe
from ..pipeline import build_plan, plan_positions
from ..plan import Plan
from ..surgery import mask_experts
from .corpus import DOMAINS
from .train import CORPUS_SUBDIR, DEMO, FIXTURE, get_demo_model

CRITERIA = ("frequency", "reap", "aimer", "mone", "seer", "ean", "tenp", "random")
QUICK_CRITERIA = ("frequency", "reap", "aimer", "mone")
ALLOCATIONS = ("uniform", "global")
SPARSITIES = (0.25, 0.5)


@dataclass(frozen=True)
class DemoSettings:
    quick: bool = False
    calibration_samples: int = 256
    eval_samples: int = 64  # per domain
    max_length: int = 256
    batch_size: int = 16
    seed: int = 0

    @classmethod
    def for_mode(cls, quick: bool) -> DemoSettings:
        if quick:
            return cls(quick=True, calibration_samples=96, eval_samples=32, max_length=128)
        return cls()


class DomainEval:
    """Held-out batches of one domain with the full model's answer distributions cached once."""

    def __init__(self, moe: MoEModel, data: CalibrationData, batch_size: int, pad: int):
        self.moe, self.batches = moe, list(data.batches(batch_size, pad))
        self.teacher = TeacherCache()
        with torch.no_grad():
            for b in self.batches:
                logits = moe.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
                self.teacher.add(
                    b.sample_index.tolist(), logits, b.input_ids, b.answer_mask, b.attention_mask
                )

    def score(self, context: Callable[[], AbstractContextManager]) -> dict[str, float]:
        """ESAP vs the full model and NLL on answer tokens, under a (fresh) virtual pruning context."""
        esap, nll = FitnessAccumulator(self.teacher, "esap"), FitnessAccumulator(self.teacher, "nll")
        with torch.no_grad(), context():
            for b in self.batches:
                logits = self.moe.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
                for acc in (esap, nll):
                    acc.add(b.sample_index.tolist(), logits, b.answer_mask, b.attention_mask)
        return {"esap": esap.result(), "nll": nll.result()}


def configurations(quick: bool) -> Iterator[tuple[str, str, float]]:
    for criterion in QUICK_CRITERIA if quick else CRITERIA:
        for allocation in ALLOCATIONS:
            for sparsity in SPARSITIES:
                yield criterion, allocation, sparsity


def sizes_after(moe: MoEModel, plan: Plan, before: dict[str, int]) -> dict[str, int]:
    """Parameter counts of the physically pruned model, computed from the plan (no surgery)."""
    removed_total = removed_routed = 0
    for layer_plan in plan.layers:
        layer = moe.layer(layer_plan.layer)
        per_expert = layer.expert_param_count()
        router_row = sum(p.numel() for p in layer.router.parameters()) // layer.num_experts
        removed_routed += len(layer_plan.dropped) * per_expert
        removed_total += len(layer_plan.dropped) * (per_expert + router_row)
    return {
        "total": before["total"] - removed_total,
        "routed_experts": before["routed_experts"] - removed_routed,
        "active_per_token": before["active_per_token"] - (removed_total - removed_routed),  # router rows
    }


def run_demo(
    output: str | Path,
    *,
    quick: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    rebuild: bool = False,
) -> dict:
    """Train or reuse the demo model, compare criteria x allocations x sparsities, write results."""
    check_output_dir(output, overwrite)
    settings = DemoSettings.for_mode(quick)
    start = time.perf_counter()
    model_dir = get_demo_model(FIXTURE if quick else DEMO, rebuild=rebuild, progress=progress)
    trained_s = time.perf_counter() - start
    corpus = model_dir / CORPUS_SUBDIR
    model, tokenizer = load_model(model_dir)
    moe = MoEModel(model)
    pad = tokenizer.pad_token_id or 0

    def data(split: str, domains, samples: int) -> CalibrationData:
        files = [str(corpus / f"{d}_{split}.jsonl") for d in domains]
        return load_data(
            files, tokenizer, num_samples=samples, max_length=settings.max_length, seed=settings.seed
        )

    calibration = data("train", DOMAINS, settings.calibration_samples)
    stats = observe(moe, calibration, batch_size=settings.batch_size, pad_token_id=pad, progress=progress)
    evals = {
        d: DomainEval(moe, data("eval", [d], settings.eval_samples), settings.batch_size, pad)
        for d in DOMAINS
    }
    before = moe.parameter_counts()
    rows = [_row("full model", "-", 0.0, {d: e.score(nullcontext) for d, e in evals.items()}, before)]
    configs = list(configurations(quick))
    for criterion, allocation, sparsity in tqdm(configs, desc="demo", unit="config", disable=not progress):
        crit = get_criterion(criterion)
        scores = compute_scores(
            criterion,
            stats=stats if crit.needs_data else None,
            weights=moe.layers if crit.needs_weights else None,
            seed=settings.seed,
            num_experts=[m.num_experts for m in moe.layers],
            layers=[m.index for m in moe.layers],
        )
        plan = build_plan(moe, crit, scores, sparsity=sparsity, allocation=allocation)
        removed = plan_positions(moe, plan)
        metrics = {d: e.score(lambda removed=removed: mask_experts(moe, removed)) for d, e in evals.items()}
        rows.append(_row(criterion, allocation, sparsity, metrics, sizes_after(moe, plan, before), plan))
    results = {
        "model": str(model_dir),
        "mode": "quick" if quick else "full",
        "domains": list(DOMAINS),
        "calibration": {"samples": len(calibration.samples), "tokens": stats.tokens},
        "eval_samples_per_domain": settings.eval_samples,
        "rows": rows,
        "timing_s": {"model": round(trained_s, 1), "total": round(time.perf_counter() - start, 1)},
    }
    table = format_table(results)

    def write(tmp: Path) -> None:
        write_json(tmp / "results.json", results)
        (tmp / "results.md").write_text(table + "\n")
        _plots(tmp, moe, rows)

    atomic_write_dir(output, write, overwrite=overwrite)
    results["table"] = table
    return results


def _row(criterion, allocation, sparsity, metrics, sizes, plan: Plan | None = None) -> dict:
    row = {
        "criterion": criterion,
        "allocation": allocation,
        "sparsity": sparsity,
        "nll": {d: round(m["nll"], 4) for d, m in metrics.items()},
        "esap": round(sum(m["esap"] for m in metrics.values()) / len(metrics), 4),
        "esap_per_domain": {d: round(m["esap"], 4) for d, m in metrics.items()},
        "parameters": sizes,
    }
    if plan is not None:
        row["kept_per_layer"] = [len(lp.kept) for lp in plan.layers]
    return row


def format_table(results: dict) -> str:
    domains = results["domains"]
    head = ["criterion", "alloc", "sparsity", *[f"NLL {d}" for d in domains], "ESAP", "params (M)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["rows"]:
        cells = [
            row["criterion"],
            row["allocation"],
            f"{row['sparsity']:.0%}",
            *[f"{row['nll'][d]:.3f}" for d in domains],
            f"{row['esap']:.4f}",
            f"{row['parameters']['total'] / 1e6:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plots(folder: Path, moe: MoEModel, rows: list[dict]) -> None:
    """Per-layer kept-expert density of the global allocations (PNG), when matplotlib is present."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [m.index for m in moe.layers]
    total = [m.num_experts for m in moe.layers]
    for sparsity in SPARSITIES:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for row in rows:
            if row["allocation"] == "global" and row["sparsity"] == sparsity:
                density = [k / n for k, n in zip(row["kept_per_layer"], total)]
                ax.plot(layers, density, marker="o", label=row["criterion"])
        ax.axhline(1 - sparsity, color="gray", linestyle="--", label="uniform")
        ax.set(
            xlabel="decoder layer",
            ylabel="kept experts (fraction)",
            title=f"global allocation, {sparsity:.0%}",
        )
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / f"density_global_{int(sparsity * 100)}.png", dpi=110)
        plt.close(fig)
