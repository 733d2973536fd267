"""The files of a checkpoint folder: safetensors shards, their index, and sharded writing.

Everything here reads headers and file sizes only, so a damaged checkpoint (an empty or
truncated shard, a shard the index names but nobody copied, an index that is not JSON) is
refused in milliseconds, before any model is built or any calibration runs.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

from moeprune.config import parse_bytes
from moeprune.errors import MoePruneError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # save_pretrained's default
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a shard, from its header: dtype, shape and absolute byte range in the file."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """Tensors and metadata of one safetensors file; a clear error when it is damaged."""
    try:
        size_on_disk = path.stat().st_size
        with path.open("rb") as handle:
            raw = handle.read(8)
            if len(raw) < 8:
                raise MoePruneError(
                    f"{path} is empty or truncated ({size_on_disk} bytes): copy the file again"
                )
            (length,) = struct.unpack("<Q", raw)
            if 8 + length > size_on_disk:
                raise MoePruneError(
                    f"{path} is truncated (its header runs past the end): copy the file again"
                )
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as exc:
        raise MoePruneError(f"cannot read the safetensors header of {path}: {exc}") from exc
    if not isinstance(header, dict):
        raise MoePruneError(f"{path} is not a safetensors file (its header is not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    base = 8 + length
    try:
        tensors = {
            key: StoredTensor(
                path.name,
                v["dtype"],
                tuple(v["shape"]),
                base + v["data_offsets"][0],
                base + v["data_offsets"][1],
            )
            for key, v in header.items()
        }
    except (KeyError, TypeError, IndexError) as exc:
        raise MoePruneError(f"{path} has a malformed safetensors header ({exc})") from exc
    end = max((t.end for t in tensors.values()), default=base)
    if end > size_on_disk:
        raise MoePruneError(
            f"{path} is truncated ({size_on_disk} bytes, its header describes {end}): copy the file again"
        )
    return tensors, meta


def shard_names(folder: Path) -> list[str]:
    """The safetensors files holding the weights: every shard the index names, or the single file."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MoePruneError(f"cannot read {index}: {exc}; the checkpoint is damaged") from exc
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise MoePruneError(
                f"{index} names {len(missing)} shard(s) that are not in the folder (first: {missing[0]}); "
                "copy the whole checkpoint"
            )
        return names
    if (folder / SINGLE).is_file():
        return [SINGLE]
    return []


def stored_tensors(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint, from the headers (validated: nothing truncated or missing)."""
    out: dict[str, StoredTensor] = {}
    for name in shard_names(folder):
        tensors, _ = read_header(folder / name)
        out.update(tensors)
    return out


def check_weights(folder: Path) -> None:
    """Refuse a checkpoint whose safetensors weights are damaged, before loading anything."""
    stored_tensors(folder)


def stored_dtype(folder: Path) -> torch.dtype | None:
    """The floating dtype holding most of the checkpoint's bytes (what "the input's dtype" means)."""
    weights: Counter[str] = Counter()
    for tensor in stored_tensors(folder).values():
        if tensor.dtype in _SAFETENSORS_DTYPES:
            weights[tensor.dtype] += tensor.end - tensor.start
    return _SAFETENSORS_DTYPES[weights.most_common(1)[0][0]] if weights else None


def iter_tensors(folder: Path, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every stored tensor, one shard open at a time."""
    for shard in names or shard_names(folder):
        with safe_open(str(folder / shard), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield key, handle.get_tensor(key)


def parse_size(size: int | str) -> int:
    """Bytes in "5GB", "500MB", "2GiB" or a plain number (save_pretrained's units: GB = 10^9)."""
    value = parse_bytes(size, "shard size")
    if value is None:
        raise MoePruneError(f"shard size {size!r} is not a size; write it like 5GB, 500MB or 2GiB")
    return value


def tensor_bytes(folder: Path) -> int:
    """Bytes of the checkpoint's stored tensors, from the headers (what `total_size` in an index
    counts); the files add their headers to it."""
    return sum(t.end - t.start for t in stored_tensors(folder).values())


def header_bytes(folder: Path) -> int:
    """Bytes of the safetensors files that are not tensors: each file's length field and JSON header."""
    files = sum((folder / name).stat().st_size for name in shard_names(folder))
    return files - tensor_bytes(folder)


def write_shards(
    folder: Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write tensors like save_pretrained: `model.safetensors`, or numbered shards plus an index.

    Floating tensors are cast to `dtype` (others keep theirs) one shard at a time, so the extra
    memory is one shard. Returns the file names written.
    """
    limit = parse_size(max_shard_size)

    def target(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    # huggingface_hub groups the tensors as save_pretrained does; it sees their size in the saved dtype
    # through meta tensors, so nothing is cast or copied before each shard is written
    split = split_torch_state_dict_into_shards(
        {name: torch.empty(t.shape, dtype=target(t), device="meta") for name, t in tensors.items()},
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=limit,
    )
    files = list(split.filename_to_tensors) if split.is_sharded else [SINGLE]
    groups = list(split.filename_to_tensors.values()) if split.is_sharded else [list(tensors)]
    for file, names in zip(files, groups):
        shard = {}
        for name in names:
            t = tensors[name].detach()
            shard[name] = t.to(device="cpu", dtype=target(t), copy=True).contiguous()  # views share storage
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        del shard
    if split.is_sharded:
        index = {
            "metadata": {"total_size": split.metadata["total_size"]},
            "weight_map": split.tensor_to_filename,
        }
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files
