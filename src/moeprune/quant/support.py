"""Which stages read a quantized checkpoint, and the one-line refusal everywhere else.

A checkpoint whose config.json holds a `quantization_config` must never come out silently wrong
or up-cast. Loading it through transformers on a CPU dequantizes it in ways moeprune cannot stand
behind (the dequantized weights take the requested dtype while the other tensors keep theirs, the
block size of a partial last block is misread from the scale grid, and the loaded model cannot be
saved back), and layer-by-layer observation would read the quantized codes without their scales.
So until a stage reads the quantized tensors itself, it refuses such a checkpoint here, before
any weight is read, naming the format and what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeprune.errors import MoePruneError
from moeprune.quant.fp8 import read_fp8_config

FP8_ROUTE = (
    "fp8 is read without loading: weight-only criteria (aimer, magnitude, random) with `score --streaming` "
    "and the drop method with `prune --no-load` keep the format; otherwise dequantize the checkpoint first"
)


def quantization_of(config: dict[str, Any]) -> str | None:
    """A short description of the checkpoint's quantization ("fp8, 128x128 blocks"), or None."""
    raw = config.get("quantization_config")
    if not raw:
        return None
    method = raw.get("quant_method", "unknown") if isinstance(raw, dict) else "unknown"
    if method == "fp8":
        fmt = read_fp8_config(config)  # a malformed fp8 config is refused there, in one line
        if fmt is not None:
            return f"fp8, {fmt.block[0]}x{fmt.block[1]} blocks"
    return str(method)


def refuse_quantized(path: str | Path, config: dict[str, Any], what: str) -> None:
    """Refuse a quantized checkpoint for `what` (a stage that does not read its quantized tensors)."""
    described = quantization_of(config)
    if described is not None:
        route = FP8_ROUTE if described.startswith("fp8") else "dequantize the checkpoint to bf16 first"
        raise MoePruneError(
            f"{path} is quantized ({described}); {what} does not read quantized weights yet and would "
            f"compute on, or save, a silently up-cast copy: {route}"
        )
