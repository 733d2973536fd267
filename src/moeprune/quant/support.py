"""What each stage does with a quantized checkpoint, and the one-line refusals where it cannot.

Every stage reads a block-scaled fp8 checkpoint: the loaded model and layer-by-layer observation
dequantize each weight with its scales as it is read (moeprune.checkpoint.quantized), streamed
scores dequantize block-rows. Writing is where the format binds: dropping whole experts keeps the
kept experts' fp8 bytes and scales as they are, while cutting neurons would split scale blocks
(a `down_proj` block spans 128 input channels) and re-quantize what remains. Rather than
re-quantize silently, moeprune refuses there, before any weight is read, naming the two ways
forward: drop whole experts, or save dequantized weights on request.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from moeprune.errors import MoePruneError
from moeprune.quant.compressed import read_compressed_config
from moeprune.quant.fp8 import read_fp8_config

KEEP_FP8_ROUTE = (
    "drop whole experts (--method drop; the kept experts' fp8 bytes and scales are copied as they are), "
    "or save dequantized weights with --save-dtype bf16 (about twice the fp8 bytes)"
)

NEURON_ROUTE = (
    "drop whole experts instead (--method drop keeps the kept experts' fp8 bytes), or prune the loaded "
    "model with --save-dtype bf16 to save dequantized weights"
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
    if method == "compressed-tensors":
        compressed = read_compressed_config(config)  # a format moeprune does not decode: refused there
        if compressed is not None:
            return compressed.saved_as
    return str(method)


def refuse_quantized(
    path: str | Path, config: dict[str, Any], what: str, route: str = KEEP_FP8_ROUTE, options: tuple = ()
) -> None:
    """Refuse a quantized checkpoint for `what` (a stage that cannot keep its quantization), in
    one line naming the format and `route`, the ways that work."""
    described = quantization_of(config)
    if described is not None:
        raise MoePruneError(
            f"{path} is quantized ({described}); {what} would split its scale blocks and re-quantize them: {route}",
            options=options,
        )


COMPRESSED_PACKAGE = "compressed-tensors"  # what transformers and vLLM read that format with


def needs_package(save_dtype: str | None) -> str | None:
    """The package stock transformers and vLLM need to load weights saved as `save_dtype` (a
    report's `save_dtype`, such as "compressed-tensors (pack-quantized int4)"), or None. moeprune
    decodes every format it reads itself; they do not."""
    return COMPRESSED_PACKAGE if (save_dtype or "").startswith(COMPRESSED_PACKAGE) else None


def package_missing(package: str) -> bool:
    """Whether `package` (a distribution named like its import, dashes for underscores) is absent here."""
    return importlib.util.find_spec(package.replace("-", "_")) is None


# lists of module names in the formats' configs (fp8 and MXFP4: modules left unquantized, MiniMax's
# spelling too; compressed-tensors: `ignore`, and each config group's `targets`)
_NAME_LISTS = ("modules_to_not_convert", "ignored_layers", "ignore")
_EXPERT_MODULE = re.compile(
    r"^(?P<head>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.*\.)?experts\.)(?P<expert>\d+)(?P<tail>\..*)?$"
)


def follow_kept_experts(quant: dict[str, Any], kept: dict[int, list[int]]) -> dict[str, Any]:
    """`quant` (a quantization_config) with every module name that names one expert following the
    pruned layout: `kept[layer]` lists the original ids kept, in their new order, so expert `e`
    of that layer becomes `kept[layer].index(e)`, and a dropped expert's names go. Names of other
    modules, layers not in `kept`, class names and "re:" patterns stay as written (a pattern over
    expert ids cannot be renumbered; releases write those per module kind, not per expert)."""

    def follow(names: list[Any]) -> list[Any]:
        out = []
        for name in names:
            match = (
                _EXPERT_MODULE.match(name) if isinstance(name, str) and not name.startswith("re:") else None
            )
            layer = int(match["layer"]) if match else None
            if match is None or layer not in kept:
                out.append(name)
            elif int(match["expert"]) in kept[layer]:
                out.append(f"{match['head']}{kept[layer].index(int(match['expert']))}{match['tail'] or ''}")
        return out

    result = dict(quant)
    for key in _NAME_LISTS:
        if isinstance(result.get(key), list):
            result[key] = follow(result[key])
    groups = result.get("config_groups")
    if isinstance(groups, dict):
        result["config_groups"] = {
            name: {**group, "targets": follow(group["targets"])}
            if isinstance(group, dict) and isinstance(group.get("targets"), list)
            else group
            for name, group in groups.items()
        }
    return result
