"""A uniform drop written as a new checkpoint without loading the model: the pruned shards are
written tensor by tensor as byte-range copies of the source (kept experts renumbered, router rows
cut), with the index, the config's expert count and the other files beside them."""

from __future__ import annotations

import copy
import json
import math
import struct
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import torch
from transformers import PretrainedConfig

from moeprune.allocate.limits import expert_allocation
from moeprune.checkpoint.files import INDEX, SINGLE, StoredTensor, read_header
from moeprune.checkpoint.save import carry_input_files, copy_modeling_files, moeprune_config
from moeprune.checkpoint.structure import CONFIG
from moeprune.criteria import get_criterion
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.reshape import drop_experts, kept_experts
from moeprune.plan import Plan
from moeprune.quant.fp8 import scale_name
from moeprune.quant.support import follow_kept_experts
from moeprune.runtime.atomic import atomic_write_dir, write_json
from moeprune.shards.internal import needs_internal_names, to_internal
from moeprune.shards.layout import CheckpointLayout
from moeprune.shards.mtp import (
    MTP_COUNT_FIELDS,
    NEURONS_SKIP_MTP,
    MtpPlan,
    is_mtp_key,
    mtp_count,
    mtp_serving,
    plan_mtp,
    record_mtp,
    unmapped_mtp,
)
from moeprune.shards.out_tensor import ITEMSIZE as _ITEMSIZE
from moeprune.shards.out_tensor import OutTensor
from moeprune.surgery.registry import ResolvedConfig

PLAN = "plan.json"
_COPY = 1 << 24  # bytes read at a time when copying tensor data


def _merge(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for start, length in ranges:
        if out and sum(out[-1]) == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return tuple(out)


def whole_tensor(key: str, stored: StoredTensor) -> OutTensor:
    return OutTensor(key, stored.dtype, stored.shape, ((stored.start, stored.end - stored.start),))


def _sliced(key: str, stored: StoredTensor, dim: int, kept: Sequence[int]) -> OutTensor:
    """`stored.index_select(dim, kept)` as byte ranges of the row-major source."""
    if stored.dtype not in _ITEMSIZE:
        raise MoePruneError(f"cannot slice {key!r}: unsupported safetensors dtype {stored.dtype}")
    inner = math.prod(stored.shape[dim + 1 :]) * _ITEMSIZE[stored.dtype]
    step = stored.shape[dim] * inner
    ranges = [
        (stored.start + o * step + k * inner, inner)
        for o in range(math.prod(stored.shape[:dim]))
        for k in kept
    ]
    shape = (*stored.shape[:dim], len(kept), *stored.shape[dim + 1 :])
    return OutTensor(key, stored.dtype, shape, _merge(ranges))


def _rewritten(
    layout: CheckpointLayout, kept: dict[int, list[int]], keep: Callable[[str], bool] = lambda key: True
) -> dict[str, list[OutTensor]]:
    """Per shard file, the tensors of the pruned checkpoint (dropped experts gone, kept renumbered),
    of the stored keys `keep` accepts (their scales and companions follow them).

    An fp8 weight's `weight_scale_inv` follows it byte for byte under the weight's new name
    (in the scale's own shard): copied whole, or cut on the same expert dimension; never
    re-quantized."""
    out: dict[str, list[OutTensor]] = defaultdict(list)
    counts = {lay.index: lay.num_experts for lay in layout.all_layers}
    extra = {lay.index: lay.num_experts + lay.spec.extra_experts for lay in layout.all_layers}
    for key, stored in layout.tensors.items():
        addr = layout.addresses.get(key)
        if addr is None or not keep(key):  # a scale: written with its weight
            continue
        layer, dim = layout.roles.get(addr.internal, (None, 0))
        if layer not in kept:
            written = [whole_tensor(key, stored)]
        elif addr.expert is None:
            written = [_sliced(key, stored, dim, _with_extra(kept[layer], counts[layer], stored.shape[dim]))]
        elif addr.expert in (rows := _with_extra(kept[layer], counts[layer], extra[layer])):
            # a kept weighted expert, or the stored row of an extra (zero) expert, after them
            model_key = layout.coded.get(key, key)  # codes are renumbered as the weight they stand for
            renamed = layout.naming.renumber(model_key, rows.index(addr.expert))
            written = [whole_tensor(_renamed(model_key, key, renamed), stored)]
        else:
            continue
        out[stored.file] += written
        cut = layer in kept and addr.expert is None
        for companion in layout.companions.get(key, ()):  # mxfp4 / compressed-tensors scales, shapes...
            moved = _renamed(key, companion, written[0].key)
            stored_companion = layout.tensors[companion]
            if cut and stored_companion.shape[: dim + 1] != stored.shape[: dim + 1]:
                raise MoePruneError(
                    f"cannot cut expert rows of {companion!r}: it is not laid out by expert like {key!r}"
                )
            out[stored_companion.file].append(
                _sliced(moved, stored_companion, dim, kept[layer])
                if cut
                else whole_tensor(moved, stored_companion)
            )
        if key in layout.scales:
            scale = layout.scales[key]
            new_scale = scale_name(written[0].key)
            if layer in kept and addr.expert is None:
                if dim >= len(stored.shape) - 2:  # rows of a block grid cannot be cut one by one
                    raise MoePruneError(
                        f"cannot cut expert rows of fp8 tensor {key!r}: its {scale!r} scales blocks of rows"
                    )
                scaled = _sliced(new_scale, layout.tensors[scale], dim, kept[layer])
            else:
                scaled = whole_tensor(new_scale, layout.tensors[scale])
            out[layout.tensors[scale].file].append(scaled)
    return out


def _with_extra(kept: list[int], count: int, rows: int) -> list[int]:
    """The kept weighted rows, then the rows of extra experts a tensor holds after them (LongCat-
    Flash's zero experts, Inkling's shared-expert sink): never pruned, never counted."""
    return kept + list(range(count, rows)) if rows > count else kept


def _renamed(old: str, other: str, new: str) -> str:
    """The name `other` (a tensor of `old`'s module: codes, scales, shapes, zero points) takes
    when `old` is renumbered to `new`: the same suffix under `new`'s module."""
    old_module, new_module = old.rpartition(".")[0], new.rpartition(".")[0]
    return new_module + other[len(old_module) :]


def _copy_range(src: BinaryIO, dst: BinaryIO, start: int, length: int) -> None:
    src.seek(start)
    while length > 0:
        chunk = src.read(min(_COPY, length))
        if not chunk:
            raise MoePruneError(f"{src.name} ended early: truncated safetensors file")
        dst.write(chunk)
        length -= len(chunk)


def write_shard(src: Path, dst: Path, tensors: Sequence[OutTensor], metadata: dict[str, str]) -> None:
    """A safetensors file written tensor by tensor (memory: one copy block, never one shard)."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in tensors:
        header[t.key] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with src.open("rb") as fin, dst.open("wb") as fout:
        fout.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors:
            if t.chunks is not None:
                _write_chunks(fout, t)
            for start, length in t.ranges:
                _copy_range(fin, fout, start, length)


def _write_chunks(dst: BinaryIO, tensor: OutTensor) -> None:
    """A tensor made in memory: each piece's raw bytes, checked against the header's size."""
    written = 0
    for piece in tensor.chunks():
        data = piece.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        dst.write(data)
        written += data.nbytes
    if written != tensor.nbytes:
        raise MoePruneError(
            f"rewriting {tensor.key!r}: made {written} bytes, its header says {tensor.nbytes} "
            f"({tensor.dtype} {list(tensor.shape)})"
        )


def index_json(original: dict, shards: dict[str, list[OutTensor]]) -> dict:
    tensors = [t for ts in shards.values() for t in ts]
    metadata = {**(original.get("metadata") or {}), "total_size": sum(t.nbytes for t in tensors)}
    if "total_parameters" in metadata:
        metadata["total_parameters"] = sum(math.prod(t.shape) for t in tensors)
    weight_map = {t.key: file for file, ts in shards.items() for t in ts}
    return {**original, "metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}


def check_plan_matches(plan: Plan, moe: MoEModel) -> None:
    """The plan was made for this checkpoint's family and MoE layers."""
    if plan.model_type != moe.model_type:
        raise MoePruneError(f"the plan is for a {plan.model_type} model, the checkpoint is {moe.model_type}")
    if [lp.layer for lp in plan.layers] != [m.index for m in moe.layers]:
        raise MoePruneError(
            f"the plan covers layers {[lp.layer for lp in plan.layers]}, the checkpoint's MoE layers are "
            f"{[m.index for m in moe.layers]}"
        )


def rewrite_supports(config: ResolvedConfig) -> bool:
    """Whether plans of this method (with these options) can be written from the input's bytes:
    whole experts dropped (any counts per layer; different ones are written in moeprune's format),
    not a `--reroute none` drop, whose empty picks are zero novices."""
    return config.surgery.whole_experts


def stock_counts(moe: MoEModel, config: ResolvedConfig, why: tuple[str, str, tuple[str, ...]]) -> list[int]:
    """Experts each layer loses in the uniform drop, refused before any scoring when the layers
    would keep different counts: a stock config says one count, and the rewrite writes nothing
    else. `why` = (when the rule holds, the other way out, the options that fix it)."""
    when, instead, options = why
    limits = config.limits(moe)
    removed = expert_allocation(
        moe, get_criterion(config.criterion), [], config.sparsity_value(), config.allocator, limits
    )
    kept = [n - r for n, r in zip(limits.num_experts, removed)]
    if len(set(kept)) > 1:
        raise MoePruneError(
            f"sparsity {config.sparsity} keeps {kept} experts per layer, different counts a stock config "
            f"cannot express; {when}, every layer must keep the same count: choose a sparsity that removes "
            f"the same share of every layer, {instead}",
            options=options,
        )
    return removed


def _whole_experts_dropped(plan: Plan) -> bool:
    """A plan whose layers only keep or drop whole experts (no novice, no narrowed expert)."""
    return not any(lp.novice or lp.neurons for lp in plan.layers)


def uniform_kept(plan: Plan, moe: MoEModel) -> dict[int, list[int]]:
    """The kept experts per MoE layer of a uniform drop plan, checked like in-memory surgery."""
    if _whole_experts_dropped(plan) and not plan.is_uniform():
        raise MoePruneError(
            "this plan keeps different expert counts per layer, which a stock config cannot express; "
            "rewriting checkpoint files supports uniform drop plans only: use the in-memory `moeprune prune`"
        )
    return plan_kept(plan, moe)


def plan_kept(plan: Plan, moe: MoEModel) -> dict[int, list[int]]:
    """The kept experts per MoE layer of a drop plan (any counts), checked like in-memory surgery."""
    if not _whole_experts_dropped(plan):
        raise MoePruneError(
            f"rewriting checkpoint files supports 'drop' plans, not {plan.method!r}: use the in-memory "
            "`moeprune prune` (it loads the model)"
        )
    check_plan_matches(plan, moe)
    kept = {}
    for lp, layer in zip(plan.layers, moe.layers):
        if lp.num_experts != layer.num_experts:
            raise MoePruneError(
                f"plan layer {lp.layer} is for {lp.num_experts} experts, the checkpoint has {layer.num_experts}"
            )
        kept[lp.layer] = kept_experts(layer, lp.dropped)  # range, top-k and routing-group checks
    return kept


def copy_other_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, custom code...: top-level files that are not weights."""
    carry_input_files(src, dst)


def _write_config(config: PretrainedConfig, dst: Path, field_name: str, count: int) -> None:
    """The config as in-memory surgery saves it: the count set through the config object, so its
    aliases (Qwen3-MoE's hub `num_experts` for `num_local_experts`) cannot disagree."""
    config = copy.deepcopy(config)
    setattr(config.get_text_config(), field_name, count)  # a wrapper's language model holds it
    config.save_pretrained(dst)


def _write_moeprune_config(layout: CheckpointLayout, kept: dict[int, list[int]], dst: Path) -> None:
    """config.json and modeling files of a result with different expert counts per layer: the
    structure moeprune's format records (the kept original ids per layer), computed by dropping the
    same experts from the model on the meta device, and the input's own fields, its
    `quantization_config` included (the kept experts are the input's bytes)."""
    moe = layout.moe
    drop_experts(
        moe,
        {lay.index: [e for e in range(lay.num_experts) if e not in kept[lay.index]] for lay in layout.layers},
    )
    data = moeprune_config(moe, layout.config)
    (dst / CONFIG).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    copy_modeling_files(dst)


def _set_fields(config_file: Path, names: Sequence[str], value: int) -> None:
    """Set the config fields of `names` it has (at its top level or in its text config) to `value`."""
    data = json.loads(config_file.read_text())
    for holder in (data, data.get("text_config")):
        if isinstance(holder, dict):
            holder.update({name: value for name in names if name in holder})
    config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _follow_kept_experts(config_file: Path, kept: dict[int, list[int]]) -> None:
    """A kept quantization_config's module names that name single experts (a release that left
    some experts unquantized) renumbered as the experts were, dropped experts' names removed."""
    data = json.loads(config_file.read_text())
    quant = data.get("quantization_config")
    if isinstance(quant, dict) and (followed := follow_kept_experts(quant, kept)) != quant:
        data["quantization_config"] = followed
        config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


DROP_MTP = "--drop-mtp asked for it"


def release_mtp(src: str | Path, plan: Plan, left_out: str = "") -> MtpPlan | None:
    """What a result of `plan` does with the multi-token-prediction layers the checkpoint `src`
    stores: pruned to the count of the plan's last MoE layer (`mtp_count`: every layer's in a
    stock result), or left out for the reason `left_out` (None: it has none, or is not a
    safetensors stock checkpoint moeprune can map)."""
    if not left_out and plan.is_uniform() and any(lp.neurons for lp in plan.layers):
        left_out = NEURONS_SKIP_MTP  # a stock config's narrowed width would not fit the MTP experts
    try:
        layout = CheckpointLayout(src)
    except MoePruneError as exc:  # MTP layers it cannot map are left out, saying why: never lost silently
        return unmapped_mtp(
            src, left_out or f"their shards cannot be mapped onto the model ({str(exc).split(':')[0]})"
        )
    groups = int(getattr(layout.config.get_text_config(), "n_group", None) or 1)  # DeepSeek's routing groups
    mtp = plan_mtp(layout, mtp_count(plan, groups), plan.criterion, left_out)
    if mtp is not None and not mtp.left_out and not plan.is_uniform():
        mtp.served = mtp_serving(layout.moe.model_type)
    return mtp


def ignored_keys(src: str | Path) -> list[str]:
    """The stored keys of `src` its model class skips on load (none where the layout cannot be read)."""
    try:
        return CheckpointLayout(src).ignored_keys()
    except MoePruneError:
        return []


def with_mtp(plan: Plan, mtp: MtpPlan | None) -> Plan:
    """`plan` recording what happened to the MTP layers (plan.json's `extra.mtp`)."""
    if mtp is not None:
        plan.extra["mtp"] = mtp.to_json()
    return plan


def append_input_tensors(src: str | Path, folder: Path, mtp: MtpPlan | None, carried: Sequence[str]) -> None:
    """Add to the saved checkpoint in `folder` the input's tensors the loaded model never held: the
    MTP layers of `mtp` (pruned as it says, unless it leaves them out) and the stored keys
    `carried` (copied as stored), in shards of their own (`model-extra-*.safetensors`) that the
    index lists beside the model's."""
    layout = CheckpointLayout(src)
    keep_mtp = mtp is not None and not mtp.left_out
    wanted = set(carried)

    def keep(key: str) -> bool:
        return key in wanted or (keep_mtp and mtp is not None and is_mtp_key(mtp, key))

    shards = {f: ts for f, ts in _rewritten(layout, mtp.kept if keep_mtp and mtp else {}, keep).items() if ts}
    if not shards:
        return
    index = json.loads((folder / INDEX).read_text()) if (folder / INDEX).is_file() else None
    if index is None:  # one model.safetensors so far: it becomes the first of numbered shards, which
        # an index lists (loaders read a lone model.safetensors and never look for an index)
        total = len(shards) + 1
        first = f"model-00001-of-{total:05d}.safetensors"
        (folder / SINGLE).rename(folder / first)
        header, _ = read_header(folder / first)
        index = {"metadata": {}, "weight_map": dict.fromkeys(header, first)}
        names = {file: f"model-{i:05d}-of-{total:05d}.safetensors" for i, file in enumerate(shards, 2)}
    else:
        names = {
            file: f"model-extra-{i:05d}-of-{len(shards):05d}.safetensors" for i, file in enumerate(shards, 1)
        }
    for file, tensors in shards.items():
        write_shard(layout.path / file, folder / names[file], tensors, layout.file_metadata[file])
        index["weight_map"].update({t.key: names[file] for t in tensors})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    total = sum(
        t.end - t.start
        for f in set(index["weight_map"].values())
        for t in read_header(folder / f)[0].values()
    )
    index["metadata"] = {**(index.get("metadata") or {}), "total_size": total}
    write_json(folder / INDEX, index)


def rewrite_checkpoint(
    src: str | Path,
    dst: str | Path,
    plan: Plan,
    overwrite: bool = False,
    extra: Callable[[Path], None] | None = None,
    *,
    stock: bool = True,
    mtp: MtpPlan | None = None,
) -> Path:
    """Write the checkpoint `plan` prunes, shard by shard, without loading the model.

    Dropped experts' tensors (or rows of fused tensors), router rows and per-expert biases are
    cut; per-expert keys of kept experts are renumbered 0..n-1; the index and the config's count
    field are updated, other files copied and `plan.json` written. The result equals in-memory
    `drop_experts` then `save_pretrained`. Only uniform drop plans (what a stock config can
    express), unless `stock=False` allows different counts per layer, written in moeprune's format
    (the same tensors, the structure in config.json, the modeling files). `extra(tmp_dir)` may add
    files (a report) before the folder is renamed into place. The release's MTP layers are
    pruned as `mtp` says (`release_mtp`), or left out with the count field set to 0.
    """
    layout = CheckpointLayout(src)
    if Path(dst).resolve() == layout.path.resolve():
        raise MoePruneError(
            "the output folder is the input checkpoint; write the pruned checkpoint elsewhere"
        )
    kept = uniform_kept(plan, layout.moe) if stock else plan_kept(plan, layout.moe)
    counts = {len(k) for k in kept.values()}
    leave_out = mtp is not None and bool(mtp.left_out)
    every = {**kept, **(mtp.kept if mtp is not None and not leave_out else {})}
    shards = {
        f: ts
        for f, ts in _rewritten(
            layout, every, lambda key: not (leave_out and mtp is not None and is_mtp_key(mtp, key))
        ).items()
        if ts
    }

    if needs_internal_names(layout, len(counts) > 1):  # moeprune's format under the model's own names
        shards = to_internal(
            layout, shards, kept, lambda key: not leave_out and mtp is not None and is_mtp_key(mtp, key)
        )

    def write(tmp: Path) -> None:
        for file, tensors in shards.items():
            write_shard(layout.path / file, tmp / file, tensors, layout.file_metadata[file])
        if layout.index is not None:
            write_json(tmp / INDEX, index_json(layout.index, shards))
        if len(counts) == 1:
            _write_config(layout.config, tmp, layout.moe.spec.count_field, counts.pop())
        else:  # moeprune's format: per-layer counts (the in-memory pipeline asks for it, stock=False)
            _write_moeprune_config(layout, kept, tmp)
            record_mtp(tmp, mtp)
        _follow_kept_experts(tmp / CONFIG, kept)
        if leave_out:
            _set_fields(tmp / CONFIG, MTP_COUNT_FIELDS, 0)
        copy_other_files(layout.path, tmp)
        with_mtp(plan, mtp).save(tmp / PLAN)
        if extra is not None:
            extra(tmp)

    return atomic_write_dir(dst, write, overwrite=overwrite)
