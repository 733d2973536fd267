"""NaN and infinity never pass silently: weights, logits and activations are checked where they are
already at hand, and a failure names the tensor, model or decoder layer.

Why here and not in each stage: the same three questions come up in calibration, the search and
evaluation (is this tensor finite, which parameter holds the bad value, which layer first produced
a non-finite output), and each answer must be cheap enough to run on every call. The checks are one
``isfinite`` reduction over a tensor a stage computed anyway; the expensive part (a forward pass with
hooks on every module, to name the first non-finite output) runs only after a failure was detected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import torch
from torch import nn

from moeprune.errors import MoePruneError
from moeprune.models import decoder_layers
from moeprune.runtime.device import input_device

_CHUNK = 1 << 22  # elements reduced per step when scanning weights: a 4M-element view, no copy


RUN_ADVICE = "check that model's weights, or load it in float32 if it ran in a narrower dtype"
WEIGHT_ADVICE = (
    "the checkpoint is corrupt or was saved from a diverged run: re-export it from a healthy model"
)


class NonFiniteError(MoePruneError):
    """A weight, logit or activation is NaN or infinite; the message names where, then what to do.

    `problem` says what went non-finite and where; callers that know more (which model, which data
    file, which layer) add it with :meth:`within` and :meth:`located`, keeping the advice last.
    """

    def __init__(self, problem: str, advice: str = RUN_ADVICE, *, options: tuple[str, ...] = ("dtype",)):
        super().__init__(f"{problem}: {advice}" if advice else problem, options=options)
        self.problem, self.advice = problem, advice

    def within(self, context: str) -> NonFiniteError:
        """The same error with `context` ("evaluating X on data file F") in front."""
        return NonFiniteError(f"{context}: {self.problem}", self.advice, options=self.options)

    def located(self, where: str) -> NonFiniteError:
        """The same error naming the first module whose output went non-finite (if found)."""
        if not where:
            return self
        return NonFiniteError(
            f"{self.problem}; the first non-finite output is {where}", self.advice, options=self.options
        )


def kind(tensor: torch.Tensor) -> str:
    """The kind of non-finite value a tensor holds: "NaN", "inf" or "NaN and inf"."""
    has_nan = bool(torch.isnan(tensor).any())
    has_inf = bool(torch.isinf(tensor).any())
    return " and ".join(k for k, present in (("NaN", has_nan), ("inf", has_inf)) if present) or "non-finite"


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no element is NaN or infinite (integer and boolean tensors always are).

    Screens with a sum first: NaN and inf propagate through it (inf - inf is NaN), so a finite sum
    proves every element finite, and a sum reads bf16 about 60x faster than ``isfinite`` on a CPU.
    Only a non-finite sum (or an overflow of the sum itself) pays for the exact elementwise test.
    """
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.is_meta or not tensor.numel():
        return True
    try:
        if bool(torch.isfinite(tensor.sum())):
            return True
    except (RuntimeError, TypeError):  # a dtype without a sum kernel (float8): test elementwise
        pass
    return bool(torch.isfinite(tensor).all())


def _chunks(tensor: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(offset of the first element, a view of at most _CHUNK elements) over a tensor, without copying."""
    if tensor.is_contiguous():
        flat = tensor.view(-1)
        for start in range(0, flat.numel(), _CHUNK):
            yield start, flat[start : start + _CHUNK]
        return
    rows = max(1, _CHUNK // max(1, tensor[0].numel())) if tensor.dim() else 1
    row_size = tensor[0].numel() if tensor.dim() else 1
    for start in range(0, tensor.shape[0] if tensor.dim() else 1, rows):
        yield start * row_size, (tensor[start : start + rows] if tensor.dim() else tensor)


def _first_bad(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first NaN/inf element, reading the tensor in chunks (None: all finite)."""
    for offset, chunk in _chunks(tensor):
        if all_finite(chunk):
            continue
        flat = (~torch.isfinite(chunk)).reshape(-1).nonzero()
        position = offset + int(flat[0])
        return (
            tuple(int(i) for i in torch.unravel_index(torch.tensor(position), tensor.shape))
            if tensor.dim()
            else ()
        )
    return None


def check_finite_weights(model: nn.Module, what: str = "the model", *, prefix: str = "") -> None:
    """Raise NonFiniteError naming the first parameter or buffer of `model` that holds NaN or inf.

    Cheap on large models: each tensor is summed in views of 4M elements (no copy, no temporary;
    about memory bandwidth) and only a chunk whose sum is not finite is tested element by element;
    meta tensors (offloaded or not yet loaded) are skipped. `prefix` is put before the tensor names
    when `model` is a part of a larger model ("model.layers.3.").
    """
    seen: set[int] = set()
    tensors: list[tuple[str, str, torch.Tensor]] = [("parameter", n, t) for n, t in model.named_parameters()]
    tensors += [("buffer", n, t) for n, t in model.named_buffers()]
    for role, name, tensor in tensors:
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        index = _first_bad(tensor.detach())
        if index is None:
            continue
        name = prefix + name
        layer = decoder_layer_of(model, name) if not prefix else _layer_number(prefix)
        where = f" (decoder layer {layer})" if layer is not None else ""
        at = f" at index {list(index)}" if index else ""
        raise NonFiniteError(
            f"{what}: {role} {name}{where} holds {kind(tensor.detach())}{at}", WEIGHT_ADVICE, options=()
        )


def decoder_layer_of(model: nn.Module, module_name: str) -> int | None:
    """The decoder layer index a (sub)module or parameter name lives in, if any."""
    try:
        layers = decoder_layers(model)
    except MoePruneError:  # not a decoder-only transformers model: no layer to name
        return None
    names = {id(m): n for n, m in model.named_modules()}
    prefix = names.get(id(layers))
    if prefix is None:
        return None
    head = f"{prefix}." if prefix else ""
    if not module_name.startswith(head):
        return None
    first = module_name[len(head) :].split(".", 1)[0]
    return int(first) if first.isdigit() else None


def _layer_number(prefix: str) -> int | None:
    """3 for "model.layers.3." (a decoder layer checked on its own), else None."""
    last = prefix.rstrip(".").rsplit(".", 1)[-1]
    return int(last) if last.isdigit() else None


def _float_tensors(value: object) -> Iterator[torch.Tensor]:
    """The floating-point tensors of a module output (a tensor, a tuple/list, or a dict-like output)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                yield item
    elif isinstance(value, dict):
        for item in value.values():
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                yield item


@contextmanager
def _watch(model: nn.Module, found: list[str]) -> Iterator[None]:
    """Forward hooks on every submodule recording, in the order they finish, the first whose output
    is non-finite; inner modules finish first, so it is the innermost first culprit."""
    handles = []

    def hook(name: str):
        def check(_module: nn.Module, _args: tuple, output: object) -> None:
            if not found and any(not all_finite(t) for t in _float_tensors(output)):
                found.append(name)

        return check

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_hook(hook(name)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def first_nonfinite_output(module: nn.Module, run: Callable[[], object]) -> str | None:
    """The name (inside `module`) of the first submodule whose output is NaN/inf while `run()` runs
    `module`; None when none is. An error raised by `run` (a check that fires again) ends the run:
    what was found before it still counts, and the diagnosis never replaces the original error."""
    found: list[str] = []
    with torch.no_grad(), _watch(module, found), suppress(Exception):
        run()
    return found[0] if found else None


def locate_nonfinite(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> str:
    """Where a forward pass first goes non-finite: "decoder layer 3 (model.layers.3.self_attn)".

    Runs the model once more with hooks, sample by sample (padding cut off, so padded positions
    cannot raise a false alarm), and returns "" when no module output is non-finite on its own.
    Meant to run only after a failure was detected: it costs one forward per sample.
    """

    device = input_device(model)
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    if attention_mask is not None and attention_mask.dim() == 1:
        attention_mask = attention_mask[None]
    for row in range(ids.shape[0]):
        length = int(attention_mask[row].sum()) if attention_mask is not None else ids.shape[1]
        if length == 0:
            continue
        sample = ids[row : row + 1, :length].to(device)
        name = first_nonfinite_output(model, functools.partial(model, input_ids=sample, use_cache=False))
        if name is not None:
            layer = decoder_layer_of(model, name)
            return f"decoder layer {layer} ({name})" if layer is not None else name
    return ""


def check_finite_logits(
    logits: torch.Tensor,
    what: str,
    *,
    attention_mask: torch.Tensor | None = None,
    model: nn.Module | None = None,
    input_ids: torch.Tensor | None = None,
    sample_ids: list | None = None,
) -> None:
    """Raise NonFiniteError when `logits` [B, S, V] hold NaN/inf at a non-padding position.

    One ``isfinite`` reduction when all is well; on failure, padding positions are forgiven (they
    are never scored), and with `model` and `input_ids` the first non-finite layer output is named.
    """
    if all_finite(logits):
        return
    bad_rows = ~torch.isfinite(logits).all(-1)  # [B, S]
    if attention_mask is not None:
        bad_rows &= attention_mask.to(bad_rows.device).bool()
    if not bool(bad_rows.any()):
        return
    row, position = (int(i) for i in bad_rows.nonzero()[0])
    sample = sample_ids[row] if sample_ids is not None else row
    error = NonFiniteError(
        f"{what} produced {kind(logits[row, position])} logits (sample {sample}, position {position})"
    )
    if model is not None and input_ids is not None:
        mask = None if attention_mask is None else attention_mask[row : row + 1]
        error = error.located(locate_nonfinite(model, input_ids[row : row + 1], mask))
    raise error
