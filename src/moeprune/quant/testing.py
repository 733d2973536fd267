"""Tiny block-scaled FP8 and MXFP4 checkpoints, written the way the releases are, for tests and surveys.

No FP8 release is small enough for a test, and transformers writes no FP8 checkpoint on a CPU
(its quantizer needs a GPU). So a tiny model is saved normally first, which gives each family's
own on-disk names (per-expert `mlp.experts.{e}.gate_proj.weight` where transformers fuses experts
in memory), and then every eligible 2-D weight of those files is replaced by its fp8 blocks and
`weight_scale_inv`, and config.json gets the releases' `quantization_config`. MXFP4 the same
way, as gpt-oss ships it: each fused 3-D expert parameter becomes its `_blocks` and `_scales`.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from moeprune.errors import MoePruneError
from moeprune.quant.compressed import (
    GLOBAL_SCALE,
    PACKED,
    SCALE,
    SHAPE,
    ZERO,
    dequantize_expert_float,
    dequantize_float,
    dequantize_nvfp4,
    dequantize_packed,
    quantize_int,
    read_compressed_config,
)
from moeprune.quant.fp8 import (
    FP8_MAX,
    SCALE_SUFFIX,
    dequantize_blocks,
    fp8_quantization_config,
    quantize_blocks,
    read_fp8_config,
    scale_name,
)
from moeprune.quant.mxfp4 import (
    BLOCKS_SUFFIX,
    SCALES_SUFFIX,
    dequantize_mxfp4,
    mxfp4_quantization_config,
    quantize_mxfp4,
    read_mxfp4_config,
)
from moeprune.serve.moeprune_quantized import EXPERTS

# Left in full precision, as the releases leave them: the output head, the embeddings and the
# routers (`mlp.gate`, MiniMax's `block_sparse_moe.gate`, Qwen's `shared_expert_gate`: all end in
# "gate", and no projection does). Norms and biases are 1-D and never quantized anyway.
DEFAULT_SKIP = ("lm_head", "embed_tokens", "gate")
_PER_EXPERT = re.compile(r"\.experts\.\d+\.")
_FUSED_EXPERTS = re.compile(r"\.experts\.[a-z_]+$")  # gpt-oss's fused `experts.gate_up_proj` [E, in, out]
# gpt-oss's own skip list: everything but the experts stays in bf16
MXFP4_SKIP = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")
_INDEX = "model.safetensors.index.json"


def skipped(module: str, patterns: Sequence[str]) -> bool:
    """transformers' rule for `modules_to_not_convert` (`should_convert_module`), so the list
    written to config.json means on loading what it meant here: a pattern matches a module name
    from its start up to a name boundary (also as a regex), or as a suffix of it."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


def _eligible(name: str, tensor: torch.Tensor, linear: set[str], skip: Sequence[str]) -> bool:
    """A 2-D float `<module>.weight` of an nn.Linear (same name in memory and on disk) or of one
    routed expert (fused in memory, one tensor per expert on disk), and not skipped: exactly the
    modules transformers makes FP8 on a GPU, so the checkpoint also loads there."""
    if not name.endswith(".weight") or tensor.dim() != 2 or not tensor.is_floating_point():
        return False
    module = name.removesuffix(".weight")
    return (module in linear or bool(_PER_EXPERT.search(name))) and not skipped(module, skip)


def _read(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    with safe_open(str(file), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118 - not a dict


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _rewrite_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    """The shard index (when the save was sharded) naming exactly the tensors written."""
    index_file = folder / _INDEX
    if not index_file.exists():
        return
    index = json.loads(index_file.read_text())
    index["weight_map"] = dict(sorted(weight_map.items()))
    index.setdefault("metadata", {})["total_size"] = total_size  # tensor bytes, as transformers counts
    index_file.write_text(json.dumps(index, indent=2) + "\n")


@dataclass
class _Quantizer:
    """What one format's writer does: `encode(name, tensor)` gives the stored tensors of an
    eligible weight (None: not quantized), `config` the quantization_config written beside them."""

    encode: Callable[[str, torch.Tensor], dict[str, torch.Tensor] | None]
    config: dict[str, Any]
    what: str  # for the error when nothing was eligible


def _write_quantized(
    model: nn.Module,
    path: Path,
    quantizer: _Quantizer,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str | None = None,
) -> Path:
    """Save `model` normally (its family's on-disk names), then rewrite every shard with each
    eligible weight replaced by its encoded tensors in the same shard (the others as saved, or in
    `dtype`), config.json with the quantization_config (and `dtype`), and the index naming exactly
    the tensors written. `path` is created if need be; files of the same names are replaced."""
    with tempfile.TemporaryDirectory() as tmp:
        stock = Path(tmp)
        sharding = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(stock, **sharding)  # type: ignore[operator]  # a transformers model
        path.mkdir(parents=True, exist_ok=True)
        weight_map: dict[str, str] = {}
        total_size = quantized = 0
        for file in sorted(stock.glob("*.safetensors")):
            tensors, metadata = _read(file)
            out: dict[str, torch.Tensor] = {}
            for name, tensor in tensors.items():
                encoded = quantizer.encode(name, tensor)
                if encoded is not None:
                    out.update(encoded)
                    quantized += 1
                else:
                    cast = dtype is not None and tensor.is_floating_point()
                    out[name] = tensor.to(dtype) if cast else tensor
            save_file(out, str(path / file.name), metadata=metadata)
            weight_map.update(dict.fromkeys(out, file.name))
            total_size += _nbytes(out)
        if not quantized:
            raise MoePruneError(f"no weight of this {type(model).__name__} is eligible for {quantizer.what}")
        for file in stock.iterdir():
            if file.suffix != ".safetensors":
                shutil.copy2(file, path / file.name)
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = quantizer.config
        if dtype is not None:
            config["dtype"] = str(dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _rewrite_index(path, weight_map, total_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def save_fp8_checkpoint(
    model: nn.Module,
    path: str | Path,
    block: tuple[int, int] = (16, 16),
    skip: Sequence[str] = DEFAULT_SKIP,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write `model` (a transformers model, e.g. `moeprune.models.factory.tiny_model(family)`) to
    `path` as a block-scaled FP8 checkpoint in its family's on-disk layout.

    Every eligible weight (see `_eligible`: Linear and per-expert weights, minus `skip`, matched as
    transformers matches `modules_to_not_convert`) becomes `quantize_blocks(w, block)`: fp8 under
    its own name and float32 `<name>_scale_inv` in the same shard; dimensions that are not
    multiples of `block` get partial last blocks. The other tensors keep the saved dtype, or
    `dtype` when given (the releases keep them in bf16). config.json gets
    `quantization_config` (`skip` as `modules_to_not_convert`) and, with `dtype`, that dtype.
    `max_shard_size` goes to `save_pretrained` (each scale lands in its weight's shard, the index
    names both). `tokenizer` (anything with `save_pretrained`) is saved beside it. `path` is
    created if need be; files of the same names in it are replaced. Returns `path`.
    """
    linear = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}

    def encode(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if not _eligible(name, tensor, linear, skip):
            return None
        fp8, scale = quantize_blocks(tensor, block)
        return {name: fp8, scale_name(name): scale}

    quantizer = _Quantizer(encode, fp8_quantization_config(block, tuple(skip)), f"fp8 (skip={skip!r})")
    return _write_quantized(model, Path(path), quantizer, tokenizer, dtype, max_shard_size)


def save_mxfp4_checkpoint(
    model: nn.Module, path: str | Path, tokenizer: Any = None, dtype: torch.dtype | None = None
) -> Path:
    """Write `model` (a gpt-oss; any family whose experts are stored fused and 3-D) to `path` as
    gpt-oss ships it: every fused expert weight `<name>` [E, in, out] (in a multiple of 32) as
    `quantize_mxfp4`'s `<name>_blocks` and `<name>_scales`, the other tensors as saved (or in
    `dtype`), config.json with gpt-oss's mxfp4 `quantization_config`. Returns `path`."""

    def encode(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if tensor.dim() != 3 or not tensor.is_floating_point() or not _FUSED_EXPERTS.search(name):
            return None
        blocks, scales = quantize_mxfp4(tensor)
        return {name + BLOCKS_SUFFIX: blocks, name + SCALES_SUFFIX: scales}

    quantizer = _Quantizer(
        encode, mxfp4_quantization_config(MXFP4_SKIP), "mxfp4 (no fused 3-D expert weight)"
    )
    return _write_quantized(model, Path(path), quantizer, tokenizer, dtype)


def compressed_quantization_config(scheme: str, group_size: int, ignore: Sequence[str]) -> dict[str, Any]:
    """The `quantization_config` compressed-tensors writes for W4A16 (`scheme="w4a16"`: 4-bit
    symmetric integers per group, pack-quantized) or FP8 weights per channel (`"fp8"`,
    float-quantized, dynamic per-token activations)."""
    if scheme == "w4a16":
        fmt = "pack-quantized"
        weights = {
            "num_bits": 4,
            "type": "int",
            "symmetric": True,
            "strategy": "group",
            "group_size": group_size,
        }
        activations = None
    elif scheme == "fp8":
        fmt = "float-quantized"
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
        activations = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "token",
            "dynamic": True,
        }
    else:
        raise MoePruneError(f"unknown compressed-tensors test scheme {scheme!r}: w4a16 or fp8")
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**weights, "dynamic": False, "observer": "minmax"},
                "input_activations": activations,
                "output_activations": None,
            }
        },
        "ignore": list(ignore),
    }


def _compressed(tensor: torch.Tensor, scheme: str, group_size: int) -> dict[str, torch.Tensor]:
    if scheme == "w4a16":
        return quantize_int(tensor, 4, group_size)
    w = tensor.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    fp8 = (w / scale.to(torch.float32)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": fp8, SCALE: scale}


def save_compressed_checkpoint(
    model: nn.Module,
    path: str | Path,
    scheme: str = "w4a16",
    group_size: int = 32,
    tokenizer: Any = None,
) -> Path:
    """Write `model` to `path` as compressed-tensors writes it (`scheme`: "w4a16" or "fp8", see
    `compressed_quantization_config`): every eligible Linear and per-expert weight (`_eligible`,
    skipping the head, embeddings and routers) replaced by its compressed tensors under
    `<module>.weight_*`, the rest as saved. Returns `path`."""
    linear = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}

    def encode(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if not _eligible(name, tensor, linear, DEFAULT_SKIP):
            return None
        module = name.removesuffix(".weight")
        return {f"{module}.{k}": v for k, v in _compressed(tensor, scheme, group_size).items()}

    ignore = ["lm_head", *(f"re:.*{s}$" for s in DEFAULT_SKIP if s != "lm_head")]
    config = compressed_quantization_config(scheme, group_size, ignore)
    return _write_quantized(model, Path(path), _Quantizer(encode, config, "compressed-tensors"), tokenizer)


def _dequantized(
    tensors: dict[str, torch.Tensor], config: dict, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """One shard's tensors with every quantized weight dequantized to `dtype` under its model name."""
    fp8, mxfp4, compressed = (
        read_fp8_config(config),
        read_mxfp4_config(config),
        read_compressed_config(config),
    )
    out = {}
    for name, tensor in tensors.items():
        module, _, last = name.rpartition(".")
        if compressed is not None and last in (PACKED, SCALE, SHAPE, ZERO, GLOBAL_SCALE, "weight"):
            if last == PACKED and tensor.dtype == torch.uint8:  # nvfp4
                parts = {k: tensors[f"{module}.{k}"] for k in (PACKED, SCALE, GLOBAL_SCALE)}
                out[f"{module}.weight"] = dequantize_nvfp4(parts).to(dtype)
            elif last == PACKED:
                parts = {
                    k: tensors[f"{module}.{k}"]
                    for k in (PACKED, SCALE, SHAPE, ZERO)
                    if f"{module}.{k}" in tensors
                }
                out[f"{module}.weight"] = dequantize_packed(parts, compressed.scheme_of(module)).to(dtype)
            elif last == "weight" and tensor.dtype == torch.float8_e4m3fn:
                scheme = compressed.scheme_of(module)
                decode = dequantize_expert_float if EXPERTS in name else dequantize_float  # as the stack's
                out[name] = decode(tensor, tensors[f"{module}.{SCALE}"], scheme).to(dtype)
            elif last == "weight":
                out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
            continue
        if name.endswith((SCALE_SUFFIX, SCALES_SUFFIX)) and (fp8 or mxfp4):
            continue
        if fp8 is not None and tensor.dtype == torch.float8_e4m3fn:
            out[name] = dequantize_blocks(tensor, tensors[scale_name(name)], fp8.block, dtype)
        elif mxfp4 is not None and name.endswith(BLOCKS_SUFFIX):
            base = name.removesuffix(BLOCKS_SUFFIX)
            out[base] = dequantize_mxfp4(tensor, tensors[base + SCALES_SUFFIX], dtype)
        else:
            out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out


def save_dequantized_checkpoint(
    source: str | Path, path: str | Path, dtype: torch.dtype = torch.float32
) -> Path:
    """Write the fp8 or mxfp4 checkpoint at `source` to `path` with every quantized weight
    replaced by its dequantization (`dequantize_blocks`, `dequantize_mxfp4`) in `dtype`, its scales
    dropped and no `quantization_config`: the reference a correct loader must reproduce, in the
    same on-disk layout (so stock transformers loads it with no quantizer, whatever the family's
    in-memory fusing)."""
    source, path = Path(source), Path(path)
    config = json.loads((source / "config.json").read_text())
    if (
        read_fp8_config(config) is None
        and read_mxfp4_config(config) is None
        and read_compressed_config(config) is None
    ):
        raise MoePruneError(f"{source} has no fp8, mxfp4 or compressed-tensors quantization_config")
    path.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total_size = 0
    for file in sorted(source.glob("*.safetensors")):
        tensors, metadata = _read(file)
        out = _dequantized(tensors, config, dtype)
        save_file(out, str(path / file.name), metadata=metadata)
        weight_map.update(dict.fromkeys(out, file.name))
        total_size += _nbytes(out)
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy2(file, path / file.name)
    del config["quantization_config"]
    config["dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _rewrite_index(path, weight_map, total_size)
    return path
