"""Saving a pruned model: a stock checkpoint when the family's config can express it, moeprune's
format (docs/checkpoint-format.md) otherwise; one writer for both.

Both forms store every tensor under the name a stock checkpoint of the family uses
(checkpoint/names.py), in the dtype asked for (by default the model's), sharded like
`save_pretrained` (`model.safetensors`, or numbered shards and an index). moeprune's format adds
the per-layer structure and a custom model type to config.json and copies the self-contained
modeling file, so stock transformers loads it only with `trust_remote_code=True` and vLLM only
with moeprune's plugin: never with wrong shapes or random weights.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import torch
from transformers import PreTrainedModel

from moeprune.checkpoint import files, structure
from moeprune.checkpoint.names import disk_tensors
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.classes import is_wrapper, text_config_key
from moeprune.models.packed import is_packed, router_count
from moeprune.runtime.atomic import atomic_write_dir
from moeprune.runtime.device import resolve_dtype
from moeprune.serve.modeling_moeprune import MODELING_FILES
from moeprune.serve.moeprune_format import auto_model_class
from moeprune.serve.vllm_native import write_native

MODELING_SOURCE = Path(__file__).resolve().parents[1] / "serve"  # the modeling files copied into results


def stock_expressible(moe: MoEModel) -> bool:
    """Whether the family's stock config describes the model: same count and width everywhere."""
    return moe.is_uniform() and not any(is_packed(m) for m in moe.layers)


def model_dtype(model: PreTrainedModel) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


MTP_FIELDS = ("num_nextn_predict_layers",)  # DeepSeek-V3, GLM-4.5, MiMo: multi-token-prediction layers


def drop_mtp_layers(config) -> None:
    """Set the count of multi-token-prediction layers to 0, saying so: transformers never builds
    those layers (it skips their weights when loading), so moeprune has not observed, pruned or
    kept them, and a config still naming them would send vLLM's MTP drafts looking for weights
    that are not there, or that no longer match the pruned expert count."""
    text = config.get_text_config()
    for field in MTP_FIELDS:
        count = getattr(text, field, None)
        if isinstance(count, int) and count > 0:
            setattr(text, field, 0)
            logging.getLogger("moeprune").warning(
                f"the input's {count} multi-token-prediction layer(s) are not in the result (transformers does "
                f"not load them, so they were not pruned); its config says {field}=0: no MTP drafts"
            )


def write_checkpoint(
    model: PreTrainedModel,
    folder: str | Path,
    tokenizer=None,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = files.DEFAULT_MAX_SHARD_SIZE,
    keep_mtp: bool | None = None,
) -> str:
    """Write `model` into the existing folder `folder`; returns "stock" or "moeprune" (the format).

    The config's multi-token-prediction count is kept with `keep_mtp` (the caller adds the pruned
    MTP layers from the input's shards: `shards.rewrite.append_input_tensors`), else set to 0:
    quietly with False (the caller says why), with a warning with None (nothing was asked).

    Not atomic by itself: callers write into a temporary folder (atomic_write_dir) and rename it.
    """
    folder = Path(folder)
    moe = MoEModel(model)
    dtype = dtype or model_dtype(model)
    files.parse_size(max_shard_size)  # a bad size fails before anything is written
    stock = stock_expressible(moe)
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = str(dtype).removeprefix("torch.")
    for key in ("moeprune", "auto_map"):  # left over from loading a moeprune-format input
        if hasattr(config, key):
            delattr(config, key)
    if keep_mtp is None:
        drop_mtp_layers(config)
    elif not keep_mtp:
        for field in MTP_FIELDS:
            if getattr(config.get_text_config(), field, None):
                setattr(config.get_text_config(), field, 0)
    if stock:
        config.save_pretrained(folder)
    else:
        (folder / structure.CONFIG).write_text(
            json.dumps(moeprune_config(moe, config), indent=2, sort_keys=True) + "\n"
        )
        copy_modeling_files(folder)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)
    files.write_shards(folder, disk_tensors(moe, stock=stock), max_shard_size=max_shard_size, dtype=dtype)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return "stock" if stock else "moeprune"


# What a result never takes from its input: files it writes itself, weights, and the evidence a
# moeprune result already carries (an input that is itself a pruned result has its own).
EVIDENCE_FILES = (
    "plan.json",
    "recipe.json",
    "report.json",
    "report.md",
    "search.json",
    "README.md",
    "moeprune.log",
    "density.png",
    "search_curve.png",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def carry_input_files(source: str | Path, folder: str | Path) -> list[str]:
    """Copy the input's other top-level files into the result, those it has not written itself:
    tokenizer and chat template, generation and processor configs, licence, custom code. A result
    must load and serve like its input without the user copying anything by hand, whichever
    pipeline made it and whether or not the prune read any text. Returns the names copied."""
    source, folder = Path(source), Path(folder)
    skip = {structure.CONFIG, files.INDEX, structure.LEGACY_FILE, *EVIDENCE_FILES, *MODELING_FILES}
    copied = []
    for item in sorted(source.iterdir()):
        name = item.name
        if not item.is_file() or name.startswith(".") or name in skip or name.endswith(WEIGHT_SUFFIXES):
            continue
        if not (folder / name).exists():
            shutil.copy2(item, folder / name)
            copied.append(name)
    return copied


def copy_modeling_files(folder: Path) -> None:
    """The self-contained modeling files a moeprune-format result carries (trust_remote_code)."""
    for name in MODELING_FILES:
        if not (MODELING_SOURCE / name).is_file():  # pragma: no cover - a broken installation
            raise MoePruneError(
                f"moeprune's modeling file {MODELING_SOURCE / name} is missing; reinstall moeprune"
            )
        shutil.copyfile(MODELING_SOURCE / name, folder / name)


def moeprune_config(moe: MoEModel, config) -> dict:
    """config.json of a moeprune-format result: the family's fields plus the structure, a custom
    model type, the plugin architecture and auto_map (docs/checkpoint-format.md)."""
    data = config.to_dict()
    base = moe.model_type
    arch = f"{structure.ARCHITECTURE_PREFIX}{type(moe.model).__name__}"  # what vLLM's plugin registers
    config_class = f"{structure.ARCHITECTURE_PREFIX}{type(config).__name__}"
    own_config = getattr(type(moe.model), "config_class", None)
    # the class stock transformers builds: the plain name, or one per (causal LM, config) pair when
    # the family runs another family's causal LM on its own config (sarvam_mla, sarvam_moe)
    model_class = auto_model_class(
        type(moe.model).__name__, type(config).__name__, own_config.__name__ if own_config else None
    )
    module = structure.MODELING_FILE.removesuffix(".py")
    key = text_config_key(config)  # a wrapper keeps the language model's fields in a sub-config
    (data[key] if key else data)[moe.spec.count_field] = max(router_count(m) for m in moe.layers)
    auto = {"AutoConfig": f"{module}.{config_class}", "AutoModelForCausalLM": f"{module}.{model_class}"}
    if is_wrapper(config):  # loaded as an image-text-to-text model too, like the stock wrapper
        auto["AutoModelForImageTextToText"] = f"{module}.{model_class}"
    data.update(
        model_type=structure.MODEL_TYPE_PREFIX + base,
        architectures=[arch],
        auto_map=auto,
        moeprune=structure.describe(moe),
    )
    return data


def save_pretrained(
    model: PreTrainedModel,
    directory: str | Path,
    tokenizer=None,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = files.DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
) -> str:
    """Save atomically into `directory` (an existing non-empty folder needs overwrite=True);
    returns "stock" or "moeprune", the format used."""
    directory = Path(directory)
    empty = directory.is_dir() and not any(directory.iterdir())
    chosen = resolve_dtype(dtype) if dtype is not None else None
    found: list[str] = []

    def write(tmp: Path) -> None:
        found.append(write_checkpoint(model, tmp, tokenizer, dtype=chosen, max_shard_size=max_shard_size))
        if found[0] == "moeprune":  # a constant-novice result: vLLM 0.33's own description too
            write_native(tmp)

    atomic_write_dir(directory, write, overwrite=overwrite or empty)
    return found[0]
