"""Data-driven descriptions of how a transformers MoE family lays out its blocks.

A `FamilySpec` replaces per-family code: where the block lives, what the router is called, how
expert weights are stored, which config field holds the expert count, and which per-expert
tensors must be sliced together when experts are removed. Specs are discovered from the model
(`models/discover.py`); `OVERRIDES` holds the little discovery cannot read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Expert weight layouts, all normalised by the adapter to gate [I,d], up [I,d], down [d,I].
FUSED = "fused"  # gate_up_proj [E, 2I, d] (gate rows, then up rows); down_proj [E, d, I]
TRANSPOSED = "transposed"  # gate_up_proj [E, d, 2I] (gate cols, then up cols); down_proj [E, I, d]
INTERLEAVED = "interleaved"  # gpt_oss: [E, d, 2I] with gate/up interleaved columns, plus biases
UNGATED = "ungated"  # Nemotron-H: up_proj [E, I, d] and down_proj [E, d, I]; m = act(up x), no gate
DOWN_IS_D_BY_I = (FUSED, UNGATED)  # layouts whose down_proj is [E, d, I] (the others [E, I, d])

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
    block_attr: str  # path inside the decoder layer to the MoE block ("" when the layer holds the experts)
    router_attr: str  # attribute of the block holding the router
    count_field: str  # config field with the number of routed experts
    intermediate_field: str  # config field with the routed experts' intermediate size
    layout: str
    routing: str
    # Per-expert tensors on the router, as (dotted path below the router, expert dimension).
    router_tensors: tuple[tuple[str, int], ...] = (("weight", 0),)
    # Per-expert tensors held by the block itself (beside router and experts), as (path, expert dim):
    # selection biases some families keep on the block (MiniMax-M2, Hunyuan-V3, AFMoE).
    block_tensors: tuple[tuple[str, int], ...] = ()
    selection_bias: str | None = None  # dotted path below the router (DeepSeek-V3, GLM, ERNIE)
    shared_attrs: tuple[str, ...] = ()  # shared expert modules on the block (never touched)
    weight_on_input: bool = False  # Llama-4 multiplies the router weight into the expert input
    group_routing: bool = False  # may use group-limited top-k (n_group > 1)
    # Config fields that other widths derive from the expert intermediate size (neuron pruning).
    shared_width_derived: bool = False
    # Other modules (dense MLP layers) read the routed width field too (Jamba): a uniform neuron
    # shrink then cannot be a stock checkpoint.
    dense_width_derived: bool = False
    # Where the router's output tuple holds the expert indices (transformers 5.16's Granite routers
    # return (indices, weights, logits); every other router (logits, weights, indices)).
    router_index_position: int = 2
    # Attributes holding the expert count on block / router / experts modules.
    count_attrs: tuple[str, ...] = ("num_experts",)
    # Router rows past the weighted experts' (the last `extra_experts` rows of the router matrix
    # and of every per-expert tensor one that long): LongCat-Flash's zero-computation (identity)
    # experts, Inkling's shared-expert sink. moeprune never counts, scores or removes them; it
    # keeps them, after the kept weighted rows, so the model routes to them as before.
    extra_experts: int = 0
    # Whether the router's indices select the extra experts (LongCat's zero experts, computed by
    # the experts module itself for indices >= the weighted count), or score them apart (Inkling).
    extra_routed: bool = False
    # Attributes holding weighted + extra experts (LongCat's router `n_routed_experts`).
    total_count_attrs: tuple[str, ...] = ()
    # How a stock checkpoint of the family names its tensors (what save_pretrained writes):
    # fragments of transformers' internal names replaced on disk (internal, on disk), and the
    # per-expert names of gate, up and down ("B.experts.<p>.<name>.weight"); None where the
    # checkpoint stores the experts fused, as transformers holds them (gpt_oss, Llama-4).
    disk_renames: tuple[tuple[str, str], ...] = ()
    disk_expert_names: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    # False when the disk layout is one only transformers' save-time conversion knows (fused
    # tensors under other names, Granite's input_linear): stock saves then go through it.
    disk_names_known: bool = True
    notes: tuple[str, ...] = field(default_factory=tuple)
    # vLLM's classes for the family assert that every layer's expert count divides the
    # expert-parallel size (vLLM 0.33: DeepSeek-V4, Kimi-K3, Muse-Spark, Step-5): `--ep-size N`
    # then makes N the default `--expert-multiple` and refuses a plan that breaks it
    ep_divisible: bool = False
    layers: str = "model.layers"  # qualified name of the decoder layer list (a wrapper's language model's)


# What discovery (models/discover.py) cannot read off a model: Llama-4 multiplies the routing
# weight into the expert input; the routing descriptions of the families moeprune has long
# reported (reports stay word for word); family notes.
OVERRIDES: dict[str, dict] = {
    **{
        m: {"routing": SOFTMAX_TOPK}
        for m in ("olmoe", "qwen2_moe", "qwen3_moe", "qwen3_next", "mixtral", "deepseek_v2")
    },
    **{m: {"routing": SIGMOID_BIAS_GROUP} for m in ("deepseek_v3", "glm4_moe")},
    "ernie4_5_moe": {"routing": SOFTMAX_BIAS},
    "gpt_oss": {
        "routing": TOPK_SOFTMAX,
        "notes": ("clamped SwiGLU with biases (gate * sigmoid(alpha * gate) * (up + 1))",),
    },
    # vLLM 0.33's model classes that assert `experts % ep_size == 0` (vllm/models/<family>/nvidia/model.py)
    **{m: {"ep_divisible": True} for m in ("deepseek_v4", "kimi_k3", "muse_spark", "step5")},
    "llama4_text": {
        "routing": TOPK_SIGMOID_INPUT,
        "weight_on_input": True,
        "notes": (
            "router weight multiplies the expert input; the transformers block runs every expert on every token",
        ),
    },
}
