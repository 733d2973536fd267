"""Loading helpers of modeling_moeprune.py: Hub arguments, the one device, the dtype, and the
strict copy of every stored tensor into the model (part of modeling_moeprune.py; moeprune copies
the three files into every moeprune-format folder).
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack, contextmanager
from typing import Protocol

import torch
from safetensors import safe_open

from .moeprune_families import INDEX_FILE, SINGLE_FILE, fail
from .moeprune_format import FormatError, parse_mtp
from .moeprune_quantized import StoredQuantization


class DiskTensors(Protocol):
    """What loading needs of a model: its tensors by on-disk name (modeling_moeprune's mixin)."""

    def moeprune_disk_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]: ...


HUB_ARGUMENTS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "revision",
    "subfolder",
    "token",
)
# Passed by transformers' Auto classes or harmless here (this loader never initialises, always
# reads safetensors and maps nothing): ignored.
_IGNORED = (
    "_from_auto",
    "_commit_hash",
    "trust_remote_code",
    "code_revision",
    "adapter_kwargs",
    "low_cpu_mem_usage",
    "use_safetensors",
    "weights_only",
    "disable_mmap",
    "mirror",
    "_fast_init",
    "offload_state_dict",
    "ignore_mismatched_sizes",
    "adapter_name",
)


def refuse_unsupported(kwargs: dict, what: str = "from_pretrained") -> None:
    unsupported = sorted(
        k for k, v in kwargs.items() if k not in _IGNORED and v is not None and v is not False and v != {}
    )
    if kwargs.get("use_safetensors") is False:
        unsupported.append("use_safetensors=False")
    if unsupported:
        raise fail(
            f"{what} does not support {', '.join(unsupported)} for moeprune checkpoints; "
            "use dtype and a single device, then adapt the model"
        )


def resolve_folder(name: str, hub: dict) -> str:
    """The local folder holding the checkpoint: `name` itself, or its snapshot from the Hub."""
    subfolder = hub.pop("subfolder", None) or ""
    if os.path.isdir(name):
        folder = os.path.join(name, subfolder)
    else:
        from huggingface_hub import snapshot_download

        patterns = [f"{subfolder}/*" if subfolder else "*"]
        hub.pop("proxies", None)
        folder = os.path.join(snapshot_download(name, allow_patterns=patterns, **hub), subfolder)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise OSError(f"modeling_moeprune: {folder} has no config.json; pass the folder moeprune saved")
    return folder


def plain_device(device_map) -> torch.device:
    """The one device a `device_map` names; placements over several devices are refused."""
    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            raise fail("a device_map placing modules on several devices is not supported; name one device")
        device_map = device_map[""]
    if device_map is None:
        return torch.device("cpu")
    if isinstance(device_map, int):
        return torch.device("cuda", device_map)
    if isinstance(device_map, str) and device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
        raise fail(f"device_map={device_map!r} is not supported; name one device (for example 'cuda:0')")
    return torch.device(device_map)


_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
# stored codes that are never a float weight's value by themselves (fp8 codes, packed integers, bytes)
_CODES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int32)
_STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def resolve_dtype(dtype, config, folder: str) -> torch.dtype:
    """A torch dtype from `dtype`: a dtype or its name; "auto" or None (the default, as in stock
    transformers 5) uses config.json's dtype, else the stored weights' dtype."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if dtype is None:
            return stored_dtype(folder)
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.removeprefix("torch."))
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise fail(f"dtype must be one of {', '.join(_DTYPES)} or 'auto', got {dtype!r}")
    return dtype


def stored_dtype(folder: str) -> torch.dtype:
    for shard in shard_files(folder):
        with safe_open(os.path.join(folder, shard), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                stored = _STORED_DTYPES.get(handle.get_slice(key).get_dtype())
                if stored is not None:
                    return stored
    return torch.float32


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def shard_files(folder: str) -> list[str]:
    """The safetensors files of the folder: those the index names, or the single file."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            try:
                weight_map = json.load(handle)["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise fail(f"{index} is damaged ({exc}); copy the checkpoint again") from exc
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise OSError(
                f"modeling_moeprune: {index} names shards that are not in the folder: {', '.join(missing)}"
            )
        return shards
    if os.path.isfile(os.path.join(folder, SINGLE_FILE)):
        return [SINGLE_FILE]
    raise OSError(f"modeling_moeprune: {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def listed(names, limit: int = 5) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def stored_quantization(folder: str) -> StoredQuantization | None:
    """How the folder's quantized weights are stored (a result that kept its input's fp8 blocks,
    MXFP4 or compressed-tensors codes), or None for a full-precision folder."""
    with open(os.path.join(folder, "config.json")) as handle:
        quant = json.load(handle).get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise fail(f"{folder}: config.json's quantization_config is not a mapping; the checkpoint is damaged")
    return StoredQuantization(quant, folder)


def mtp_roots(config) -> tuple[str, ...]:
    """The key prefixes of the multi-token-prediction layers the section's `mtp` entry records:
    kept on disk for vLLM's drafts, never built here (transformers has no MTP forward)."""
    section = getattr(config, "moeprune", None)
    try:
        mtp = parse_mtp(
            section.get("mtp") if isinstance(section, dict) else None, "config.json's 'moeprune' section"
        )
    except FormatError as exc:
        raise fail(str(exc)) from None
    return mtp.roots if mtp is not None else ()


def load_weights(model: DiskTensors, folder: str, beside: tuple[str, ...] = ()) -> None:
    """Copy every stored tensor into the model by its on-disk name; strict both ways, but for the
    keys under `beside` (the MTP layers the config records: `mtp_roots`), which stay on disk.
    Quantized weights (codes beside scales) are decoded as their format's library decodes them,
    then cast to the model's dtype."""
    targets, aliases = model.moeprune_disk_tensors()
    shards = shard_files(folder)
    stored: dict[str, str] = {}
    for shard in shards:
        with safe_open(os.path.join(folder, shard), framework="pt") as handle:
            names = handle.keys()  # a safetensors handle is not iterable
            stored.update({key: shard for key in names if not (beside and key.startswith(beside))})
    quantization = stored_quantization(folder)
    coded = quantization.parts(set(stored)) if quantization else {}
    sources = {name: (name,) for name in stored} | coded
    for part in {part for parts in coded.values() for part in parts} - set(coded):
        del sources[part]  # a companion (scale, shape, zero point) or codes under another name
    filled = {aliases.get(name, name) for name in sources}
    missing = set(targets) - filled
    unexpected = set(sources) - set(targets) - set(aliases)
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing tensors {listed(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors {listed(unexpected)}")
        raise fail(
            f"{folder} does not match its config.json: {'; '.join(problems)}; the checkpoint is incomplete or damaged"
        )
    with ExitStack() as stack, torch.no_grad():
        handles = {s: stack.enter_context(safe_open(os.path.join(folder, s), framework="pt")) for s in shards}
        for name, parts in sources.items():
            target = targets[aliases.get(name, name)]
            values = [handles[stored[part]].get_tensor(part) for part in parts]
            if name in coded:
                assert quantization is not None
                value = quantization.decode(name, values)
            else:
                value = values[0]
                if value.dtype in _CODES and target.is_floating_point():
                    raise fail(
                        f"{folder}: tensor {name} is stored as {value.dtype} without the scales that decode it; "
                        "the checkpoint is damaged or its quantization_config does not describe it"
                    )
            if tuple(value.shape) != tuple(target.shape):
                raise fail(
                    f"{folder}: tensor {name} has shape {tuple(value.shape)} but config.json's structure "
                    f"gives {tuple(target.shape)}; the checkpoint is damaged"
                )
            target.copy_(value)
