"""moeprune's family table and the `moeprune` section of config.json, for stock transformers (part
of modeling_moeprune.py; moeprune copies these files into every moeprune-format folder).

How each family lays out its MoE blocks in memory and on disk (`Family`, `FAMILIES`, or the record
the section carries), and the section read and checked by the format's one reader.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .moeprune_format import FormatError, LayerStructure, parse_section

MEAN_OUTPUT = "mean_output"  # a novice's stored vector
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

FUSED = "fused"  # gate_up_proj [E, 2I, d] (gate rows, then up rows); down_proj [E, d, I]
TRANSPOSED = "transposed"  # Llama-4: gate_up_proj [E, d, 2I] (gate columns, then up); down_proj [E, I, d]
INTERLEAVED = "interleaved"  # gpt_oss: [E, d, 2I] with gate/up columns alternating, plus biases
UNGATED = "ungated"  # Nemotron-H: up_proj [E, I, d], down_proj [E, d, I]; y = down(act(up x))


@dataclass(frozen=True)
class Family:
    """How one transformers MoE family lays out its MoE blocks, in memory and on disk."""

    config_class: str  # the stock config class in transformers
    causal_lm_class: str  # the stock causal-LM class in transformers
    block_attr: str  # decoder-layer attribute holding the MoE block
    router_attr: str  # block attribute holding the router
    count_field: str  # config field with the number of routed experts (the largest layer's here)
    intermediate_field: str  # config field with the routed experts' full width
    layout: str  # FUSED, TRANSPOSED or INTERLEAVED
    # Per-expert router tensors: (dotted path below the router, expert dimension).
    router_tensors: tuple[tuple[str, int], ...] = (("weight", 0),)
    # Attributes holding the expert count on the block, the router and the experts module.
    count_attrs: tuple[str, ...] = ("num_experts",)
    # Fragments of in-memory names that stock checkpoints spell differently: (in memory, on disk).
    disk_renames: tuple[tuple[str, str], ...] = ()
    # Per-expert tensor names on disk (gate, up, down: "<B>.experts.<p>.<name>.weight"), or None
    # where checkpoints keep the fused tensors (gpt_oss, Llama-4).
    disk_expert_names: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    weight_on_input: bool = False  # Llama-4 multiplies the routing weight into the expert input
    # Per-expert tensors on the block itself (selection biases some families keep there).
    block_tensors: tuple[tuple[str, int], ...] = ()
    own_gate: bool = False  # the experts gate with their own _apply_gate (soft-capped SwiGLU, ...)
    layers: str = "model.layers"  # where the decoder layers are
    # Router rows past the weighted experts' (LongCat-Flash's zero experts, Inkling's shared-expert
    # sink): the last rows of the router matrix and of every per-expert tensor that long, kept
    # after the weighted rows whatever was pruned; attributes counting weighted + extra experts.
    extra_experts: int = 0
    total_count_attrs: tuple[str, ...] = ()


_BIASED = (("weight", 0), ("e_score_correction_bias", 0))  # DeepSeek-V3, GLM-4-MoE selection bias

FAMILIES: dict[str, Family] = {
    "olmoe": Family(
        "OlmoeConfig", "OlmoeForCausalLM", "mlp", "gate", "num_experts", "intermediate_size", FUSED
    ),
    "qwen2_moe": Family(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "mlp", "gate", "num_experts", "moe_intermediate_size", FUSED
    ),
    "qwen3_moe": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        "mlp",
        "gate",
        "num_local_experts",
        "moe_intermediate_size",
        FUSED,
    ),
    "qwen3_next": Family(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        "mlp",
        "gate",
        "num_experts",
        "moe_intermediate_size",
        FUSED,
    ),
    "mixtral": Family(
        "MixtralConfig",
        "MixtralForCausalLM",
        "mlp",
        "gate",
        "num_local_experts",
        "intermediate_size",
        FUSED,
        disk_renames=((".mlp.", ".block_sparse_moe."),),
        disk_expert_names=("w1", "w3", "w2"),
    ),
    "deepseek_v2": Family(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        "mlp",
        "gate",
        "n_routed_experts",
        "moe_intermediate_size",
        FUSED,
    ),
    "deepseek_v3": Family(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        "mlp",
        "gate",
        "n_routed_experts",
        "moe_intermediate_size",
        FUSED,
        router_tensors=_BIASED,
    ),
    "glm4_moe": Family(
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        "mlp",
        "gate",
        "n_routed_experts",
        "moe_intermediate_size",
        FUSED,
        router_tensors=_BIASED,
    ),
    "ernie4_5_moe": Family(
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        "mlp",
        "gate",
        "moe_num_experts",
        "moe_intermediate_size",
        FUSED,
        router_tensors=(("weight", 0), ("moe_statics.e_score_correction_bias", 1)),
        disk_renames=((".mlp.gate.moe_statics.", ".mlp.moe_statics."),),
    ),
    "gpt_oss": Family(
        "GptOssConfig",
        "GptOssForCausalLM",
        "mlp",
        "router",
        "num_local_experts",
        "intermediate_size",
        INTERLEAVED,
        router_tensors=(("weight", 0), ("bias", 0)),
        disk_expert_names=None,
    ),
    "llama4_text": Family(
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        "feed_forward",
        "router",
        "num_local_experts",
        "intermediate_size",
        TRANSPOSED,
        count_attrs=("num_experts", "out_features"),
        disk_expert_names=None,
        weight_on_input=True,
    ),
}


def fail(message: str) -> FormatError:
    return FormatError(f"modeling_moeprune: {message}")


def family_of(config) -> Family:
    """The base family's layout: as the `moeprune` section records it (written for every family
    since the record exists), else from the table above (results written before it)."""
    section = getattr(config, "moeprune", None) or {}
    record = section.get("family") if isinstance(section, dict) else None
    if record is None:
        base = base_model_type(config)
        if base not in FAMILIES:
            raise fail(f"config.json's 'moeprune' section has no 'family' record for the {base!r} model type")
        return FAMILIES[base]
    try:
        tuples = {
            key: tuple(tuple(x) if isinstance(x, list) else x for x in record[key])
            for key in ("router_tensors", "block_tensors", "count_attrs", "disk_renames", "total_count_attrs")
            if key in record
        }
        names = record.get("disk_expert_names")
        return Family(
            **{**record, **tuples, "disk_expert_names": tuple(names) if names is not None else None}
        )
    except (TypeError, KeyError) as exc:
        raise fail(f"config.json's 'moeprune' family record is damaged ({exc})") from None


def block_of(layer: nn.Module, family: Family):
    """A decoder layer's MoE block ('' when the layer itself holds the experts), or None."""
    if not family.block_attr:
        return layer
    try:
        return layer.get_submodule(family.block_attr)
    except AttributeError:
        return None


# ----------------------------------------------------------------------------- the structure
def read_structure(config) -> list[LayerStructure]:
    """The `moeprune` section of the config, checked by the format's one reader (moeprune_format.py):
    a damaged or hand-edited section is one clear error here, never a model of the wrong shape."""
    where = "config.json's 'moeprune' section"
    section = getattr(config, "moeprune", None)
    try:
        structure = parse_section(section, where, num_hidden_layers=_decoder_layers(config), oldest_version=3)
    except FormatError as exc:
        raise fail(str(exc)) from None
    if structure.base_model_type != base_model_type(config):
        raise fail(
            f"{where} is for a {structure.base_model_type!r} model but config.json's model type is {config.model_type!r}"
        )
    return list(structure.layers)


def _decoder_layers(config) -> int | None:
    text = getattr(config, "get_text_config", lambda: config)()
    return getattr(text, "num_hidden_layers", None)


def base_model_type(config) -> str:
    return str(config.model_type).removeprefix("moeprune_")
