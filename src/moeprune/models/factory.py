"""Tiny random models of every MoE family of the installed transformers, built from config
classes (no downloads).

Used by the tests, by `moeprune inspect --tiny FAMILY`, and as a smoke-test model for users.
`moe_families()` enumerates the families at run time: every causal-LM model type whose config
names routed experts, so a family transformers adds is found the day it appears. Its tiny config
shrinks the config class's own defaults by field name (`_SHRINK`), keeping one decoder layer of
each kind the default stacks (dense and MoE, linear and full attention), so the code paths of
interleaved and hybrid stacks run. The eleven reference families keep hand-made fixtures
(`TINY_OVERRIDES`) that the deeper per-family tests were written against.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedModel

from moeprune.models.classes import model_class

_COMMON: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_DEEPSEEK_ATTN: dict[str, Any] = dict(
    num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8
)

TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "olmoe": dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
    ),
    "qwen3_moe": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        head_dim=8,
    ),
    "qwen3_next": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        head_dim=8,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    ),
    "mixtral": dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v2": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        n_group=2,
        topk_group=1,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
        **_DEEPSEEK_ATTN,
    ),
    "deepseek_v3": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        **_DEEPSEEK_ATTN,
    ),
    "glm4_moe": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        head_dim=8,
    ),
    "ernie4_5_moe": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        moe_num_experts=8,
        moe_k=2,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
    ),
    "gpt_oss": dict(
        intermediate_size=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=16,
    ),
    "llama4_text": dict(
        intermediate_size=16,
        intermediate_size_mlp=48,
        num_local_experts=8,
        num_experts_per_tok=1,
        moe_layers=[0, 2],
        head_dim=8,
        layer_types=["chunked_attention", "full_attention", "chunked_attention"],
        attention_chunk_size=16,
    ),
}


# Field-name rules that shrink any family's default config (first match wins); expert widths
# (16), shared-expert widths (24) and dense widths (48) differ so discovery cannot confuse them.
_SHRINK: tuple[tuple[str, int], ...] = (
    # unpadded_vocab_size: the lm_head's width in inkling2 from transformers 5.24 (5.23 used vocab_size)
    (r"^(unpadded_)?vocab_size(_per_layer_input)?$", 96),
    (r"^hidden_size$", 32),
    (r"^(num_hidden_layers|num_layers)$", 4),
    (r"^(num_attention_heads|num_key_value_heads)$", 4),
    (r"^head_dim$", 8),
    (r"^max_position_embeddings$", 128),
    (r"hidden_size_per_layer_input", 4),
    (r"router_hidden_size", 16),
    (r"^moe_hidden_size$", 32),  # the experts' own model width (muse_spark)
    (r"per_tok|per_token|^moe_topk$|^moe_k$|^top_k_experts$", 2),
    (r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts)$", 8),
    (r"zero_expert_num", 2),
    (r"shared_experts?$", 1),
    (r"shared.*(intermediate|dim)|share_expert_dim", 24),
    (r"(moe|expert).*(intermediate|ffn|dim)|(intermediate|ffn).*(moe|expert)", 16),
    (r"dense.*intermediate", 40),
    (r"intermediate_size|ffn_hidden|ffn_dim", 48),
    (r"first_k_dense|moe_layer_start|num_dense_layers", 1),
    (r"kv_lora_rank|q_lora_rank", 16),
    (r"qk_rope_head_dim|qk_nope_head_dim|v_head_dim", 8),
    (r"^qk_head_dim$", 16),
    (r"^(n_group|num_expert_group|topk_group)$", 1),
    (r"^linear_(num_key|num_value)_heads$", 2),
    (r"^linear_(key|value)_head_dim$", 8),
    (r"^mamba_n_heads$|^mamba_num_heads$", 4),
    (r"^mamba_d_head$|^mamba_head_dim$", 16),
    (r"^mamba_d_state$|^ssm_state_size$", 8),
    (r"^mamba_chunk_size$", 16),
    (r"^(mamba_)?n_groups$", 1),
    (r"^index_topk$", 4),
    (r"^index_head_dim$", 8),
    (r"^index_n_heads$", 2),
    (r"^index_kpool$", 2),  # divides index_topk
    (r"^sliding_window$|attention_chunk_size", 16),
    (r"^(expert|attn)_layer_period$", 2),
    (r"^(expert|attn)_layer_offset$", 1),
    (r"^linear_head_dim$", 8),
    (r"^linear_num_heads$", 2),
)
# What field names cannot say: families whose defaults have no MoE block at all.
_GENERIC_EXTRA: dict[str, dict[str, Any]] = {
    "gemma4_text": dict(enable_moe_block=True),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "zaya": dict(num_experts_per_tok=1),  # its config accepts top-1 routing only
    "mimo_v2_flash": dict(num_key_value_heads=2),  # sliding layers double the KV heads
    "nemotron_h": dict(
        layers_block_type=["linear_attention", "moe", "full_attention", "moe"]
    ),  # two MoE layers
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),  # None by default
    "dots3_note_text": dict(head_dim=16),  # sliding layers need head_dim = qk_nope + qk_rope
    "qwen4_exp_text": dict(
        indexer_budget=8, indexer_compress_ratio=2, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8
    ),
    # multimodal RoPE: the sections (t, h, w) of the rotary half-dims default to a real model's
    "ernie4_5_vl_moe_text": dict(
        rope_parameters=dict(rope_type="default", rope_theta=500000.0, mrope_section=[1, 1, 2])
    ),
    "glm4v_moe_text": dict(
        rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[0, 1, 1]
        )
    ),
    "nemotron_h_omni": dict(projector_hidden_size=48),  # 4096 wide by default
    "muse_spark": dict(out_hidden_size=128, projector_hidden_size=48),  # merged 2x2 patches of width 32
    # its 3-D rope index reads vision_start_token_id on padded batches, which the thinker config
    # leaves to the enclosing Qwen3-Omni config (151652 there)
    "qwen3_omni_moe_thinker": dict(vision_start_token_id=151652),
    # dbrx names its sizes its own way
    "dbrx": dict(
        d_model=32,
        n_heads=4,
        n_layers=4,
        max_seq_len=128,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),  # read unconditionally
        ffn_config=dict(ffn_hidden_size=16, moe_num_experts=8, moe_top_k=2),
    ),
}
_MAX_TINY_PARAMETERS = 4_000_000
_GENERIC_LAYERS = 4  # one of each layer kind the defaults stack, then later (MoE) layers
# Vision and audio towers of multimodal wrappers: one small layer, projected to hidden 32.
_TOWER_DEPTH = ("depth", "num_hidden_layers", "num_layers", "n_layers", "encoder_layers")
_TOWER: dict[str, int] = {
    **dict.fromkeys(_TOWER_DEPTH, 1),
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "out_hidden_size": 32,
    "embed_dim": 32,
    "projection_dim": 32,
    "head_dim": 8,
    "vision_output_dim": 32,
    "projector_hidden_size": 32,
    "text_hidden_size": 32,
    "projector_input_dim": 32,
    "projector_output_dim": 32,
    "image_size": 56,
    # audio encoders (whisper-like) and other towers' own names
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 48,
    "d_model": 32,
    "output_dim": 32,
    "downsample_hidden_size": 16,
    "mlp_dim": 48,
    "output_channels": 32,
    "adapter_in_dim": 32,
    "adapter_input_size": 32,
    "adapter_out_dim": 32,
}
_WRAPPER: dict[str, int] = {"vision_hidden_size": 32}
_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


@cache
def moe_families() -> tuple[str, ...]:
    """Every causal-LM or image-text-to-text model type of the installed transformers whose
    config names routed experts (a field with "expert" in its name, sub-configs included),
    found at run time, sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )
    from transformers.utils import logging as hf_logging

    found = []
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # default configs warn about their own token ids
    try:
        for model_type in sorted(
            {*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}
        ):
            try:
                defaults = CONFIG_MAPPING[model_type]().to_dict()
            except Exception:  # noqa: BLE001 - a config class whose defaults do not validate
                continue
            if any("expert" in key for key in _flat_keys(defaults)):
                found.append(model_type)
    finally:
        hf_logging.set_verbosity(verbosity)
    return tuple(found)


def _flat_keys(data: dict) -> Iterator[str]:
    for key, value in data.items():
        yield str(key)
        if isinstance(value, dict):
            yield from _flat_keys(value)


def reference_families() -> list[str]:
    """The families with hand-made tiny fixtures, run through every test of the suite."""
    return sorted(TINY_OVERRIDES)


def _layer_pick(values: list, layers: int) -> list[int]:
    """Indices of `layers` decoder layers covering each distinct kind in a per-layer list."""
    first: dict[str, int] = {}
    for i, value in enumerate(values):
        first.setdefault(repr(value), i)
    keep = sorted(first.values())[:layers]
    keep += [i for i in reversed(range(len(values))) if i not in keep][
        : layers - len(keep)
    ]  # later layers are MoE
    return sorted(keep)


def _shrunk(values: dict) -> dict:
    """`values` with `_SHRINK` applied to its integer (or unset) fields, and into nested plain
    dicts (dbrx's ffn_config, dots3's per-layer-type sub-configs), not into other models' configs."""
    out: dict = {}
    for key, value in values.items():
        if isinstance(value, dict) and not value.get("model_type"):
            out[key] = {**value, **_shrunk(value)}
            continue
        widths = (  # one width per modality (ernie4.5-VL's text and vision experts)
            isinstance(value, list)
            and value
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
        )
        if widths and not str(key).endswith(("layers", "ids", "indexes", "indices")):
            rule = next((n for pattern, n in _SHRINK if re.search(pattern, str(key))), None)
            if rule is not None:
                out[key] = [rule] * len(value)
            continue
        if isinstance(value, bool) or not (isinstance(value, int) or value is None):
            continue
        if value == 0 and "head_dim" in key:
            continue  # a zero head says "none" (glm5's NoPE attention: qk_rope_head_dim 0)
        rule = next((n for pattern, n in _SHRINK if re.search(pattern, str(key))), None)
        if rule is not None:
            out[key] = rule
    return out


def _cut_layers(defaults: dict, kwargs: dict, total: int, layers: int) -> list[int]:
    """Cut the per-layer fields of a `total`-layer config in `kwargs` to `layers` layers (those
    `_layer_pick` keeps): lists with one entry a layer (layer_types, a tower's stage widths),
    lists of layer indices (mlp_only_layers, moe_layers) and `per_layer_config` keyed by layer
    index (dots3's vision experts), so a shrunk stack validates against its own layer count."""
    per_layer = {k: v for k, v in defaults.items() if isinstance(v, list) and total and len(v) == total}
    keep = list(range(layers))
    if per_layer:
        richest = max(per_layer, key=lambda k: len({repr(x) for x in per_layer[k]}))
        keep = _layer_pick(per_layer[richest], layers)
        kwargs.update({k: [v[i] for i in keep] for k, v in per_layer.items()})
    for key, value in defaults.items():  # lists of layer indices (mlp_only_layers, moe_layers)
        indices = isinstance(value, list) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in value
        )
        if key.endswith("layers") and indices and key not in per_layer:
            kwargs[key] = [keep.index(x) for x in value if x in keep]
    per_config = kwargs.get("per_layer_config")
    if isinstance(per_config, dict) and all(str(k).isdigit() for k in per_config):  # keyed by layer index
        kwargs["per_layer_config"] = {
            str(keep.index(int(k))): v for k, v in per_config.items() if int(k) in keep
        }
    return keep


def _tower(values: dict) -> dict:
    """A vision or audio tower shrunk by `_TOWER`, its own sub-configs too (a SAM encoder inside
    a vision config), its per-layer lists and per-layer configs cut to its one layer."""
    out: dict = {}
    for key, value in values.items():
        if isinstance(value, dict) and value.get("model_type"):
            out[key] = _tower(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            out[key] = _TOWER.get(key, value)
        elif isinstance(value, list) and key.endswith(("channels", "hidden_sizes")):
            out[key] = [_TOWER["hidden_size"] if isinstance(v, int) else v for v in value]  # stage widths
        else:
            out[key] = value
    total = next((values[k] for k in _TOWER_DEPTH if isinstance(values.get(k), int)), 0)
    _cut_layers(dict(out), out, total, _TOWER[_TOWER_DEPTH[0]])
    return out


def _wrapper_kwargs(model_type: str, defaults: dict, kwargs: dict) -> dict[str, Any]:
    """A multimodal wrapper: its language model shrunk as a family of its own, its towers by
    `_TOWER` (one layer, hidden 32, projected to the language model's 32), the token ids of
    its images and sounds inside the tiny vocabulary."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for key, value in defaults.items():
        sub = value.get("model_type") if isinstance(value, dict) else None
        if not sub:
            continue
        if key == "text_config" and sub in CONFIG_MAPPING:
            kwargs[key] = {**generic_tiny_kwargs(sub), "model_type": sub}
        else:
            kwargs[key] = _tower(value)
    for key, value in defaults.items():
        if (
            key.endswith(("token_id", "token_index"))
            and isinstance(value, int)
            and not isinstance(value, bool)
        ):
            kwargs[key] = _TOKENS.get(key, 90)
    for key, value in defaults.items():  # the wrapper's own copy of a tower's width
        if key in _WRAPPER and isinstance(value, int) and not isinstance(value, bool):
            kwargs[key] = _WRAPPER[key]
    kwargs["tie_word_embeddings"] = False
    kwargs.update(_GENERIC_EXTRA.get(model_type, {}))
    return kwargs


def generic_tiny_kwargs(model_type: str) -> dict[str, Any]:
    """The family's default config, shrunk by `_SHRINK`, per-layer lists cut to 4 layers."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]().to_dict()
    kwargs = {
        k: v for k, v in defaults.items() if k not in ("model_type", "transformers_version", "architectures")
    }
    if any(isinstance(v, dict) and v.get("model_type") for v in defaults.values()):
        return _wrapper_kwargs(model_type, defaults, kwargs)
    kwargs.update(_shrunk(defaults))
    nope, rope = defaults.get("qk_nope_head_dim"), defaults.get("qk_rope_head_dim")
    if isinstance(nope, int) and isinstance(rope, int) and defaults.get("head_dim") == nope + rope > 0:
        kwargs["head_dim"] = kwargs["qk_nope_head_dim"] + kwargs["qk_rope_head_dim"]  # MLA's full head
    total = defaults.get("num_hidden_layers") or defaults.get("num_layers") or 0
    _cut_layers(defaults, kwargs, total, _GENERIC_LAYERS)
    kwargs.update({k: v for k, v in _TOKENS.items() if k in defaults})
    kwargs["tie_word_embeddings"] = False
    kwargs["use_cache"] = False  # stacks of linear-attention layers alone have no cache length to report
    kwargs.update(_GENERIC_EXTRA.get(model_type, {}))
    return kwargs


def tiny_config(model_type: str, **overrides: Any):
    """A small config of `model_type` (3 decoder layers, hidden 32, 8 experts)."""
    if model_type in TINY_OVERRIDES:
        return AutoConfig.for_model(model_type, **{**_COMMON, **TINY_OVERRIDES[model_type], **overrides})
    if model_type not in moe_families():
        raise ValueError(
            f"no tiny config for {model_type!r}: not an MoE family of this transformers; known: "
            f"{', '.join(moe_families())}"
        )
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kwargs = generic_tiny_kwargs(model_type)
    text = kwargs.get("text_config")
    if isinstance(text, dict):  # a wrapper: fields it has no own of go to its language model
        own = CONFIG_MAPPING[model_type]().to_dict()
        text.update({k: v for k, v in overrides.items() if k not in own})
        overrides = {k: v for k, v in overrides.items() if k in own}
    return CONFIG_MAPPING[model_type](**{**kwargs, **overrides})


@cache
def _default_size(model_type: str) -> int:
    """Parameters of the tiny config without overrides, counted on the meta device once a process
    (a meta copy built before every tiny model was 40 % of its time)."""
    config = tiny_config(model_type)
    with torch.device("meta"):
        return sum(p.numel() for p in model_class(config)._from_config(config).parameters())


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A random tiny model in fp32 and eval mode; routers and biases are randomised too.
    Zero-initialised tensors (routers, selection biases) would make routing degenerate, so
    every floating tensor gets random values: the tests then exercise real routing.
    """
    if not overrides and (size := _default_size(model_type)) > _MAX_TINY_PARAMETERS:
        raise ValueError(f"the tiny {model_type} config still builds {size:,} parameters; shrink its fields")
    config = tiny_config(model_type, **overrides)
    cls = model_class(config)  # the causal LM, or the multimodal wrapper around it
    torch.manual_seed(seed)
    model = cls._from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not tensor.is_floating_point() or "inv_freq" in name or "rotary" in name:
                continue
            if (
                "norm" in name
                and "layernorm" not in name.lower()
                and tensor.dim() == 1
                and "bias" not in name
            ):
                tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=generator))
            elif "correction_bias" in name:
                tensor.copy_(0.05 * torch.randn(tensor.shape, generator=generator))
            elif tensor.dim() >= 2 or "bias" in name:
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=generator))
    return model.eval()


def save_tiny_model(model_type: str, path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Build a tiny model and write it as a normal transformers checkpoint folder."""
    path = Path(path)
    tiny_model(model_type, seed=seed, **overrides).save_pretrained(path)
    return path
