"""Streaming weight-only scoring: `score_checkpoint(path, "aimer")` vs reading the same bytes once.

The baseline copies every routed-expert tensor's bytes once with plain file reads into a reused
buffer and computes nothing (not `safe_open(...).get_tensor`: that maps the file and returns a
view without touching the bytes). Two page-cache states:

- cold: the shards are evicted (posix_fadvise DONTNEED, no root needed) before every run, so
  both read from the disk; this is the situation the streaming path is for (a checkpoint larger
  than memory). On a virtual disk the host may still cache the file.
- warm: the page cache holds the shards, the read runs at memory speed, and the ratio measures
  pure compute overhead (cast, |w|, sum, w^2, sum per value) over a memcpy: the hardest case.

Scoring is timed with one worker thread and with one per core (`--workers`); the read is one
thread (a memcpy per byte from the page cache). Alternating runs, best of N. Peak memory is
measured in a fresh process (so no earlier run's freed memory hides it): the largest anonymous
resident memory (RssAnon, sampled every millisecond) above the level before the run. The page
cache, which the kernel reclaims at will, is not counted.
Prints the ratio last. Target: <= 1.5x.

    .venv/bin/python benchmarks/weight_scoring.py [--model PATH | --layers 4 --experts 24 ...]

Without --model it builds a random qwen3_moe (bf16, ~300 MB) once under the moeprune cache.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from moeprune.models.factory import tiny_model
from moeprune.runtime.atomic import atomic_write_dir
from moeprune.runtime.cache import cache_root
from moeprune.runtime.device import resolve_dtype
from moeprune.shards.layout import CheckpointLayout
from moeprune.shards.weight_scores import score_checkpoint


def build(args) -> Path:
    name = f"bench-weight-scoring-{args.family}-L{args.layers}-E{args.experts}-d{args.hidden}-I{args.intermediate}-{args.dtype}"
    path = cache_root() / name
    if (path / "config.json").is_file():
        return path

    def write(tmp: Path) -> None:
        model = tiny_model(
            args.family,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_experts=args.experts,
            moe_intermediate_size=args.intermediate,
            mlp_only_layers=[],
            vocab_size=1024,
        )
        model.to(resolve_dtype(args.dtype)).save_pretrained(tmp)

    print(f"building {path} (once)")
    return atomic_write_dir(path, write)


def expert_keys(layout: CheckpointLayout) -> list[str]:
    """Every checkpoint tensor holding routed-expert weights (fused or one per expert)."""
    keys = []
    for layer in layout.layers:
        for param in layer.experts.values():
            keys += [param.fused] if param.fused else [k for e in sorted(param.parts) for k in param.keys(e)]
    return keys


def read_once(path: Path, layout: CheckpointLayout, keys: list[str]) -> None:
    """Copy every expert tensor's bytes from the page cache into one reused buffer (plain reads).

    Not `safe_open(...).get_tensor`: it maps the file and returns a view without touching the
    bytes, so it would time almost nothing.
    """
    ranges = defaultdict(list)
    for key in keys:
        stored = layout.tensors[key]
        ranges[stored.file].append((stored.start, stored.end - stored.start))
    buffer = memoryview(bytearray(max(n for rs in ranges.values() for _, n in rs)))
    for file, file_ranges in ranges.items():
        with open(path / file, "rb", buffering=0) as fh:
            for start, length in sorted(file_ranges):
                fh.seek(start)
                fh.readinto(buffer[:length])


def rss_anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def drop_page_cache(path: Path, files: list[str]) -> None:
    """Evict the shards from the page cache (posix_fadvise, no root needed; a host-side cache of a
    virtual disk may still serve them faster than a real disk)."""
    for file in files:
        fd = os.open(path / file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[[], object], prepare: Callable[[], None]) -> tuple[float, float]:
    """(wall, cpu) seconds of fn(); cpu time (this process, all threads, user + system) is what
    to compare on a loaded machine, where other processes stretch the wall time."""
    prepare()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def peak_memory(fn: Callable[[], object]) -> int:
    """Peak anonymous memory of fn() above the level before it (sampled every millisecond)."""
    base, peak, done = rss_anon(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    fn()
    done.set()
    sampler.join()
    return max(0, max(peak[0], rss_anon()) - base)


def peak_in_fresh_process(kind: str, path: str, criterion: str, workers: int) -> int:
    """peak_memory of one read or score run, in a process that has allocated nothing else."""
    layout = CheckpointLayout(path)
    keys = expert_keys(layout)
    if kind == "read":
        return peak_memory(lambda: read_once(Path(path), layout, keys))
    return peak_memory(lambda: score_checkpoint(path, criterion, workers=workers))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="A stock safetensors checkpoint folder (default: build one).")
    parser.add_argument("--criterion", default="aimer")
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--workers", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}),
        help="Scoring worker threads to time (default: 1 and one per core).",
    )  # fmt: skip
    parser.add_argument(
        "--cache", nargs="+", choices=("warm", "cold"), default=["warm", "cold"],
        help="Page-cache states to measure; cold evicts the shards before every run.",
    )  # fmt: skip
    args = parser.parse_args()
    path = Path(args.model) if args.model else build(args)
    layout = CheckpointLayout(path)
    keys = expert_keys(layout)
    nbytes = sum(layout.tensors[k].end - layout.tensors[k].start for k in keys)
    layer_bytes = nbytes / len(layout.layers)
    expert_bytes = layer_bytes / layout.layers[0].num_experts
    print(f"model: {path}\n  {layout.moe.model_type}, {len(layout.layers)} MoE layers x "
          f"{layout.layers[0].num_experts} experts; routed-expert bytes {nbytes / 2**20:.1f} MiB "
          f"({layer_bytes / 2**20:.1f} MiB per layer, {expert_bytes / 2**20:.2f} MiB per expert)")  # fmt: skip
    files = sorted({layout.tensors[k].file for k in keys})
    read_once(path, layout, keys)  # warm-up (imports, page cache)
    score_checkpoint(path, args.criterion)
    setup = min(timed(lambda: CheckpointLayout(path), lambda: None)[0] for _ in range(args.repeats))
    print(f"fixed cost in every score: config, meta model, headers and key mapping {setup:.3f}s")
    ratios = {}
    for cache in args.cache:
        prepare = (lambda: drop_page_cache(path, files)) if cache == "cold" else (lambda: None)
        reads, scores = [], defaultdict(list)
        for _ in range(args.repeats):
            reads.append(timed(lambda: read_once(path, layout, keys), prepare))
            for w in args.workers:
                scores[w].append(
                    timed(lambda w=w: score_checkpoint(path, args.criterion, workers=w), prepare)
                )
        read_wall, read_cpu = min(reads)
        print(f"[{cache} page cache] read the expert bytes once (plain reads): best {read_wall:.3f}s of "
              f"{args.repeats} ({nbytes / read_wall / 2**30:.2f} GiB/s), cpu {read_cpu:.3f}s")  # fmt: skip
        for w in args.workers:
            score_wall, score_cpu = min(scores[w])
            ratios[cache, w] = (score_wall / read_wall, score_cpu / read_cpu)
            print(f"[{cache} page cache] score_checkpoint({args.criterion!r}, workers={w}) incl. the fixed cost: "
                  f"best {score_wall:.3f}s ({nbytes / score_wall / 2**30:.2f} GiB/s), cpu {score_cpu:.3f}s")  # fmt: skip
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(1, maxtasksperchild=1) as pool:  # a fresh process per measurement
        peaks = {
            kind: pool.apply(peak_in_fresh_process, (kind, str(path), args.criterion, max(args.workers)))
            for kind in ("read", "score")
        }
    print(f"peak extra anonymous memory (fresh process, RssAnon sampled every ms): read {peaks['read'] / 2**20:.1f} MiB, "
          f"score {peaks['score'] / 2**20:.1f} MiB; one layer's experts {layer_bytes / 2**20:.1f} MiB, "
          f"one expert {expert_bytes / 2**20:.2f} MiB, all experts {nbytes / 2**20:.1f} MiB")  # fmt: skip
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for (cache, w), (wall, cpu) in ratios.items():
        print(f"[{cache} page cache, {w} worker{'s' * (w > 1)}] scoring / read ratio: {wall:.3f}x wall "
              f"({cpu:.3f}x cpu time)")  # fmt: skip


if __name__ == "__main__":
    main()
