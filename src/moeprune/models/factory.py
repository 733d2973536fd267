"""Tiny random models of every supported family, built from config classes (no downloads).

Used by the tests, by `moeprune inspect --tiny FAMILY`, and as a smoke-test model for users.
Some layers are dense where the family allows it, so the code paths that skip dense layers run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from moeprune.models.spec import supported_families

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


def tiny_config(model_type: str, **overrides: Any):
    """A small config of `model_type` (3 decoder layers, hidden 32, 8 experts)."""
    if model_type not in TINY_OVERRIDES:
        raise ValueError(f"no tiny config for {model_type!r}; known: {', '.join(supported_families())}")
    kwargs = {**_COMMON, **TINY_OVERRIDES[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A random tiny model in fp32 and eval mode; routers and biases are randomised too.

    Zero-initialised tensors (routers, selection biases) would make routing degenerate, so
    every floating tensor gets random values: the tests then exercise real routing.
    """
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
