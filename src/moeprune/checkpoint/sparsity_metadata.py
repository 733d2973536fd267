"""`moe_sparsity_config`: the metadata standard for MoE checkpoints with fewer experts.

compressed-tensors 0.20 describes a pruned MoE checkpoint by `{"method": "prune" | "novice",
"num_experts": [null | int per decoder layer]}` (its `ExpertSparsityConfig`, a field of its
quantization config): null for a dense layer, else the experts the layer retains (novices are not
counted: they stay as constants beside the retained experts). moeprune writes it as plain JSON (no
import of compressed-tensors: the vLLM and llm-compressor environments pin older versions) into
every result that removed experts or made novices, so tools that know the standard read the
per-layer counts without knowing moeprune's own section.

Where it goes in config.json, chosen so that no loader changes how it loads the result:
- a quantized result (`--quantize`, or an input's kept quantization) carries it inside its existing
  `quantization_config`, where the standard puts it; transformers passes unknown fields of a
  quantization config through (fp8 and MXFP4 configs take **kwargs; compressed-tensors 0.19's
  QuantizationConfig ignores extra fields, 0.20 validates the field);
- an unquantized result carries it as a top-level key of config.json. Not inside a new
  `quantization_config` (transformers would look for a quantizer and the result would look
  quantized) nor in `compression_config` (vLLM reads that key as a quantization config); a plain
  unknown key becomes a config attribute that transformers, compressed-tensors and vLLM ignore.
`read_sparsity` accepts both places, for checkpoints other tools wrote.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moeprune.checkpoint.structure import CONFIG, read_config_dict
from moeprune.errors import MoePruneError
from moeprune.plan import Plan

SPARSITY_KEY = "moe_sparsity_config"
QUANT_KEY = "quantization_config"
PRUNE, NOVICE = "prune", "novice"  # the standard's methods (compressed-tensors' MoESparsityMethod)


def sparsity_config(plan: Plan, decoder_layers: int, moe_counts: Mapping[int, int]) -> dict | None:
    """The standard's description of a result made by `plan`, or None when no expert was removed
    or made a novice (neuron pruning keeps every expert: nothing for the standard to say).

    `moe_counts` holds every MoE layer's routed-expert count as the result stores it (layers the
    plan leaves out keep theirs); a planned layer retains its kept experts less its novices."""
    if not any(lp.dropped or lp.novice for lp in plan.layers):
        return None
    counts: list[int | None] = [None] * decoder_layers
    for index, count in moe_counts.items():
        counts[index] = int(count)
    for lp in plan.layers:
        counts[lp.layer] = len(lp.kept) - len(lp.novice)  # a plan's novices are among its kept ids
    return {"method": NOVICE if any(lp.novice for lp in plan.layers) else PRUNE, "num_experts": counts}


def record_sparsity(folder: Path, metadata: dict) -> None:
    """Add `metadata` to `folder`'s config.json: inside its quantization_config when it has one,
    else as a top-level key (the module docstring says why). Everything else is left as it is."""
    config = read_config_dict(folder)
    quant = config.get(QUANT_KEY)
    target = quant if isinstance(quant, dict) else config
    target[SPARSITY_KEY] = metadata
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")  # keys in their order


def read_sparsity(config: Mapping[str, Any]) -> dict | None:
    """The `moe_sparsity_config` a config.json carries (any tool's), checked against the standard's
    schema; None when it has none. One clear error for a malformed one."""
    quant = config.get(QUANT_KEY)
    found = quant.get(SPARSITY_KEY) if isinstance(quant, Mapping) else None
    if found is None:
        found = config.get(SPARSITY_KEY)
    if found is None:
        return None
    valid = (
        isinstance(found, Mapping)
        and found.get("method") in (PRUNE, NOVICE)
        and isinstance(found.get("num_experts"), list)
        and all(c is None or (isinstance(c, int) and not isinstance(c, bool)) for c in found["num_experts"])
    )
    if not valid:
        raise MoePruneError(
            f"config.json's {SPARSITY_KEY} is {found!r}: the standard (compressed-tensors 0.20) wants "
            '{"method": "prune" | "novice", "num_experts": [null | int per decoder layer]}; fix or remove it'
        )
    return {"method": found["method"], "num_experts": list(found["num_experts"])}


def describe_sparsity(metadata: Mapping[str, Any]) -> str:
    """One line for `inspect`: the method and each MoE layer's retained count."""
    counts: Sequence[int | None] = metadata["num_experts"]
    moe = [f"{i}:{c}" for i, c in enumerate(counts) if c is not None]
    return f"{SPARSITY_KEY}: method {metadata['method']}; experts per MoE layer {' '.join(moe) or '-'}"
