"""A rewritten checkpoint in moeprune's format for a family whose disk names moeprune cannot
give (`FamilySpec.disk_names_known` false: DeepSeek-V4's reference naming, `layers.3.ffn.
experts.5.w1.weight`).

moeprune's format keeps transformers' internal names for such a family (`checkpoint/names.
disk_tensors`), and its loader reads them back strictly. So the no-load rewrite, which copies the
input's bytes under the input's names, renames every tensor to the parameter it loads into
(transformers' own renamings, `CheckpointLayout.addresses`) and writes each MoE layer's experts
as the fused parameter the model holds (`experts.gate_up_proj [E', 2I, d]`): the kept experts'
stored parts (gate and up) concatenated expert by expert, read one expert at a time. A tensor
transformers converts when loading beyond that, or a quantized input, is refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from moeprune.errors import MoePruneError
from moeprune.shards.layout import CheckpointLayout, ExpertParam
from moeprune.shards.out_tensor import OutTensor
from moeprune.shards.reader import ShardReader

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def needs_internal_names(layout: CheckpointLayout, per_layer_counts: bool) -> bool:
    """Whether a result in moeprune's format must be written under the internal names."""
    return per_layer_counts and not layout.moe.spec.disk_names_known


def to_internal(
    layout: CheckpointLayout,
    shards: dict[str, list[OutTensor]],
    kept: dict[int, list[int]],
    as_stored: Callable[[str], bool] = lambda key: False,
) -> dict[str, list[OutTensor]]:
    """`shards` (the rewrite under the input's names, dropped experts gone) with every tensor
    under its internal name and each MoE layer's experts fused, kept experts in plan order, the
    extra (zero) experts' stored rows after them. Keys `as_stored` accepts (the release's MTP
    layers, which the model does not hold and config.json's `mtp` entry names as stored) keep
    their names."""
    if layout.fmt is not None:
        raise MoePruneError(
            f"{layout.moe.model_type} results with different expert counts per layer are written under the "
            "model's own names, which a quantized input cannot keep byte for byte: prune the loaded model instead "
            "(without --no-load)"
        )
    fused = {p.internal for lay in layout.all_layers for p in lay.experts.values()}
    reader = ShardReader(layout.path, layout.tensors)
    out: dict[str, list[OutTensor]] = {}
    model = set(layout.moe.model.state_dict())
    first = next(iter(shards), None)
    for file, tensors in shards.items():
        renamed = []
        for tensor in tensors:
            if as_stored(tensor.key):
                renamed.append(tensor)
                continue
            addr = layout.naming.address(tensor.key)  # a renumbered expert key names its parameter too
            if addr.internal in fused:
                continue  # the experts: written below, fused
            # transformers checks a renamed key against the model when loading: one the model lacks
            # was not meant (DeepSeek-V4's `.norm.` -> `.kv_norm.` is the attention's, not the final norm)
            name = addr.internal if addr.internal in model else tensor.key
            if addr.converted or name not in model:
                raise MoePruneError(
                    f"cannot name {tensor.key!r} as the model does (transformers converts it when loading): "
                    "prune the loaded model instead (without --no-load)"
                )
            renamed.append(OutTensor(name, tensor.dtype, tensor.shape, tensor.ranges, tensor.chunks))
        out[file] = renamed
    if first is None:
        return out
    for lay in layout.layers:
        for param in lay.experts.values():
            rows = kept[lay.index] + list(range(lay.num_experts, lay.num_experts + param.extra_rows))
            out[first].append(_fused(layout, reader, param, rows))
    return out


def _fused(layout: CheckpointLayout, reader: ShardReader, param: ExpertParam, rows: list[int]) -> OutTensor:
    """The fused parameter `param` holding `rows` (its stored experts' numbers), made in memory one
    expert at a time while the shard is written; the rows of extra experts the input does not
    store (LongCat-Flash's release: its zero experts' gate/up) are zeros, as moeprune loads them."""
    sample = reader.row(param.fused, 0) if param.fused else _expert(reader, param, rows[0])
    if sample.dtype not in _DTYPES:
        raise MoePruneError(f"cannot write {param.internal}: unsupported dtype {sample.dtype}")

    def chunks() -> Iterator[torch.Tensor]:
        for e in rows:
            if param.fused:
                yield reader.row(param.fused, e)
            else:
                yield _expert(reader, param, e) if e in param.parts else torch.zeros_like(sample)

    return OutTensor(param.internal, _DTYPES[sample.dtype], (len(rows), *sample.shape), chunks=chunks)


def _expert(reader: ShardReader, param: ExpertParam, expert: int) -> torch.Tensor:
    """One expert's slice of `param`: its stored parts (gate, up) concatenated as loading does."""
    return torch.cat([reader.tensor(k) for k in param.keys(expert)], dim=param.cat_dim)
