"""Data-driven descriptions of how each transformers MoE family lays out its blocks.

One `FamilySpec` per family replaces per-family code: where the block lives, what the router
is called, how expert weights are stored, which config field holds the expert count, and which
per-expert tensors must be sliced together when experts are removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Expert weight layouts, all normalised by the adapter to gate [I,d], up [I,d], down [d,I].
FUSED = "fused"  # gate_up_proj [E, 2I, d] (gate rows, then up rows); down_proj [E, d, I]
TRANSPOSED = "transposed"  # gate_up_proj [E, d, 2I] (gate cols, then up cols); down_proj [E, I, d]
INTERLEAVED = "interleaved"  # gpt_oss: [E, d, 2I] with gate/up interleaved columns, plus biases

# Routing kinds (what the router does; the adapter never recomputes it, this is for reports).
SOFTMAX_TOPK = "softmax -> top-k"
SIGMOID_BIAS_GROUP = "sigmoid + selection bias -> group-limited top-k"
SOFTMAX_BIAS = "softmax + selection bias -> top-k"
TOPK_SOFTMAX = "top-k logits -> softmax over k"
TOPK_SIGMOID_INPUT = "top-k logits -> sigmoid, weight applied to the expert input"


@dataclass(frozen=True)
class FamilySpec:
    """How one model family stores its MoE blocks."""

    model_type: str
    block_attr: str  # attribute of the decoder layer holding the MoE block
    router_attr: str  # attribute of the block holding the router
    count_field: str  # config field with the number of routed experts
    intermediate_field: str  # config field with the routed experts' intermediate size
    layout: str
    routing: str
    # Per-expert tensors on the router, as (dotted path below the router, expert dimension).
    router_tensors: tuple[tuple[str, int], ...] = (("weight", 0),)
    selection_bias: str | None = None  # dotted path below the router (DeepSeek-V3, GLM, ERNIE)
    shared_attrs: tuple[str, ...] = ()  # shared expert modules on the block (never touched)
    weight_on_input: bool = False  # Llama-4 multiplies the router weight into the expert input
    group_routing: bool = False  # may use group-limited top-k (n_group > 1)
    # Config fields that other widths derive from the expert intermediate size (neuron pruning).
    shared_width_derived: bool = False
    # Attributes holding the expert count on block / router / experts modules.
    count_attrs: tuple[str, ...] = ("num_experts",)
    # How a stock checkpoint of the family names its tensors (what save_pretrained writes):
    # fragments of transformers' internal names replaced on disk (internal, on disk), and the
    # per-expert names of gate, up and down ("B.experts.<p>.<name>.weight"); None where the
    # checkpoint stores the experts fused, as transformers holds them (gpt_oss, Llama-4).
    disk_renames: tuple[tuple[str, str], ...] = ()
    disk_expert_names: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    notes: tuple[str, ...] = field(default_factory=tuple)


_SOFTMAX_COMMON = dict(block_attr="mlp", router_attr="gate", layout=FUSED, routing=SOFTMAX_TOPK)
_DEEPSEEK_COMMON = dict(
    block_attr="mlp",
    router_attr="gate",
    count_field="n_routed_experts",
    intermediate_field="moe_intermediate_size",
    layout=FUSED,
    shared_attrs=("shared_experts",),
    group_routing=True,
    shared_width_derived=True,
)

FAMILIES: dict[str, FamilySpec] = {
    spec.model_type: spec
    for spec in (
        FamilySpec(
            "olmoe", count_field="num_experts", intermediate_field="intermediate_size", **_SOFTMAX_COMMON
        ),
        FamilySpec(
            "qwen2_moe",
            count_field="num_experts",
            intermediate_field="moe_intermediate_size",
            shared_attrs=("shared_expert", "shared_expert_gate"),
            **_SOFTMAX_COMMON,
        ),
        FamilySpec(
            "qwen3_moe",
            count_field="num_local_experts",
            intermediate_field="moe_intermediate_size",
            **_SOFTMAX_COMMON,
        ),
        FamilySpec(
            "qwen3_next",
            count_field="num_experts",
            intermediate_field="moe_intermediate_size",
            shared_attrs=("shared_expert", "shared_expert_gate"),
            **_SOFTMAX_COMMON,
        ),
        FamilySpec(
            "mixtral",
            count_field="num_local_experts",
            intermediate_field="intermediate_size",
            disk_renames=((".mlp.", ".block_sparse_moe."),),
            disk_expert_names=("w1", "w3", "w2"),
            **_SOFTMAX_COMMON,
        ),
        FamilySpec("deepseek_v2", routing=SOFTMAX_TOPK, **_DEEPSEEK_COMMON),
        FamilySpec(
            "deepseek_v3",
            routing=SIGMOID_BIAS_GROUP,
            router_tensors=(("weight", 0), ("e_score_correction_bias", 0)),
            selection_bias="e_score_correction_bias",
            **_DEEPSEEK_COMMON,
        ),
        FamilySpec(
            "glm4_moe",
            routing=SIGMOID_BIAS_GROUP,
            router_tensors=(("weight", 0), ("e_score_correction_bias", 0)),
            selection_bias="e_score_correction_bias",
            **_DEEPSEEK_COMMON,
        ),
        FamilySpec(
            "ernie4_5_moe",
            block_attr="mlp",
            router_attr="gate",
            count_field="moe_num_experts",
            intermediate_field="moe_intermediate_size",
            layout=FUSED,
            routing=SOFTMAX_BIAS,
            router_tensors=(("weight", 0), ("moe_statics.e_score_correction_bias", 1)),
            selection_bias="moe_statics.e_score_correction_bias",
            shared_attrs=("shared_experts",),
            shared_width_derived=True,
            disk_renames=((".mlp.gate.moe_statics.", ".mlp.moe_statics."),),
        ),
        FamilySpec(
            "gpt_oss",
            block_attr="mlp",
            router_attr="router",
            count_field="num_local_experts",
            intermediate_field="intermediate_size",
            layout=INTERLEAVED,
            routing=TOPK_SOFTMAX,
            router_tensors=(("weight", 0), ("bias", 0)),
            disk_expert_names=None,
            notes=("clamped SwiGLU with biases (gate * sigmoid(alpha * gate) * (up + 1))",),
        ),
        FamilySpec(
            "llama4_text",
            block_attr="feed_forward",
            router_attr="router",
            count_field="num_local_experts",
            intermediate_field="intermediate_size",
            layout=TRANSPOSED,
            routing=TOPK_SIGMOID_INPUT,
            shared_attrs=("shared_expert",),
            weight_on_input=True,
            shared_width_derived=True,
            count_attrs=("num_experts", "out_features"),
            disk_expert_names=None,
            notes=(
                "router weight multiplies the expert input; the transformers block runs every expert on every token",
            ),
        ),
    )
}


def supported_families() -> list[str]:
    return sorted(FAMILIES)
