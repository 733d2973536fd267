"""Fused-MoE layers of moeprune's shapes, built by vLLM's own model classes.

vLLM's MoE blocks build their router (`GateLinear`) and fused experts (`FusedMoEFactory`) from
one expert count and one width read from the config. `per_layer_moe` swaps those two names in a
family's vLLM module while moeprune's model class is being constructed, so each layer gets

- a router with one row per router position (novices included), and a selection bias resized
  to match (DeepSeek-V3, GLM-4);
- fused experts for its weight-holding positions only, as wide as its widest expert (the
  loader pads the narrower ones with zero neurons);
- for layers with MoNE novices, a `NoviceRouter` and a `NoviceMoERunner`: the router applies
  the family's own routing rule (the router vLLM would have built for all positions) and hands
  the fused kernel only the weighted experts, novice picks becoming expert 0 with weight 0;
  the runner adds sum over picked novices of g_p(t) * mean_output_p to the block's output, g
  being exactly the weight the model applies (softmax, top-k, renormalisation, DeepSeek's
  sigmoid, selection bias, group-limited top-k and routed_scaling_factor included).

Novices therefore cost one d-vector each and no expert memory. The routing runs twice for
novice layers (once inside the fused op, once for the novice term, on the same logits): cheap,
and free of hidden state, so it stays correct under torch.compile and CUDA graphs.

The swap lasts only for the constructor (model construction is single-threaded) and checks
afterwards that every MoE layer of the checkpoint went through it.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
from vllm.model_executor.layers.fused_moe.router.router_factory import create_fused_moe_router
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

from moeprune.serve.moeprune_format import FormatError, LayerStructure

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class NoviceTable(nn.Module):
    """A layer's novice vectors and the maps from router position to fused expert / novice row."""

    slot: torch.Tensor  # buffers registered in __init__, declared for the type checker
    fused: torch.Tensor
    is_novice: torch.Tensor

    def __init__(self, layer: LayerStructure, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.layer = layer.layer
        self.positions = layer.novices
        slot = torch.zeros(layer.num_experts, dtype=torch.long)
        fused = torch.zeros(layer.num_experts, dtype=torch.long)
        for row, position in enumerate(layer.novices):
            slot[position] = row
        for index, position in enumerate(layer.weighted):
            fused[position] = index
        novice = torch.zeros(layer.num_experts)
        novice[list(layer.novices)] = 1.0
        self.register_buffer("slot", slot, persistent=False)
        self.register_buffer("fused", fused, persistent=False)
        self.register_buffer("is_novice", novice, persistent=False)
        self.mean_output = nn.Parameter(
            torch.empty(len(layer.novices), hidden_size, dtype=dtype), requires_grad=False
        )
        self.loaded: set[int] = set()

    def load(self, position: int, value: torch.Tensor) -> None:
        if tuple(value.shape) != (self.mean_output.shape[1],):
            raise FormatError(
                f"layer {self.layer}: novice {position}'s mean_output has shape {tuple(value.shape)}, expected "
                f"({self.mean_output.shape[1]},); the checkpoint is damaged, re-create it with moeprune"
            )
        self.mean_output.data[self.positions.index(position)].copy_(value)
        self.loaded.add(position)

    def check_loaded(self) -> None:
        missing = sorted(set(self.positions) - self.loaded)
        if missing:
            raise FormatError(
                f"layer {self.layer}: the checkpoint has no mean_output for novices {missing}; "
                "it is incomplete, re-create it with moeprune"
            )

    def forward(self, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * mean_output[ids[t, k]] over the picked novices, per token t."""
        ids = ids.long()
        gates = weights.to(self.mean_output.dtype) * self.is_novice[ids].to(self.mean_output.dtype)
        return torch.einsum("tk,tkd->td", gates, self.mean_output[self.slot[ids]])


class NoviceRouter(BaseRouter):
    """The family's router over all positions; the fused kernel sees weighted experts only."""

    def __init__(self, inner: BaseRouter, table: NoviceTable):
        super().__init__(top_k=inner.top_k, global_num_experts=inner.global_num_experts)
        self.inner = inner
        self.table = table

    @property
    def routing_method_type(self) -> RoutingMethodType:
        # Kernels that route internally would skip this router: ask for one that does not.
        return RoutingMethodType.Unspecified

    def route(self, hidden_states, router_logits, indices_type=None, input_ids=None):
        """(weights, router positions) exactly as the family routes them."""
        return self.inner._compute_routing(hidden_states, router_logits, indices_type, input_ids=input_ids)

    def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        weights, ids = self.route(hidden_states, router_logits, indices_type, input_ids)
        picked = ids.long()
        weights = weights.masked_fill(self.table.is_novice[picked].bool(), 0.0)
        return weights.contiguous(), self.table.fused[picked].to(ids.dtype).contiguous()


class NoviceMoERunner(MoERunner):
    """vLLM's runner plus the novice term, added outside the fused op."""

    def __init__(self, *args, novices: NoviceTable, **kwargs):
        super().__init__(*args, **kwargs)
        self.novices = novices
        if (
            self.moe_config.skip_final_all_reduce
        ):  # pragma: no cover - none of the served families asks for it
            raise FormatError(f"{self.layer_name}: MoNE novices need the MoE output reduced inside the layer")

    def forward(self, hidden_states, router_logits, input_ids=None, shared_experts_input=None):
        out = super().forward(
            hidden_states, router_logits, input_ids=input_ids, shared_experts_input=shared_experts_input
        )
        if self.gate is not None:  # the runner computes the logits itself (router_logits is a placeholder)
            router_logits = self.gate(hidden_states)
            router_logits = router_logits[0] if isinstance(router_logits, tuple) else router_logits
        assert isinstance(self.router, NoviceRouter)
        weights, ids = self.router.route(hidden_states, router_logits, None, input_ids)
        extra = self.novices(weights, ids)
        # The same scaling MoERunner applies to the routed output (routed_scaling_factor on the
        # output; in fp16 with shared experts it scales those down instead and the decoder
        # layer compensates, so the routed part, novices included, stays unscaled).
        if self.routed_scaling_factor != 1.0 and (out.dtype != torch.float16 or self.shared_experts is None):
            extra = extra * self.routed_scaling_factor
        return out + extra.to(out.dtype)


def layer_of(prefix: str, layout: dict[int, LayerStructure], family: str) -> LayerStructure:
    match = _LAYER.search(prefix)
    index = int(match.group(1)) if match else None
    if index not in layout:
        raise FormatError(
            f"vLLM's {family} model has a MoE block at {prefix!r} but the checkpoint's moeprune section lists "
            f"layers {sorted(layout)}; the checkpoint is damaged or was edited, re-create it with moeprune"
        )
    return layout[index]


def _sized_gate(original: Callable, layout: dict[int, LayerStructure], family: str) -> Callable:
    signature = inspect.signature(original)

    def gate(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        layer = layer_of(bound.arguments.get("prefix", ""), layout, family)
        bound.arguments["output_size"] = layer.num_experts
        return original(*bound.args, **bound.kwargs)

    return gate


def _sized_factory(
    original: Callable, layout: dict[int, LayerStructure], family: str, built: dict[int, NoviceTable | None]
) -> Callable:
    signature = inspect.signature(original)

    def factory(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        layer = layer_of(a["prefix"], layout, family)
        for name in (
            "router",
            "runner_cls",
            "custom_routing_function",
            "hash_indices_table",
            "zero_expert_type",
        ):
            if a.get(name) is not None:  # pragma: no cover - none of the served families passes these
                raise FormatError(
                    f"{a['prefix']}: vLLM's {family} block passes {name}, which moeprune's plugin does not handle"
                )
        if a["enable_eplb"] or a["fuse_shared_experts"]:
            raise FormatError(
                f"{family} models in moeprune's format have different expert counts per layer; serve them "
                "without expert-parallel load balancing (EPLB) and without fused shared experts"
            )
        bias = a.get("e_score_correction_bias")
        if bias is not None and bias.shape[0] != layer.num_experts:  # built from the config's largest count
            bias.data = torch.empty(layer.num_experts, dtype=bias.dtype, device=bias.device)
        tp = a["tp_size"] or _tp_size()
        a["intermediate_size"] = -(-layer.width // tp) * tp  # zero neurons also make it divisible by TP
        a["num_experts"] = len(layer.weighted)
        table = None
        if layer.novices:
            scale = 1.0 if a["apply_routed_scale_to_output"] else a["routed_scaling_factor"]
            inner = create_fused_moe_router(
                top_k=a["top_k"],
                global_num_experts=layer.num_experts,
                renormalize=a["renormalize"],
                use_grouped_topk=a["use_grouped_topk"],
                num_expert_group=a["num_expert_group"],
                topk_group=a["topk_group"],
                scoring_func=a["scoring_func"],
                routed_scaling_factor=scale,
                e_score_correction_bias=bias,
                num_logical_experts=layer.num_experts,
            )
            dtype = a["params_dtype"] or torch.get_default_dtype()
            table = NoviceTable(layer, a["hidden_size"], dtype)
            a["router"] = NoviceRouter(inner, table)
            a["runner_cls"] = NoviceMoERunner
            a["runner_args"] = {**(a["runner_args"] or {}), "novices": table}
        built[layer.layer] = table
        return original(*bound.args, **bound.kwargs)

    return factory


def _tp_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def _model_modules(names: tuple[str, ...]) -> list[ModuleType]:
    """vLLM's model modules (loaded so far) that hold one of `names`: a family's MoE block may
    live beside its causal-LM class or in a module it imports (Qwen3-Next builds Qwen2-MoE's)."""
    prefixes = ("vllm.model_executor.models.", "vllm.models.")
    return [
        module
        for module_name, module in list(sys.modules.items())
        if module_name.startswith(prefixes) and module is not None and set(names) & vars(module).keys()
    ]


@contextmanager
def per_layer_moe(layout: dict[int, LayerStructure], family: str) -> Iterator[dict[int, NoviceTable | None]]:
    """While active, vLLM's MoE blocks are built with the checkpoint's per-layer shapes;
    yields {layer: its NoviceTable or None} for every MoE layer built."""
    built: dict[int, NoviceTable | None] = {}
    wrappers = {
        "FusedMoEFactory": lambda original: _sized_factory(original, layout, family, built),
        "GateLinear": lambda original: _sized_gate(original, layout, family),
    }
    saved = [
        (module, name, vars(module)[name])
        for module in _model_modules(tuple(wrappers))
        for name in wrappers
        if name in vars(module)
    ]
    for module, name, original in saved:
        setattr(module, name, wrappers[name](original))
    try:
        yield built
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
