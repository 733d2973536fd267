"""Rows a model holds that a release does not store: LongCat-Flash's zero experts' gate/up rows.

transformers (5.23) sizes LongCat-Flash's fused `gate_up_proj` for the weighted and the zero
(identity) experts, though it never computes the zero experts' rows; the release stores the
weighted experts only (`experts.0..n-1`, as vLLM reads them), so the stock loader refuses it on a
size mismatch. moeprune loads it by handing transformers' own loader zeros for those rows:
they stand for nothing, and the weighted experts load from the files as stored.
"""

from __future__ import annotations

import re

import torch
from transformers import PreTrainedModel

from moeprune.checkpoint.files import StoredTensor
from moeprune.models import MoEModel

_PER_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(\w+)\.weight$")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def unstored_rows(model: PreTrainedModel, tensors: dict[str, StoredTensor]) -> dict[str, torch.Tensor]:
    """Stored key -> zeros, for every extra expert's per-expert tensor the model's parameters hold
    but the checkpoint does not (none for a checkpoint transformers saved: it writes them)."""
    try:
        moe = MoEModel(model)
    except Exception:  # noqa: BLE001 - not an MoE model moeprune knows: nothing to add
        return {}
    # the per-expert names transformers' conversion reads (LongCat-Flash: the qwen2_moe naming)
    extra, names = moe.spec.extra_experts, moe.spec.disk_expert_names or ("gate_proj", "up_proj", "down_proj")
    if not extra:
        return {}
    sized = [
        name
        for name, p in moe.layers[0].experts.named_parameters(recurse=False)
        if p.dim() >= 1 and p.shape[0] == moe.layers[0].num_experts + extra
    ]
    if not sized:
        return {}
    fused = {"gate_up_proj": names[:2], "up_proj": names[1:2]}
    wanted = {part for name in sized for part in fused.get(name, ())}
    found: dict[tuple[str, str], dict[int, StoredTensor]] = {}
    for key, stored in tensors.items():
        match = _PER_EXPERT.match(key)
        if match and match.group(3) in wanted:
            found.setdefault((match.group(1), match.group(3)), {})[int(match.group(2))] = stored
    count = moe.layers[0].num_experts
    out = {}
    for (prefix, part), experts in found.items():
        if sorted(experts) != list(range(count)):  # all stored (transformers' save), or not an MoE's
            continue
        first = experts[0]
        for e in range(count, count + extra):
            out[f"{prefix}{e}.{part}.weight"] = torch.zeros(
                first.shape, dtype=_DTYPES.get(first.dtype, torch.float32)
            )
    return out
