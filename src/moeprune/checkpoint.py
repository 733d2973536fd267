"""moeprune's checkpoint format, for results a stock transformers config cannot express.

A folder with the usual `config.json`, safetensors weights and tokenizer, plus `moeprune.json`
that records, per MoE layer, how many experts it keeps (and their original ids), and for packed
layers (surgery/packed.py) which router positions are novices and each other expert's neuron
count. The config keeps the largest per-layer count and the full expert width, so transformers
builds a model that is at least as wide; `load_pretrained` then narrows and packs each layer to
its recorded shape and loads the weights strictly. Uniform results are saved as plain stock
checkpoints instead (no moeprune.json). Format version 2 adds the packed entries; files without
packed layers are still written as version 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.initialization import no_init_weights

from . import __version__
from .errors import MoePruneError
from .io import MOEPRUNE_CONFIG, check_model_path, save_stock, stock_expressible, write_json
from .models import MoEModel
from .surgery.drop import EXPERT_IDS_ATTR, drop_experts
from .surgery.packed import is_packed, pack_like, packed_structure, router_count

FORMAT = "moeprune-checkpoint"
FORMAT_VERSION = 2  # the newest version this moeprune reads and writes
PACKED_VERSION = 2  # first version with packed layers (novices, per-expert neuron counts)
WEIGHTS = "model.safetensors"


def save_pretrained(model: PreTrainedModel, directory: str | Path, tokenizer=None) -> str:
    """Write `model` into `directory`; returns "stock" or "moeprune" (the format used)."""
    directory = Path(directory)
    moe = MoEModel(model)
    if not any(is_packed(m) for m in moe.layers) and stock_expressible(moe):
        save_stock(model, directory, tokenizer)
        return "stock"
    field = moe.spec.count_field
    original = getattr(model.config, field)
    setattr(model.config, field, max(router_count(m) for m in moe.layers))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(directory)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(directory)
    finally:
        setattr(model.config, field, original)
    # transformers' internal (fused) tensor names: no conversion back to per-expert hub names
    save_model(model, str(directory / WEIGHTS), metadata={"format": "pt", "moeprune": FORMAT})
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    write_json(directory / MOEPRUNE_CONFIG, describe_structure(moe))
    return "moeprune"


def describe_structure(moe: MoEModel) -> dict:
    packed = any(is_packed(m) for m in moe.layers)
    return {
        "format": FORMAT,
        "format_version": PACKED_VERSION if packed else 1,
        "moeprune_version": __version__,
        "model_type": moe.model_type,
        "layers": [_layer_entry(m) for m in moe.layers],
    }


def _layer_entry(layer) -> dict:
    entry = {"layer": layer.index, "num_experts": router_count(layer), "expert_ids": layer.expert_ids}
    if is_packed(layer):
        entry["packed"] = packed_structure(layer)
    return entry


def read_structure(path: Path) -> dict:
    try:
        meta = json.loads((path / MOEPRUNE_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MoePruneError(f"cannot read {path / MOEPRUNE_CONFIG}: {exc}") from exc
    if meta.get("format") != FORMAT or meta.get("format_version", 0) > FORMAT_VERSION:
        raise MoePruneError(
            f"{path / MOEPRUNE_CONFIG} is not a moeprune checkpoint of a version this moeprune reads "
            f"(format {meta.get('format')!r} v{meta.get('format_version')}); upgrade moeprune"
        )
    return meta


def build_skeleton(path: Path, dtype: torch.dtype = torch.float32, meta: bool = False) -> PreTrainedModel:
    """The model structure a checkpoint describes, with uninitialised (or meta) weights."""
    config = AutoConfig.from_pretrained(path)
    if meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (path / MOEPRUNE_CONFIG).is_file():
        meta_info = read_structure(path)
        moe = MoEModel(model)
        layers = {entry["layer"]: entry for entry in meta_info["layers"]}
        drop_experts(moe, {m.index: _surplus(m, layers[m.index]["num_experts"]) for m in moe.layers})
        for m in moe.layers:
            setattr(m.block, EXPERT_IDS_ATTR, list(layers[m.index]["expert_ids"]))
            if "packed" in layers[m.index]:
                pack_like(m, layers[m.index]["packed"])
    return model


def _fill_tied(model: PreTrainedModel, missing: list[str], weights: Path) -> None:
    """safetensors stores one name per tied tensor: copy it into the partner it was tied to."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    pairs = list(tied.items()) if isinstance(tied, dict) else []
    state = model.state_dict()
    for name in missing:
        partner = next((a if b == name else b for a, b in pairs if name in (a, b)), None)
        if partner is None or partner in missing:
            raise MoePruneError(f"{weights} does not match {MOEPRUNE_CONFIG}: missing tensor {name!r}")
        with torch.no_grad():
            state[name].copy_(state[partner])
    if missing and getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def _surplus(layer, keep: int) -> list[int]:
    """Positions to cut so `keep` remain (group-balanced: weights are loaded afterwards anyway)."""
    groups, extra = layer.n_group, layer.num_experts - keep
    if groups <= 1:
        return list(range(keep, layer.num_experts))
    size = layer.num_experts // groups
    return [g * size + size - 1 - j for g in range(groups) for j in range(extra // groups)]


def load_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | None = None
) -> PreTrainedModel:
    """Reload any moeprune output: a stock checkpoint, or moeprune's format (exact weights)."""
    path = check_model_path(path)
    if not (path / MOEPRUNE_CONFIG).is_file():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return (model.to(device) if device else model).eval()
    model = build_skeleton(path, dtype)
    weights = path / WEIGHTS
    if not weights.is_file():
        raise MoePruneError(f"{path} has no {WEIGHTS}; it is not a complete moeprune checkpoint")
    missing, unexpected = load_model(model, str(weights), strict=False)
    if unexpected:
        raise MoePruneError(
            f"{weights} does not match {MOEPRUNE_CONFIG}: unexpected tensors {unexpected[:5]}"
        )
    _fill_tied(model, missing, weights)
    return (model.to(device) if device else model).eval()
