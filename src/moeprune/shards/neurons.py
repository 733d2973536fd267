"""Uniform neuron shrink (ENP) written straight to the safetensors shards, without loading the model.

A uniform neuron plan keeps the same K neurons per routed expert (each expert its own K, chosen
from calibration statistics), so the result is a stock checkpoint whose config says K. Like the
drop rewriter (`streaming.rewrite_checkpoint`) it is written shard by shard, tensor by tensor:

- every routed-expert tensor with a neuron axis is rebuilt one expert at a time as the loaded
  model would hold it (`SafetensorsExperts.expert_tensor`: its parts concatenated, or its row of
  a fused tensor), cut with the very `slice_neurons` of in-memory surgery, and split back into
  the checkpoint's parts (gate, up). Peak memory is about one expert.
- where the shared expert's width derives from the routed width (DeepSeek-V2/V3, GLM-4-MoE,
  ERNIE-4.5), the multiplier becomes ceil(W / K) and the shared expert is zero-padded, exactly as
  `surgery.neurons._resize_shared` does (one shared MLP in memory at a time).
- everything else (attention, routers, norms, gpt_oss's down bias) is copied as byte ranges.

The result equals `apply_plan_physical` (`shrink_uniform`) then `save_pretrained` (tested per
family, bit for bit). Llama-4 is refused: its shared expert's width is the same config field
with no multiplier, so in-memory surgery packs it into moeprune's format, which is no stock
checkpoint. So is any plan that is not one K for every expert of every layer (TENP, per-expert
widths), or that drops experts or makes novices.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from itertools import accumulate
from pathlib import Path

import torch
from torch.nn import functional as F

from moeprune.checkpoint.files import INDEX, StoredTensor
from moeprune.checkpoint.structure import read_config_dict
from moeprune.errors import MoePruneError
from moeprune.models.adapter import MoEModel
from moeprune.models.packed import NEURON_AXES, neuron_index, slice_neurons
from moeprune.plan import Plan
from moeprune.quant.support import NEURON_ROUTE, refuse_quantized
from moeprune.runtime.atomic import atomic_write_dir, write_json
from moeprune.shards.layout import CheckpointLayout, ExpertParam, LayerLayout
from moeprune.shards.mtp import MTP_COUNT_FIELDS, MtpPlan
from moeprune.shards.reader import SafetensorsExperts, ShardReader
from moeprune.shards.rewrite import (
    PLAN,
    OutTensor,
    check_plan_matches,
    copy_other_files,
    index_json,
    whole_tensor,
    with_mtp,
    write_shard,
)
from moeprune.surgery.neurons import check_neuron_prunable, shared_multiplier, stock_width_expressible

Keep = Mapping[int, Mapping[int, torch.Tensor]]  # decoder layer -> expert id -> kept neuron ids
_SHARED_PROJ = (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1))  # as surgery.neurons.pad_mlp
_LISTED_IDS = 1 << 16  # kept neuron ids listed in the report up to this many (a digest always)


# --------------------------------------------------------------------------- checks
def check_stock_shrink(moe: MoEModel) -> None:
    """MoePruneError unless a uniform neuron shrink of this family is a stock checkpoint."""
    check_neuron_prunable(moe)
    if not stock_width_expressible(moe):
        raise MoePruneError(
            f"{moe.model_type} derives its shared expert's width from the routed experts' config field "
            f"{moe.spec.intermediate_field!r} with no multiplier, so a uniform neuron shrink is saved in "
            "moeprune's packed format, not as a stock checkpoint; rewriting checkpoint files cannot write it: "
            "prune it with the model loaded",
            options=("no_load",),
        )


def uniform_neuron_width(plan: Plan, moe: MoEModel) -> int:
    """K of a plan where every routed expert of every layer keeps K neurons (K = I: no shrink)."""
    check_plan_matches(plan, moe)
    check_stock_shrink(moe)
    full = {m.intermediate_size for m in moe.layers}
    if len(full) != 1:
        raise MoePruneError(
            f"the MoE layers have different expert widths {sorted(full)}; no stock config says K"
        )
    width = full.pop()
    counts = set()
    for lp, layer in zip(plan.layers, moe.layers):
        if lp.num_experts != layer.num_experts or sorted(lp.kept) != list(range(layer.num_experts)):
            raise MoePruneError(
                f"plan layer {lp.layer} drops experts or makes novices; rewriting checkpoint files with neuron "
                "shrink keeps every expert (drop experts with a drop plan, or prune in memory)"
            )
        counts |= {int(lp.neurons.get(e, width)) for e in range(layer.num_experts)}
    if len(counts) != 1:
        raise MoePruneError(
            f"this plan gives experts different neuron counts {sorted(counts)}, which a stock config cannot "
            "express (TENP, per-expert widths); rewriting checkpoint files supports uniform neuron plans only: "
            "use the in-memory `moeprune prune` (it saves them in moeprune's packed format)"
        )
    k = counts.pop()
    if not 1 <= k <= width:
        raise MoePruneError(f"the plan keeps {k} neurons of {width} per expert; keep between 1 and all")
    if not stock_width_expressible(moe, k):
        raise MoePruneError(
            f"{k} neurons per expert is not a multiple of 8: transformers' default grouped_mm kernel could not "
            "run the stock checkpoint; use the in-memory `moeprune prune` (it packs such widths)"
        )
    return k


def _check_keep(keep: Keep, moe: MoEModel, width: int) -> None:
    full = moe.layers[0].intermediate_size
    for layer in moe.layers:
        given = keep.get(layer.index, {})
        if width == full and not given:
            continue
        if sorted(given) != list(range(layer.num_experts)):
            raise MoePruneError(
                f"layer {layer.index}: kept neurons are given for experts {sorted(given)}, the plan shrinks "
                f"all {layer.num_experts}"
            )
        for e, ids in given.items():
            ids = torch.as_tensor(ids)
            ok = ids.dim() == 1 and len(ids) == width and not ids.is_floating_point()
            if not ok or (width and (ids.min() < 0 or ids.max() >= full or bool((ids.diff() <= 0).any()))):
                raise MoePruneError(
                    f"layer {layer.index} expert {e}: kept neurons must be {width} increasing ids in [0, {full})"
                )


# --------------------------------------------------------------------------- routed experts
class _Slicer:
    """Each routed expert's tensors cut to its kept neurons, read one expert at a time.

    The parts of one per-expert tensor (gate and up of gate_up_proj) are written as separate
    checkpoint tensors: the cut expert is kept (one per parameter name) until its parts are
    written, so it is read once.
    """

    def __init__(self, layout: CheckpointLayout, keep: Keep, full: int):
        self.layout, self.keep, self.full = layout, keep, full
        self._last: dict[str, tuple[tuple[int, int], tuple[torch.Tensor, ...]]] = {}
        self._source: SafetensorsExperts | None = None

    def source(self, lay: LayerLayout) -> SafetensorsExperts:
        """The layer's experts on disk; moving to another layer closes the shards' memory maps, so
        the pages read stay mapped for one layer at most."""
        if self._source is None or self._source.layer != lay.index:
            self._source = None
            self._source = SafetensorsExperts(lay, ShardReader(self.layout.path, self.layout.tensors))
        return self._source

    def index(self, lay: LayerLayout, name: str, expert: int) -> torch.Tensor:
        """Positions along the expert tensor's neuron axis that are kept (increasing)."""
        ids = torch.as_tensor(self.keep[lay.index][expert])
        return neuron_index(lay.spec.layout, name, ids, self.full)

    def cut(self, lay: LayerLayout, name: str, expert: int) -> torch.Tensor:
        tensor = self.source(lay).expert_tensor(name, expert)
        ids = torch.as_tensor(self.keep[lay.index][expert])
        return slice_neurons(lay.spec.layout, name, tensor, ids, self.full)

    def parts(self, lay: LayerLayout, name: str, expert: int, sizes: list[int]) -> tuple[torch.Tensor, ...]:
        param = lay.experts[name]
        last = self._last.get(name)
        if last is None or last[0] != (lay.index, expert):
            self._last.pop(name, None)  # free the previous expert first
            cut = self.cut(lay, name, expert)
            self._last[name] = ((lay.index, expert), torch.split(cut, sizes, dim=param.cat_dim))
        return self._last[name][1]


def _checked(piece: torch.Tensor, shape: tuple[int, ...], key: str) -> torch.Tensor:
    if tuple(piece.shape) != shape:
        raise MoePruneError(f"rewriting {key!r}: cut to {list(piece.shape)}, expected {list(shape)}")
    return piece


def _fused_tensor(
    key: str, stored: StoredTensor, lay: LayerLayout, name: str, slicer: _Slicer, axis: int
) -> OutTensor:
    """A fused [E, ...] tensor: every expert's row cut, written one row at a time."""
    row = list(stored.shape[1:])
    row[axis] = len(slicer.index(lay, name, 0))
    row_shape = tuple(row)

    def chunks() -> Iterator[torch.Tensor]:
        for e in range(lay.num_experts):
            yield _checked(slicer.cut(lay, name, e), row_shape, key)

    return OutTensor(key, stored.dtype, (stored.shape[0], *row_shape), chunks=chunks)


def _part_tensor(
    key: str,
    stored: StoredTensor,
    lay: LayerLayout,
    name: str,
    param: ExpertParam,
    expert: int,
    slicer: _Slicer,
    axis: int,
) -> OutTensor:
    """One part (gate, up, or the whole) of one expert's tensor, cut like the concatenated tensor."""
    keys = param.keys(expert)
    shapes = [slicer.layout.tensors[k].shape for k in keys]
    index = slicer.index(lay, name, expert)
    d = param.cat_dim
    if d == axis:  # the parts split the neuron axis: each keeps the kept positions in its range
        bounds = [0, *accumulate(s[d] for s in shapes)]
        sizes = [int(((index >= lo) & (index < hi)).sum()) for lo, hi in zip(bounds, bounds[1:])]
    else:
        sizes = [s[d] for s in shapes]
    j = keys.index(key)
    shape = list(stored.shape)
    if d == axis:
        shape[d] = sizes[j]
    else:
        shape[axis] = len(index)
    out_shape = tuple(shape)

    def chunks() -> Iterator[torch.Tensor]:
        yield _checked(slicer.parts(lay, name, expert, sizes)[j], out_shape, key)

    return OutTensor(key, stored.dtype, out_shape, chunks=chunks)


# --------------------------------------------------------------------------- shared expert
def _shared_padding(
    layout: CheckpointLayout, full: int, width: int
) -> tuple[dict[str, OutTensor], tuple[str, int] | None]:
    """Zero-padded shared-expert tensors and the new multiplier, as `_resize_shared` does in memory."""
    moe = layout.moe
    field = shared_multiplier(moe) if moe.spec.shared_width_derived else None
    multiplier = int(getattr(moe.config, field) or 0) if field else 0
    if field is None or multiplier <= 0 or width == full:
        return {}, None
    new_multiplier = math.ceil(full * multiplier / width)
    target = width * new_multiplier
    names = {id(m): n for n, m in moe.model.named_modules()}
    out: dict[str, OutTensor] = {}
    for layer in moe.layers:
        for module in layer.shared_modules:
            for proj, dim in _SHARED_PROJ:
                for pname, param in getattr(module, proj).named_parameters(recurse=False):
                    if pname != "weight" and dim == 1:
                        continue  # down_proj's bias has no neuron axis
                    pad_dim = dim if pname == "weight" else 0
                    extra = target - param.shape[pad_dim]
                    if extra <= 0:
                        continue
                    internal = f"{names[id(module)]}.{proj}.{pname}"
                    out.update(_padded(layout, internal, tuple(param.shape), pad_dim, extra))
    return out, (field, new_multiplier)


def _padded(
    layout: CheckpointLayout, internal: str, shape: tuple[int, ...], dim: int, extra: int
) -> dict[str, OutTensor]:
    keys = layout.stored_as.get(internal, [])
    if len(keys) != 1 or layout.tensors[keys[0]].shape != shape:
        raise MoePruneError(
            f"checkpoint {layout.path}: shared-expert parameter {internal} is not stored as one {list(shape)} "
            f"tensor (found {[(k, list(layout.tensors[k].shape)) for k in keys]}); cannot pad it"
        )
    key = keys[0]
    stored = layout.tensors[key]
    pad = [0, 0] * (len(shape) - 1 - dim) + [0, extra]
    new_shape = tuple(s + extra if i == dim else s for i, s in enumerate(shape))

    def chunks() -> Iterator[torch.Tensor]:
        stored_tensor = ShardReader(layout.path, layout.tensors).tensor(key)  # mapped only while read
        yield _checked(F.pad(stored_tensor, pad), new_shape, key)

    return {key: OutTensor(key, stored.dtype, new_shape, chunks=chunks)}


# --------------------------------------------------------------------------- the rewrite
def _neuron_shards(
    layout: CheckpointLayout,
    keep: Keep,
    width: int,
    shared: Mapping[str, OutTensor],
    leave_out: tuple[str, ...] = (),
) -> dict[str, list[OutTensor]]:
    """Per shard file, the tensors of the shrunk checkpoint (same keys, same order), but those
    under the prefixes `leave_out` (MTP layers the shrink does not narrow)."""
    full = layout.moe.layers[0].intermediate_size
    slicer = _Slicer(layout, keep, full)
    params = {p.internal: (lay, name, p) for lay in layout.layers for name, p in lay.experts.items()}
    out: dict[str, list[OutTensor]] = defaultdict(list)
    for key, stored in layout.tensors.items():
        if leave_out and key.startswith(leave_out):
            continue
        addr = layout.addresses[key]
        hit = params.get(addr.internal) if width < full else None
        axis = NEURON_AXES[hit[0].spec.layout][hit[1]] if hit else None
        if key in shared:
            tensor = shared[key]
        elif hit is None or axis is None:
            tensor = whole_tensor(key, stored)
        elif addr.expert is None:
            tensor = _fused_tensor(key, stored, hit[0], hit[1], slicer, axis[0])
        else:
            tensor = _part_tensor(key, stored, hit[0], hit[1], hit[2], addr.expert, slicer, axis[0])
        out[stored.file].append(tensor)
    return out


def rewrite_neuron_checkpoint(
    src: str | Path,
    dst: str | Path,
    plan: Plan,
    keep: Keep,
    overwrite: bool = False,
    extra: Callable[[Path], None] | None = None,
    mtp: MtpPlan | None = None,
) -> Path:
    """Write the checkpoint a uniform neuron plan gives, shard by shard, without loading the model;
    the release's MTP layers of `mtp` are left out (it says why).

    `keep[layer][expert]` are the kept neuron ids (increasing; `plans.resolve_plan(...).keep`,
    from calibration statistics). The config's intermediate size becomes K (and the shared
    multiplier of derived shared experts), the index is updated, other files are copied and
    `plan.json` written; `extra(tmp_dir)` may add files before the folder is renamed into place.
    The result equals `apply_plan_physical` then `save_pretrained`.
    """
    refuse_quantized(src, read_config_dict(Path(src)), "cutting neurons", NEURON_ROUTE, options=("method",))
    layout = CheckpointLayout(src)
    if any(p.extra_rows for lay in layout.layers for p in lay.experts.values()):
        raise MoePruneError(
            f"this {layout.moe.model_type} checkpoint stores rows for its zero experts beside the weighted "
            "ones (transformers' own save), which the neuron rewrite does not cut: prune the loaded model "
            "instead (without --no-load), or give the release's layout"
        )
    if Path(dst).resolve() == layout.path.resolve():
        raise MoePruneError(
            "the output folder is the input checkpoint; write the pruned checkpoint elsewhere"
        )
    moe = layout.moe
    width = uniform_neuron_width(plan, moe)
    _check_keep(keep, moe, width)
    full = moe.layers[0].intermediate_size
    shared, multiplier = _shared_padding(layout, full, width)
    leave_out = mtp.roots if mtp is not None else ()
    shards = {f: ts for f, ts in _neuron_shards(layout, keep, width, shared, leave_out).items() if ts}

    def write(tmp: Path) -> None:
        for file, tensors in shards.items():
            write_shard(layout.path / file, tmp / file, tensors, layout.file_metadata[file])
        if layout.index is not None:
            write_json(tmp / INDEX, index_json(layout.index, shards))
        config = copy.deepcopy(layout.config)
        if width < full:  # set through the config object, as in-memory surgery does
            text = config.get_text_config()  # a wrapper's language model holds the fields
            setattr(text, moe.spec.intermediate_field, width)
            if multiplier is not None:
                setattr(text, *multiplier)
        if mtp is not None:  # left out (its experts are not narrowed), as the report says
            for name in MTP_COUNT_FIELDS:
                if getattr(config.get_text_config(), name, None):
                    setattr(config.get_text_config(), name, 0)
        config.save_pretrained(tmp)
        copy_other_files(layout.path, tmp)
        with_mtp(plan, mtp).save(tmp / PLAN)
        if extra is not None:
            extra(tmp)

    return atomic_write_dir(dst, write, overwrite=overwrite)


def keep_summary(keep: Keep) -> dict:
    """For the report: how many neurons were kept, a digest of every kept id, and the ids if few."""
    digest = hashlib.sha256()
    total = sum(len(ids) for by_expert in keep.values() for ids in by_expert.values())
    listed: dict[str, list[list[int]]] = {}
    for layer in sorted(keep):
        for e in sorted(keep[layer]):
            ids = torch.as_tensor(keep[layer][e]).to(torch.int64)
            digest.update(f"{layer}:{e}:".encode() + ids.numpy().tobytes())
            if total <= _LISTED_IDS:
                listed.setdefault(str(layer), []).append(ids.tolist())
    summary: dict[str, object] = {"ids_total": total, "sha256": digest.hexdigest()}
    if total <= _LISTED_IDS:
        summary["ids"] = listed  # per MoE layer, one list per expert (by expert id)
    return summary
