"""A quantized checkpoint's tensors, read as the full-precision weights they stand for.

A block-scaled fp8 checkpoint stores each quantized Linear weight as `float8_e4m3fn` beside a
`weight_scale_inv` grid (moeprune.quant.fp8); an mxfp4 one (gpt-oss) stores each fused expert
parameter as `<name>_blocks` codes and `<name>_scales` exponents (moeprune.quant.mxfp4). Every stage that runs the model (in-memory
observation, the search, eval, layer-by-layer observation) needs the dequantized weights in the
model's fused in-memory layout. transformers' own fp8 loader would give them on a CPU, but it
reads the block size of a partial last block from the scale grid (wrong when a dimension is not a
multiple of the block), casts only the quantized weights to the requested dtype, and is missing
from the oldest transformers moeprune supports. So moeprune pairs each fp8 weight with its scales
itself, by the stored dtypes and names (no table of module names: whatever is quantized on disk
is dequantized, whatever is not is read as it is), and hands transformers' conversion mapping
lazy sources that dequantize when the loader reads them: the model is built exactly as
`from_pretrained` builds it from the dequantized checkpoint, each weight holding the values its
format's library decodes (fp8 blocks and mxfp4: transformers' float32 products; compressed-tensors:
the library's, in the scale's dtype), cast to the requested dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from moeprune.checkpoint.files import StoredTensor, stored_tensors
from moeprune.checkpoint.structure import read_config_dict
from moeprune.errors import MoePruneError
from moeprune.quant.compressed import (
    GLOBAL_SCALE,
    NVFP4_FORMAT,
    PACKED,
    SCALE,
    SHAPE,
    ZERO,
    CompressedFormat,
    dequantize_expert_float,
    dequantize_float,
    dequantize_nvfp4,
    dequantize_packed,
    read_compressed_config,
)
from moeprune.quant.fp8 import SCALE_SUFFIX, Fp8Format, dequantize_blocks, read_fp8_config, scale_shape
from moeprune.quant.mxfp4 import (
    BLOCKS_SUFFIX,
    GROUP,
    SCALES_SUFFIX,
    Mxfp4Format,
    dequantize_mxfp4,
    read_mxfp4_config,
)
from moeprune.serve.moeprune_quantized import EXPERTS

QuantFormat = Fp8Format | Mxfp4Format | CompressedFormat
SUPPORTED_QUANTIZATION = ("fp8", "mxfp4", "compressed-tensors")  # quant_method values moeprune reads
FP8_WEIGHT = "F8_E4M3"  # the safetensors dtype of an fp8 weight
_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0", "U8")  # float scales, or ue8m0 exponent bytes


def quantization_format(path: str | Path) -> QuantFormat | None:
    """The checkpoint's quantization format from config.json (None: not quantized); a
    `quantization_config` moeprune does not read is refused in one line, before a weight is read."""
    data = read_config_dict(Path(path))
    quant = data.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if str(method).lower() not in SUPPORTED_QUANTIZATION:
        raise MoePruneError(
            f"{Path(path) / 'config.json'}: quantization_config has quant_method {method!r}; moeprune reads "
            f"{', '.join(SUPPORTED_QUANTIZATION)} checkpoints only: dequantize it to bf16 first"
        )
    return read_mxfp4_config(data) or read_compressed_config(data) or read_fp8_config(data)


def fp8_scales(path: Path, tensors: dict[str, StoredTensor], fp8: Fp8Format | None) -> dict[str, str]:
    """fp8 weight key -> its `weight_scale_inv` key, every pair checked against the format: fp8
    tensors only with an fp8 quantization_config, a scale beside every fp8 weight (and none
    beside another), each scale of the weight's block grid."""
    scales = {k.removesuffix(SCALE_SUFFIX): k for k in tensors if k.endswith(SCALE_SUFFIX)}
    fp8_keys = [k for k, t in tensors.items() if t.dtype.startswith("F8_") and k not in scales.values()]
    if fp8 is None:
        if fp8_keys or scales:
            what = fp8_keys[0] if fp8_keys else next(iter(scales.values()))
            raise MoePruneError(
                f"checkpoint {path} stores fp8 weights or scales ({what!r}) but its config.json has no fp8 "
                "quantization_config: the numbers cannot be read without one"
            )
        return {}
    for key in fp8_keys:
        if tensors[key].dtype != FP8_WEIGHT:
            raise MoePruneError(
                f"checkpoint tensor {key!r} is {tensors[key].dtype}; fp8 checkpoints store {FP8_WEIGHT} weights"
            )
        if key not in scales:
            raise MoePruneError(
                f"checkpoint {path}: fp8 weight {key!r} has no {key + SCALE_SUFFIX!r} (scales missing)"
            )
    for weight, scale in scales.items():
        if weight not in tensors or tensors[weight].dtype != FP8_WEIGHT:
            raise MoePruneError(f"checkpoint {path}: scale {scale!r} is not beside an fp8 weight {weight!r}")
        expected = scale_shape(tensors[weight].shape, fp8.block)
        stored = tensors[scale]
        if stored.shape != expected or stored.dtype not in _SCALE_DTYPES:
            raise MoePruneError(
                f"checkpoint {path}: scale {scale!r} is {stored.dtype} {list(stored.shape)}, its weight "
                f"{list(tensors[weight].shape)} in {fp8.block[0]}x{fp8.block[1]} blocks needs {list(expected)}"
            )
    return scales


def mxfp4_pairs(path: Path, tensors: dict[str, StoredTensor]) -> dict[str, tuple[str, str]]:
    """Model key -> (`<key>_blocks`, `<key>_scales`) of every mxfp4 weight, each pair checked:
    uint8 codes [..., rows, groups, 16] beside uint8 exponents [..., rows, groups]."""
    pairs = {}
    for key, stored in tensors.items():
        if not key.endswith(BLOCKS_SUFFIX):
            continue
        base = key.removesuffix(BLOCKS_SUFFIX)
        scale = tensors.get(base + SCALES_SUFFIX)
        if scale is None:
            raise MoePruneError(
                f"checkpoint {path}: mxfp4 codes {key!r} have no {base + SCALES_SUFFIX!r} (scales missing)"
            )
        fits = stored.shape[-1:] == (GROUP // 2,) and stored.shape[:-1] == scale.shape
        if stored.dtype != "U8" or scale.dtype != "U8" or not fits:
            raise MoePruneError(
                f"checkpoint {path}: mxfp4 codes {key!r} ({stored.dtype} {list(stored.shape)}) and scales "
                f"({scale.dtype} {list(scale.shape)}) do not fit: uint8 [..., rows, groups, {GROUP // 2}] "
                "beside uint8 [..., rows, groups]"
            )
        pairs[base] = (key, base + SCALES_SUFFIX)
    coded = {k for pair in pairs.values() for k in pair}
    stray = [k for k in tensors if k.endswith(SCALES_SUFFIX) and k not in coded]
    if stray:
        raise MoePruneError(f"checkpoint {path}: mxfp4 scales {stray[0]!r} are not beside codes")
    return pairs


def compressed_pairs(
    path: Path, tensors: dict[str, StoredTensor], fmt: CompressedFormat
) -> dict[str, tuple[str, ...]]:
    """Model key `<m>.weight` -> the stored keys it is decoded from, for compressed-tensors:
    `weight_packed`, `weight_scale`, `weight_shape` (and `weight_zero_point`) of pack-quantized
    modules, `weight_packed`, `weight_scale` and `weight_global_scale` of nvfp4 ones, the fp8
    `weight` and its `weight_scale` of float-quantized ones; each checked."""
    pairs: dict[str, tuple[str, ...]] = {}
    for key, stored in tensors.items():
        module, _, name = key.rpartition(".")
        nvfp4 = name == PACKED and fmt.scheme_of(module).format == NVFP4_FORMAT
        if nvfp4:
            needed = [f"{module}.{n}" for n in (PACKED, SCALE, GLOBAL_SCALE)]
        elif name == PACKED:
            needed = [f"{module}.{n}" for n in (PACKED, SCALE, SHAPE)]
            zero = f"{module}.{ZERO}"
            if not fmt.scheme_of(module).symmetric:
                needed.append(zero)
        elif name == "weight" and stored.dtype.startswith("F8_"):
            needed = [key, f"{module}.{SCALE}"]
        else:
            continue
        missing = [k for k in needed if k not in tensors]
        if missing:
            raise MoePruneError(
                f"checkpoint {path}: compressed-tensors weight of {module!r} has no {missing[0]!r}"
            )
        if name == PACKED and stored.dtype != ("U8" if nvfp4 else "I32"):
            raise MoePruneError(
                f"checkpoint {path}: {key!r} is {stored.dtype}; compressed-tensors packs "
                + ("nvfp4 codes into uint8" if nvfp4 else "into int32")
            )
        pairs[f"{module}.weight"] = tuple(needed)
    return pairs


def coded_pairs(
    path: Path, tensors: dict[str, StoredTensor], fmt: QuantFormat | None
) -> dict[str, tuple[str, ...]]:
    """Model key -> its stored keys (the codes first) for formats whose codes are not the
    weight's own key and dtype (mxfp4, compressed-tensors); fp8 pairs are `fp8_scales`."""
    if isinstance(fmt, Mxfp4Format):
        return dict(mxfp4_pairs(path, tensors))
    if isinstance(fmt, CompressedFormat):
        return compressed_pairs(path, tensors, fmt)
    return {}


def logical_shape(fmt: QuantFormat | None, codes: str, stored: StoredTensor) -> tuple[int, ...]:
    """The shape of the parameter stored codes stand for, from the header alone: mxfp4's blocks
    [..., rows, groups, 16] hold the transposed [..., groups * 32, rows]; pack-quantized int32
    words [out, w] hold [out, w * 32 / bits] (exact for the multiples of 32 / bits models use);
    nvfp4's bytes [out, w] hold [out, 2w]."""
    if isinstance(fmt, Mxfp4Format) and codes.endswith(BLOCKS_SUFFIX):
        *lead, rows, groups, _ = stored.shape
        return (*lead, groups * GROUP, rows)
    if isinstance(fmt, CompressedFormat) and codes.endswith(PACKED):
        if fmt.scheme_of(codes.rpartition(".")[0]).format == NVFP4_FORMAT:
            return (*stored.shape[:-1], stored.shape[-1] * 2)
        bits = fmt.scheme_of(codes.rpartition(".")[0]).num_bits
        return (*stored.shape[:-1], stored.shape[-1] * 32 // bits)
    return stored.shape


def decoder(fmt: QuantFormat | None, key: str) -> Callable[..., torch.Tensor]:
    """The function that turns the stored tensors of quantized weight `key` (in `pairs` order:
    the codes first) into its values as the format's library decodes them: float32 for fp8 blocks
    and mxfp4 (transformers' products), the scale's dtype for compressed-tensors (its library's;
    bf16 for nvfp4)."""
    if isinstance(fmt, Fp8Format):
        return partial(dequantize_blocks, block=fmt.block)
    if isinstance(fmt, CompressedFormat):
        scheme = fmt.scheme_of(key.rpartition(".")[0])
        if scheme.format == "float-quantized":  # routed experts as transformers decodes them
            return partial(dequantize_expert_float if EXPERTS in key else dequantize_float, scheme=scheme)
        if scheme.format == NVFP4_FORMAT:
            return lambda *parts: dequantize_nvfp4(dict(zip((PACKED, SCALE, GLOBAL_SCALE), parts)))
        names = (PACKED, SCALE, SHAPE, ZERO)
        return lambda *parts: dequantize_packed(dict(zip(names, parts)), scheme)
    return dequantize_mxfp4


class _Dequantized:
    """A quantized weight (its stored tensors), dequantized (`decoder`) when the loader reads it
    (`x[...]`, what transformers' loader does with a safetensors slice): one tensor at a time."""

    def __init__(self, parts: tuple[Any, ...], decode: Callable[..., torch.Tensor]):
        self.parts, self.decode = parts, decode

    def __getitem__(self, index: Any) -> torch.Tensor:
        full = self.decode(*(part[...] for part in self.parts))
        return full if index is Ellipsis else full[index]


@dataclass
class QuantizedSources:
    """The tensors of one checkpoint folder as full-precision sources for transformers' loader.

    `fmt` is the format (None: not quantized, every tensor is read as stored); `pairs` maps each
    quantized weight's model key to the stored keys it is decoded from, checked against the
    format (fp8: the weight and its `weight_scale_inv`; mxfp4: `_blocks` and `_scales`;
    compressed-tensors: see `compressed_pairs`). The first stored key holds the codes.
    """

    path: Path
    tensors: dict[str, StoredTensor]
    fmt: QuantFormat | None
    pairs: dict[str, tuple[str, ...]]

    @classmethod
    def of(cls, path: str | Path) -> QuantizedSources:
        path = Path(path)
        fmt = quantization_format(path)
        tensors = stored_tensors(path)
        pairs = coded_pairs(path, tensors, fmt)
        if fmt is None or isinstance(fmt, Fp8Format):  # fp8 weights keep their own key and dtype
            pairs = {w: (w, s) for w, s in fp8_scales(path, tensors, fmt).items()}
        return cls(path, tensors, fmt, pairs)

    def weight_keys(self) -> dict[str, str]:
        """Every key that loads into the model -> the shard holding it (a quantized weight's: its codes')."""
        coded = {k for pair in self.pairs.values() for k in pair}
        keys = {k: t.file for k, t in self.tensors.items() if k not in coded}
        keys.update({key: self.tensors[stored[0]].file for key, stored in self.pairs.items()})
        return keys

    def _decode(self, key: str) -> Callable[..., torch.Tensor]:
        return decoder(self.fmt, key)

    def sources(self, keys: list[str], stack: ExitStack) -> dict[str, Any]:
        """key -> a slice transformers' loader reads (`[...]`), quantized weights dequantized on
        read; the shards are opened in `stack` (scales may live in another shard)."""
        handles: dict[str, Any] = {}

        def sliced(key: str) -> Any:
            file = self.tensors[key].file
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(self.path / file, framework="pt", device="cpu"))
            return handles[file].get_slice(key)

        out: dict[str, Any] = {}
        for key in keys:
            stored = self.pairs.get(key)
            out[key] = (
                sliced(key) if stored is None else _Dequantized(tuple(map(sliced, stored)), self._decode(key))
            )
        return out


def check_quantized(path: str | Path) -> QuantFormat | None:
    """The checkpoint's quantization format (None: not quantized), after checking from the shard
    headers alone that moeprune can read it: a known format, every quantized weight beside
    scales that fit it."""
    return QuantizedSources.of(path).fmt
