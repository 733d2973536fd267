"""What vLLM must build for a moeprune-format checkpoint, read from config.json alone.

The `moeprune` section of config.json (docs/checkpoint-format.md, version 3) lists, per MoE
layer, one width per router position (null for a MoNE novice). vLLM's fused-MoE module holds
one [experts, 2 * width, hidden] block of one width, so each layer is built with

- one fused block per width group (`moeprune_format.width_groups`): experts whose widths are
  within WIDTH_MERGE_TOLERANCE (5%) of the group's widest share a block, at most
  MAX_WIDTH_GROUPS (4) per layer; a TENP layer is two blocks (whole and narrowed experts);
- in each block, the group's experts, the narrower ones padded with zero neurons to its width.
  For the gated MLPs of every served family this is exact: silu(0) * 0 = 0 and a zero
  down-projection column adds nothing;
- novices hold no expert weights: what they store (a d-vector each; a low-rank novice of rank R
  also its two [d, R] factors), added outside the fused kernel.

This module imports neither torch nor vLLM: moeprune's model card uses `served_parameter_count`
to print what serving costs next to the packed size on disk.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from moeprune.serve.moeprune_format import (  # noqa: F401  (FORMAT: the plugin's names, defined once)
    ARCHITECTURE_PREFIX,
    FORMAT,
    FORMAT_VERSION,
    MAX_WIDTH_GROUPS,
    MODEL_TYPE_PREFIX,
    WIDTH_MERGE_TOLERANCE,
    FormatError,
    LayerStructure,
    parse_section,
)

# base model type -> vLLM's causal-LM class for it (the plugin serves "MoePrune" + that name)
SERVED_FAMILIES: dict[str, str] = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "exaone_moe": "ExaoneMoeForCausalLM",
}

# Families whose moeprune-format results vLLM drafts from with their MTP layers (vLLM's own MTP
# draft class, built with the MTP layers' expert count: vllm_plugin.draft_config), checked by
# tests/serve/test_serve_mtp_format.py on vLLM 0.32's CPU build.
MTP_DRAFTED = ("deepseek_v3",)


def mtp_refusal(family: str, where: str, has_mtp: bool) -> str:
    """Why vLLM cannot draft from this moeprune-format result with MTP layers (one sentence)."""
    if not has_mtp:
        return (
            f"{where}: this moeprune result keeps no multi-token-prediction layer (its input had none, or it "
            "was pruned with --drop-mtp); serve it without speculative_config, or with another method"
        )
    return (
        f"{where}: moeprune's vLLM plugin serves MTP drafts of {', '.join(MTP_DRAFTED)} results only, not "
        f"{family}; serve it without speculative_config (its main model is served)"
    )


# Families vLLM 0.32 implements that the plugin does not serve, and why (measured on the CPU
# build with tiny transformers-written checkpoints: scripts/vllm_family_probe.py, see
# docs/serving.md). Every other family: vLLM has no class for it, or it was not tried.
UNSERVED_REASONS: dict[str, str] = {
    "cohere2_moe": "vLLM's Cohere2MoeForCausalLM does not reproduce transformers' model even unpruned",
    "ernie4_5_moe": "vLLM's Ernie4_5_MoeForCausalLM does not reproduce transformers' model even unpruned",
    "afmoe": "vLLM's AfmoeForCausalLM needs config fields transformers' config lacks (score_func)",
    "minimax_m2": "vLLM's MiniMaxM2ForCausalLM needs config fields transformers' config lacks (rotary_dim)",
    "mimo_v2_flash": "vLLM's MiMoV2FlashForCausalLM needs config fields transformers' config lacks (hybrid_layer_pattern)",
    "hy_v3": "vLLM's HYV3ForCausalLM needs config fields transformers' config lacks (first_k_dense_replace)",
    "laguna": "vLLM's LagunaForCausalLM routes with softmax only, transformers' laguna with sigmoid",
    "lfm2_moe": "vLLM's Lfm2MoeForCausalLM reads the convolution sizes differently from transformers' config",
    "llama4_text": "vLLM's Llama4ForCausalLM names its dense layers differently from transformers' checkpoints",
    "granitemoe": "its experts are stored with gate and up fused per expert, which the plugin does not split",
    "gpt_oss": "its experts carry biases and vLLM's CPU build has no kernel for them, so it was not checked",
    "nemotron_h": "its experts are ungated, which vLLM runs on CUDA/ROCm only, so it was not checked",
    "qwen3_next": "vLLM runs its linear attention in bf16 only on CPU, so it was not checked against fp32",
}


def served_family(model_type: str, architecture: str, where: str) -> str:
    """The base family of a checkpoint of `model_type` that vLLM builds as `architecture`, read
    from the config rather than from the class: several model types may share one vLLM class
    (transformers 5.24's sarvam_mla runs DeepSeek-V3's), and each must route as its own family."""
    family = model_type.removeprefix(MODEL_TYPE_PREFIX)
    if SERVED_FAMILIES.get(family) != architecture:
        raise FormatError(
            f"{where} has model type {model_type!r}, which moeprune's vLLM plugin does not serve as "
            f"{ARCHITECTURE_PREFIX}{architecture}; re-create the checkpoint with moeprune"
        )
    return family


def refused_families(model_types) -> list[str]:
    """Of `model_types` (transformers' config types), those the plugin refuses in one sentence:
    every one it does not serve (UNSERVED_REASONS says why for those vLLM implements), so a
    moeprune result of any family meets the refusal, never vLLM's own 'unknown model type'."""
    return [m for m in model_types if m not in SERVED_FAMILIES]


DOWN_PROJECTIONS = ("down_proj", "w2")  # [hidden, width]; every other expert matrix is [width, hidden]


def refusal(family: str) -> str:
    """The one sentence a user sees when the plugin does not serve a family."""
    reason = f" ({UNSERVED_REASONS[family]})" if family in UNSERVED_REASONS else ""
    return (
        f"moeprune's vLLM plugin does not serve {family} models saved in moeprune's format{reason} (it serves "
        f"{', '.join(SERVED_FAMILIES)}); load this checkpoint with transformers "
        "(AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)) or with moeprune.load_pretrained(path)"
    )


def quantized_refusal(method: str) -> str:
    """The one sentence a user sees for a moeprune-format result that kept quantized weights:
    serving it at its size needs vLLM's quantized fused-MoE kernels built per layer, not wired yet."""
    return (
        f"moeprune's vLLM plugin does not serve moeprune-format checkpoints that keep {method} weights yet; "
        "load this checkpoint with transformers (AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)) "
        "or with moeprune.load_pretrained(path), which decode them, or prune with --save-dtype bf16"
    )


LayoutError = FormatError  # the format's one error type, under the name the plugin has always raised
LayerLayout = LayerStructure  # one MoE layer: router positions, their expert ids and widths


def read_layout(config: dict[str, Any], where: str = "config.json") -> dict[int, LayerStructure]:
    """The served structure of a moeprune-format config (a dict), checked by the format's one
    reader (serve/moeprune_format.py); {} for a stock config."""
    section = config.get("moeprune")
    if section is None:
        return {}
    structure = parse_section(
        section,
        f"{where} ('moeprune' section)",
        num_hidden_layers=_decoder_layers(config),
        oldest_version=FORMAT_VERSION,
    )
    for layer in structure.layers:
        if not layer.weighted:
            raise FormatError(
                f"{where}: layer {layer.layer} has only novices, which vLLM's fused MoE cannot run; "
                "load it with moeprune.load_pretrained(path)"
            )
    return {layer.layer: layer for layer in structure.layers}


def _decoder_layers(config: dict[str, Any]) -> int | None:
    text_config = config.get("text_config")
    text = text_config if isinstance(text_config, dict) else config
    return text.get("num_hidden_layers")


_EXPERT_TENSOR = re.compile(r"\.layers\.(\d+)\.[A-Za-z_]+\.experts\.(\d+)\.([A-Za-z0-9_]+)\.weight$")


CPU_MOE_ALIGNMENT = 32  # vLLM 0.32's CPU fused-MoE kernel pads every expert width to this multiple


def served_parameter_count(path: str | Path, alignment: int = 1) -> int:
    """Parameters vLLM holds for the checkpoint in `path`: what is stored, plus the zero neurons
    that pad each expert to its width group's width (gate, up and down rows/columns), i.e. the
    packed size up to WIDTH_MERGE_TOLERANCE per group (more only where MAX_WIDTH_GROUPS merged
    groups further).

    A stock checkpoint, or a moeprune one with one width per layer, holds exactly what it
    stores. Counted for one GPU: under tensor parallelism each group's width is rounded up to a
    multiple of the TP size. `alignment` rounds every expert width up to a multiple, as a kernel
    that pads after loading does: vLLM's CPU build pads each fused block to CPU_MOE_ALIGNMENT
    neurons (`experts/cpu_moe.py`), so what it holds once loaded is this count with
    `alignment=CPU_MOE_ALIGNMENT`; the plugin allocates the count with 1.
    """
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    layout = read_layout(config, str(path / "config.json"))
    group_width = {
        (layer.layer, position): group.width
        for layer in layout.values()
        for group in layer.groups
        for position in group.positions
    }
    total = 0
    for name, shape in _stored_shapes(path).items():
        numel = 1
        for size in shape:
            numel *= size
        total += numel
        match = _EXPERT_TENSOR.search(name)
        if match is None:
            continue
        narrow = shape[1] if match.group(3) in DOWN_PROJECTIONS else shape[0]
        width = group_width.get((int(match.group(1)), int(match.group(2))), narrow)
        width = -(-width // alignment) * alignment
        total += (numel // narrow) * (width - narrow)
    return total


def _stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from the safetensors headers (nothing else is read)."""
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise LayoutError(f"{path} holds no .safetensors file; pass a checkpoint folder")
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        with shard.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def route_like_transformers(family: str, config) -> None:
    """Spell out the routing transformers applies but transformers-written configs leave implicit.

    vLLM reads DeepSeek's routing from optional config fields that DeepSeek's own configs carry
    and transformers' configs omit, defaulting to softmax without selection bias. moeprune's
    result must route as transformers did when it was pruned, so the fields are set here:
    DeepSeek-V3 always uses sigmoid scores and the selection bias (noaux_tc); DeepSeek-V2 never
    renormalises the top-k weights, and its "greedy" top-k ignores expert groups (vLLM applies
    them whenever n_group > 1).
    """
    if family == "deepseek_v3":
        config.scoring_func = "sigmoid"
        config.topk_method = "noaux_tc"
    elif family == "deepseek_v2":
        config.norm_topk_prob = False
        if getattr(config, "topk_method", None) in (None, "greedy"):
            config.n_group, config.topk_group = 1, 1
