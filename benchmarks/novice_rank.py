"""Novice rank 0 / 4 / 16 at 25 % and 50 % sparsity on the demo model: ESAP against the full
model and answer NLL per held-out domain, the novices applied virtually (docs/surgery.md's table).

    PYTHONPATH=src python benchmarks/novice_rank.py fixture   # the quick demo's model (cached)
    PYTHONPATH=src python benchmarks/novice_rank.py demo      # the full demo's model (trains once)

Settings are `moeprune demo --quick`'s (96 calibration samples, 32 held-out samples per domain,
mone criterion, uniform allocation).
"""

import functools
import sys
import time

import torch

from moeprune.checkpoint import load_model
from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.data.loading import load_data
from moeprune.demo.run import DOMAINS, DemoSettings, DomainEval
from moeprune.demo.train import CORPUS_SUBDIR, DEMO, FIXTURE, get_demo_model
from moeprune.models import MoEModel
from moeprune.observe.observer import observe
from moeprune.surgery.lowrank import fit_novices
from moeprune.surgery.planning import build_plan
from moeprune.surgery.plans import virtual_plan

preset = DEMO if sys.argv[1] == "demo" else FIXTURE
torch.set_num_threads(2)
s = DemoSettings.for_mode(True)
model_dir = get_demo_model(preset, progress=False, threads=2)
model, tok = load_model(model_dir)
moe = MoEModel(model)
pad = tok.pad_token_id or 0
corpus = model_dir / CORPUS_SUBDIR


def data(split, domains, n):
    return load_data(
        [str(corpus / f"{d}_{split}.jsonl") for d in domains],
        tok,
        num_samples=n,
        max_length=s.max_length,
        seed=s.seed,
    )


calib = data("train", DOMAINS, s.calibration_samples)
stats = observe(moe, calib, batch_size=s.batch_size, pad_token_id=pad, progress=False)
evals = {d: DomainEval(moe, data("eval", [d], s.eval_samples), s.batch_size, pad) for d in DOMAINS}
print(
    f"model {model_dir} hidden {moe.layers[0].hidden_size} experts {moe.layers[0].num_experts} layers {len(moe.layers)}; calib {len(calib.samples)} samples {stats.tokens} tokens; eval {s.eval_samples}/domain",
    flush=True,
)
print("| sparsity | rank | " + " | ".join(f"{d} ESAP | {d} NLL" for d in DOMAINS) + " |", flush=True)
crit = get_criterion("mone")
scores = compute_scores("mone", stats=stats)
for sp in (0.25, 0.5):
    for rank in (0, 4, 16):
        t = time.perf_counter()
        plan = build_plan(
            moe,
            crit,
            scores,
            config=PruneConfig("mone", sp, method="novice", options={"novice_rank": rank}),
            stats=[stats],
        )
        fits = (
            fit_novices(moe, plan, [calib], batch_size=s.batch_size, pad_token_id=pad, progress=False)
            if rank
            else None
        )
        m = {d: e.score(functools.partial(virtual_plan, moe, plan, stats, fits)) for d, e in evals.items()}
        print(
            f"| {sp:.0%} | {rank} | "
            + " | ".join(f"{m[d]['esap']:.4f} | {m[d]['nll']:.4f}" for d in DOMAINS)
            + f" |  ({time.perf_counter() - t:.0f}s)",
            flush=True,
        )
