"""Quantized weights a moeprune result kept from its input, decoded with torch alone
(part of modeling_moeprune.py; moeprune copies it into every moeprune-format folder, and its own
reader calls the same functions, so both compute the same numbers).

A result pruned from a quantized checkpoint keeps the input's bytes: config.json keeps its
`quantization_config`, and each quantized weight is stored as codes beside companions, by the
names the three formats use:

- block-scaled fp8 (`"quant_method": "fp8"`, DeepSeek-V3, MiniMax-M2, Qwen3-FP8): `<w>` in
  float8_e4m3fn beside `<w>_scale_inv`, one scale per `weight_block_size` block (fp32, or ue8m0
  powers of two);
- MXFP4 (`"mxfp4"`, gpt-oss): `<p>_blocks` (two e2m1 codes per byte, [..., out, in/32, 16]) beside
  `<p>_scales` (one e8m0 exponent per 32 values) stand for the parameter `<p>` [..., in, out];
- compressed-tensors (`"compressed-tensors"`): pack-quantized `<m>.weight_packed` (int32 words),
  `<m>.weight_scale`, `<m>.weight_shape` and, asymmetric, `<m>.weight_zero_point` stand for
  `<m>.weight`; float-quantized `<m>.weight` (fp8) beside `<m>.weight_scale`; nvfp4-pack-quantized
  `<m>.weight_packed` (uint8, two e2m1 codes a byte) beside `<m>.weight_scale` (fp8, one per 16
  inputs) and `<m>.weight_global_scale` (float32 [1], which divides the scales).

Each format is decoded as its own library decodes it, so these files, moeprune's reader and the
stock stack hold the same numbers:

- fp8 blocks and MXFP4 as transformers does: every product in float32 (exact for MXFP4, a 2-bit
  mantissa times a power of two; one float32 rounding for fp8 times a float32 scale), then cast to
  the model's dtype by the loader;
- compressed-tensors as its `dequantize` does: the codes cast to the scale's dtype, the zero point
  subtracted and the scale multiplied in that dtype, so a bf16 scale gives bf16 weights (each
  product rounded once to bf16), not the float32 products; nvfp4 as its compressor does: the codes
  and fp8 scales cast to bf16, the scales divided by the float32 global scale (float32 by torch's
  promotion), the product in float32, then rounded to bf16 whatever the model's dtype.

and read as transformers with compressed-tensors reads them (the stack that loads the input):

- routed experts (a name with `.experts.`: transformers 5 holds them fused, not as Linear
  modules, and decodes them while loading, by `"experts"` in its conversion patterns):
  float-quantized (fp8) ones as float32 products, rounded to bf16 by transformers before 5.21
  (`.to(torch.bfloat16)` in its DecompressExperts, `.to(dtype)` from 5.21 on): `expert_float`;
- the Linear modules a config group with dynamic fp8 `input_activations` targets (fp8-dynamic:
  attention, shared experts, dense MLPs; not the routed experts, which are no Linear there)
  quantize their input on every call, as compressed-tensors' forward does:
  `quantize_linear_inputs` (a forward pre-hook computing `fake_quantize_fp8_tokens`);
- before transformers 5.21, fp8 routed experts keep bf16 parameters (and compute in bf16) in a
  model of any dtype: `hold_fp8_experts_in_bf16`. `read_as_compressed_tensors` does both.
"""

from __future__ import annotations

import re

import torch
import transformers

from .moeprune_format import FormatError

FP8_SCALE_SUFFIX = "_scale_inv"
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
MXFP4_GROUP = 32  # values sharing one exponent
# the 16 e2m1 codes: sign bit 3, exponent bits 2-1, mantissa bit 0 (no inf, no nan)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PACKED, SCALE, SHAPE, ZERO = "weight_packed", "weight_scale", "weight_shape", "weight_zero_point"
GLOBAL_SCALE, NVFP4_GROUP = "weight_global_scale", 16  # nvfp4: the scales' divisor, inputs per scale
NVFP4_FORMAT = "nvfp4-pack-quantized"
DECODED_METHODS = ("fp8", "mxfp4", "compressed-tensors")


# ------------------------------------------------------------------------------------ the math
def fp8_scales_as_float(scale_inv: torch.Tensor) -> torch.Tensor:
    """float32 scales: float ones as they are, ue8m0 ones stored as raw exponent bytes (uint8, as
    MXFP8 checkpoints store them) decoded to their powers of two."""
    if scale_inv.dtype == torch.uint8:
        return torch.exp2(scale_inv.to(torch.float32) - 127.0)
    return scale_inv.to(torch.float32)


def dequantize_fp8_blocks(fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`fp8` [..., out, in] times its block's scale (`scale_inv` [..., ceil(out/B0), ceil(in/B1)];
    the last blocks may be partial), in float32."""
    rows, cols = fp8.shape[-2:]
    scale = fp8_scales_as_float(scale_inv).repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return fp8.to(torch.float32) * scale.repeat_interleave(block[1], dim=-1)[..., :cols]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The parameter [..., in, out] that uint8 `blocks` [..., out, G, 16] (low nibble first) and
    uint8 `scales` [..., out, G] (2^(byte - 127)) store, in float32."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., out, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).transpose(-1, -2).contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, count: int) -> torch.Tensor:
    """The `count` signed integers of each row of int32 `packed` (offset by 2^(bits-1), packed
    densely from bit 0; a value may straddle two words for 3, 5, 6 or 7 bits)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF  # the unsigned bits
    start = torch.arange(count) * num_bits
    word, offset = start // 32, start % 32
    mask = (1 << num_bits) - 1
    bits = (words[..., word] >> offset) & mask
    spill = offset + num_bits - 32
    if bool((spill > 0).any()):
        following = words[..., (word + 1).clamp(max=words.shape[-1] - 1)]
        bits = torch.where(spill > 0, bits | ((following << (num_bits - spill).clamp(min=0)) & mask), bits)
    return bits - (1 << (num_bits - 1))


def dequantize_packed(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: torch.Tensor,
    num_bits: int,
    zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight [out, in] of one pack-quantized module in the scale's dtype, as compressed-tensors
    computes it: `(q - zero) * scale` per group of inputs (a [out, 1] or [out] scale: per channel),
    the integers cast to the scale's dtype (exact: 8 bits fit bf16's mantissa) and every step in
    that dtype; `zero` packed along the output dimension."""
    out, cols = (int(s) for s in shape.tolist())
    dtype = scale.dtype
    q = unpack_int32(packed, num_bits, cols).to(dtype)
    if scale.dim() == 1:
        scale = scale[:, None]
    if zero is not None:
        zero = unpack_int32(zero.transpose(0, 1).contiguous(), num_bits, out).transpose(0, 1)
        q = q - zero.to(dtype).repeat_interleave(-(-cols // zero.shape[-1]), dim=-1)[..., :cols]
    return q * scale.repeat_interleave(-(-cols // scale.shape[-1]), dim=-1)[..., :cols]


def dequantize_float(
    weight: torch.Tensor, scale: torch.Tensor, block_structure: tuple[int, int] | None = None
) -> torch.Tensor:
    """The weight of one float-quantized (fp8) module in the scale's dtype, as compressed-tensors
    computes it: the fp8 values cast to the scale's dtype (exact) times the scale in that dtype,
    the scale per tensor, per output channel, per group of inputs, or per `block_structure` block."""
    w = weight.to(scale.dtype)
    rows, cols = w.shape
    if scale.numel() == 1:
        return w * scale.reshape(())
    if block_structure:
        b0, b1 = block_structure
        return w * scale.repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]
    if scale.dim() == 1:
        scale = scale[:, None]
    return w * scale.repeat_interleave(-(-cols // scale.shape[-1]), dim=-1)[..., :cols]


def dequantize_nvfp4(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None
) -> torch.Tensor:
    """The weight [out, in] of one nvfp4-pack-quantized module, in bf16, as compressed-tensors'
    NVFP4 compressor decodes it: uint8 `packed` [out, in/2] holds two e2m1 codes a byte, the low
    nibble first; `scale` [out, in/16] (fp8) one per 16 inputs, divided by `global_scale` (float32
    [1]) before it multiplies. The library unpacks to bf16 and casts the scale to it (both exact),
    divides by the global scale in the promoted dtype (float32 for a [1] tensor), multiplies there
    (one rounding) and rounds the product to bf16 (a second): each step here is the same torch op."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    values = table[codes.long()].to(torch.bfloat16)
    step = scale.to(values.dtype)
    if global_scale is not None:
        step = step / global_scale
    groups = values.unflatten(-1, (-1, NVFP4_GROUP)).to(step.dtype)
    return (groups * step[..., None]).to(torch.bfloat16).flatten(-2)


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
BF16_EXPERTS_BELOW = (5, 21)  # transformers before 5.21 rounds decoded fp8 experts to bf16
EXPERTS = ".experts."  # in a routed expert's tensor and module names (not `shared_experts.`)


def rounds_fp8_experts_to_bf16(version: str | None = None) -> bool:
    """Whether the installed transformers (or `version`) rounds float-quantized routed experts to
    bf16 while loading, whatever the model's dtype (DecompressExperts before 5.21)."""
    parts = re.findall(r"\d+", version or transformers.__version__)[:2]
    return tuple(int(p) for p in parts) < BF16_EXPERTS_BELOW


def expert_float(
    fp8: torch.Tensor, scale: torch.Tensor, block_structure: tuple[int, int] | None = None
) -> torch.Tensor:
    """A float-quantized routed expert's weight as transformers decodes it while loading: before
    5.21 the product rounded to bf16 whatever the model's dtype (exactly the scale's-dtype
    product for a bf16 scale, as a float32 one's rounded); from 5.21 on, with float32 scales, the
    float32 product, which `dequantize_float` gives (with bf16 scales 5.21+ keeps float32 products
    in a float32 model where moeprune keeps the library's bf16 ones: docs/quantization.md)."""
    dense = dequantize_float(fp8, scale, block_structure)
    return dense.to(torch.bfloat16) if rounds_fp8_experts_to_bf16() else dense


def fake_quantize_fp8_tokens(x: torch.Tensor, per_token: bool = True) -> torch.Tensor:
    """compressed-tensors' dynamic fp8 activation quantization, as its forward applies it to a
    Linear's input: one scale per token (over the dimensions after the first two; a 2-D input
    gets one scale, as the library reduces it) or per tensor, `max(|min(x, 0)|, max(x, 0)) / 448`
    in x's dtype (an all-zero row: the dtype's eps), `x / scale` clamped to +-448, rounded to
    e4m3 and multiplied back, each step in x's dtype."""
    dims = tuple(range(2, x.dim())) if per_token else ()
    if dims:
        low, high = torch.amin(x, dim=dims, keepdim=True), torch.amax(x, dim=dims, keepdim=True)
    else:
        low, high = torch.aminmax(x)
    low, high = torch.clamp(low, max=0), torch.clamp(high, min=0)
    scale = torch.maximum(low.abs(), high.abs()) / FP8_MAX
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(x.dtype).eps, dtype=x.dtype), scale)
    codes = torch.clamp(x / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.to(x.dtype) * scale


def _quantize_input(module: torch.nn.Module, args: tuple) -> tuple:
    per_token = getattr(module, "moeprune_input_per_token", True)
    return (fake_quantize_fp8_tokens(args[0], per_token), *args[1:])


def _input_strategy(group: dict, folder: str) -> bool | None:
    """A config group's dynamic fp8 input quantization: True per token, False per tensor, None
    without input quantization; any other activation scheme is refused (moeprune would misread it)."""
    acts = group.get("input_activations")
    if not acts:
        return None
    kind = (
        acts.get("type"),
        int(acts.get("num_bits") or 0),
        acts.get("dynamic"),
        acts.get("symmetric", True),
    )
    if kind != ("float", 8, True, True) or acts.get("strategy") not in ("token", "tensor"):
        raise _fail(
            f"{folder}: input_activations {acts!r} are not dynamic symmetric fp8 per token or tensor, "
            "the only activation quantization moeprune reads; dequantize the checkpoint first"
        )
    return acts.get("strategy") == "token"


def quantize_linear_inputs(model: torch.nn.Module, quant: dict, folder: str) -> list[str]:
    """Hook every Linear of `model` that a compressed-tensors config group with dynamic fp8
    input activations targets (its `targets`: a class name or "re:" pattern; minus `ignore`;
    a pattern taking precedence over a class name) so that it quantizes its input as
    compressed-tensors does; routed experts (no Linear in the stock model) are left as the
    library leaves them. Returns the hooked modules' names."""
    if str(quant.get("quant_method", "")).lower() != "compressed-tensors":
        return []
    groups = [g for g in (quant.get("config_groups") or {}).values() if isinstance(g, dict)]
    strategies = [_input_strategy(g, folder) for g in groups]
    if all(s is None for s in strategies):
        return []
    ignore = [t for t in quant.get("ignore") or () if isinstance(t, str)]
    hooked = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or EXPERTS in f".{name}.":
            continue
        if any(target_matches(t, name) for t in ignore):
            continue
        named = [
            s
            for g, s in zip(groups, strategies)
            if any(target_matches(t, name) for t in g.get("targets") or ())
        ]
        by_class = [
            s for g, s in zip(groups, strategies) if type(module).__name__ in (g.get("targets") or ())
        ]
        chosen = (named or by_class or [None])[0]
        if chosen is None:
            continue
        setattr(module, "moeprune_input_per_token", chosen)  # noqa: B010 - an attribute torch's stub does not know
        module.register_forward_pre_hook(_quantize_input)
        hooked.append(name)
    return hooked


def experts_group(quant: dict) -> dict | None:
    """The config group transformers decodes the routed experts with (its get_experts_scheme):
    the one whose "re:" targets name experts, else the first with a class target, else the first."""
    groups = [
        g for g in (quant.get("config_groups") or {}).values() if isinstance(g, dict) and g.get("weights")
    ]
    targets = [[t for t in g.get("targets") or () if isinstance(t, str)] for g in groups]
    for rule in (lambda t: t.startswith("re:") and "experts" in t, lambda t: not t.startswith("re:")):
        chosen = [g for g, names in zip(groups, targets) if any(rule(t) for t in names)]
        if chosen:
            return chosen[0]
    return groups[0] if groups else None


def hold_fp8_experts_in_bf16(model: torch.nn.Module, quant: dict) -> list[str]:
    """Before transformers 5.21, the fused routed experts decoded from fp8 keep bf16 parameters
    whatever the model's dtype (and so compute in bf16): the same here, for every fused experts
    module (its own 3-D parameters). Returns the modules cast."""
    group = (
        experts_group(quant) if str(quant.get("quant_method", "")).lower() == "compressed-tensors" else None
    )
    weights = (group or {}).get("weights") or {}
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8) or not rounds_fp8_experts_to_bf16():
        return []
    cast = []
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if name.rpartition(".")[2] == "experts" and own and all(p.dim() == 3 for p in own):
            module.to(torch.bfloat16)
            cast.append(name)
    return cast


def read_as_compressed_tensors(model: torch.nn.Module, quant: dict, folder: str) -> None:
    """The loaded `model` computes what transformers with compressed-tensors computes from the
    same quantized files: dynamic fp8 input activations quantized (`quantize_linear_inputs`),
    fp8 routed experts held as that transformers holds them (`hold_fp8_experts_in_bf16`)."""
    quantize_linear_inputs(model, quant, folder)
    hold_fp8_experts_in_bf16(model, quant)


def target_matches(target: str, module: str) -> bool:
    """Whether a compressed-tensors `targets` entry names `module` ("re:" regex, else the name)."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


# ------------------------------------------------------------------- the stored names, decoded
def _fail(message: str) -> FormatError:
    return FormatError(f"modeling_moeprune: {message}")


class StoredQuantization:
    """How a folder's `quantization_config` stores its quantized weights: which stored tensors
    make each weight (`parts`) and how they decode (`decode`). Methods other than the three
    above are refused in one sentence."""

    def __init__(self, quant: dict, folder: str):
        self.method = str(quant.get("quant_method", "")).lower()
        self.quant, self.folder = quant, folder
        if self.method not in DECODED_METHODS:
            raise _fail(
                f"{folder} holds {quant.get('quant_method')!r}-quantized weights, which these modeling files "
                f"do not decode (they read {', '.join(DECODED_METHODS)})"
            )
        if self.method == "fp8":
            block = quant.get("weight_block_size")
            if not (
                isinstance(block, (list, tuple))
                and len(block) == 2
                and all(isinstance(b, int) for b in block)
            ):
                raise _fail(
                    f"{folder}: fp8 weight_block_size {block!r} is not two integers (block-scaled fp8)"
                )
            self.block = (int(block[0]), int(block[1]))

    def parts(self, stored: set[str]) -> dict[str, tuple[str, ...]]:
        """Weight name -> the stored names it decodes from (the codes first); a companion without
        its codes is an error naming it."""
        found: dict[str, tuple[str, ...]] = {}
        for name in stored:
            if self.method == "fp8" and name.endswith(FP8_SCALE_SUFFIX):
                found[name.removesuffix(FP8_SCALE_SUFFIX)] = (name.removesuffix(FP8_SCALE_SUFFIX), name)
            elif self.method == "mxfp4" and name.endswith(MXFP4_BLOCKS):
                base = name.removesuffix(MXFP4_BLOCKS)
                found[base] = (name, base + MXFP4_SCALES)
            elif self.method == "compressed-tensors" and name.endswith(f".{PACKED}"):
                module = name.removesuffix(f".{PACKED}")
                zero = (f"{module}.{ZERO}",) if f"{module}.{ZERO}" in stored else ()
                nvfp4 = (self._group(module).get("format") or self.quant.get("format")) == NVFP4_FORMAT
                last = GLOBAL_SCALE if nvfp4 else SHAPE
                found[f"{module}.weight"] = (name, f"{module}.{SCALE}", f"{module}.{last}", *zero)
            elif self.method == "compressed-tensors" and name.endswith(f".{SCALE}"):
                module = name.removesuffix(f".{SCALE}")
                if f"{module}.weight" in stored:  # float-quantized: the fp8 weight beside its scale
                    found[f"{module}.weight"] = (f"{module}.weight", name)
        for weight, names in found.items():
            absent = [n for n in names if n not in stored]
            if absent:
                raise _fail(
                    f"{self.folder}: quantized weight {weight} has no {absent[0]}; the checkpoint is damaged"
                )
        return found

    def decode(self, weight: str, values: list[torch.Tensor]) -> torch.Tensor:
        """The weight from its stored tensors, in `parts` order, as the format's library decodes
        it (see the module docstring); the loader casts it to the model's dtype."""
        if self.method == "fp8":
            return dequantize_fp8_blocks(values[0], values[1], self.block)
        if self.method == "mxfp4":
            return dequantize_mxfp4(values[0], values[1])
        scheme = self._scheme(weight.removesuffix(".weight"))
        if values[0].dtype == torch.uint8:  # nvfp4: codes, scales, global scale
            return dequantize_nvfp4(values[0], values[1], values[2])
        if values[0].dtype == torch.int32:
            zero = values[3] if len(values) > 3 and not scheme.get("symmetric", True) else None
            return dequantize_packed(values[0], values[1], values[2], int(scheme.get("num_bits", 8)), zero)
        block = scheme.get("block_structure") if scheme.get("strategy") == "block" else None
        decode = expert_float if EXPERTS in weight else dequantize_float
        return decode(values[0], values[1], tuple(block) if block else None)

    def _scheme(self, module: str) -> dict:
        """The `weights` section of the config group that quantized `module`."""
        return self._group(module)["weights"]

    def _group(self, module: str) -> dict:
        """The config group that quantized `module`: the group whose targets name it, else the only group."""
        groups = [
            g
            for g in (self.quant.get("config_groups") or {}).values()
            if isinstance(g, dict) and g.get("weights")
        ]
        named = [g for g in groups if any(target_matches(t, module) for t in g.get("targets") or ())]
        if len(named) == 1 or (not named and len(groups) == 1):
            return (named or groups)[0]
        # no pattern names it: the one group with a class target ("Linear") has it, as in
        # compressed-tensors, where a name pattern takes precedence over a class name (per-layer precision)
        by_class = [g for g in groups if any(not t.startswith("re:") for t in g.get("targets") or ())]
        if not named and len(by_class) == 1:
            return by_class[0]
        raise _fail(f"{self.folder}: cannot tell which compressed-tensors config group quantized {module}")
