"""`prune --quantize`: the schemes llm-compressor applies to a pruned result, what each weighs on
disk, and the checks that need no weights (a scheme, a group size, the quantization environment).

Why a byte model here: `--target-size 40GiB --quantize w4a16` names the memory a user has, so the
sparsity is solved in the bytes the quantized result will have (packed codes, scales, zero points,
and what stays unquantized: embeddings, norms, routers, lm_head) before anything is loaded. The
formulas are compressed-tensors' layouts for one Linear weight [out, in]:

- w4a16 (pack-quantized, int4 symmetric, groups of G along `in`): int32 codes [out, in/8] (in/2
  bytes a row), scales [out, in/G] in the model's dtype, and the int64 `weight_shape` [2];
- w8a16 (pack-quantized, int8 symmetric, groups of G): codes [out, in/4] int32 (in bytes a row),
  scales [out, in/G], `weight_shape`;
- fp8-dynamic (float-quantized, e4m3 per output channel, activations per token at run time):
  fp8 weight [out, in], one scale per row [out, 1];
- nvfp4a16 (nvfp4-pack-quantized, fp4 e2m1 in groups of 16): uint8 codes [out, in/2], fp8 scales
  [out, in/16] and one float32 global scale.

Symmetric schemes store no zero point. The router (gate) and lm_head stay in the model's dtype.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from moeprune.errors import MoePruneError
from moeprune.quantize.fake import FAKE_SCHEMES
from moeprune.runtime.cache import cache_root

SETUP = "moeprune setup quantize"  # makes the environment from the installed package (no clone needed)
# a clone's environment (scripts/setup_quant.sh), under the current folder
DEFAULT_PYTHON = ".venv-quant/bin/python"
RECORD = "quant-env.json"  # in moeprune's cache folder: the environment `setup quantize` made last
DEFAULT_GROUP = 128


@dataclass(frozen=True)
class Scheme:
    """One `--quantize` choice: how llm-compressor quantizes each Linear, and its bytes on disk."""

    name: str
    help: str
    bits: int  # of one code
    grouped: bool  # scales per group of `group_size` inputs (else per output channel)
    fixed_group: int | None = None  # a format whose group size is part of it (nvfp4: 16)
    scale_bytes: int | None = None  # None: the model's dtype
    global_scale_bytes: int = 0  # per Linear (nvfp4's float32 global scale)
    shape_bytes: int = 0  # per Linear (pack-quantized's int64 weight_shape [2])

    def linear_bytes(self, out: int, inputs: int, group: int, dtype_bytes: int) -> int:
        """Bytes of one quantized Linear weight [out, inputs] with everything stored beside it."""
        groups = inputs // self.group(group) if self.grouped else 1
        scale = self.scale_bytes if self.scale_bytes is not None else dtype_bytes
        return (
            out * inputs * self.bits // 8 + out * groups * scale + self.global_scale_bytes + self.shape_bytes
        )

    def group(self, asked: int) -> int:
        return self.fixed_group or asked


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("w4a16", "int4 weights in groups, 16-bit activations (GPTQ or RTN)", 4, True, shape_bytes=16),
        Scheme("w8a16", "int8 weights in groups, 16-bit activations (GPTQ or RTN)", 8, True, shape_bytes=16),
        Scheme("fp8-dynamic", "fp8 e4m3 weights per channel, activations per token at run time", 8, False),
        Scheme(
            "nvfp4a16",
            "fp4 e2m1 weights in groups of 16 with fp8 scales, 16-bit activations",
            4,
            True,
            fixed_group=16,
            scale_bytes=1,
            global_scale_bytes=4,
        ),
    )
}
METHODS = ("gptq", "rtn")


@dataclass(frozen=True)
class QuantizeOptions:
    """What `prune --quantize` asks for; checked once by `check_quantize` before anything loads."""

    scheme: str
    method: str = "gptq"
    group_size: int | None = None  # None: DEFAULT_GROUP for grouped schemes
    python: str | None = None  # None: DEFAULT_PYTHON under the current folder
    # per-layer precision (quantize/choice.py): {decoder layer: its routed experts' scheme};
    # `scheme` is then the base, for every other Linear
    layer_schemes: dict[int, str] | None = None
    # `auto:a,b,...` resolved (job/prepare.py): the schemes a layer's experts may take, `scheme`
    # their first (the base); None for one scheme
    candidates: tuple[str, ...] | None = None
    budget: int | str | None = None  # with candidates: the target the choice fits (not a solved sparsity)
    # with candidates and no --sparsity: the sparsities tried for the joint choice (quantize/grid.py)
    sparsity_grid: int = 4
    joint: bool = False  # no sparsity given: it is chosen with the schemes

    @property
    def spec(self) -> Scheme:
        return SCHEMES[self.scheme]

    @property
    def group(self) -> int:
        return self.spec.group(self.group_size or DEFAULT_GROUP)

    def recipe(self) -> dict[str, object]:
        """What recipe.json records to repeat the quantization (the format's own group left out)."""
        grouped = self.spec.grouped and not self.spec.fixed_group
        if self.candidates:  # `auto:` repeats as asked; the choice is recorded beside it
            grouped = any(SCHEMES[s].grouped for s in self.candidates)
        out: dict[str, object] = {
            "scheme": self.asked,
            "method": self.method,
            "group_size": self.group_size or DEFAULT_GROUP if grouped else None,
        }
        if self.layer_schemes:
            out["layer_schemes"] = {str(k): v for k, v in sorted(self.layer_schemes.items())}
        return out

    @property
    def asked(self) -> str:
        """The scheme as the user gave it: `auto:a,b` for per-layer precision."""
        return AUTO + ",".join(self.candidates) if self.candidates else self.scheme

    def describe(self) -> str:
        grouped = [self.of(s).group for s in self.candidates or (self.scheme,) if SCHEMES[s].grouped]
        group = f", groups of {'/'.join(map(str, sorted(set(grouped))))}" if grouped else ""
        return f"{self.asked} ({self.method}{group})"

    def of(self, scheme: str) -> QuantizeOptions:
        """These options with one scheme everywhere (a group size given for the list goes to the
        schemes that take one)."""
        spec = SCHEMES[scheme]
        group = self.group_size if spec.grouped and not spec.fixed_group else None
        return QuantizeOptions(scheme, self.method, group, self.python)


OPTIONS = ("quantize",)


def check_quantize(options: QuantizeOptions, has_data: bool, quantized_input: str | None) -> str:
    """The refusals of a quantize request that need nothing but the request and the input's
    format, in one line each; returns the quantization environment's Python. `quantized_input`:
    how the input is quantized (None: full precision)."""
    names = options.candidates or check_auto(options.scheme, has_data)
    if names is not None:  # per-layer precision: every candidate passes the one-scheme checks
        for name in names:
            python = check_quantize(options.of(name), has_data, quantized_input)
        return python
    if options.scheme not in SCHEMES:
        raise MoePruneError(
            f"unknown quantization scheme {options.scheme!r}; choose one of {', '.join(SCHEMES)}",
            options=OPTIONS,
        )
    if options.method not in METHODS:
        raise MoePruneError(
            f"unknown quantization method {options.method!r}; choose gptq or rtn", options=("quant_method",)
        )
    spec = options.spec
    if options.group_size is not None and not spec.grouped:
        raise MoePruneError(
            f"{options.scheme} scales each output channel; a group size applies to w4a16 and w8a16",
            options=("quant_group_size",),
        )
    if options.group_size is not None and spec.fixed_group and options.group_size != spec.fixed_group:
        raise MoePruneError(
            f"{options.scheme} groups {spec.fixed_group} weights by its format; leave the group size out",
            options=("quant_group_size",),
        )
    if options.group_size is not None and options.group_size <= 0:
        raise MoePruneError(
            f"the group size must be positive, got {options.group_size}", options=("quant_group_size",)
        )
    if quantized_input is not None:
        raise MoePruneError(
            f"the input is already quantized ({quantized_input}); moeprune quantizes full-precision "
            "checkpoints only (prune it keeping its format, or start from the full-precision release)",
            options=OPTIONS,
        )
    if options.method == "gptq" and not has_data:
        raise MoePruneError(
            "GPTQ calibrates on the prune's calibration data: give data files, or quantize by "
            "round-to-nearest (method rtn)",
            options=("data", "quant_method"),
        )
    return _quant_python(options.python)


def check_group(options: QuantizeOptions, dims: list[int], widths: list[int]) -> None:
    """Refuse, before loading, a group size that does not divide every grouped input: `dims` the
    other quantized Linears' inputs and the experts' hidden size, `widths` the kept expert widths
    (the down projections' inputs). The line names the largest group size that would."""
    if not options.spec.grouped:
        return
    group = options.group
    every = [*dims, *widths]
    bad = sorted({d for d in every if d % group})
    if not bad:
        return
    largest = max(g for g in range(group, 0, -1) if all(d % g == 0 for d in every))
    what = "kept expert width" if set(bad) <= set(widths) else "quantized input width"
    raise MoePruneError(
        f"a group of {group} weights does not divide the {what}{'s' if len(bad) > 1 else ''} "
        f"{', '.join(map(str, bad))}: the largest group size that divides every width is {largest}",
        options=("quant_group_size",),
    )


AUTO = "auto:"


def parse_auto(text: str) -> tuple[str, ...] | None:
    """The schemes of `auto:a,b,...` (None for a single scheme); refuses, in one line, an unknown
    or unmodelled scheme, a repeat, or fewer than two."""
    if not text.startswith(AUTO):
        return None
    names = tuple(n.strip() for n in text[len(AUTO) :].split(",") if n.strip())
    for name in names:
        if name not in SCHEMES:
            raise MoePruneError(
                f"unknown quantization scheme {name!r} in {text!r}; choose among {', '.join(FAKE_SCHEMES)}",
                options=("quantize",),
            )
        if name not in FAKE_SCHEMES:
            raise MoePruneError(
                f"{name} has its own group size and scale format, which per-layer precision does not model; "
                f"choose among {', '.join(FAKE_SCHEMES)}",
                options=("quantize",),
            )
    if len(set(names)) != len(names):
        raise MoePruneError(f"a scheme is named twice in {text!r}", options=("quantize",))
    if len(names) < 2:
        raise MoePruneError(
            f"{text!r} leaves nothing to choose: name two or more schemes after 'auto:', or give the one "
            "scheme without it",
            options=("quantize",),
        )
    return names


def check_auto(text: str, has_data: bool) -> tuple[str, ...] | None:
    """`parse_auto` plus the refusal that needs the request only: scoring needs calibration data."""
    names = parse_auto(text)
    if names is not None and not has_data:
        raise MoePruneError(
            "per-layer precision scores each layer's schemes on the calibration data: give data files",
            options=("data", "quantize"),
        )
    return names


def _quant_python(given: str | None) -> str:
    if given:
        path = Path(given)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise MoePruneError(f"{given!r} is not an executable Python", options=("quant_python",))
        return str(path.absolute())
    found = default_quant_python()
    if found is None:
        raise MoePruneError(
            f"no quantization environment (none recorded by {SETUP!r}, no {DEFAULT_PYTHON} here): run "
            f"'{SETUP}' to make it, or give the Python of an environment with llmcompressor",
            options=("quant_python",),
        )
    return str(found)


def default_quant_python() -> Path | None:
    """The quantization environment's Python when none is given: a clone's `.venv-quant` under the
    current folder, else the one `moeprune setup quantize` recorded; None when neither exists."""
    local = Path(DEFAULT_PYTHON)
    if local.is_file() and os.access(local, os.X_OK):
        return local.absolute()
    record = cache_root() / RECORD
    try:
        python = Path(json.loads(record.read_text())["python"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return python if python.is_file() and os.access(python, os.X_OK) else None


def record_quant_python(python: Path) -> Path:
    """Remember `python` as the quantization environment (`moeprune setup quantize`); returns the record."""
    record = cache_root() / RECORD
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"python": str(Path(python).absolute())}) + "\n")
    return record
