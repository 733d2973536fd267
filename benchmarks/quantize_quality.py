"""Prune, quantize, or both, at equal bytes on disk? One table on a trained demo model.

The evidence behind docs/quantization.md. Every row is a checkpoint written to disk, by
`moeprune prune` (with `--quantize` where it says so) or, for "quantize only", by the same
llm-compressor driver `prune --quantize` runs (quantize/oneshot.py; prune refuses sparsity 0), then
read back with `moeprune.load_pretrained` and scored on the held-out eval split against the
full-precision model (benchmarks/quality.py's Demo and demo.run.DomainEval: ESAP, NLL per domain).

The budgets are the W4A16 rows' bytes on disk (quantize only, prune + W4A16 at each sparsity); at
each, `prune --target-size` solves the bf16 prune-only and the prune + W8A16 rows (the largest
plan that fits, or the solver's refusal when none does). Every full-precision part is bf16.

    python benchmarks/quantize_quality.py --quick --group-size 32
    python benchmarks/quantize_quality.py --quick --family deepseek_v3 --group-size 32

`--precision add` (or `only`, beside the rows it is compared with) adds per-layer precision rows
(`--quantize auto:w4a16,w8a16`): see `precision`.

Each row costs a prune and a quantization (about 30 s on the quick model, 2 CPU cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moeprune.checkpoint import load_pretrained
from moeprune.demo.corpus import DOMAINS
from moeprune.demo.train import FAMILIES
from moeprune.errors import MoePruneError
from moeprune.quantize.oneshot import quantize_folder
from moeprune.quantize.schemes import QuantizeOptions
from quality import Demo, load_demo

ROOT = Path(__file__).resolve().parents[1]
ROUTED = ".mlp.experts."  # routed experts' tensors (a shared expert is mlp.shared_experts.)
AUTO = "auto:w4a16,w8a16"  # per-layer precision (`--precision`): each MoE layer's experts in one of these


@dataclass
class Row:
    """One line of the table: how the checkpoint was made, its bytes and its scores."""

    name: str
    flags: str  # the prune flags that make it (beside the common ones), or how it was made
    budget: str = ""  # the W4A16 row whose bytes it had to fit in
    sparsity: float | None = None
    routed_bytes: int | None = None
    total_bytes: int | None = None
    metrics: dict = field(default_factory=dict)  # domain -> {"esap", "nll"}
    refused: str = ""  # the solver's one line when no plan fits

    def cells(self) -> list[str]:
        if self.refused:
            return [
                self.name,
                self.budget,
                "-",
                "-",
                "-",
                *["-"] * len(DOMAINS),
                "-",
                f"`{self.flags}`: {self.refused}",
            ]
        esap = sum(m["esap"] for m in self.metrics.values()) / len(self.metrics)
        sparsity = "" if self.sparsity is None else f"{self.sparsity:.1%}"
        return [
            self.name,
            self.budget,
            sparsity,
            f"{self.routed_bytes:,}",
            f"{self.total_bytes:,}",
            *[f"{self.metrics[d]['nll']:.3f}" for d in DOMAINS],
            f"{esap:.4f}",
            f"`{self.flags}`",
        ]


HEAD = [
    "row",
    "budget",
    "expert sparsity",
    "routed-expert bytes",
    "bytes on disk",
    *[f"NLL {d}" for d in DOMAINS],
    "ESAP",
    "command",
]


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    return "\n".join(lines + ["| " + " | ".join(r.cells()) + " |" for r in rows])


def weight_bytes(folder: Path) -> tuple[int, int]:
    """(routed-expert tensor bytes, bytes of all weight files on disk) of a saved checkpoint, from
    the safetensors headers (no tensor is read)."""
    routed = total = 0
    for path in sorted(folder.glob("*.safetensors")):
        total += path.stat().st_size
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name != "__metadata__" and ROUTED in name:
                start, end = entry["data_offsets"]
                routed += end - start
    return routed, total


class Runner:
    """Makes the checkpoints (in `work`) and scores them against the full model's distributions."""

    def __init__(self, demo: Demo, args: argparse.Namespace, work: Path):
        self.demo, self.args, self.work = demo, args, work
        self.evals = demo.evals()
        settings = demo.settings
        self.common = [
            "--criterion", args.criterion,
            *[a for f in demo.files("train", DOMAINS) for a in ("--data", f)],
            "--samples", str(settings.calibration_samples), "--max-length", str(settings.max_length),
            "--seed", "0", "--save-dtype", "bf16", "--threads", str(args.threads), "--quiet", "--overwrite",
        ]  # fmt: skip

    def quant_flags(self, scheme: str) -> list[str]:
        a = self.args
        return ["--quantize", scheme, "--quant-method", a.method, "--quant-group-size", str(a.group_size)]

    def command(self, out: Path, flags: list[str]) -> list[str]:
        command = [sys.executable, "-m", "moeprune", "prune", str(self.demo.model_dir), "--output", str(out)]
        return command + (
            self.common + flags + (["--quant-python", self.args.python] if "--quantize" in flags else [])
        )

    def prune(self, name: str, flags: list[str], budget: str = "") -> Row:
        out = self.work / name.replace(" ", "_").replace("%", "").replace("+", "").replace(":", "_")
        row = Row(name, " ".join(flags), budget)
        if not (self.args.reuse and (out / "report.json").is_file()):  # else made by an earlier run
            done = subprocess.run(self.command(out, flags), capture_output=True, text=True, check=False)
            if done.returncode == 2 and "--target-size" in flags:  # no plan fits: the solver's line
                row.refused = done.stderr.strip().splitlines()[-1].removeprefix("moeprune: error: ")
                return row
            if done.returncode != 0:
                raise SystemExit(f"{name}: prune failed ({done.returncode}):\n{done.stderr[-3000:]}")
        report = json.loads((out / "report.json").read_text())
        row.sparsity = report["sparsity"]
        chosen = report.get("quantization", {}).get("precision", {}).get("chosen")
        if chosen:  # per-layer precision: which scheme each MoE layer's experts got
            row.name += " (" + ", ".join(f"layer {k} {v}" for k, v in chosen.items()) + ")"
        try:
            return self.score(row, out)
        except MoePruneError as error:  # saved but not readable back (e.g. every expert kept is picked)
            row.refused = f"saved ({weight_bytes(out)[1]:,} bytes), not scored: {str(error).splitlines()[0]}"
            return row

    def quantize_only(self, scheme: str) -> tuple[Row, Row | None]:
        """The whole model in bf16, quantized by prune --quantize's llm-compressor driver on the
        same calibration data; also the bf16 copy's row (with w4a16, the first)."""
        bf16, folder = self.work / "full_bf16", self.work / f"full_{scheme}"
        if not bf16.is_dir():
            copy.deepcopy(self.demo.moe.model).to(torch.bfloat16).save_pretrained(bf16)
            self.demo.tokenizer.save_pretrained(bf16)
        row = None  # the bf16 copy's own row, once
        if scheme == "w4a16":
            row = self.score(Row("bf16, full model", "(the model saved in bf16)", sparsity=0.0), bf16)
        config = folder / "config.json"
        if self.args.reuse and config.is_file() and "quantization_config" in config.read_text():
            return self.score(Row(f"{scheme} only", self.only_flags(scheme), sparsity=0.0), folder), row
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(bf16, folder)
        calibration = self.demo.data("train", DOMAINS, self.demo.settings.calibration_samples)
        samples = [list(map(int, s.input_ids)) for s in calibration.samples]
        options = QuantizeOptions(scheme, self.args.method, self.args.group_size, self.args.python)
        quantize_folder(self.args.python, folder, options, samples, "5GB")
        return self.score(Row(f"{scheme} only", self.only_flags(scheme), sparsity=0.0), folder), row

    def every_layer_at(self, sparsity: float) -> dict[str, int]:
        """prune --dry-run's predicted bytes at `sparsity` with every MoE layer's experts in each
        scheme of AUTO (bounds: the safetensors headers are allowed for), e.g. {"w4a16": 193216, ...}."""
        flags = [
            "--sparsity",
            str(sparsity),
            *self.quant_flags(AUTO),
            "--target-size",
            str(10**12),
            "--dry-run",
        ]
        done = subprocess.run(
            self.command(self.work / "dry_run", flags), capture_output=True, text=True, check=True
        )
        line = next(x for x in (done.stdout + done.stderr).splitlines() if x.startswith("per-layer"))
        return {
            s: int(b.replace(",", "")) for s, b in re.findall(r"(\w+) [\d.]+ \w*B \(([\d,]+) bytes\)", line)
        }

    def quantize_only_predicted(self) -> int:
        """prune --dry-run's predicted bytes of W4A16 of the whole model (the grid's sparsity-0
        point): the least `--target-size` under which quantizing only is a candidate (the byte
        model bounds the safetensors headers, so it lies above the bytes the driver writes)."""
        flags = [*self.quant_flags(AUTO), "--target-size", str(10**12), "--dry-run"]
        done = subprocess.run(
            self.command(self.work / "dry_run", flags), capture_output=True, text=True, check=True
        )
        found = re.search(r"sparsity 0: every layer in one scheme w4a16 ([\d,]+)", done.stdout + done.stderr)
        assert found is not None, done.stdout + done.stderr
        return int(found[1].replace(",", ""))

    def only_flags(self, scheme: str) -> str:
        return " ".join(self.quant_flags(scheme)) + " (llm-compressor driver, no prune)"

    def score(self, row: Row, folder: Path) -> Row:
        row.routed_bytes, row.total_bytes = weight_bytes(folder)
        model = load_pretrained(folder).eval()
        row.metrics = {d: e.score(nullcontext, model=model) for d, e in self.evals.items()}
        print(f"{time.strftime('%H:%M:%S')} | " + " | ".join(row.cells()) + " |", file=sys.stderr, flush=True)
        return row


def run(runner: Runner, sparsities: list[float], bf16_sparsities: list[float]) -> list[Row]:
    """The rows: the W4A16 anchors (quantize only, then prune + W4A16 per sparsity); at each
    anchor's bytes the bf16 prune-only plan the solver finds (or its refusal); bf16 prune-only rows
    at `bf16_sparsities` (what pruning alone reaches); at each anchor's bytes prune + W8A16; and
    W8A16 of the whole model. Cheapest first after the anchors."""
    only, bf16 = runner.quantize_only("w4a16")
    rows = [r for r in (bf16, only) if r is not None]
    anchors = [only]
    for s in sparsities:
        flags = ["--sparsity", str(s), *runner.quant_flags("w4a16")]
        anchors.append(runner.prune(f"reap {s:.0%} + w4a16", flags))
    rows += anchors[1:]
    targets = [(["--target-size", str(a.total_bytes)], f"= {a.name}", a.name) for a in anchors]
    rows += [runner.prune(f"bf16 prune only at {name}", flags, budget) for flags, budget, name in targets]
    rows += [runner.prune(f"reap {s:.0%}, bf16", ["--sparsity", str(s)]) for s in bf16_sparsities]
    w8 = runner.quant_flags("w8a16")
    rows += [
        runner.prune(f"prune + w8a16 at {name}", [*flags, *w8], budget) for flags, budget, name in targets
    ]
    rows.append(runner.quantize_only("w8a16")[0])
    return rows


def precision(runner: Runner, sparsities: list[float], only: Row) -> list[Row]:
    """The per-layer precision rows (`--quantize auto:w4a16,w8a16`): at each sparsity, a target
    halfway between the dry run's predictions with every layer's experts at w4a16 and at w8a16
    (so the choice has bytes to spend and cannot buy every layer w8a16); then, without `--sparsity`
    (the sparsity chosen with the schemes), the joint grid and the joint evo search (experts and
    schemes per layer searched together, seeded with the grid, on the demo's search split and
    search budget), and the joint mixed search (each layer's mixed forms and scheme together) at the
    bytes of W4A16 of the whole model on disk and at the byte model's prediction of them (where
    quantizing only is itself a candidate)."""
    rows = []
    for s in sparsities:
        bounds = runner.every_layer_at(s)
        target = (bounds["w4a16"] + bounds["w8a16"]) // 2
        flags = ["--sparsity", str(s), "--target-size", str(target), *runner.quant_flags(AUTO)]
        budget = f"halfway: {bounds['w4a16']:,} / {bounds['w8a16']:,} predicted"
        rows.append(runner.prune(f"reap {s:.0%} + {AUTO}", flags, budget))
    settings = runner.demo.settings
    search = [a for f in runner.demo.files("search", DOMAINS) for a in ("--search-data", f)]
    evo = ["--allocation", "evo", *search, "--search-samples", str(settings.search_samples),
           "--population", str(settings.population), "--elites", "4", "--generations", str(settings.generations)]  # fmt: skip
    predicted = runner.quantize_only_predicted()
    for target, budget, tag in (
        (only.total_bytes, f"= {only.name}", ""),
        (predicted, f"= {only.name}, predicted", " (predicted)"),
    ):
        flags = ["--target-size", str(target), *runner.quant_flags(AUTO)]
        rows.append(runner.prune(f"{AUTO}, sparsity chosen{tag}", flags, budget))
        rows.append(runner.prune(f"{AUTO}, evo{tag}", [*flags, *evo], budget))
        mixed = ["--method", "mixed", *evo]  # forms (whole, narrowed, novice, dropped) and schemes together
        rows.append(runner.prune(f"{AUTO}, mixed evo{tag}", [*flags, *mixed], budget))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", choices=FAMILIES, default="qwen3_moe")
    parser.add_argument("--quick", action="store_true", help="the quick demo model and settings")
    parser.add_argument("--spec", default="", metavar="KEY=VALUE,...", help="fields of the demo spec changed")
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument(
        "--bf16-sparsity", type=float, nargs="+", default=[0.25, 0.5, 0.75], help="bf16 prune-only rows"
    )
    parser.add_argument(
        "--reuse", action="store_true", help="score the checkpoints an earlier run left in --work"
    )
    parser.add_argument("--criterion", default="reap")
    parser.add_argument("--method", choices=("gptq", "rtn"), default="gptq")
    parser.add_argument(
        "--group-size", type=int, default=32, help="must divide every quantized Linear's input width"
    )
    parser.add_argument(
        "--python", default=str(ROOT / ".venv-quant" / "bin" / "python"), help="llm-compressor's Python"
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="keep the checkpoints here [default: a temporary folder]"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--precision",
        choices=("off", "add", "only"),
        default="off",
        help=f"per-layer precision rows ({AUTO}): added to the table, or only they beside their anchors "
        "(W4A16 only, reap S %% + W4A16; with --reuse those are scored, not made again)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    demo = load_demo(args.family, args.quick, args.spec, args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        runner = Runner(demo, args, work)
        full = Row("full model (reference)", "(the trained fp32 model)", sparsity=0.0)
        full.routed_bytes, full.total_bytes = weight_bytes(demo.model_dir)
        full.metrics = {d: e.score(nullcontext) for d, e in runner.evals.items()}
        if args.precision == "only":
            only = runner.quantize_only("w4a16")[0]
            flags = [["--sparsity", str(s), *runner.quant_flags("w4a16")] for s in args.sparsity]
            rows = [
                full,
                only,
                *[runner.prune(f"reap {s:.0%} + w4a16", f) for s, f in zip(args.sparsity, flags)],
            ]
        else:
            rows = [full, *run(runner, args.sparsity, args.bf16_sparsity)]
        if args.precision != "off":
            rows += precision(runner, args.sparsity, next(r for r in rows if r.name == "w4a16 only"))
    print(
        f"model {demo.model_dir} ({args.family}{', quick' if args.quick else ''}), groups of {args.group_size}, {args.method}"
    )
    print("common prune flags: " + " ".join(a if "/" not in a else Path(a).name for a in runner.common))
    print(table(rows))
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
