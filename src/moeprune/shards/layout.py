"""Scoring and surgery straight on the safetensors shards, without loading the model.

Weight-only criteria (aimer, magnitude) read each expert once, and a uniform drop plan only moves
bytes, so neither needs the model in memory: `score_checkpoint` reads one expert's byte ranges
at a time from the shards (plain reads into a reused buffer), and `rewrite_checkpoint` writes the pruned shards tensor by tensor
as byte-range copies. The model is only ever built on the meta device (no storage), to find its
MoE layers with the very rules of the adapter.

Checkpoint naming is not the in-memory naming. transformers 5 fuses the experts in memory
(`experts.gate_up_proj [E, 2I, d]`) but `save_pretrained` writes most families back in their hub
naming, one tensor per expert (`mlp.experts.3.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.3.w1.weight`), while gpt_oss and Llama-4 stay fused. Rather than a
table per family, every key goes through transformers' own load-time conversion
(`get_model_conversion_mapping`): its renamings and converter give the in-memory parameter the
key feeds, the converter's wildcard gives the expert number, and the position of the matching
source pattern gives the part (gate 0, up 1 of `gate_up_proj`). A naming transformers can load,
we can stream; a conversion beyond stacking experts and concatenating parts (quantized scales,
transposes) is refused with a clear error instead of being guessed. The renamings are applied with
`rename_source_key` (what loading itself calls, in every release from 5.16 on; the newer helper
`apply_renamings` is missing up to 5.19 at least).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import struct
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import BinaryIO

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

from moeprune.checkpoint import (
    LEGACY_FILE,
    atomic_write_dir,
    check_model_path,
    is_moeprune_format,
    load_config,
    write_json,
)
from moeprune.criteria import (
    CRITERIA,
    WEIGHT_SCORERS,
    LayerScores,
    compute_scores,
    get_criterion,
    pruning_order_of,
)
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.adapter import MoELayer
from moeprune.models.spec import FamilySpec
from moeprune.plan import Plan
from moeprune.surgery.drop import kept_experts

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
PLAN = "plan.json"
# Top-level files a rewrite does not copy: rewritten ones, stale weights, the source's own evidence.
_NOT_COPIED = (CONFIG, INDEX, PLAN, "report.json", LEGACY_FILE)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_ITEMSIZE = {  # bytes per element of the safetensors dtypes a slice may cut
    **dict.fromkeys(("F64", "I64", "U64", "C64"), 8),
    **dict.fromkeys(("F32", "I32", "U32"), 4),
    **dict.fromkeys(("F16", "BF16", "I16", "U16"), 2),
    **dict.fromkeys(("I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0"), 1),
}
_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
_SUMMED = ("gate_up_proj", "down_proj")  # the expert parameters gate, up and down come from
_BLOCK = 1 << 20  # elements per op: few enough ops that worker threads seldom queue for the GIL
_COPY = 1 << 24  # bytes read at a time when copying tensor data
WEIGHT_ONLY = tuple(c.name for c in CRITERIA.values() if not c.needs_data)


# --------------------------------------------------------------------------- shard headers
@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a shard, from its header: absolute byte range in the file."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _read_header(path: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """The tensors and file metadata of one safetensors file (8-byte size, JSON, data)."""
    try:
        with path.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
    except (OSError, struct.error, ValueError) as exc:
        raise MoePruneError(f"cannot read the safetensors header of {path}: {exc}") from exc
    meta = header.pop("__metadata__", None) or {}
    base = 8 + size
    tensors = {
        key: StoredTensor(path.name, v["dtype"], tuple(v["shape"]), base + v["data_offsets"][0], base + v["data_offsets"][1])
        for key, v in header.items()
    }  # fmt: skip
    return tensors, meta


def _shards(path: Path) -> tuple[list[str], dict | None]:
    """Shard file names and the index JSON (None for a single-file checkpoint)."""
    index = path / INDEX
    if index.is_file():
        try:
            data = json.loads(index.read_text())
            return sorted(set(data["weight_map"].values())), data
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise MoePruneError(f"cannot read {index}: {exc}") from exc
    if (path / SINGLE).is_file():
        return [SINGLE], None
    raise MoePruneError(
        f"{str(path)!r} has no safetensors weights ({SINGLE} or {INDEX}); checkpoint streaming reads "
        "safetensors only: load the model instead"
    )


# --------------------------------------------------------------------------- checkpoint naming
@dataclass(frozen=True)
class Address:
    """Where one checkpoint tensor goes in the model: its parameter, and for per-expert naming
    the expert number and the part (position among the converter's sources)."""

    internal: str
    expert: int | None = None
    part: int = 0
    cat_dim: int = 0  # dimension of one expert along which its parts are concatenated


def _cat_dim(converter: WeightConverter) -> int:
    """Per-expert parts are stacked on dim 0 then (optionally) concatenated: the dim within one expert."""
    ops = list(converter.operations)
    stacked = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    rest = ops[1:]
    if not stacked or len(rest) > 1 or (rest and not (isinstance(rest[0], Concatenate) and rest[0].dim >= 1)):
        raise MoePruneError(
            f"checkpoint conversion {converter!r} does more than stacking experts and concatenating parts; "
            "streaming cannot read this checkpoint: load the model instead"
        )
    return rest[0].dim - 1 if rest else 0


def _expert_number(pattern: str, renamed: str) -> int:
    pieces = pattern.split("*")
    match = re.search(r"(\d+)".join(pieces), renamed) if len(pieces) == 2 else None
    if match is None:
        raise MoePruneError(f"cannot find the expert number of {renamed!r} with pattern {pattern!r}")
    return int(match.group(1))


class Naming:
    """transformers' own load-time conversion of checkpoint keys, asked one key at a time."""

    def __init__(self, model: torch.nn.Module):
        transforms = get_model_conversion_mapping(model)
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def address(self, key: str) -> Address:
        renamed, _ = rename_source_key(key, self.renamings, [])  # renamings only, in order
        for converter in self.converters:  # at most one converter applies, as when loading
            internal, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                part = converter.source_patterns.index(pattern)
                return Address(internal, _expert_number(pattern, renamed), part, _cat_dim(converter))
        return Address(renamed)

    def renumber(self, key: str, new: int) -> str:
        """`key` with its expert number replaced by `new`: the dotted component whose change moves
        the expert (not, say, the layer number that happens to be equal)."""
        old = self.address(key)
        if old.expert == new:
            return key
        parts = key.split(".")
        for i, part in enumerate(parts):
            if part == str(old.expert):
                candidate = ".".join([*parts[:i], str(new), *parts[i + 1 :]])
                moved = self.address(candidate)
                if moved.expert == new and (moved.internal, moved.part) == (old.internal, old.part):
                    return candidate
        raise MoePruneError(f"cannot renumber expert {old.expert} in checkpoint key {key!r}")


# --------------------------------------------------------------------------- layer layouts
@dataclass
class ExpertParam:
    """One fused expert parameter of the model (gate_up_proj, down_proj, biases) as stored on disk."""

    internal: str
    shape: tuple[int, ...]  # in-memory shape [E, ...]
    fused: str | None = None  # key of the whole [E, ...] tensor
    parts: dict[int, dict[int, str]] = field(default_factory=dict)  # expert -> part -> key
    cat_dim: int = 0

    def keys(self, expert: int) -> list[str]:
        return [self.parts[expert][p] for p in sorted(self.parts[expert])]


@dataclass
class LayerLayout:
    """Where one MoE layer's experts and router live in the checkpoint."""

    index: int
    spec: FamilySpec
    num_experts: int
    experts: dict[str, ExpertParam]  # by parameter name on the experts module
    router: dict[str, tuple[str, int]]  # router tensor path -> (checkpoint key, expert dim)


def meta_model(path: str | Path, config: PretrainedConfig | None = None) -> MoEModel:
    """The checkpoint's model on the meta device (allocates nothing), seen through the adapter.

    Its layers give the MoE layer indices, expert counts, top-k and routing groups the plan and
    allocation code need (`pipeline.build_plan` accepts it), with the same rules as a loaded model.
    """
    config = config or load_config(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return MoEModel(model)


class CheckpointLayout:
    """A checkpoint folder mapped onto its model's MoE layers, without reading any weight."""

    def __init__(self, path: str | Path):
        self.path = check_model_path(path)
        if is_moeprune_format(self.path):
            raise MoePruneError(
                f"{str(self.path)!r} is in moeprune's own format (per-layer expert counts); streaming reads stock "
                "checkpoints: load it with moeprune.load_pretrained instead"
            )
        self.config = load_config(self.path)
        self.moe = meta_model(self.path, self.config)
        files, self.index = _shards(self.path)
        self.tensors: dict[str, StoredTensor] = {}
        self.file_metadata: dict[str, dict[str, str]] = {}
        for name in files:
            tensors, self.file_metadata[name] = _read_header(self.path / name)
            self.tensors.update(tensors)
        self.naming = Naming(self.moe.model)
        self.addresses = {key: self.naming.address(key) for key in self.tensors}
        self.stored_as: dict[str, list[str]] = defaultdict(list)  # in-memory name -> checkpoint keys
        for key, addr in self.addresses.items():
            self.stored_as[addr.internal].append(key)
        blocks = {id(m): name for name, m in self.moe.model.named_modules()}
        self.layers = [self._layout(layer, blocks[id(layer.block)]) for layer in self.moe.layers]
        self.roles = {  # in-memory name -> (layer, expert dim) of every per-expert tensor
            **{p.internal: (lay.index, 0) for lay in self.layers for p in lay.experts.values()},
            **{self.addresses[key].internal: (lay.index, dim) for lay in self.layers for key, dim in lay.router.values()},
        }  # fmt: skip
        self._check_unknown_expert_tensors()

    def _layout(self, layer: MoELayer, block: str) -> LayerLayout:
        n = layer.num_experts
        params = {
            name: ExpertParam(f"{block}.experts.{name}", tuple(p.shape))
            for name, p in layer.experts.named_parameters(recurse=False)
            if p.dim() >= 1 and p.shape[0] == n
        }
        for param in params.values():
            for key in self.stored_as.get(param.internal, ()):
                addr = self.addresses[key]
                if addr.expert is None:
                    param.fused = key
                else:
                    param.parts.setdefault(addr.expert, {})[addr.part] = key
                    param.cat_dim = addr.cat_dim
            self._check_param(param, n)
        router = {}
        for path, dim in layer.spec.router_tensors:
            internal = f"{block}.{layer.spec.router_attr}.{path}"
            keys = self.stored_as.get(internal)
            if not keys:
                raise MoePruneError(f"checkpoint {self.path} has no tensor for router parameter {internal}")
            router[path] = (keys[0], dim)
        return LayerLayout(layer.index, layer.spec, n, params, router)

    def _check_param(self, param: ExpertParam, n: int) -> None:
        if param.fused is not None:
            got = self.tensors[param.fused].shape
        elif sorted(param.parts) == list(range(n)):
            got = (n, *self.expert_shape(param, 0))
            if any(self.expert_shape(param, e) != got[1:] for e in range(n)):
                got = ()  # experts of different shapes
        else:
            raise MoePruneError(
                f"checkpoint {self.path} does not hold all {n} experts of {param.internal} "
                f"(found experts {sorted(param.parts)})"
            )
        if tuple(got) != param.shape:
            raise MoePruneError(
                f"checkpoint {self.path}: {param.internal} is stored as {list(got)}, the config expects "
                f"{list(param.shape)}; is config.json the one of these weights?"
            )

    def expert_shape(self, param: ExpertParam, expert: int) -> tuple[int, ...]:
        """Shape of one expert's slice of `param`, once its parts are concatenated."""
        shapes = [self.tensors[k].shape for k in param.keys(expert)]
        d = param.cat_dim
        return (*shapes[0][:d], sum(s[d] for s in shapes), *shapes[0][d + 1 :])

    def _check_unknown_expert_tensors(self) -> None:
        """Refuse per-expert tensors the model has no parameter for (quantization scales...)."""
        prefixes = [p.internal.rsplit(".", 1)[0] + "." for lay in self.layers for p in lay.experts.values()]
        under = re.compile("|".join(re.escape(p) for p in set(prefixes)))
        for key, addr in self.addresses.items():
            if under.match(addr.internal) and addr.internal not in self.roles:
                raise MoePruneError(
                    f"checkpoint tensor {key!r} belongs to routed experts but matches no parameter of the model "
                    "(a quantized checkpoint?); streaming handles plain floating-point checkpoints: load the model instead"
                )


# --------------------------------------------------------------------------- streaming experts
def _read_at(fd: int, out: memoryview, offset: int, lock: threading.Lock) -> int:
    """One positioned read into `out`; where os.preadv is missing (Windows), a locked seek + read."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [out], offset)
    with lock:
        os.lseek(fd, offset, os.SEEK_SET)
        data = os.read(fd, len(out))
    out[: len(data)] = data
    return len(data)


class ShardReader:
    """Memory-mapped shard handles (safe_open), opened on first use (by any worker thread)."""

    def __init__(self, root: Path, tensors: dict[str, StoredTensor]):
        self.root, self.tensors = root, tensors
        self._open: dict[str, object] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _handle(self, key: str):
        file = self.tensors[key].file
        with self._lock:
            if file not in self._open:
                self._open[file] = safe_open(str(self.root / file), framework="pt")
            return self._open[file]

    def tensor(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def row(self, key: str, index: int) -> torch.Tensor:
        """`tensor(key)[index]`, reading only that row."""
        return self._handle(key).get_slice(key)[index]

    def _fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                self._fds[file] = os.open(self.root / file, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            return self._fds[file]

    def prefetch(self, key: str, start: int, length: int) -> None:
        """Ask the kernel to read these bytes of `key`'s shard in the background (a hint)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd(self.tensors[key].file), start, length, os.POSIX_FADV_WILLNEED)

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Fill `out` with the bytes of `key`'s shard from absolute `offset` (plain reads: no page
        faults on a fresh mapping, which cost more than the copy itself)."""
        fd, done = self._fd(self.tensors[key].file), 0
        while done < len(out):
            got = _read_at(fd, out[done:], offset + done, self._lock)
            if got == 0:
                raise MoePruneError(
                    f"{self.root / self.tensors[key].file} ended early: truncated safetensors file"
                )
            done += got

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:  # os may be gone at exit
        for fd in getattr(self, "_fds", {}).values():
            _close(fd)


class SafetensorsExperts:
    """ExpertWeightSource over one MoE layer of a checkpoint on disk: each call reads one expert.

    Only the requested expert's bytes are read (its own tensors, or its row of a fused tensor),
    so memory stays at one expert whatever the model size.
    """

    def __init__(self, layout: LayerLayout, shards: ShardReader):
        self.layout = layout
        self.layer = layout.index
        self.num_experts = layout.num_experts
        self._shards = shards

    def stored_parts(self, name: str, expert: int) -> list[torch.Tensor]:
        """The stored pieces of `experts.<name>[expert]`: its row of a fused tensor, or its own
        tensors (gate, up) in order; memory-mapped, nothing is copied."""
        param = self.layout.experts[name]
        if param.fused is not None:
            return [self._shards.row(param.fused, expert)]
        return [self._shards.tensor(k) for k in param.keys(expert)]

    def stored_ranges(self, name: str, expert: int) -> list[tuple[str, int, int]]:
        """(checkpoint key, absolute byte offset, byte length) of the pieces `stored_parts` maps."""
        param = self.layout.experts[name]
        if param.fused is not None:
            stored = self._shards.tensors[param.fused]
            row = (stored.end - stored.start) // self.num_experts
            return [(param.fused, stored.start + expert * row, row)]
        return [(k, self._shards.tensors[k].start, self._shards.tensors[k].end - self._shards.tensors[k].start)
                for k in param.keys(expert)]  # fmt: skip

    def prefetch(self, expert: int) -> None:
        """Start reading one expert's bytes from disk (no-op past the last expert)."""
        if expert >= self.num_experts:
            return
        for name in _SUMMED:
            for key, start, length in self.stored_ranges(name, expert):
                self._shards.prefetch(key, start, length)

    def stored_tensor(self, key: str) -> StoredTensor:
        return self._shards.tensors[key]

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        self._shards.read_into(key, offset, out)

    def expert_tensor(self, name: str, expert: int) -> torch.Tensor:
        """`experts.<name>[expert]` exactly as the loaded model would hold it."""
        parts = self.stored_parts(name, expert)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.layout.experts[name].cat_dim)

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I,d], up [I,d], down [d,I]), decoded by the adapter's own layout rules."""
        one = SimpleNamespace(
            gate_up_proj=self.expert_tensor("gate_up_proj", expert)[None],
            down_proj=self.expert_tensor("down_proj", expert)[None],
        )  # a one-expert stand-in for the experts module
        return MoELayer(self.layer, SimpleNamespace(experts=one), self.layout.spec).expert_weights(0)


def checkpoint_layers(path: str | Path) -> list[SafetensorsExperts]:
    """One lazy expert-weight source per MoE layer of a checkpoint folder (weights stay on disk)."""
    layout = CheckpointLayout(path)
    shards = ShardReader(layout.path, layout.tensors)
    return [SafetensorsExperts(lay, shards) for lay in layout.layers]


class _Sums:
    """(sum |w|, sum w^2, N) of one expert's weights, for one worker thread.

    Each block of up to 1M values is read once into a reused byte buffer (or taken from an
    in-memory tensor), cast into a reused fp32 buffer (fp64 stays fp64), then made absolute and
    summed, squared and summed, in place: no temporaries, and few enough ops per expert that
    worker threads seldom queue for the GIL. torch's sums are cascaded (relative error ~1e-7 in
    fp32, where a BLAS dot drifts to ~1e-6); the block sums are added in fp64.
    """

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.raw = bytearray()
        self.l1 = self.sq = 0.0
        self.n = 0

    def _add(self, chunk: torch.Tensor) -> None:
        wide = torch.float64 if chunk.dtype == torch.float64 else torch.float32
        if wide not in self.buffers:
            self.buffers[wide] = torch.empty(_BLOCK, dtype=wide)
        block = self.buffers[wide][: chunk.numel()]
        block.copy_(chunk)
        self.l1 += float(block.abs_().sum())
        self.sq += float(block.square_().sum())
        self.n += chunk.numel()

    def _totals(self) -> tuple[float, float, int]:
        totals = (self.l1, self.sq, self.n)
        self.l1 = self.sq = 0.0
        self.n = 0
        return totals

    def of_tensors(self, tensors: Sequence[torch.Tensor]) -> tuple[float, float, int]:
        for t in tensors:
            for chunk in t.reshape(-1).split(_BLOCK):
                self._add(chunk)
        return self._totals()

    def of_stored(self, source: SafetensorsExperts, expert: int) -> tuple[float, float, int]:
        """Every layout only rearranges the elements of gate_up_proj and down_proj into gate, up
        and down, so the sums run over the stored byte ranges as they are (no decoding)."""
        for name in _SUMMED:
            for key, start, length in source.stored_ranges(name, expert):
                stored = source.stored_tensor(key)
                if stored.dtype not in _FLOAT_DTYPES:
                    raise MoePruneError(
                        f"cannot score checkpoint tensor {key!r}: unsupported dtype {stored.dtype}"
                    )
                dtype = _FLOAT_DTYPES[stored.dtype]
                step = _BLOCK * dtype.itemsize
                if len(self.raw) < step:
                    self.raw = bytearray(step)
                    self.raw_tensor = torch.frombuffer(self.raw, dtype=torch.uint8)
                view = memoryview(self.raw)
                for offset in range(0, length, step):
                    size = min(step, length - offset)
                    source.read_into(key, start + offset, view[:size])
                    self._add(self.raw_tensor[:size].view(dtype))
        return self._totals()


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` for a while (worker threads must not each start
    an OpenMP team per small op: that oversubscribes the cores and is many times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _all_sums(sources: Sequence[SafetensorsExperts], workers: int) -> list[list[tuple[float, float, int]]]:
    """Weight sums of every expert of every layer, `workers` experts at a time.

    Every layout only rearranges the elements of gate_up_proj and down_proj into gate, up and
    down, so the sums run over the stored pieces as they are (no concatenation, no decoding).
    Each worker owns its buffers and sums whole experts with single-threaded torch ops (which
    release the GIL); the bytes of the expert `workers` places ahead are requested from the disk
    meanwhile, so a cold read overlaps the arithmetic.
    """
    tasks = [(s, e) for s in sources for e in range(s.num_experts)]
    local = threading.local()
    ahead = workers  # deeper prefetching measured no better on a cold cache

    def expert_sums(i: int) -> tuple[float, float, int]:
        if i + ahead < len(tasks):
            src, e = tasks[i + ahead]
            src.prefetch(e)
        if not hasattr(local, "sums"):
            local.sums = _Sums()
        source, e = tasks[i]
        return local.sums.of_stored(source, e)

    for i in range(min(ahead, len(tasks))):
        tasks[i][0].prefetch(tasks[i][1])
    with _torch_threads(1):  # one worker per core instead of torch's threads inside each op
        if workers <= 1:
            flat = [expert_sums(i) for i in range(len(tasks))]
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="moeprune-score") as pool:
                flat = list(pool.map(expert_sums, range(len(tasks))))
    out, start = [], 0
    for source in sources:
        out.append(flat[start : start + source.num_experts])
        start += source.num_experts
    return out


def _layer_scores(
    name: str, source: SafetensorsExperts, sums: Sequence[tuple[float, float, int]]
) -> np.ndarray:
    scores = np.zeros(source.num_experts, dtype=np.float64)
    for e, (l1, sq, n) in enumerate(sums):
        if n == 0 or sq == 0.0:
            raise MoePruneError(
                f"criterion {name!r}: expert {e} of decoder layer {source.layer} has no non-zero weights; "
                "its score is undefined"
            )
        scores[e] = WEIGHT_SCORERS[name](l1, sq, n)
    if not np.isfinite(scores).all():
        raise MoePruneError(f"criterion {name!r}: non-finite scores in decoder layer {source.layer}")
    return scores


def score_checkpoint(
    path: str | Path, criterion: str, seed: int = 0, workers: int | None = None
) -> list[LayerScores]:
    """Scores of a weight-only criterion straight from the safetensors shards.

    Never builds the model with weights: anonymous memory is a read buffer of 1M stored values and
    a 4 MiB fp32 block per worker (the page cache keeps what was read; the kernel reclaims it).
    `workers` threads sum experts
    in parallel (default: torch's thread count). Equal to `compute_scores(criterion,
    weights=MoEModel(model).layers)` (fp64 throughout) to ~1e-7 relative: blocks are summed in fp32.
    """
    crit = get_criterion(criterion)
    if crit.needs_data:
        raise MoePruneError(
            f"criterion {criterion!r} needs calibration data run through the model, so it cannot be computed "
            f"from the checkpoint files; streaming supports {', '.join(WEIGHT_ONLY)} (drop the streaming option)"
        )
    sources = checkpoint_layers(path)
    if not crit.needs_weights:
        return compute_scores(criterion, weights=sources, seed=seed)
    workers = max(1, workers if workers is not None else torch.get_num_threads())
    result = []
    for source, sums in zip(sources, _all_sums(sources, workers)):
        scores = _layer_scores(crit.name, source, sums)
        result.append(
            LayerScores(layer=source.layer, scores=scores, order=pruning_order_of(scores, crit.prune_first))
        )
    return result


# --------------------------------------------------------------------------- rewriting shards
@dataclass(frozen=True)
class OutTensor:
    """One tensor of a rewritten shard: its header entry and the source byte ranges it is made of,
    or (`chunks`) a function giving its data as tensors in the stored dtype, made in memory
    piece by piece while the shard is written (an expert's sliced tensor, a padded one)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...] = ()  # (absolute offset in the source shard, length)
    chunks: Callable[[], Iterable[torch.Tensor]] | None = None  # row-major pieces, in order

    @property
    def nbytes(self) -> int:
        if self.chunks is not None:
            return math.prod(self.shape) * _ITEMSIZE[self.dtype]
        return sum(length for _, length in self.ranges)


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


def _rewritten(layout: CheckpointLayout, kept: dict[int, list[int]]) -> dict[str, list[OutTensor]]:
    """Per shard file, the tensors of the pruned checkpoint (dropped experts gone, kept renumbered)."""
    out: dict[str, list[OutTensor]] = defaultdict(list)
    for key, stored in layout.tensors.items():
        addr = layout.addresses[key]
        layer, dim = layout.roles.get(addr.internal, (None, 0))
        if layer not in kept:
            out[stored.file].append(whole_tensor(key, stored))
        elif addr.expert is None:
            out[stored.file].append(_sliced(key, stored, dim, kept[layer]))
        elif addr.expert in kept[layer]:
            new_key = layout.naming.renumber(key, kept[layer].index(addr.expert))
            out[stored.file].append(whole_tensor(new_key, stored))
    return out


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


def uniform_kept(plan: Plan, moe: MoEModel) -> dict[int, list[int]]:
    """The kept experts per MoE layer of a uniform drop plan, checked like in-memory surgery."""
    if plan.method != "drop":
        raise MoePruneError(
            f"rewriting checkpoint files supports 'drop' plans, not {plan.method!r}: use the in-memory "
            "`moeprune prune` (it loads the model)"
        )
    if not plan.is_uniform():
        raise MoePruneError(
            "this plan keeps different expert counts per layer, which a stock config cannot express; "
            "rewriting checkpoint files supports uniform drop plans only: use the in-memory `moeprune prune`"
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
    """Tokenizer, generation config, README...: top-level files that are not weights (no subfolders)."""
    for item in sorted(src.iterdir()):
        if item.is_file() and item.name not in _NOT_COPIED and not item.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(item, dst / item.name)


def _write_config(config: PretrainedConfig, dst: Path, field_name: str, count: int) -> None:
    """The config as in-memory surgery saves it: the count set through the config object, so its
    aliases (Qwen3-MoE's hub `num_experts` for `num_local_experts`) cannot disagree."""
    config = copy.deepcopy(config)
    setattr(config, field_name, count)
    config.save_pretrained(dst)


def rewrite_checkpoint(
    src: str | Path,
    dst: str | Path,
    plan: Plan,
    overwrite: bool = False,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write the checkpoint `plan` prunes, shard by shard, without loading the model.

    Dropped experts' tensors (or rows of fused tensors), router rows and per-expert biases are
    cut; per-expert keys of kept experts are renumbered 0..n-1; the index and the config's count
    field are updated, other files copied and `plan.json` written. The result equals in-memory
    `drop_experts` then `save_pretrained`. Only uniform drop plans (what a stock config can
    express). `extra(tmp_dir)` may add files (a report) before the folder is renamed into place.
    """
    layout = CheckpointLayout(src)
    if Path(dst).resolve() == layout.path.resolve():
        raise MoePruneError(
            "the output folder is the input checkpoint; write the pruned checkpoint elsewhere"
        )
    kept = uniform_kept(plan, layout.moe)
    shards = {f: ts for f, ts in _rewritten(layout, kept).items() if ts}
    count = len(next(iter(kept.values())))

    def write(tmp: Path) -> None:
        for file, tensors in shards.items():
            write_shard(layout.path / file, tmp / file, tensors, layout.file_metadata[file])
        if layout.index is not None:
            write_json(tmp / INDEX, index_json(layout.index, shards))
        _write_config(layout.config, tmp, layout.moe.spec.count_field, count)
        copy_other_files(layout.path, tmp)
        plan.save(tmp / PLAN)
        if extra is not None:
            extra(tmp)

    return atomic_write_dir(dst, write, overwrite=overwrite)
