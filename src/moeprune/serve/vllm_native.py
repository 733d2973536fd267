"""vLLM 0.33's own description of a constant-novice result, so stock vLLM >= 0.33 serves it.

vLLM 0.33 serves MoNE novices natively ("expert substitution": vllm/model_executor/layers/
fused_moe/expert_substitution.py). A model declares, per decoder layer, which logical experts
are constants, in `compression_config.transform_config.expert_substitution` (version 1, each
replacement `constant-v1` naming its value tensor, layout `compact_retained_experts`: retained
experts keep their logical names). Its routing is moeprune's: the router runs over all logical
experts as the family routes (softmax, top-k, renormalisation over the picks, DeepSeek's sigmoid
and bias), and a pick of a substituted expert adds `g * value` with its router weight g kept
(tests/serve/test_vllm33_native.py computes both on a tiny model).

A moeprune-format result keeps its `MoePrune*` config.json (moeprune's loader, transformers and
vLLM 0.32-0.33 with the plugin read it as before), so the native description is a second
config in `vllm-native/config.json`: the family's stock model type and architecture, the stock
routing fields, and the substitution naming the result's own tensors (router position p is
logical expert p, a novice's value is its `mean_output`). No tensor is written twice:

    vllm serve OUT --hf-config-path OUT/vllm-native

It is written only where vLLM 0.33's path is exact and accepted: a family the plugin serves
(vLLM's class checked against transformers), unquantized weights, constant novices (no
low-rank factors), one router count in every MoE layer equal to the config's and one expert
width (vLLM builds every layer from the config), no MTP layers (their count differs), at least
one expert kept per layer. Otherwise `native_refusal` says why, and the summary names the plugin.
vLLM 0.33 itself refuses the path under expert or data parallelism, EPLB and with MoE LoRA.

Standard library only (config.json and the safetensors headers).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from moeprune.serve.moeprune_format import FormatError, parse_section
from moeprune.serve.vllm.layout import SERVED_FAMILIES, _stored_shapes

NATIVE_DIR = "vllm-native"
NO_NOVICES = "it has no novices"
ROUTER_SEMANTICS = {  # the only routing vLLM 0.33's constant-v1 accepts, and moeprune's
    "preserve_logical_expert_ids": True,
    "preserve_router_weights": True,
    "renormalize_after_substitution": False,
}
_NOVICE = re.compile(r"^(.*\.layers\.(\d+)\.[A-Za-z_]+\.experts)\.(\d+)\.mean_output$")
# fields vLLM reads for routing that transformers' configs leave implicit (layout.route_like_transformers)
_ROUTING: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
    "deepseek_v2": {"norm_topk_prob": False},
}


def native_refusal(config: dict[str, Any], names: set[str]) -> str | None:
    """Why vLLM 0.33 cannot serve this moeprune-format result natively (None: it can)."""
    section: dict[str, Any] = config.get("moeprune") or {}
    family = str(section.get("base_model_type", ""))
    if family not in SERVED_FAMILIES:
        return f"vLLM 0.33's expert substitution is not checked for {family or 'this family'}"
    if config.get("quantization_config") or config.get("compression_config"):
        return "vLLM 0.33 substitutes experts only in unquantized (bf16) MoE weights"
    structure = parse_section(section, "config.json ('moeprune' section)")
    layers = structure.layers
    if not any(layer.novices for layer in layers):
        return NO_NOVICES
    if any(layer.novice_rank for layer in layers):
        return "vLLM 0.33 substitutes constants only, not low-rank novices"
    fields: dict[str, Any] = section.get("family") or {}
    text: dict[str, Any] = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    if any(layer.num_experts != text.get(str(fields.get("count_field"))) for layer in layers):
        return (
            "its MoE layers have different router counts, and vLLM 0.33 builds every layer with the config's"
        )
    width = text.get(str(fields.get("intermediate_field")))
    if any(w is not None and w != width for layer in layers for w in layer.widths):
        return "its experts have different widths, and vLLM 0.33 builds one width from the config"
    if section.get("mtp"):
        return "vLLM 0.33 would build its MTP layers with the main layers' expert count"
    found = {(int(m.group(2)), int(m.group(3))) for m in map(_NOVICE.match, names) if m}
    wanted = {(layer.layer, p) for layer in layers for p in layer.novices}
    if found != wanted:
        return "its novices' mean_output tensors are not stored under the names vLLM 0.33 would read"
    return None


def native_config(config: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The stock config of the result's family carrying vLLM 0.33's expert substitution
    (call after native_refusal returned None)."""
    section = config["moeprune"]
    family = section["base_model_type"]
    # moeprune's section and remote code stay behind, and so does moe_sparsity_config (whichever
    # writer added it first): the substitution below is the whole description vLLM 0.33 reads
    native = {k: v for k, v in config.items() if k not in ("moeprune", "auto_map", "moe_sparsity_config")}
    native.update(model_type=family, architectures=[section["base_architecture"]], **_ROUTING.get(family, {}))
    targets: dict[str, Any] = {}
    for name in sorted(names):
        match = _NOVICE.match(name)
        if match:
            target = targets.setdefault(
                match.group(1), {"weight_layout": "compact_retained_experts", "replacements": {}}
            )
            target["replacements"][match.group(3)] = {"format": "constant-v1", "tensors": {"value": name}}
    native["compression_config"] = {
        "transform_config": {
            "expert_substitution": {
                "version": 1,
                "router_semantics": dict(ROUTER_SEMANTICS),
                "targets": targets,
            }
        }
    }
    return native


def write_native(folder: str | Path) -> str | None:
    """Write `folder/vllm-native/config.json` where vLLM 0.33 serves the result natively;
    returns the summary's line on which vLLM path serves its novices (None: it has none)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    names = set(_stored_shapes(folder))
    try:
        reason = native_refusal(config, names)
    except FormatError as exc:  # pragma: no cover - the writer's own section
        reason = str(exc)
    if reason == NO_NOVICES:
        return None
    if reason is not None:
        return f"through moeprune's plugin only (vLLM 0.32-0.33): not natively in vLLM 0.33, {reason}"
    (folder / NATIVE_DIR).mkdir(exist_ok=True)
    (folder / NATIVE_DIR / "config.json").write_text(
        json.dumps(native_config(config, names), indent=2, sort_keys=True) + "\n"
    )
    return (
        f"natively in vLLM >= 0.33 (vllm serve OUT --hf-config-path OUT/{NATIVE_DIR}), "
        "or through moeprune's plugin (vLLM 0.32-0.33)"
    )
