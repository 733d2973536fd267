"""Golden outputs: prove a refactoring changed no result, bit for bit.

    python scripts/golden.py record golden.json     # before the change
    python scripts/golden.py compare golden.json    # after it: every number and hash identical

It runs the command line (the stable contract) on the small trained fixture model for a handful
of configurations covering every criterion family, allocation and surgery method, and keeps
what they decide: scores, plans, the EvoESAP search's allocation and fitness history, and the
SHA-256 of every saved tensor. Timings, paths and versions are left out.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from moeprune.demo.train import CORPUS_SUBDIR, FIXTURE, get_demo_model

CONFIGS = {
    "reap-uniform-drop": ["--criterion", "reap", "--sparsity", "0.25"],
    "aimer-global-drop": ["--criterion", "aimer", "--sparsity", "0.5", "--allocation", "global"],
    "mone-global-novice": ["--criterion", "mone", "--sparsity", "0.25", "--method", "novice", "--allocation", "global"],
    "reap-neurons": ["--criterion", "reap", "--sparsity", "0.5", "--method", "neurons"],
    "tenp-trapezoid": ["--criterion", "tenp", "--sparsity", "0.5", "--method", "tenp", "--domains"],
    "frequency-evo": ["--criterion", "frequency", "--sparsity", "0.5", "--allocation", "evo", "--search",
                      "--population", "8", "--elites", "2", "--generations", "5"],
    "auto-uniform": ["--criterion", "auto", "--sparsity", "0.25", "--search"],
    "reap-no-load-drop": ["--criterion", "reap", "--sparsity", "0.25", "--no-load"],
    # the no-load pipeline writes stock widths only: super experts narrowed with the others, as before the guard
    "reap-no-load-neurons": ["--criterion", "reap", "--sparsity", "0.5", "--method", "neurons", "--no-load",
                             "--allow-super-experts"],
}  # fmt: skip
_DROP = ("timing_s", "timings_s", "model", "output", "command_line", "moeprune_version", "versions", "disk_bytes",
         "speedups")  # fmt: skip


def _strip(value):
    """Drop the fields that legitimately differ between runs (time, paths, versions)."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _DROP}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _tensor_hashes(folder: Path) -> dict[str, str]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = handle.get_tensor(name)
                out[name] = hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
    return out


def run_all() -> dict:
    model = get_demo_model(FIXTURE, progress=False, threads=1)
    corpus = model / CORPUS_SUBDIR
    domains = [str(corpus / f"{d}_train.jsonl") for d in ("code", "prose", "math")]
    search = str(corpus / "math_search.jsonl")
    moeprune = str(Path(sys.executable).with_name("moeprune"))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in CONFIGS.items():
            args = list(args)
            data = domains if "--domains" in args else [domains[0]]
            args = [a for a in args if a not in ("--domains", "--search")] + (
                ["--search-data", search, "--search-samples", "16"] if "--search" in CONFIGS[name] else []
            )
            out = Path(tmp) / name
            command = [moeprune, "prune", str(model), "--output", str(out), *args, "--samples", "64",
                       "--threads", "1", "--quiet", *[x for d in data for x in ("--data", d)]]  # fmt: skip
            subprocess.run(command, check=True, capture_output=True, text=True)
            entry = {
                "report": _strip(json.loads((out / "report.json").read_text())),
                "plan": _strip(json.loads((out / "plan.json").read_text())),
                "tensors": _tensor_hashes(out),
            }
            if (out / "search.json").exists():
                entry["search"] = _strip(json.loads((out / "search.json").read_text()))
            results[name] = entry
            print(f"{name}: {len(entry['tensors'])} tensors", flush=True)
    return results


def _diff(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}: only in one run" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += _diff(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"[:300]]


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "compare"):
        print("usage: python scripts/golden.py record|compare FILE.json", file=sys.stderr)
        return 2
    mode, path = sys.argv[1], Path(sys.argv[2])
    results = run_all()
    if mode == "record":
        path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        return 0
    differences = _diff(json.loads(path.read_text()), json.loads(json.dumps(results)))
    print("\n".join(differences[:50]) or "identical: every score, plan, search and tensor hash")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
