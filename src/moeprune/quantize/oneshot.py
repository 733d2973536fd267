"""`prune --quantize`: the pruned model, just saved, quantized by llm-compressor's `oneshot` in the
quantization environment (driver.py in a subprocess of its Python), and its weights
replaced by the compressed-tensors ones in the same folder.

Why after saving: llm-compressor needs transformers 5.15-5.17 and compressed-tensors 0.19, which
moeprune's environment does not have, so the two meet through a checkpoint on disk, as moeprune
and vLLM do (evaluate/driver.py). The saved folder is still the temporary one of the atomic write,
so a failed quantization leaves no half-written result.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from moeprune.evaluate.driver import run_driver
from moeprune.quantize.pricing import IGNORE
from moeprune.quantize.schemes import QuantizeOptions

DRIVER = Path(__file__).with_name("driver.py")
TIMEOUT_S = 24 * 3600.0  # a real model's GPTQ takes hours; the tiny ones of the tests, a minute
WEIGHTS = ("config.json", "model.safetensors", "model.safetensors.index.json")


def quantize_folder(
    python: str,
    folder: Path,
    options: QuantizeOptions,
    samples: list[list[int]],
    max_shard_size: int | str,
    moeprune_format: bool = False,
) -> dict[str, Any]:
    """Quantize the full-precision checkpoint in `folder` in place (its config and weights
    replaced; `moeprune_format`: a folder in moeprune's format, loaded through its modeling files
    and rewritten by names, see layout.py); returns what report.json records: the scheme, the library versions and the
    calibration tokens each kept expert computed on."""
    work = folder / ".moeprune-quantized"
    spec = {
        "model": str(folder),
        "output": str(work),
        "scheme": options.scheme,
        "method": options.method,
        "group_size": options.group,
        "samples": samples,
        "ignore": list(IGNORE),
        "max_shard_size": max_shard_size,
        "moeprune": moeprune_format,
    }
    if options.layer_schemes:  # per-layer precision: each layer's experts in its own scheme
        spec["layer_schemes"] = {str(k): v for k, v in options.layer_schemes.items()}
    out = run_driver(python, DRIVER, spec, TIMEOUT_S, "llm-compressor's oneshot", f" on {folder}")
    for name in WEIGHTS:
        (folder / name).unlink(missing_ok=True)
    for old in folder.glob("model-*.safetensors"):
        old.unlink()
    for new in sorted(work.iterdir()):
        if new.name in WEIGHTS or (new.name.startswith("model-") and new.suffix == ".safetensors"):
            shutil.move(str(new), folder / new.name)
        elif new.name == "recipe.yaml":  # llm-compressor's recipe: beside moeprune's recipe.json
            shutil.move(str(new), folder / "quantization_recipe.yaml")
    shutil.rmtree(work)
    counts: dict[str, list[int]] = out["tokens_per_expert"]
    return {
        "scheme": options.scheme,
        "method": options.method,
        "group_size": options.group if options.spec.grouped else None,
        "format": "compressed-tensors",
        "ignored": list(IGNORE),
        "calibration_tokens": out["tokens"],
        "tokens_per_expert": counts,
        "least_tokens_per_expert": min((min(c) for c in counts.values() if c), default=0),
        "versions": out["versions"],
        **(
            {"layer_schemes": {str(k): v for k, v in options.layer_schemes.items()}}
            if options.layer_schemes
            else {}
        ),
    }


def ignore_prefixes(folder: Path, prefixes: tuple[str, ...]) -> None:
    """Name the stored key `prefixes` (the MTP layers kept beside a quantized model, unquantized) in
    config.json's `quantization_config.ignore`, as "re:" patterns: a loader that builds those
    layers (vLLM's MTP drafts) then builds them unquantized, as they are stored, rather than
    looking for compressed-tensors codes that are not there."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or not prefixes:
        return
    ignore = list(quant.get("ignore") or [])
    ignore += [p for p in (f"re:{re.escape(root)}.*" for root in prefixes) if p not in ignore]
    quant["ignore"] = ignore
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
