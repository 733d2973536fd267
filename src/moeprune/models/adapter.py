"""One view of every supported MoE family: layers, routers and per-expert weights.

The adapter never re-implements routing. It reads the router's own output and, for removal,
slices the router's own per-expert tensors, so a virtual mask and physical surgery run the very
same routing code.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache, cached_property

import torch
from torch import nn
from torch.nn import functional as F

from moeprune.errors import UnsupportedModelError
from moeprune.models.classes import model_class as class_of
from moeprune.models.discover import (
    discover_spec,
    find_decoder_layers,
    names_experts,
    no_moe_message,
    text_config,
)
from moeprune.models.routers import HASH_ROUTING, routes_by_token
from moeprune.models.spec import DOWN_IS_D_BY_I, FUSED, INTERLEAVED, TRANSPOSED, UNGATED, FamilySpec

EXPERT_IDS_ATTR = "moeprune_expert_ids"  # original expert ids kept by a block after surgery
# Config fields holding k, for routers that read it from their config (Gemma-4)
_TOP_K_FIELDS = ("top_k_experts", "num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k")


def get_path(module: nn.Module, dotted: str) -> torch.Tensor:
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def set_path(module: nn.Module, dotted: str, value: torch.Tensor) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        module = getattr(module, part)
    old = getattr(module, leaf)
    if isinstance(old, nn.Parameter):
        value = nn.Parameter(value, requires_grad=old.requires_grad)
    elif not isinstance(value, nn.Parameter) and leaf in module._buffers:
        module._buffers[leaf] = value
        return
    setattr(module, leaf, value)


@dataclass(frozen=True)
class ExpertCost:
    """Parameters of one routed expert of width K: per_neuron * K + per_expert."""

    per_neuron: int
    per_expert: int

    def params(self, width: int) -> int:
        return self.per_neuron * width + self.per_expert


@dataclass
class MoELayer:
    """One MoE block: its router, its routed experts and how they are stored."""

    index: int  # decoder layer index
    block: nn.Module
    spec: FamilySpec

    @property
    def router(self) -> nn.Module:
        return getattr(self.block, self.spec.router_attr)

    @property
    def experts(self) -> nn.Module:
        return self.block.experts

    @property
    def layer(self) -> int:  # ExpertWeightSource protocol
        return self.index

    @property
    def kept_whole(self) -> str | None:
        """Why this layer cannot lose an expert, or None when it can. A router that routes by
        token id (DeepSeek-V4's hash layers) sends every token to the experts its table names;
        removing one would leave those tokens unrouted, so every allocation keeps the layer whole.
        The one place this is decided: allocation, plans, surgery and reports read it here."""
        return HASH_ROUTING if routes_by_token(self.router) else None

    @property
    def fixed(self) -> bool:
        """Whether the layer is kept whole by every method (see `kept_whole`)."""
        return self.kept_whole is not None

    @property
    def num_experts(self) -> int:
        """Experts the router chooses among (a packed layer's slots, novices included)."""
        slots = getattr(self.experts, "moeprune_slots", None)  # models.packed: per-expert widths
        return len(slots) if slots is not None else int(self.experts.down_proj.shape[0])

    @cached_property
    def top_k(self) -> int:
        return top_k_of(self.index, self.router, self.block, self.experts)

    @property
    def hidden_size(self) -> int:
        if hasattr(self.experts, "moeprune_hidden"):  # packed
            return int(self.experts.moeprune_hidden)
        down = self.experts.down_proj
        return int(down.shape[1] if self.spec.layout in DOWN_IS_D_BY_I else down.shape[2])

    @property
    def intermediate_size(self) -> int:
        if hasattr(self.experts, "moeprune_widths"):  # packed: the widest kept expert
            return max(self.experts.moeprune_widths, default=0)
        down = self.experts.down_proj
        return int(down.shape[2] if self.spec.layout in DOWN_IS_D_BY_I else down.shape[1])

    @property
    def n_group(self) -> int:
        """Number of routing groups when routing is group-limited, else 1."""
        if not self.spec.group_routing:
            return 1
        groups = getattr(self.router, "num_group", None) or 1
        if getattr(self.router, "topk_method", "group_limited_greedy") != "group_limited_greedy":
            return 1
        return int(groups)

    @property
    def topk_group(self) -> int:
        return int(getattr(self.router, "topk_group", None) or 1)

    @property
    def expert_ids(self) -> list[int]:
        """Original ids of the experts this block still holds (identity before any surgery)."""
        ids = getattr(self.block, EXPERT_IDS_ATTR, None)
        return list(ids) if ids is not None else list(range(self.num_experts))

    def routing_tensors(self) -> list[tuple[nn.Module, str, int]]:
        """(owner, dotted path, expert axis) of every per-expert routing tensor: the router's
        rows, biases and selection biases, and those the block itself holds. A layer kept whole
        lists those it holds (a hash router has no selection bias: the spec is read off a learned one)."""
        found = [(self.router, p, d) for p, d in self.spec.router_tensors] + [
            (self.block, p, d) for p, d in self.spec.block_tensors
        ]
        if self.fixed:
            return [(owner, p, d) for owner, p, d in found if _holds(owner, p)]
        return found

    @property
    def shared_modules(self) -> list[nn.Module]:
        return [m for a in self.spec.shared_attrs if (m := getattr(self.block, a, None)) is not None]

    # ----------------------------------------------------------------- expert weights
    def expert_weights(self, expert: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(gate [I,d], up [I,d], down [d,I]) views of one expert, whatever the storage (gate None
        for experts without one)."""
        if self.spec.layout == UNGATED:
            return None, self.experts.up_proj[expert], self.experts.down_proj[expert]
        gate_up, down = self.experts.gate_up_proj[expert], self.experts.down_proj[expert]
        inter = self.intermediate_size
        if self.spec.layout == FUSED:
            return gate_up[:inter], gate_up[inter:], down
        if self.spec.layout == TRANSPOSED:
            return gate_up[:, :inter].T, gate_up[:, inter:].T, down.T
        return gate_up[:, 0::2].T, gate_up[:, 1::2].T, down.T  # INTERLEAVED

    def expert_biases(
        self, expert: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        if self.spec.layout != INTERLEAVED:
            return None, None, None
        b = self.experts.gate_up_proj_bias[expert]
        return b[0::2], b[1::2], self.experts.down_proj_bias[expert]

    def activate(self, gate_pre: torch.Tensor | None, up_pre: torch.Tensor) -> torch.Tensor:
        """The family's gated activation m = act(gate) * up (act(up) without a gate), using the
        model's own function."""
        if self.spec.layout == UNGATED:
            return self.experts.act_fn(up_pre)
        if self.spec.layout == INTERLEAVED:
            interleaved = torch.stack((gate_pre, up_pre), dim=-1).flatten(-2)
            return self.experts._apply_gate(interleaved)
        if own_gate(self.experts):  # a family's own gating (soft-capped SwiGLU and the like)
            return self.experts._apply_gate(torch.cat((gate_pre, up_pre), dim=-1))
        return self.experts.act_fn(gate_pre) * up_pre

    def expert_forward(
        self,
        expert: int,
        x: torch.Tensor,
        return_intermediate: bool = False,
        neuron_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Expert output E_i(x) for rows x [n, d] (and the intermediate activations m [n, I]).

        `neuron_mask` [I] zeroes intermediate neurons (virtual neuron pruning). Experts held in
        another dtype than x (fp8 experts kept in bf16 by transformers < 5.21 in a float32 model)
        compute in theirs, x cast to it as transformers' grouped experts do, y and m cast back.
        """
        held = self.experts.down_proj.dtype
        if x.dtype != held:
            y, m = self.expert_forward(expert, x.to(held), True, neuron_mask)
            y, m = y.to(x.dtype), m.to(x.dtype)
            return (y, m) if return_intermediate else y
        if self.spec.layout == UNGATED:
            m = self.experts.act_fn(F.linear(x, self.experts.up_proj[expert]))
            if neuron_mask is not None:
                m = m * neuron_mask.to(m.dtype)
            y = F.linear(m, self.experts.down_proj[expert])
            return (y, m) if return_intermediate else y
        gate_up, down = self.experts.gate_up_proj[expert], self.experts.down_proj[expert]
        if self.spec.layout == FUSED:
            gate_pre, up_pre = F.linear(x, gate_up).chunk(2, dim=-1)
            m = self.activate(gate_pre, up_pre)
        elif self.spec.layout == TRANSPOSED:
            gate_pre, up_pre = (x @ gate_up).chunk(2, dim=-1)
            m = self.activate(gate_pre, up_pre)
        else:
            m = self.experts._apply_gate(x @ gate_up + self.experts.gate_up_proj_bias[expert])
        if neuron_mask is not None:
            m = m * neuron_mask.to(m.dtype)
        if self.spec.layout == FUSED:
            y = F.linear(m, down)
        elif self.spec.layout == TRANSPOSED:
            y = m @ down
        else:
            y = m @ down + self.experts.down_proj_bias[expert]
        return (y, m) if return_intermediate else y

    def down_matrix(self, expert: int) -> torch.Tensor:
        """W_down [d, I] of one expert (so that y = W_down m (+ bias))."""
        return self.expert_weights(expert)[2]


def _holds(module: nn.Module, dotted: str) -> bool:
    try:
        return isinstance(get_path(module, dotted), torch.Tensor)
    except AttributeError:
        return False


def top_k_of(index: int, router: nn.Module, block: nn.Module, experts: nn.Module) -> int:
    """Experts chosen per token: the router's own `top_k` (or the block's, or the experts'), or
    its config's field for routers that read k from their config (Gemma-4)."""
    for module in (router, block, experts):
        k = getattr(module, "top_k", None)
        if isinstance(k, int) and not isinstance(k, bool):
            return k
    config = getattr(router, "config", None)
    for name in _TOP_K_FIELDS:
        k = getattr(config, name, None)
        if isinstance(k, int) and not isinstance(k, bool):
            return k
    raise UnsupportedModelError(f"decoder layer {index}: no top_k on its router, block or experts")


def own_gate(experts) -> bool:
    """Whether the experts class gates with its own `_apply_gate` (a soft-capped SwiGLU, say)
    rather than transformers' default act(gate) * up (a one-expert view says so itself)."""
    flag = getattr(experts, "moeprune_own_gate", None)
    if flag is not None:
        return bool(flag)
    return _class_gates(type(experts))


@cache
def _class_gates(cls: type) -> bool:
    """Per experts class, once: asked for every expert call, so it must cost a dict lookup."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # pragma: no cover - older transformers: act_fn is the gate
        return False
    method = getattr(cls, "_apply_gate", None)
    return method is not None and method is not _default_apply_gate


SPEC_ATTR = "moeprune_spec"  # the FamilySpec discovered once per model instance


class MoEModel:
    """A causal LM with routed experts, its MoE layers exposed uniformly (any family whose
    structure `models/discover.py` reads off the model)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = text_config(model.config)
        self.spec = spec_of(model)
        self.layers = self._find_layers()
        # decoder layer -> original expert ids no plan may remove, make novices or narrow (the super
        # experts, criteria/super_experts.py); set once the calibration statistics are known
        self.protected: dict[int, list[int]] = {}
        if not self.layers:
            raise UnsupportedModelError(
                f"this {self.spec.model_type} model has no MoE layers (every decoder layer is dense)"
            )

    def _find_layers(self) -> list[MoELayer]:
        found = []
        for i, decoder_layer in enumerate(decoder_layers(self.model)):
            block = block_of(decoder_layer, self.spec)
            if block is None or not hasattr(block, "experts") or not hasattr(block, self.spec.router_attr):
                continue
            found.append(MoELayer(index=i, block=block, spec=self.spec))
        return found

    def __iter__(self) -> Iterator[MoELayer]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def layer(self, index: int) -> MoELayer:
        for layer in self.layers:
            if layer.index == index:
                return layer
        raise KeyError(
            f"decoder layer {index} is not an MoE layer (MoE layers: {[m.index for m in self.layers]})"
        )

    @property
    def model_type(self) -> str:
        return self.spec.model_type

    @property
    def fixed_layers(self) -> list[MoELayer]:
        """The MoE layers no method may take an expert from (`MoELayer.kept_whole`)."""
        return [m for m in self.layers if m.fixed]

    def kept_whole(self) -> dict[int, str]:
        """Decoder layer index -> why it is kept whole, for every fixed layer (plans record it)."""
        return {m.index: str(m.kept_whole) for m in self.fixed_layers}

    def kept_whole_note(self) -> str | None:
        """One line saying which layers are kept whole and why (inspect, plans, reports), or None."""
        return kept_whole_note(self.kept_whole())

    def is_uniform(self) -> bool:
        """Whether every MoE layer has the same expert count and intermediate size."""
        return len({(m.num_experts, m.intermediate_size) for m in self.layers}) == 1


def kept_whole_note(kept_whole: dict[int, str] | dict[str, str]) -> str | None:
    """'layers 0-2 route by token id (hash routing): kept whole' from {layer: reason} (the keys
    may be strings: a plan read back from JSON), one clause per reason."""
    by_reason: dict[str, list[int]] = {}
    for layer, reason in kept_whole.items():
        by_reason.setdefault(reason, []).append(int(layer))
    clauses = []
    for reason, layers in by_reason.items():
        head, _, why = reason.partition(": ")
        which = layer_ranges(sorted(layers))
        word = "layers" if len(layers) > 1 else "layer"
        verb = head.replace("routes ", "route ", 1) if len(layers) > 1 else head
        clauses.append(
            f"{word} {which} {verb}: kept whole ({why})" if why else f"{word} {which} {verb}: kept whole"
        )
    return "; ".join(clauses) or None


def layer_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[str] = []
    start = prev = None
    for i in indices:
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = i
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ", ".join(parts)


def block_of(decoder_layer: nn.Module, spec: FamilySpec) -> nn.Module | None:
    """The MoE block of one decoder layer (the layer itself when it holds the experts)."""
    if not spec.block_attr:
        return decoder_layer
    try:
        return decoder_layer.get_submodule(spec.block_attr)
    except AttributeError:
        return None


def spec_of(model: nn.Module) -> FamilySpec:
    """The model's FamilySpec: discovered from the instance the first time and kept on it, so
    the same spec describes it after surgery and packing changed its tensors; a model built
    packed (moeprune format) is read from a meta-device build of its stock config."""
    spec = model.__dict__.get(SPEC_ATTR)
    if spec is None:
        packed = any(getattr(m, "moeprune_packed", False) for m in model.modules())
        spec = check_config(model.config, type(model)) if packed else discover_spec(model)
        model.__dict__[SPEC_ATTR] = spec
    return spec


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers holding the MoE blocks: where discovery found them (after surgery and
    packing too, when the experts no longer look stock), else found now."""
    spec = model.__dict__.get(SPEC_ATTR)
    if spec is not None:
        return model.get_submodule(spec.layers)
    found = find_decoder_layers(model)
    if found is None:
        raise UnsupportedModelError(f"cannot find the decoder layers of {type(model).__name__}")
    return found[1]


def family_spec(config) -> FamilySpec:
    """The spec of an MoE model's config; a clear error for dense or unsupported models."""
    return check_config(config)


def check_config(config, model_class: type | None = None) -> FamilySpec:
    """Fail early (before loading weights) on unsupported or dense configs: the model is built
    on the meta device (nothing allocated) and its structure discovered."""
    key = (model_class, type(config), config.to_json_string(use_diff=False))
    if key not in _SPECS:
        _SPECS[key] = _spec_from_config(model_class, copy.deepcopy(config))
    return _SPECS[key]


_SPECS: dict[tuple, FamilySpec] = {}


def _spec_from_config(model_class: type | None, config) -> FamilySpec:
    model_type = getattr(config, "model_type", None)
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = (model_class or class_of(config))._from_config(config)
    except UnsupportedModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' own refusal of the config
        raise UnsupportedModelError(
            f"cannot build a {model_type!r} model from this config: {str(exc).strip().splitlines()[0]}"
        ) from exc
    if find_decoder_layers(model) is None:
        raise UnsupportedModelError(no_moe_message(model_type, names_experts(text_config(config))))
    return discover_spec(model)
