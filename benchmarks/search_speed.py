"""How fast is one EvoESAP candidate, and the whole search, compared with plain forwards?

Prints, measured in one run on a trained demo-size model:
  (a) time to evaluate one candidate / time of one plain forward over the search set (target <= 1.15)
  (b) whole-search time / (P x T plain forwards) (target <= 0.6)
  (c) one mixed candidate (whole, narrowed, novice and dropped experts: `--method mixed
      --allocation evo`) / one drop candidate, both cold, same evaluator settings (target <= 1.2)

A plain forward is ``model(input_ids, attention_mask)`` over every batch of the search set, full
logits, nothing else. The whole search includes the teacher pass. The default run uses P=16, T=12
(the paper uses P=32, T=50) to stay within a few minutes on two cores; the ratio (b) improves with
T, because the prefix cache and racing get more to work with as elites settle.

    python benchmarks/search_speed.py                       # demo model (trained on first use)
    python benchmarks/search_speed.py --population 32 --generations 50   # paper setting
    python benchmarks/search_speed.py --compare             # also run the plain search: same result?
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from moeprune.allocate import budget_from_sparsity
from moeprune.allocate.limits import layer_limits
from moeprune.checkpoint import load_model
from moeprune.config import DataOptions, SearchConfig
from moeprune.criteria import score_experts
from moeprune.data.loading import CalibrationData, calibration_sets, load_data
from moeprune.models import MoEModel
from moeprune.search.candidates import CandidateEvaluator
from moeprune.search.options import SearchRuntime
from moeprune.search.run import run_evo_search

DOMAINS = ("code", "prose", "math")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint folder with corpus/ beside it (default: the demo model)")
    p.add_argument("--samples", type=int, default=64, help="search samples (paper: 64)")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--population", type=int, default=16)
    p.add_argument("--elites", type=int, default=4)
    p.add_argument("--generations", type=int, default=12)
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--fitness", default="esap")
    p.add_argument("--criterion", default="frequency")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (timings synchronize the GPU)")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 [default: as stored]")
    p.add_argument("--compare", action="store_true", help="also run the search without speedups")
    return p.parse_args()


def model_and_corpus(path: str | None) -> tuple[Path, Path]:
    if path:
        return Path(path), Path(path) / "corpus"
    from moeprune.demo.train import CORPUS_SUBDIR, DEMO, get_demo_model

    start = time.perf_counter()
    folder = get_demo_model(DEMO, progress=True)
    print(f"demo model: {folder} ({time.perf_counter() - start:.1f} s to get)")
    return folder, folder / CORPUS_SUBDIR


@torch.no_grad()
def plain_forward_seconds(
    moe: MoEModel, data: CalibrationData, batch_size: int, pad: int, repeats: int = 3
) -> float:
    """Median time of one plain forward over the whole search set."""
    batches = list(data.batches(batch_size, pad))
    device = moe.model.device
    batches = [(b.input_ids.to(device), b.attention_mask.to(device)) for b in batches]
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for ids, mask in batches:
            moe.model(input_ids=ids, attention_mask=mask, use_cache=False)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a host clock measures it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def candidate_seconds(evaluator: CandidateEvaluator, allocations: list[list[int]]) -> float:
    """Median time of one cold candidate evaluation (empty prefix cache, no racing)."""
    times = []
    for allocation in allocations:
        evaluator.prefix_cache.clear()
        start = time.perf_counter()
        evaluator.evaluate(allocation)
        synchronize(evaluator.moe.model.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mixed_candidate_seconds(moe, crit, scores, stats, data, args, runtime) -> float:
    """Median cold time of mixed candidates: the seeds of `--method mixed --allocation evo` (TENP's
    trapezoid, ENP, novices) and mutants of them, each holding several forms per layer."""
    import numpy as np

    from moeprune.criteria.super_experts import protected_order
    from moeprune.search.mixed_space import MixedSpace, as_genes
    from moeprune.surgery.mixed import MixedOptions, layer_costs, mixed_plan
    from moeprune.surgery.plans import virtual_plan
    from moeprune.surgery.registry import PlanRequest

    limits = layer_limits(moe)
    space = MixedSpace(layer_costs(moe, limits), limits.layers, args.sparsity)
    seeds = space.seeds(limits, MixedOptions())
    ordered = protected_order(scores, moe.protected)
    request = PlanRequest(moe, crit, ordered, args.sparsity, "evo", "mixed", stats=stats)
    domains = request.domains
    evaluator = CandidateEvaluator(
        moe, data, [s.order for s in ordered], fitness=args.fitness, runtime=runtime,
        plan_context=lambda c: virtual_plan(moe, mixed_plan(request, as_genes(c)), domains),
        prefix_key=space.prefix_key,
    )  # fmt: skip
    rng = np.random.Generator(np.random.PCG64(0))
    config = SearchConfig(population=4, elites=2)
    probes = [seeds[k] for k in ("tenp", "neurons", "novice") if k in seeds]
    probes += [space.mutate(space.mutate(p, config, rng), config, rng) for p in probes]
    return candidate_seconds(evaluator, probes)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir, corpus = model_and_corpus(args.model)
    model, tokenizer = load_model(model_dir, dtype=args.dtype, device=args.device)
    moe = MoEModel(model)
    pad = tokenizer.pad_token_id
    sources = [str(corpus / f"{d}_search.jsonl") for d in DOMAINS]
    data = load_data(sources, tokenizer, num_samples=args.samples, max_length=args.max_length, seed=0)
    options = DataOptions(sources=sources, samples=args.samples, max_length=args.max_length)
    crit, scores, stats = score_experts(
        moe,
        args.criterion,
        calibration_sets(tokenizer, options),
        progress=False,
        pad_token_id=tokenizer.pad_token_id or 0,
        neurons=True,  # the mixed candidates narrow experts by their neurons' importance
    )
    orders = [s.order for s in scores]
    limits = layer_limits(moe)
    budget = budget_from_sparsity(args.sparsity, limits.num_experts, limits.top_k)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {moe.model_type}, {params / 1e6:.1f}M params, {len(moe.layers)} MoE layers x "
        f"{limits.num_experts[0]} experts (top-{limits.top_k[0]}); search set: {len(data.samples)} samples, "
        f"{data.num_tokens()} tokens; budget {budget} experts; threads {args.threads}"
    )

    forward = plain_forward_seconds(moe, data, args.batch_size, pad)
    runtime = SearchRuntime(batch_size=args.batch_size, pad_token_id=pad, progress=False)
    evaluator = CandidateEvaluator(moe, data, orders, fitness=args.fitness, runtime=runtime)
    probes = [[r] * len(limits.caps) for r in (0, 1, 2)]
    one = candidate_seconds(evaluator, [[min(r, c) for r, c in zip(p, limits.caps)] for p in probes])
    print(f"plain forward over the search set: {forward:.3f} s; one candidate (cold): {one:.3f} s")
    mixed = mixed_candidate_seconds(moe, crit, scores, stats, data, args, runtime)
    print(f"one mixed candidate (cold): {mixed:.3f} s")
    print(
        f"teacher cache: {evaluator.cache_nbytes / 2**20:.1f} MiB ({evaluator.teacher.num_positions} positions)"
    )

    config = SearchConfig(
        fitness=args.fitness, population=args.population, elites=args.elites, generations=args.generations
    )
    start = time.perf_counter()
    best, doc = run_evo_search(moe, data, orders, budget, config=config, fingerprint={}, runtime=runtime)
    whole = time.perf_counter() - start
    sp = doc["speedups"]
    print(
        f"search P={args.population} T={args.generations} m={args.elites}: {whole:.1f} s, "
        f"{doc['evaluations']} evaluations, best {best} ({doc['fitness_value']:.4f}) vs uniform "
        f"{doc['uniform']['allocation']} ({doc['uniform']['fitness_value']:.4f})"
    )
    print(
        f"speedups: prefix hits {sp['prefix_hits']}/{sp['batch_evaluations']} batch evaluations, decoder "
        f"layers skipped {sp['decoder_layers_skipped']} (run {sp['decoder_layers_run']}), raced "
        f"{sp['raced']} candidates ({sp['samples_skipped_by_racing']} samples skipped), prefix cache peak "
        f"{sp['prefix_cache_peak_bytes'] / 2**20:.1f} MiB of {sp['prefix_cache_budget_bytes'] / 2**20:.0f} MiB"
    )
    if args.compare:
        start = time.perf_counter()
        plain_best, plain = run_evo_search(
            moe, data, orders, budget, config=config, fingerprint={},
            runtime=replace(runtime, fast=False, race=False),
        )  # fmt: skip
        slow = time.perf_counter() - start
        same = plain_best == best and [g["best_allocation"] for g in plain["generations"]] == [
            g["best_allocation"] for g in doc["generations"]
        ]
        print(
            f"plain search (no speedups): {slow:.1f} s, same selection: {same}, speedup x{slow / whole:.2f}"
        )
    print(f"(a) one candidate / one plain forward = {one / forward:.3f} (target <= 1.15)")
    print(f"(c) one mixed candidate / one drop candidate = {mixed / one:.3f} (target <= 1.2)")
    ratio = whole / (args.population * args.generations * forward)
    print(f"(b) whole search / (P x T plain forwards) = {ratio:.3f} (target <= 0.6)")


if __name__ == "__main__":
    main()
