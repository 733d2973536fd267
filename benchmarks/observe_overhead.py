"""Observer overhead: observe() passes vs a plain forward, measured in one run.

Every pass runs over the same batches of the same model in one process, alternating, best of N:
- REAP drop run: what `moeprune prune --criterion reap --method drop` asks the pass for (its
  `requirements(config).statistics`: the per-token sums and the super-expert guard's maxima);
- full statistics: every kind a pass can record but the per-neuron sums (observe()'s default:
  Welford mean and variance, TENP's direction term, the guard's maxima, merge's gated sums and
  probe tokens);
- with per-neuron importances (only neuron pruning asks: one extra [n, d] x [d, I] product per
  expert).
Prints each ratio to the plain forward; the last two lines are the REAP and full-statistics
ratios. Target: REAP drop run <= 1.10x.

    .venv/bin/python benchmarks/observe_overhead.py [--layers 8 --hidden 256 --experts 32 ...]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from moeprune.config import PruneConfig
from moeprune.data.loading import CalibrationData, Sample
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.observe.kinds import DEFAULT, Statistic
from moeprune.observe.observer import observe
from moeprune.runtime.device import DTYPES
from moeprune.surgery.planning import requirements


def build(args) -> MoEModel:
    model = tiny_model(
        args.family,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.intermediate,
        mlp_only_layers=[],
        max_position_embeddings=args.seq_len,
    )
    return MoEModel(model)


def calibration(args) -> CalibrationData:
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(args.samples):
        n = args.seq_len - (i % 4) * (args.seq_len // 8)  # some padding, as in real calibration batches
        ids = torch.randint(3, args.vocab, (n,), generator=gen).tolist()
        samples.append(Sample(input_ids=ids, answer_mask=[True] * n, source="bench", truncated=False))
    return CalibrationData(
        samples=samples, fingerprint="bench", truncated=0, text_only=True, sources=["bench"]
    )


def plain_pass(moe: MoEModel, data: CalibrationData, batch_size: int) -> None:
    device = moe.model.device
    with torch.no_grad():
        for batch in data.batches(batch_size, 0):
            ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
            moe.model(input_ids=ids, attention_mask=mask, use_cache=False)


def observed_pass(moe: MoEModel, data: CalibrationData, batch_size: int, kinds) -> None:
    observe(moe, data, batch_size=batch_size, progress=False, statistics=kinds)


def timed(work) -> float:
    """Seconds `work()` takes, the GPU's queued kernels included."""
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    synchronize()
    start = time.perf_counter()
    work()
    synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (timings synchronize the GPU)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    moe = build(args)
    moe.model.to(device=args.device, dtype=DTYPES[args.dtype])
    data = calibration(args)
    params = sum(p.numel() for p in moe.model.parameters())
    print(f"model: {args.family} on {args.device} in {args.dtype}, {params / 1e6:.1f}M parameters, {len(moe.layers)} MoE layers x {args.experts} "
          f"experts (top-{args.top_k}); {data.num_tokens()} tokens in batches of {args.batch_size}")  # fmt: skip
    reap = requirements(PruneConfig(sparsity=0.5, criterion="reap", method="drop")).statistics
    passes = {
        "REAP drop run (" + ", ".join(sorted(k.name for k in reap)) + ")": reap,
        "full statistics": DEFAULT,
        "full statistics + per-neuron importances": DEFAULT | {Statistic.NEURONS},
    }
    plain_pass(moe, data, args.batch_size)  # warm-up
    plain: list[float] = []
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(args.repeats):
        plain.append(timed(lambda: plain_pass(moe, data, args.batch_size)))
        for name, kinds in passes.items():
            times[name].append(timed(partial(observed_pass, moe, data, args.batch_size, kinds)))
    print(f"plain forward: best {min(plain):.3f}s of {args.repeats}")
    for name in reversed(passes):
        print(f"observe, {name}: best {min(times[name]):.3f}s ({min(times[name]) / min(plain):.3f}x plain)")
    names = list(passes)
    print(f"observe / plain forward ratio, full statistics: {min(times[names[1]]) / min(plain):.3f}x")
    print(f"observe / plain forward ratio, REAP drop run: {min(times[names[0]]) / min(plain):.3f}x")


if __name__ == "__main__":
    main()
