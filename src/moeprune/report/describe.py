"""`moeprune inspect`: a checkpoint's MoE structure and parameter counts, without loading weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from moeprune.checkpoint import build_skeleton, check_model_path, files, load_config
from moeprune.checkpoint.names import beside_stack_prefixes
from moeprune.checkpoint.sparsity_metadata import describe_sparsity, read_sparsity
from moeprune.checkpoint.structure import read_config_dict
from moeprune.models import MoEModel
from moeprune.models.expert_parallel import ep_sizes, format_ep_sizes
from moeprune.quant import quantization_of
from moeprune.report.prune_report import weight_bytes
from moeprune.surgery.parameters import describe_layers, expert_params, routed_parameters


def describe_checkpoint(path: str | Path, trust_remote_code: bool = False) -> dict:
    """Build the model on the meta device (no weights read) and describe it."""
    folder = check_model_path(path)  # a local folder or a cached model id
    load_config(folder, trust_remote_code)  # clear errors for missing, dense or unsupported checkpoints
    info = describe_model(build_skeleton(folder, meta=True), source=str(path))
    config = read_config_dict(folder)
    info["quantization"] = quantization_of(config)  # what moeprune keeps or refuses
    info["moe_sparsity_config"] = read_sparsity(config)  # the standard's per-layer counts (any tool's)
    info["weight_bytes"] = weight_bytes(folder)
    stored = files.stored_tensors(folder) if files.shard_names(folder) else {}
    info["mtp_layers"] = beside_stack_prefixes(stored, info["decoder_layers"])
    return info


def describe_model(model: nn.Module, source: str = "") -> dict:
    moe = MoEModel(model)
    # transformers' config, a plain attribute: nn.Module's __getattr__ (typed Tensor | Module) only
    # serves parameters, buffers and submodules, so that annotation does not apply to it
    config: Any = model.config
    config = config.get_text_config()  # a wrapper (vision-language) keeps the decoder's fields there
    layers = []
    for m, row in zip(moe.layers, describe_layers(moe)):
        params = expert_params(m)
        layers.append(
            {
                **row,
                "params_per_expert": max(params, default=0),
                "routing_groups": m.n_group,
                "shared_experts": [a for a in m.spec.shared_attrs if getattr(m.block, a, None) is not None],
            }
        )
    moe_indices = {m.index for m in moe.layers}
    return {
        "source": source,
        "family": moe.model_type,
        "architecture": type(model).__name__,
        "decoder_layers": int(config.num_hidden_layers),
        "moe_layers": sorted(moe_indices),
        "dense_layers": [i for i in range(config.num_hidden_layers) if i not in moe_indices],
        "hidden_size": int(config.hidden_size),
        "routing": moe.spec.routing,
        # layers no method may take an expert from (hash routing), and the one line saying so
        "kept_whole": {str(i): reason for i, reason in moe.kept_whole().items()},
        "kept_whole_note": moe.kept_whole_note(),
        "uniform": len({(r["experts"], r["intermediate_size"], r["novices"]) for r in layers}) == 1,
        "layers": layers,
        "parameters": routed_parameters(moe),
        "ep_sizes": ep_sizes(row["experts"] for row in layers),
    }


def format_description(info: dict) -> str:
    params = info["parameters"]
    lines = [
        f"{info['source']}: {info['family']} ({info['architecture']})",
        f"  decoder layers {info['decoder_layers']}; MoE layers {_ranges(info['moe_layers'])}"
        + (f"; dense layers {_ranges(info['dense_layers'])}" if info["dense_layers"] else ""),
        f"  routing: {info['routing']}",
        *(
            [
                f"  beside the stack: {len(info['mtp_layers'])} multi-token-prediction layer(s) "
                f"({', '.join(p + '*' for p in info['mtp_layers'])}): a result keeps them, pruned to its (last "
                "MoE layer's) expert count (--drop-mtp leaves them out)"
            ]
            if info.get("mtp_layers")
            else []
        ),
        *([f"  {info['kept_whole_note']}"] if info.get("kept_whole_note") else []),
        *([f"  quantized: {info['quantization']}"] if info.get("quantization") else []),
        *([f"  {describe_sparsity(info['moe_sparsity_config'])}"] if info.get("moe_sparsity_config") else []),
        *([f"  expert parallel: {format_ep_sizes(info['ep_sizes'])}"] if info.get("ep_sizes") else []),
        *(
            [f"  weights on disk: {info['weight_bytes']:,} bytes"]
            if info.get("weight_bytes") is not None
            else []
        ),
        f"  parameters: total {params['total']:,}; routed experts {params['routed_experts']:,}; "
        f"active per token {params['active_per_token']:,}",
        "  layer  experts  novices  top-k  intermediate  params/expert  groups  shared",
    ]
    for row in info["layers"]:
        lines.append(
            f"  {row['layer']:>5}  {row['experts']:>7}  {row['novices']:>7}  {row['top_k']:>5}  {row['intermediate_size']:>12}  "
            f"{row['params_per_expert']:>13,}  {row['routing_groups']:>6}  {','.join(row['shared_experts']) or '-'}"
        )
    return "\n".join(lines)


def _ranges(ids: list[int]) -> str:
    """[0,1,2,5] -> '0-2,5'."""
    parts, start = [], None
    for i, value in enumerate(ids):
        if start is None:
            start = value
        if i + 1 == len(ids) or ids[i + 1] != value + 1:
            parts.append(f"{start}-{value}" if value != start else f"{value}")
            start = None
    return ",".join(parts) or "-"
