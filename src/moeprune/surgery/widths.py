"""Which widths a narrowed expert may keep (`--width-multiple N`), and the width super experts'
layer neighbours share when `--method neurons` keeps the super experts whole.

Why a multiple: serving kernels pad an expert's width to their alignment (vLLM's fused MoE to 32
neurons: a TENP result with 43-neuron experts was held at 1.084x its packed parameters) and a
quantization group must divide every quantized input (a down projection's input is the width).
A narrowed width that is a multiple of N wastes nothing there. The full width is always allowed.

The default (no `--width-multiple`): the quantization group size with `--quantize` (set by the
prune job, job/prepare.py), else 32, the serving kernels' alignment, where the full width is a
multiple of 32 and at least 256 (8 blocks: half a step is then at most 1/16 of the width). A narrower or unaligned expert (the tiny test models) keeps the
method's own step: 8 neurons for the neurons method where the width is a multiple of 8
(transformers' grouped_mm needs 16-byte strides in a stock checkpoint), else 1.

With `--method neurons`, a layer's guarded super experts stay whole and its others share
`guarded_width` (`guarded_shared` below: under the default step, 32 falls back to 8,
then 1, where less than one block would be left); TENP under the default step falls back to its
own 1 neuron the same way (surgery/tenp.py `tenp_steps`). An explicit `--width-multiple` is never
relaxed: a budget it cannot meet is refused.

`--method mixed` takes the same rule (surgery/mixed.py `mixed_steps`): `width_step(width, asked,
floor)` is the step of one layer, `nearest_multiple` rounds a target width onto it, and
`hand_out_blocks` hands the neurons its genes miss to the narrowed experts a block at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from moeprune.errors import MoePruneError
from moeprune.models.adapter import ExpertCost, MoELayer
from moeprune.models.packed import layer_cost

ALIGN = 32  # the serving kernels' alignment (vLLM's fused MoE pads expert widths to it)
# the default aligns only experts at least 8 blocks wide: half a step is then at most 1/16 of the
# width, where on a 64-wide expert it would round a 25 % ENP cut (48 neurons) up to no cut at all
ALIGN_MIN_WIDTH = 8 * ALIGN
STOCK_MULTIPLE = 8  # grouped_mm's 16-byte strides (bf16/fp16): a stock uniform width's step


def check_width_multiple(value: object) -> int | None:
    """None (the default) or a positive integer; anything else one line naming the setting."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MoePruneError(
            f"the width multiple must be a positive integer, got {value!r}", options=("width_multiple",)
        )
    return value


def width_step(width: int, asked: int | None, floor: int = 1) -> int:
    """The step of the narrowed widths of experts `width` neurons wide: `asked` when given (the
    full width stays allowed even when it is not a multiple), else ALIGN where the full width is a
    multiple of it and at least ALIGN_MIN_WIDTH, else `floor` where the width is a multiple of it, else 1."""
    if asked is not None:
        return asked
    if width % ALIGN == 0 and width >= ALIGN_MIN_WIDTH:
        return ALIGN
    return floor if floor >= 1 and width % floor == 0 else 1


def nearest_multiple(target: float, step: int, width: int) -> int:
    """The multiple of `step` nearest `target` neurons (ties: the larger), capped at `width`
    (the full width counts as a multiple); 0 when the nearest is no neuron at all."""
    low = math.floor(target / step) * step
    if low >= width:
        return width
    high = min(low + step, width)
    return high if target - low >= high - target else max(low, 0)


def guarded_width(
    cost: ExpertCost, width: int, experts: int, whole: int, uniform: int, step: int, layer: int
) -> int:
    """The width the other experts of a layer share when `whole` of its `experts` (super experts)
    stay whole: the widest multiple of `step` whose layer total does not exceed what the neurons
    method's one width `uniform` keeps there (so the planned size of the stock plan still bounds
    the result, and the layer keeps at most one step, (experts - whole) x step neurons, less);
    one line when not even one block of `step` neurons is left."""
    budget = experts * cost.params(uniform) - whole * cost.params(width)
    rest = experts - whole
    k = (width // step) * step
    while k >= step and rest * cost.params(k) > budget:
        k -= step
    if k < step or rest <= 0:
        raise MoePruneError(
            f"MoE layer {layer}: with its {whole} super expert(s) kept whole, its other {rest} experts would "
            f"keep less than {'one neuron' if step == 1 else f'one block of {step} neurons'} each; "
            "lower the sparsity, or allow narrowing super experts (a stock checkpoint)",
            options=("sparsity", "allow_super_experts", "width_multiple"),
        )
    return min(k, width)


def promoted_widths(
    m: MoELayer, others: list[int], whole: int, k: int, shared: int, step: int
) -> dict[int, int]:
    """The narrowed widths of a guarded layer's other experts: `shared` each, then one step more
    for as many of them (the lowest ids) as what `shared` leaves of ENP's layer budget pays for, so
    the layer keeps at most one step of one expert less than ENP's K would, never more (the
    stock plan's planned size still bounds the result). An expert promoted to its full width is
    whole."""
    cost, full = layer_cost(m), m.intermediate_size
    left = m.num_experts * cost.params(k) - whole * cost.params(full) - len(others) * cost.params(shared)
    up = min(shared + step, full)
    promoted = int(left // (cost.params(up) - cost.params(shared))) if up > shared else 0
    widths = {e: up if i < promoted else shared for i, e in enumerate(others)}
    return {e: w for e, w in widths.items() if w < full}


def guarded_shared(m: MoELayer, whole: int, k: int, asked: int | None) -> tuple[int, int]:
    """(width, step) the other experts of a layer with `whole` super experts share. An asked
    multiple is kept or refused; the default step (32) falls back to 8, then 1, where less than one
    block would be left (a small expert: the demo's 64 neurons at 50 %)."""
    full, cost = m.intermediate_size, layer_cost(m)
    steps = [asked] if asked is not None else [width_step(full, None, STOCK_MULTIPLE), STOCK_MULTIPLE, 1]
    tries = [s for s in dict.fromkeys(steps) if asked is not None or full % s == 0 or s == 1]
    for pos, step in enumerate(tries):
        try:
            return guarded_width(cost, full, m.num_experts, whole, k, step, m.index), step
        except MoePruneError:
            if pos == len(tries) - 1:
                raise
    raise AssertionError("no width step tried")  # pragma: no cover - tries is never empty


def hand_out_blocks(
    widths: list[list[int]], slots: list[tuple[int, int]], layers: list[tuple[int, int]], owed: float
) -> float:
    """Give `owed` neurons (taken back when negative) to the narrowed experts `widths[pos][j]`, a
    block of their layer's step at a time (`layers[pos]` = (step, full width)), round-robin over
    `slots` in order (the mixed method's most important first), each block only while at least half
    of it is still owed (TENP's rule, allocate/trapezoid.py): a width stays a multiple of its step
    (or the full width) and at least one block. Blocks taken back come from the least important
    first, as the single-neuron fill does. Returns what is left owed, in neurons."""
    sign = 1 if owed > 0 else -1
    order = slots if sign > 0 else slots[::-1]
    moved = True
    while moved:
        moved = False
        for j, pos in order:
            step, full = layers[pos]
            w = widths[pos][j]
            new = min((w // step + 1) * step, full) if sign > 0 else (w - 1) // step * step
            if (new > w if sign > 0 else new >= step) and sign * owed >= abs(new - w) / 2:
                widths[pos][j] = new
                owed -= new - w
                moved = True
    return owed


def check_gradient_steps(steps: Sequence[int]) -> None:
    """Refuse width steps above 1 for `--allocation gradient`: its projection (search/form_projection.py)
    fills the narrowed experts neuron by neuron, so its plans are not on a width multiple."""
    if any(s > 1 for s in steps):
        raise MoePruneError(
            f"--allocation gradient narrows mixed experts neuron by neuron, but these experts keep widths on "
            f"a multiple of {max(steps)} (--width-multiple, the group size of --quantize, or the serving "
            "alignment of 32 on experts at least 256 wide); give --width-multiple 1 (vLLM then pads the widths: "
            "docs/surgery.md) or use --allocation evo",
            options=("allocation", "width_multiple"),
        )
