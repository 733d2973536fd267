"""Tiny checkpoints laid out as the releases are: the decoder stack transformers builds, plus what a
release ships beside it (multi-token-prediction layers, under the release's own names).

An MTP layer is a decoder layer of the family's own kind plus a few projections and norms. The
fixture builds the family's tiny model with one more layer, saves it (the stack in the family's
hub naming), then moves that last layer under the release's MTP prefix, adds the MTP-only
tensors under the names vLLM's MTP loaders read (`deepseek_mtp.py`, `glm4_moe_mtp.py`,
`qwen3_next_mtp.py`, `mimo_v2_mtp`), and writes the config the release ships (one layer fewer,
`num_nextn_predict_layers` where the family's config has it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from moeprune.models.factory import tiny_config, tiny_model
from moeprune.quant.testing import save_fp8_checkpoint


@dataclass(frozen=True)
class MtpRelease:
    """How one release family stores its MTP layer."""

    model_type: str
    prefix: str  # the MTP decoder layer's stored prefix, {n}: num_hidden_layers
    extras: tuple[str, ...]  # MTP-only tensors below the prefix (or whole names, starting with "/")
    count_field: str | None = "num_nextn_predict_layers"
    layer_kind: tuple[tuple[str, str], ...] = ()  # per-layer config lists set for the MTP layer


_DEEPSEEK_EXTRAS = (
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
)
_QWEN_EXTRAS = (
    "/mtp.fc.weight",
    "/mtp.norm.weight",
    "/mtp.pre_fc_norm_hidden.weight",
    "/mtp.pre_fc_norm_embedding.weight",
)

RELEASES = {
    "deepseek_v3": MtpRelease("deepseek_v3", "model.layers.{n}.", (*_DEEPSEEK_EXTRAS, "embed_tokens.weight")),
    "glm4_moe": MtpRelease("glm4_moe", "model.layers.{n}.", _DEEPSEEK_EXTRAS),
    "qwen3_next": MtpRelease("qwen3_next", "mtp.layers.0.", _QWEN_EXTRAS, None),
    # the multimodal release: a vision tower, the language model under model.language_model, mtp.*
    "qwen3_5_moe": MtpRelease("qwen3_5_moe", "mtp.layers.0.", _QWEN_EXTRAS, None),
    # DeepSeek-V4 in its reference naming (layers.{i}.ffn.experts.{j}.w1, mtp.{i}.*)
    "deepseek_v4": MtpRelease(
        "deepseek_v4", "mtp.0.", ("enorm.weight", "hnorm.weight", "e_proj.weight", "norm.weight")
    ),
    # MiMo-V2-Flash's MTP layer has a dense MLP (vLLM's mimo_v2_mtp.py): nothing to prune in it
    "mimo_v2_flash": MtpRelease(
        "mimo_v2_flash",
        "model.mtp.layers.0.",
        ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"),
        None,
        (("mlp_layer_types", "dense"),),
    ),
}


def _extra_shape(name: str, hidden: int, vocab: int) -> tuple[int, ...]:
    if name.endswith(("eh_proj.weight", "fc.weight")):
        return (hidden, 2 * hidden)
    if name.endswith(("head.weight", "embed_tokens.weight")):
        return (vocab, hidden)
    return (hidden,)


def write_mtp_release(
    model_type: str, folder: Path, seed: int = 0, fp8: bool = False, **overrides: Any
) -> Path:
    """A tiny `model_type` checkpoint with one MTP layer stored the release's way, in `folder`;
    with `fp8`, block-scaled as DeepSeek-V3 ships (the MTP layer's experts too). `overrides` are
    config fields for `tiny_config` (num_hidden_layers: the stack without the MTP layer)."""
    release = RELEASES[model_type]
    config = tiny_config(model_type, **overrides)
    text = config.get_text_config()  # a wrapper's (Qwen3.5-MoE) language model holds the stack
    n = text.num_hidden_layers
    kinds = dict(release.layer_kind)
    longer = {
        key: [*value, kinds.get(key, "full_attention" if "full_attention" in value else value[-1])]
        for key, value in text.to_dict().items()
        if isinstance(value, list) and len(value) == n and key != "architectures"
    }
    model = tiny_model(model_type, seed=seed, **{**overrides, "num_hidden_layers": n + 1, **longer})
    if fp8:
        save_fp8_checkpoint(model, folder)
    else:
        model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    stack = next(k[: k.index(f"layers.{n}.") + len(f"layers.{n}.")] for k in tensors if f"layers.{n}." in k)
    prefix = release.prefix.format(n=n)
    stored = {(prefix + k[len(stack) :] if k.startswith(stack) else k): v for k, v in tensors.items()}
    generator = torch.Generator().manual_seed(seed + 1)
    for extra in release.extras:
        name = extra[1:] if extra.startswith("/") else prefix + extra
        shape = _extra_shape(name, text.hidden_size, text.vocab_size)
        stored[name] = (1.0 if len(shape) == 1 else 0.0) + 0.2 * torch.randn(shape, generator=generator)
    save_file(
        {k: v.contiguous() for k, v in stored.items()},
        folder / "model.safetensors",
        metadata={"format": "pt"},
    )
    saved = json.loads((folder / "config.json").read_text())
    holder = saved.get("text_config", saved)
    holder["num_hidden_layers"] = n
    for key in longer:
        holder[key] = holder[key][:n]
    if release.count_field:
        holder[release.count_field] = 1
    (folder / "config.json").write_text(json.dumps(saved, indent=2))
    return folder


def mtp_keys(folder: Path, model_type: str) -> dict[str, torch.Tensor]:
    """The stored tensors of the checkpoint's MTP layer (its prefix and MTP-only whole names)."""
    release = RELEASES[model_type]
    saved = json.loads((folder / "config.json").read_text())
    n = saved.get("text_config", saved)["num_hidden_layers"]
    prefix = release.prefix.format(n=n)
    whole = {e[1:] for e in release.extras if e.startswith("/")}
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update({k: v for k, v in load_file(file).items() if k.startswith(prefix) or k in whole})
    return out


# LongCat-Flash as meituan-longcat/LongCat-Flash-Chat ships it (vLLM's longcat_flash.py and
# longcat_flash_mtp.py): per-expert tensors for the weighted experts only (`experts.0..n-1`; the
# zero experts have no weights, only their router rows: `router.classifier.weight` and
# `router.e_score_correction_bias` are n + zero_expert_num long), and one dense MTP layer under
# `model.mtp.*`: a single attention and a plain MLP (`transformer_layer.mlp`), no experts.
_LONGCAT_MTP_FROM_LAYER_0 = {  # MTP name below model.mtp.layers.0. -> the stack layer 0 tensor it is shaped as
    "input_layernorm.weight": "input_layernorm.0.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.0.weight",
    **{
        f"self_attn.{name}.weight": f"self_attn.0.{name}.weight"
        for name in (
            "q_a_proj",
            "q_a_layernorm",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_a_layernorm",
            "kv_b_proj",
            "o_proj",
        )
    },
    **{
        f"transformer_layer.mlp.{p}.weight": f"mlps.0.{p}.weight"
        for p in ("gate_proj", "up_proj", "down_proj")
    },
}


def write_longcat_release(folder: Path, seed: int = 0) -> Path:
    """A tiny LongCat-Flash checkpoint in the release's naming (see above), its zero experts made
    popular (tokens really reach them): what moeprune must prune without losing the MTP layer."""
    model = tiny_model("longcat_flash", seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            router = layer.mlp.router
            router.e_score_correction_bias[model.config.n_routed_experts :] += 0.3
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    n = model.config.n_routed_experts
    expert = re.compile(r"\.experts\.(\d+)\.")
    stored = {k: v for k, v in tensors.items() if not ((m := expert.search(k)) and int(m.group(1)) >= n)}
    generator = torch.Generator().manual_seed(seed + 1)

    def noisy(shape: torch.Size) -> torch.Tensor:
        return (1.0 if len(shape) == 1 else 0.0) + 0.2 * torch.randn(shape, generator=generator)

    mtp = "model.mtp.layers.0."
    for name, like in _LONGCAT_MTP_FROM_LAYER_0.items():
        stored[mtp + name] = noisy(tensors["model.layers.0." + like].shape)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    stored[mtp + "eh_proj.weight"] = noisy(torch.Size((hidden, 2 * hidden)))
    stored[mtp + "enorm.m.weight"] = noisy(torch.Size((hidden,)))
    stored[mtp + "hnorm.m.weight"] = noisy(torch.Size((hidden,)))
    stored["model.mtp.norm.weight"] = noisy(torch.Size((hidden,)))
    stored["model.mtp.embed_tokens.weight"] = noisy(torch.Size((vocab, hidden)))
    save_file(
        {k: v.contiguous() for k, v in stored.items()},
        folder / "model.safetensors",
        metadata={"format": "pt"},
    )
    return folder


def longcat_mtp_keys(folder: Path) -> dict[str, torch.Tensor]:
    """The stored tensors of a LongCat-Flash checkpoint's MTP module (`model.mtp.*`)."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update({k: v for k, v in load_file(file).items() if k.startswith("model.mtp.")})
    return out
