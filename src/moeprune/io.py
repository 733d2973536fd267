"""Loading checkpoints with clear errors, and atomic saving of results.

A save writes everything (weights, config, tokenizer, plan, report) into a temporary sibling
folder and renames it into place, so an interrupted save never leaves a half-written result and
an existing folder is only replaced when the user asked for it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .errors import MoePruneError
from .models import MoEModel, check_config

MOEPRUNE_CONFIG = "moeprune.json"  # marks a checkpoint in moeprune's own format


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype or torch.float32
    table = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    if dtype not in table:
        raise MoePruneError(f"unknown dtype {dtype!r}; use one of {', '.join(table)}")
    return table[dtype]


def check_model_path(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise MoePruneError(f"model path {str(path)!r} does not exist; pass a local checkpoint folder")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise MoePruneError(
            f"{str(path)!r} has no config.json; pass a transformers checkpoint folder (the one save_pretrained wrote)"
        )
    return path


def load_config(path: str | Path):
    path = check_model_path(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:
        raise MoePruneError(f"cannot read {path / 'config.json'}: {exc}") from exc
    check_config(config)
    return config


def load_model(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    device_map: str | None = None,
) -> tuple[PreTrainedModel, object | None]:
    """Load a stock or moeprune-format checkpoint in eval mode, plus its tokenizer if it has one.

    `device_map="auto"` (accelerate) spreads a stock checkpoint over every visible GPU.
    """
    path = check_model_path(path)
    if (path / MOEPRUNE_CONFIG).is_file():
        from .checkpoint import load_pretrained  # moeprune's own format (non-uniform results)

        if device_map:
            raise MoePruneError(
                f"{str(path)!r} is in moeprune's own format, which loads on one device; --device auto "
                "(accelerate's device_map) splits stock checkpoints only: use --device cuda or cpu"
            )

        model = load_pretrained(path, dtype=resolve_dtype(dtype), device=device)
    else:
        load_config(path)
        placed = device_map or ({"": str(device)} if device else None)  # weights go straight to the GPU
        extra = {"device_map": placed} if placed else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype), **extra)
        if device_map:
            check_not_offloaded(model)
    model.eval()
    return model, load_tokenizer(path)


def check_not_offloaded(model: PreTrainedModel) -> None:
    """Refuse a model accelerate spilled to CPU or disk: it leaves those weights on the meta device
    and loads them only inside each module's own forward, while moeprune reads expert weights
    and router rows directly (routed compute, masks, surgery)."""
    offloaded = sorted({name.rsplit(".", 1)[0] for name, p in model.named_parameters() if p.is_meta})
    if offloaded:
        raise MoePruneError(
            f"the model does not fit on the GPUs: accelerate offloaded {len(offloaded)} modules to CPU or disk "
            f"(first: {offloaded[0]}), and moeprune needs every weight on a device; observe layer by layer "
            "with --sequential, prune with --no-load, or use more GPUs"
        )


def load_tokenizer(path: str | Path):
    path = Path(path)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / n).exists() for n in names):
        return None
    return AutoTokenizer.from_pretrained(path)


def check_output_dir(path: str | Path, overwrite: bool) -> Path:
    """Refuse an existing output folder unless overwriting was asked for (nothing is written)."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise MoePruneError(f"output folder {str(path)!r} already exists; choose another or pass --overwrite")
    if path.exists() and not path.is_dir():
        raise MoePruneError(f"output path {str(path)!r} exists and is not a folder")
    return path


def atomic_write_dir(out_dir: str | Path, write: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Run `write(tmp_dir)` then move tmp_dir to out_dir in one rename (replacing only on success)."""
    out_dir = check_output_dir(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        if out_dir.exists():
            backup = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, backup)
            os.replace(tmp, out_dir)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def write_json(path: str | Path, data: object) -> None:
    """Atomic JSON write (temp file + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def stock_expressible(moe: MoEModel) -> bool:
    """Whether a stock config can describe the model (same experts and widths in every layer)."""
    return moe.is_uniform() and not getattr(moe.model, "moeprune_custom", False)


def save_stock(model: PreTrainedModel, directory: Path, tokenizer=None) -> None:
    """save_pretrained for results a stock config expresses; refuse the others with a pointer."""
    moe = MoEModel(model)
    if not stock_expressible(moe):
        counts = {m.index: m.num_experts for m in moe.layers}
        raise MoePruneError(
            f"per-layer expert counts differ ({counts}): a stock transformers config cannot express this model; "
            "save it in moeprune's format with moeprune.save_pretrained (reload with moeprune.load_pretrained)"
        )
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
