"""What `--repair` may train: the small tensors around the experts, never the experts' weights.

Each part registers one collector that lists the model's tensors it trains (REPAIR_PARTS, the names
of config.repair.REPAIR_PARTS):

- routers: every per-expert routing tensor of each MoE layer (router rows, router biases, selection
  biases such as DeepSeek-V3's `e_score_correction_bias`). A selection bias only chooses the top-k
  and multiplies no output, so no gradient reaches it: it is listed, and the report says it was
  left as it was.
- gains: one scalar per MoE layer multiplying its routed experts' output (with a pruned layer's
  routing spread over fewer experts, the routed share of the block's output changes). It is no
  tensor of the checkpoint: after training it is folded into the layer's `down_proj` (and
  `down_proj_bias`), which is exact (the routed output is linear in each expert's down
  projection), so the saved checkpoint keeps its tensors, names and shapes: a stock uniform drop
  stays stock. A layer whose experts are packed (moeprune's format) or stored in another layout
  gets no gain.
- novices: a novice plan's constants and low-rank factors (moeprune's format).
- norms: the norm weights of each MoE decoder layer and of the decoder layer after it (the norm
  feeding the block and the ones reading its output from the residual stream).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from moeprune.config import REPAIR_PARTS, Registry
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.adapter import MoELayer, decoder_layers, get_path
from moeprune.models.packed import NOVICE_PARAM, NOVICE_U, NOVICE_V, is_packed


@dataclass
class Trained:
    """One trained tensor: where it is (for the report), what part it belongs to, and the tensor
    itself (a model tensor, or a gain that the hooks read)."""

    name: str
    part: str
    tensor: torch.Tensor
    gain_of: MoELayer | None = None  # a gain: the MoE layer whose routed output it scales


@dataclass(frozen=True)
class RepairPart:
    name: str
    help: str
    needs: tuple[str, ...] = ()
    fn: Callable[[MoEModel], list[Trained]] | None = None


REPAIR_PART_REGISTRY: Registry[RepairPart] = Registry("repair part", "repair_parts")


def _module_name(model: nn.Module, module: nn.Module) -> str:
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    return type(module).__name__


@REPAIR_PART_REGISTRY.register(RepairPart("routers", "router rows, biases and selection biases"))
def _routers(moe: MoEModel) -> list[Trained]:
    found = []
    for layer in moe.layers:
        if layer.fixed:  # a hash router's table is no weight to train
            continue
        for owner, path, _axis in layer.routing_tensors():
            tensor = get_path(owner, path)
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                found.append(Trained(f"{_module_name(moe.model, owner)}.{path}", "routers", tensor))
    return found


def gain_capable(layer: MoELayer) -> bool:
    """Whether a gain on this layer's routed output can be folded into its checkpoint tensors."""
    down = getattr(layer.experts, "down_proj", None)
    return not is_packed(layer) and isinstance(down, nn.Parameter) and down.is_floating_point()


@REPAIR_PART_REGISTRY.register(RepairPart("gains", "one scalar per MoE layer on its routed output"))
def _gains(moe: MoEModel) -> list[Trained]:
    found = []
    for layer in moe.layers:
        if layer.fixed or not gain_capable(layer):
            continue
        down = layer.experts.down_proj
        assert isinstance(down, torch.Tensor)  # gain_capable
        gain = torch.ones((), dtype=torch.float32, device=down.device)
        found.append(Trained(f"layers.{layer.index}.routed_gain", "gains", gain, gain_of=layer))
    return found


@REPAIR_PART_REGISTRY.register(RepairPart("novices", "novice constants and low-rank factors"))
def _novices(moe: MoEModel) -> list[Trained]:
    found = []
    for layer in moe.layers:
        for attr in (NOVICE_PARAM, NOVICE_U, NOVICE_V):
            tensor = getattr(layer.experts, attr, None)
            if isinstance(tensor, torch.Tensor):
                found.append(Trained(f"{_module_name(moe.model, layer.experts)}.{attr}", "novices", tensor))
    return found


@REPAIR_PART_REGISTRY.register(RepairPart("norms", "norm weights around the MoE blocks"))
def _norms(moe: MoEModel) -> list[Trained]:
    stack = decoder_layers(moe.model)
    around = sorted({i for layer in moe.layers for i in (layer.index, layer.index + 1) if i < len(stack)})
    found, seen = [], set()
    for i in around:
        for child_name, child in stack[i].named_children():
            weight = getattr(child, "weight", None)
            if "norm" not in type(child).__name__.lower() or not isinstance(weight, nn.Parameter):
                continue
            if id(weight) not in seen:
                seen.add(id(weight))
                found.append(
                    Trained(f"{_module_name(moe.model, stack[i])}.{child_name}.weight", "norms", weight)
                )
    return found


def collect(moe: MoEModel, parts: tuple[str, ...]) -> list[Trained]:
    """The tensors the named parts train, in the registry's order (never an expert weight)."""
    if set(REPAIR_PART_REGISTRY.names()) != set(REPAIR_PARTS):  # the config's names are these
        raise MoePruneError(f"repair parts registered {REPAIR_PART_REGISTRY.names()} != {REPAIR_PARTS}")
    out = []
    for spec in REPAIR_PART_REGISTRY:
        if spec.name in parts:
            assert spec.fn is not None
            out += spec.fn(moe)
    return out


@contextmanager
def applied_gains(trained: list[Trained]) -> Iterator[None]:
    """The gains multiply their layers' routed output while the context lasts (forward hooks)."""
    handles = []
    for item in trained:
        if item.gain_of is None:
            continue
        gain = item.tensor

        def hook(module: nn.Module, args: tuple, output, gain: torch.Tensor = gain):
            if isinstance(output, tuple):
                return (output[0] * gain.to(output[0].dtype), *output[1:])
            return output * gain.to(output.dtype)

        handles.append(item.gain_of.experts.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def fold_gains(trained: list[Trained]) -> list[tuple[nn.Module, float]]:
    """Multiply each gain into its layer's `down_proj` (and `down_proj_bias`), then reset it to 1:
    the model then computes, without hooks, what it computed with them. Returns what was folded."""
    folded = []
    for item in trained:
        if item.gain_of is None or float(item.tensor) == 1.0:
            continue
        gain = float(item.tensor)
        _scale(item.gain_of.experts, gain)
        folded.append((item.gain_of.experts, gain))
        item.tensor.fill_(1.0)
    return folded


@torch.no_grad()
def unfold_gains(folded: list[tuple[nn.Module, float]]) -> None:
    """Undo `fold_gains` (to the rounding of the weights' dtype)."""
    for experts, gain in folded:
        _scale(experts, 1.0 / gain)


def _scale(experts: nn.Module, gain: float) -> None:
    for attr in ("down_proj", "down_proj_bias"):
        tensor = getattr(experts, attr, None)
        if isinstance(tensor, torch.Tensor):
            tensor.copy_((tensor.float() * gain).to(tensor.dtype))
