"""How fast, and how large, is each kind of moeprune result once vLLM serves it?

One run prunes a model to the same routed-parameter budget (``--sparsity``, default 0.5) with
every method moeprune has (uniform drop, global and evo per-layer counts, MoNE novices, ENP
neurons, TENP), then serves the base model and every result in ONE vLLM process (the same build,
the same kernels, the same machine state) and prints, per result:

- generated tokens/s of offline ``LLM.generate`` on fixed prompts (token ids of the calibration
  text, all ``--prompt-length`` long), greedy, exactly ``--new-tokens`` tokens each (EOS ignored),
  for each batch size of ``--batch-sizes``; the time covers prefill and decode of the whole batch;
- the ratio of those tokens/s to the base model's and to the uniform drop's;
- the weights vLLM holds, counted on the model vLLM built in its worker (``LLM.apply_model``),
  next to moeprune's prediction (``served_parameter_count``, the figure report.json's ``serving``
  part and the summary's "in vLLM" line give) and to the packed size on disk.

Why the timing is built this way: the machines this runs on are often shared (two cores, other
jobs), and a shared machine only ever slows a run down, in bursts. So every engine is built first
and warmed up (the first batches of a fresh engine run several times slower), then ``--repeats``
rounds each time every (batch size, model) pair once, the model order rotating per round; each
tokens/s figure is given as the median over rounds and the best (the fastest round). The ratios
printed are of the bests: a shared machine never makes a run faster, so the fastest round is the
engine's own speed, while on two busy cores the median measures the neighbours (measured: medians
at a fifth of the best while another vLLM ran beside it, bests within 5% of a quiet run). The JSON
also has the paired ratio, the median of per-round ratios (both sides timed in the same round, so
a slow spell longer than a round cancels); the script says when medians fell below 0.8x the best.

Why parameters are counted from the modules: vLLM's CPU build repacks every dense linear layer
(attention, the router, dense MLPs) into a oneDNN or packed-GEMM handle after loading and leaves
an empty ``weight`` parameter behind; those are counted at the layer's own partition sizes
(``output_size_per_partition x input_size_per_partition``; the router, replicated, at
``output_size x input_size``). On a GPU nothing is repacked and the parameters are counted as
they are. The KV cache is not weights and is left out. vLLM pads a
vocabulary to a multiple of 64 rows, which moeprune's prediction does not count (the demo model's
2,048 needs none).  "held / packed" compares parameters, i.e. bytes at one dtype: with
``--dtype auto`` vLLM serves a float32 checkpoint in bfloat16 (half the bytes on disk), which is
vLLM's choice, not a saving of the result.

    python benchmarks/serve_speed.py --vllm-python .venv-vllm/bin/python      # the demo model
    python benchmarks/serve_speed.py --model M --data calib.jsonl --kinds uniform,global,tenp
    python benchmarks/serve_speed.py --vllm-option enforce_eager=false          # CUDA graphs on a GPU

The script runs in moeprune's environment (it prunes there) and starts ``--vllm-python`` (an
environment with vLLM and moeprune, as ``moeprune serve-check`` does) on itself with ``--driver``:
that part imports vLLM and the standard library only, moeprune's plugin comes in through vLLM.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DOMAINS = ("code", "prose", "math")
# kind: how it is pruned (criterion, allocation, method); every one at the same --sparsity, which
# counts experts for the expert methods and routed-expert parameters for neurons and tenp, so that
# all of them keep the same routed-parameter budget
KINDS: dict[str, dict[str, Any]] = {
    "uniform": dict(criterion="reap", allocation="uniform", method="drop"),
    "global": dict(criterion="reap", allocation="global", method="drop"),
    "evo": dict(criterion="reap", allocation="evo", method="drop"),
    "novice": dict(criterion="mone", allocation="uniform", method="novice"),
    "neurons": dict(criterion="reap", allocation="uniform", method="neurons"),
    "tenp": dict(criterion="tenp", allocation="trapezoid", method="tenp"),
}
BASE = "base"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint folder (default: the demo model, trained on first use)")
    p.add_argument(
        "--data", action="append", default=[], help="calibration file (repeatable; default: the demo corpus)"
    )
    p.add_argument(
        "--search-data", action="append", default=[], help="evo's search data (default: the demo's)"
    )
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)}")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--samples", type=int, default=96, help="calibration samples")
    p.add_argument("--max-length", type=int, default=256, help="calibration tokens per sample")
    p.add_argument("--search-samples", type=int, default=16)
    p.add_argument("--population", type=int, default=8)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15, help="timed rounds after the warm-up")
    p.add_argument(
        "--dtype", default="auto", help="vLLM's dtype (auto: vLLM's own choice, bf16 for fp32 checkpoints)"
    )
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 27, help="KV cache per engine")
    p.add_argument(
        "--vllm-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vllm.LLM keyword (JSON)",
    )
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="build one engine at a time (GPU memory for one model only; ratios then compare different minutes)",
    )
    p.add_argument("--vllm-python", default=None, help="Python with vLLM and moeprune (default: this one)")
    p.add_argument("--outputs", default=None, help="keep the pruned results here (reused when already there)")
    p.add_argument("--json", default=None, help="write the measurements as JSON here")
    p.add_argument("--threads", type=int, default=None, help="torch threads while pruning")
    p.add_argument("--driver", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The driver: runs in vLLM's Python. vLLM and the standard library only.
# ---------------------------------------------------------------------------------------------


def held_weights(model: Any) -> dict[str, int]:
    """Parameters and bytes of the weights in the model vLLM built (each tensor once: tied
    embeddings share one). A layer whose weight vLLM's CPU build repacked into a GEMM handle
    (``cpu_linear``, an empty ``weight`` left behind) counts its logical partition size."""
    parameters = nbytes = repacked = 0
    seen: set[int] = set()
    for module in model.modules():
        for name, tensor in module._parameters.items():
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            count = tensor.numel()
            if count == 0 and name == "weight" and hasattr(module, "cpu_linear"):
                rows = getattr(module, "output_size_per_partition", None) or module.output_size
                columns = getattr(module, "input_size_per_partition", None) or module.input_size
                count = rows * columns  # a replicated layer (the router) has no partition sizes
                repacked += count
            parameters += count
            nbytes += count * tensor.element_size()
    return {"parameters": parameters, "bytes": nbytes, "repacked_parameters": repacked}


def _engine(path: str, spec: dict) -> Any:
    from vllm import LLM

    options = {
        "skip_tokenizer_init": True,
        "dtype": spec["dtype"],
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": spec["prompt_length"] + spec["new_tokens"],
        "max_num_seqs": max(spec["batch_sizes"]),
        "kv_cache_memory_bytes": spec["kv_cache_bytes"],
        "distributed_executor_backend": "uni",
        **spec["llm"],
    }
    return LLM(model=path, **options)


def _time_batch(engine: Any, prompts: list, params: Any, expected: int) -> float:
    start = time.perf_counter()
    results = engine.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - start
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    if generated != expected:  # ignore_eos and max_tokens fix the work; anything else is no measurement
        raise RuntimeError(f"generated {generated} tokens, expected {expected}")
    return took


def _measure(engines: dict[str, Any], spec: dict, out: dict, rounds: int) -> None:
    """Warm every engine at every batch size, then `rounds` rounds of every (batch, model) pair,
    the model order rotated each round; seconds go to out[name]["seconds"][batch] in round order."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    names = list(engines)
    for name in names:
        for batch in spec["batch_sizes"]:
            for _ in range(2):  # a fresh engine's first batches of a new shape run several times slower
                _time_batch(engines[name], prompts[:batch], params, batch * spec["new_tokens"])
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for batch in spec["batch_sizes"]:
            for name in order:
                took = _time_batch(engines[name], prompts[:batch], params, batch * spec["new_tokens"])
                out[name]["seconds"].setdefault(str(batch), []).append(took)


def driver(spec_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: timed as is
    import vllm

    spec = json.loads(Path(spec_path).read_text())
    out: dict[str, Any] = {"vllm_version": str(vllm.__version__), "models": {}}
    engines: dict[str, Any] = {}
    for name, path in spec["models"].items():
        engine = _engine(path, spec)
        out["models"][name] = {
            "architecture": engine.llm_engine.model_config.architectures[0],
            "held": engine.apply_model(held_weights)[0],
            "dtype": str(engine.llm_engine.model_config.dtype).removeprefix("torch."),
            "seconds": {},
        }
        if spec["one_at_a_time"]:
            _measure({name: engine}, spec, out["models"], spec["repeats"])
            del engine
            gc.collect()
        else:
            engines[name] = engine
    if engines:
        _measure(engines, spec, out["models"], spec["repeats"])
    Path(out_path).write_text(json.dumps(out))


# ---------------------------------------------------------------------------------------------
# The benchmark: runs in moeprune's Python.
# ---------------------------------------------------------------------------------------------


def _inputs(args: argparse.Namespace) -> tuple[Path, list[str], list[str], str]:
    """The model, its calibration and search files, and what it is (for the printout)."""
    if args.model:
        if not args.data:
            sys.exit("--model needs --data (calibration files)")
        return Path(args.model), args.data, args.search_data or args.data, str(args.model)
    from moeprune.demo.train import CORPUS_SUBDIR, DEMO, get_demo_model

    folder = get_demo_model(DEMO, progress=True)
    corpus = folder / CORPUS_SUBDIR
    data = args.data or [str(corpus / f"{d}_train.jsonl") for d in DOMAINS]
    search = args.search_data or [str(corpus / f"{d}_search.jsonl") for d in DOMAINS]
    return folder, data, search, f"the demo model ({folder.name})"


def prune_all(args: argparse.Namespace, model: Path, data: list[str], search: list[str], root: Path) -> dict:
    """Every requested kind pruned into root/<kind>, reusing a finished one (report.json present)."""
    from moeprune.config import DataOptions, PruneConfig, RunOptions, SearchConfig
    from moeprune.job import PruneRequest, prune_checkpoint

    options = DataOptions(sources=data, samples=args.samples, max_length=args.max_length)
    evo = SearchConfig(
        samples=args.search_samples, population=args.population, elites=2, generations=args.generations
    )
    paths = {}
    for kind in args.kinds:
        out = root / kind
        if not (out / "report.json").is_file():
            start = time.perf_counter()
            config = PruneConfig(sparsity=args.sparsity, search=evo, **KINDS[kind])
            prune_checkpoint(PruneRequest(
                model,
                out,
                config,
                data=options,
                search_data=search if config.allocation == "evo" else [],
                run=RunOptions(progress=False, overwrite=True),
            ))
            print(f"pruned {kind} in {time.perf_counter() - start:.0f} s", flush=True)
        paths[kind] = out
    return paths


def stored(path: Path) -> dict[str, int]:
    """Parameters and bytes of the tensors in a checkpoint's safetensors files (headers only)."""
    import struct

    parameters = nbytes = 0
    for shard in sorted(path.glob("*.safetensors")):
        with shard.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            parameters += count
            nbytes += entry["data_offsets"][1] - entry["data_offsets"][0]
    return {"parameters": parameters, "bytes": nbytes}


def prompts(model: Path, data: list[str], count: int, length: int) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids from the calibration text (a short sample is
    repeated to length), so every model gets the same work and routes real text."""
    from moeprune.checkpoint.load import load_tokenizer
    from moeprune.data.loading import load_data

    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        sys.exit(f"{model} has no tokenizer: the prompts are tokenized calibration text")
    samples = load_data(data, tokenizer, num_samples=count, max_length=length, seed=0).samples
    ids = [s.input_ids for s in samples if s.input_ids]
    if not ids:
        sys.exit("the calibration data gave no tokens for prompts")
    out = []
    for i in range(count):
        row = ids[i % len(ids)]
        out.append((row * (length // len(row) + 1))[:length])
    return out


def describe(path: Path) -> str:
    """Format and structure in a few words: what the vLLM kernel gets to run."""
    config = json.loads((path / "config.json").read_text())
    section = config.get("moeprune")
    if section is None:
        experts = (
            config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
        )
        width = config.get("moe_intermediate_size") or config.get("intermediate_size")
        return f"stock: {experts} experts x {width}"
    layers = section["layers"]
    counts = [sum(w is not None for w in layer["widths"]) for layer in layers]
    novices = sum(len(layer["novice"]) for layer in layers)
    widths = sorted({w for layer in layers for w in layer["widths"] if w is not None})
    shape = f"moeprune: experts {'/'.join(map(str, counts))}"
    if novices:
        shape += f" + {novices} novices"
    if len(widths) > 1:
        shape += f", widths {widths[0]}-{widths[-1]}"
    return shape


def _ratios(mine: list[float], other: list[float]) -> dict[str, float]:
    """My tokens/s over other's: of the fastest rounds (`best`), and the median of the per-round
    ratios (`paired`: both timed within the same round, so a slow spell shared by both cancels)."""
    return {"best": min(other) / min(mine), "paired": statistics.median(o / m for m, o in zip(mine, other))}


def summarize(spec: dict, served: dict, facts: dict) -> dict:
    """The table: per result its tokens/s (median, best), ratios and weights held vs predicted."""
    rows = []
    for name, result in served["models"].items():
        row: dict[str, Any] = {"result": name, **facts[name], "architecture": result["architecture"]}
        row["held"] = {**result["held"], "dtype": result["dtype"]}
        row["held_minus_predicted"] = result["held"]["parameters"] - facts[name]["predicted_parameters"]
        row["held_over_packed"] = result["held"]["parameters"] / facts[name]["stored"]["parameters"]
        row["tokens_per_second"] = {}
        row["vs_base"], row["vs_uniform"] = {}, {}
        for batch in map(str, spec["batch_sizes"]):
            seconds = result["seconds"][batch]
            tokens = int(batch) * spec["new_tokens"]
            row["tokens_per_second"][batch] = {
                "median": tokens / statistics.median(seconds),
                "best": tokens / min(seconds),
                "rounds": len(seconds),
            }
            for key, other in (("vs_base", BASE), ("vs_uniform", "uniform")):
                if other in served["models"]:
                    row[key][batch] = _ratios(seconds, served["models"][other]["seconds"][batch])
        rows.append(row)
    return {"vllm_version": served["vllm_version"], "settings": spec["settings"], "rows": rows}


def markdown(table: dict) -> str:
    """Two Markdown tables: throughput with ratios, then weights held."""
    batches = [str(b) for b in table["settings"]["batch_sizes"]]
    has_uniform = any(r["result"] == "uniform" for r in table["rows"])
    head = ["result", "served as", *[f"tok/s b={b}: median (best)" for b in batches], "x base (best)"]
    if has_uniform:
        head.append("x uniform (best)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table["rows"]:
        tps = row["tokens_per_second"]
        cells = [row["result"], row["shape"]]
        cells += [f"{tps[b]['median']:,.0f} ({tps[b]['best']:,.0f})" for b in batches]
        cells.append(" / ".join(f"{row['vs_base'][b]['best']:.2f}" for b in batches))
        if has_uniform:
            cells.append(" / ".join(f"{row['vs_uniform'][b]['best']:.2f}" for b in batches))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| result | on disk (packed) | predicted in vLLM | vLLM holds | held / packed |", "|---|---|---|---|---|"]  # fmt: skip
    for row in table["rows"]:
        held, disk = row["held"], row["stored"]
        lines.append(
            f"| {row['result']} | {disk['parameters']:,} params, {disk['bytes'] / 1e6:.2f} MB "
            f"| {row['predicted_parameters']:,} params "
            f"| {held['parameters']:,} params, {held['bytes'] / 1e6:.2f} MB ({held['dtype']}) "
            f"| {row['held_over_packed']:.3f} |"
        )
    return "\n".join(lines)


def _vllm_python(given: str | None) -> str:
    if given:
        return given
    try:
        import vllm  # noqa: F401
    except ImportError:
        sys.exit("this Python has no vLLM: pass --vllm-python (an environment with vLLM and moeprune)")
    return sys.executable


def _options(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.driver:
        driver(*args.driver)
        return
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown:
        sys.exit(f"unknown kind(s) {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    python = _vllm_python(args.vllm_python)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from moeprune.serve.vllm.layout import CPU_MOE_ALIGNMENT, served_parameter_count

    model, data, search, what = _inputs(args)
    work = Path(tempfile.mkdtemp(prefix="serve_speed_"))
    root = Path(args.outputs) if args.outputs else work / "outputs"
    paths = {BASE: model, **prune_all(args, model, data, search, root)}
    facts = {
        name: {
            "path": str(path),
            "shape": describe(path),
            "stored": stored(path),
            "predicted_parameters": served_parameter_count(path),  # what the plugin allocates
            # once loaded, vLLM's CPU kernel pads every expert width to a multiple of 32
            "predicted_cpu_parameters": served_parameter_count(path, alignment=CPU_MOE_ALIGNMENT),
        }
        for name, path in paths.items()
    }
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    settings = {
        "model": what,
        "sparsity": args.sparsity,
        "batch_sizes": batch_sizes,
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "dtype": args.dtype,
        "interleaved": not args.one_at_a_time,
    }
    spec = {
        "models": {name: str(path) for name, path in paths.items()},
        "prompts": prompts(model, data, max(batch_sizes), args.prompt_length),
        "llm": _options(args.vllm_option),
        "one_at_a_time": args.one_at_a_time,
        "kv_cache_bytes": args.kv_cache_bytes,
        **{k: settings[k] for k in ("batch_sizes", "prompt_length", "new_tokens", "repeats", "dtype")},
    }
    (work / "spec.json").write_text(json.dumps(spec))
    log = work / "vllm.log"
    print(f"serving {len(paths)} models in one vLLM process ({python}); log: {log}", flush=True)
    start = time.perf_counter()
    with log.open("w") as handle:
        done = subprocess.run(
            [python, __file__, "--driver", str(work / "spec.json"), str(work / "served.json")],
            stdout=handle,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        sys.exit(
            f"vLLM failed (exit {done.returncode}); its log and spec are kept in {work}; the end of it:\n{tail}"
        )
    served = json.loads((work / "served.json").read_text())
    spec["settings"] = settings
    table = summarize(spec, served, facts)
    table["seconds"] = time.perf_counter() - start
    print(
        f"\nvLLM {table['vllm_version']}, {what}, sparsity {args.sparsity}, dtype {args.dtype}; prompts of "
        f"{args.prompt_length} tokens, {args.new_tokens} greedy tokens each (EOS ignored); after a warm-up, "
        f"{args.repeats} {'interleaved ' if not args.one_at_a_time else ''}rounds: tokens/s median (best); "
        f"ratios of the bests, for b={'/'.join(map(str, batch_sizes))}\n"
    )
    print(markdown(table))
    busy = min(t["median"] / t["best"] for row in table["rows"] for t in row["tokens_per_second"].values())
    if busy < 0.8:
        print(
            f"\nthe machine was busy: a median fell to {busy:.2f}x its best; the medians measure the load, "
            "the bests the engine (the JSON has the paired per-round ratios too)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))
    shutil.rmtree(work)  # the pruned results too, unless --outputs kept them elsewhere; a failure keeps it


if __name__ == "__main__":
    main()
