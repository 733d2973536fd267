"""Fused-MoE layers of moeprune's shapes, built by vLLM's own model classes.

vLLM's MoE blocks build their router (`GateLinear`) and fused experts (`FusedMoEFactory`) from
one expert count and one width read from the config. `per_layer_moe` swaps those two names in a
family's vLLM module while moeprune's model class is being constructed, so each layer gets

- a router with one row per router position (novices included), and a selection bias resized
  to match (DeepSeek-V3, GLM-4);
- one fused block per width group of its weight-holding experts (`LayerStructure.groups`:
  experts within 5% of a group's width share it, zero-padded; at most 4 groups). The block the
  family built (`routed_experts` of its runner) holds the widest group; the others are vLLM
  `RoutedExperts` of their own width, built by the same factory, held by the runner
  (`PrunedMoERunner.width_groups`) and run inside the same fused-MoE op, so the layer's output is
  reduced across tensor-parallel ranks once, shared experts and output scaling untouched;
- for layers with novices or several width groups, a `GroupRouter`: it applies the family's own
  routing rule over all router positions (the router vLLM would have built for all of them).
  The runner routes once per forward and hands each block the top-k positions as the block's
  local expert ids, the weights of positions outside the block (other groups, novices) set to
  zero. Top-k stays the model's, so shapes are static; a block computes its zero-weighted slots
  too, so a layer of G groups costs G kernel calls of top-k slots each. vLLM 0.32's CPU kernel
  cannot skip a slot: `CPUUnquantizedExperts.apply` never passes `expert_map` on, and
  `cpu_fused_moe` indexes its per-expert counts with the ids unchecked (-1 crashes it, an id past
  the block gives wrong output). GPU kernels can (Triton's `moe_align_block_size` drops ids that
  `expert_map` maps to -1), but nothing here can run them, so the plugin does not use it;
- for layers with novices, a `NoviceTable` (novices.py): sum over picked novices of g_p(t) *
  (c_p + U_p V_p^T h_t) (constant MoNE novices: c_p = mean_output_p alone), g being exactly
  the weight the model applies (softmax, top-k, renormalisation, DeepSeek's sigmoid, selection
  bias, group-limited top-k and routed_scaling_factor included), added to the fused output
  from the same routing on one rank, after the reduction otherwise (`PrunedMoERunner`).

Novices therefore cost what they store (d, or d + 2 d R at rank R) and no expert memory, and
width groups hold the packed size up to the 5% padding. Splitting the routing among groups and novices is gathers and
products on fixed shapes, free of hidden state, data-dependent Python control flow and host
synchronisation, so it stays correct under torch.compile and CUDA graphs; each block's weights
are sharded by vLLM's own loader, so tensor parallelism splits every group (its width rounded up
to a multiple of the TP size).

The swap lasts only for the constructor (model construction is single-threaded) and checks
afterwards that every MoE layer of the checkpoint went through it.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
from vllm.model_executor.layers.fused_moe.moe_output import UnfinalizedMoEOutput
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
from vllm.model_executor.layers.fused_moe.router.router_factory import create_fused_moe_router
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

from moeprune.serve.moeprune_format import FormatError, LayerStructure, WidthGroup
from moeprune.serve.vllm.novices import NoviceTable

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class GroupTable(nn.Module):
    """Router position -> (width group, expert index inside the group's fused block); novices
    belong to no group (-1)."""

    local: torch.Tensor  # buffers registered in __init__, declared for the type checker
    keep: torch.Tensor

    def __init__(self, layer: LayerStructure, groups: tuple[WidthGroup, ...]):
        super().__init__()
        group, local = [-1] * layer.num_experts, [0] * layer.num_experts
        for g, members in enumerate(groups):
            for index, position in enumerate(members.positions):
                group[position], local[position] = g, index
        # built in Python and made tensors at once (vLLM constructs models on the target device):
        # local[g, position]: the pick's expert id in group g's block (0 outside it), int32 as
        # vLLM's top-k ids are; keep[g, position]: 1 inside group g, 0 outside. Per group, so a
        # split is two gathers and a product, whatever the ids' dtype (no int64 copies, no masks).
        inside = [
            [1.0 if group[p] == g else 0.0 for p in range(layer.num_experts)] for g in range(len(groups))
        ]
        ids = [
            [local[p] if group[p] == g else 0 for p in range(layer.num_experts)] for g in range(len(groups))
        ]
        self.register_buffer("local", torch.tensor(ids, dtype=torch.int32), persistent=False)
        self.register_buffer("keep", torch.tensor(inside, dtype=torch.float32), persistent=False)

    def split(
        self, weights: torch.Tensor, positions: torch.Tensor, group: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Group `group`'s view of the top-k picks: its local expert ids, and the weights with
        every pick outside the group zeroed (its slot then points at local expert 0 and adds
        0 * expert_0(x), which is exact for finite activations).

        Why zero weights and not a skip: vLLM's CPU kernel has no way to skip a pick. Its
        `CPUUnquantizedExperts.apply` (experts/cpu_moe.py) never hands `expert_map` to
        `cpu_fused_moe`, whose C++ counts tokens per expert at `topk_ids` unchecked: an id of -1
        crashes it (segmentation fault) and an id past the block gives wrong outputs."""
        ids = self.local[group][positions].to(positions.dtype)
        return weights * self.keep[group][positions].to(weights.dtype), ids


class GroupRouter(BaseRouter):
    """The family's router over all positions; the fused block sees its own group's experts only."""

    def __init__(self, inner: BaseRouter, table: GroupTable, group: int = 0):
        super().__init__(top_k=inner.top_k, global_num_experts=inner.global_num_experts)
        self.inner = inner
        self.table = table
        self.group = group

    @property
    def routing_method_type(self) -> RoutingMethodType:
        # Kernels that route internally would skip this router: ask for one that does not.
        return RoutingMethodType.Unspecified

    def route(self, hidden_states, router_logits, indices_type=None, input_ids=None):
        """(weights, router positions) exactly as the family routes them."""
        return self.inner._compute_routing(hidden_states, router_logits, indices_type, input_ids=input_ids)

    def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        weights, positions = self.route(hidden_states, router_logits, indices_type, input_ids)
        return self.table.split(weights, positions, self.group)


class PrunedMoERunner(MoERunner):
    """vLLM's runner plus the layer's other width groups (inside the fused op, before the
    reduction) and the novice term.

    The layer is routed once per forward: `_apply_quant_method` computes the family's routing
    over all positions and hands every group's block its share of it. The novice term is the
    routed output of the novices, so where nothing runs between the fused op and the layer's
    output but vLLM's own scaling and shared-expert sum (one rank, no routed transforms, no
    padded hidden size: decided once, at construction) it is added to the fused output from
    that same routing, and vLLM scales it as it scales the experts'. Elsewhere (tensor, data or
    expert parallel: the fused output is reduced across ranks, which would count it once per
    rank) it is added after the reduction, from the layer's gate and routing run again: that
    costs a gate product and a routing more per layer."""

    def __init__(
        self,
        *args,
        novices: NoviceTable | None = None,
        groups: GroupTable | None = None,
        width_groups: tuple[RoutedExperts, ...] = (),
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.novices = novices
        self.groups = groups
        self.width_groups = nn.ModuleList(width_groups)  # registered: named, loaded and processed by vLLM
        self._blocks = tuple(width_groups)  # the same modules, typed
        parallel = self.moe_config.moe_parallel_config
        self.novices_in_fused_output = (
            novices is not None
            and (parallel.tp_size, parallel.dp_size, parallel.ep_size, parallel.pcp_size) == (1, 1, 1, 1)
            and not parallel.use_ep
            and self.routed_input_transform is None
            and self.routed_output_transform is None
            and self.moe_config.hidden_dim == novices.mean_output.shape[1]  # kernels that pad it: after
        )
        if (
            novices is not None and self.moe_config.skip_final_all_reduce
        ):  # pragma: no cover - none of the served families asks for it
            raise FormatError(f"{self.layer_name}: MoNE novices need the MoE output reduced inside the layer")
        if (
            novices is not None and novices.rank and self.routed_input_transform is not None
        ):  # pragma: no cover - none of the served families has one
            raise FormatError(
                f"{self.layer_name}: low-rank novices read the experts' input, which this vLLM block transforms"
            )

    def _apply_quant_method(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        shared_experts_input: torch.Tensor | None,
        input_ids: torch.Tensor | None = None,
        shared_experts_overlapping: bool = False,
    ):
        """MoERunner's step (shared experts, routing, fused experts) with one routing for every
        group: the first group's block runs as vLLM runs it, with the shared experts; every
        other group's block on the same input with its share of the same routing."""
        if self.routed_experts.quant_method.is_monolithic:
            raise FormatError(
                f"{self.layer_name}: vLLM picked a fused-MoE kernel that routes internally, which cannot "
                "run moeprune's width groups or novices; serve this checkpoint unquantized or with another MoE backend"
            )
        if self.groups is None:  # pragma: no cover - the factory gives every PrunedMoERunner a table
            return super()._apply_quant_method(
                hidden_states, router_logits, shared_experts_input, input_ids, shared_experts_overlapping
            )
        assert isinstance(self.router, GroupRouter)
        self._maybe_apply_shared_experts(shared_experts_input, SharedExpertsOrder.NO_OVERLAP)
        weights, positions = self.router.route(hidden_states, router_logits, None, input_ids)
        # what FusedMoERouter.select_experts records besides routing (returned routed experts,
        # routing replay), given the layer's router positions
        if self.router.capture_fn is not None:
            self.router.capture_fn(positions)
        if self.router._routing_replay_out is not None:
            self.router._routing_replay_out[: positions.shape[0]].copy_(positions.to(torch.int16))
        fused: torch.Tensor | UnfinalizedMoEOutput | None = None
        for g, experts in enumerate((self.routed_experts, *self._blocks)):
            experts._ensure_moe_quant_config_init()
            group_weights, ids = self.groups.split(weights, positions, g)
            dtype = experts.quant_method.topk_indices_dtype
            out = experts.forward_modular(
                x=hidden_states,
                topk_weights=group_weights,
                topk_ids=ids if dtype is None else ids.to(dtype),
                shared_experts=self._shared_experts if g == 0 else None,
                shared_experts_input=shared_experts_input if g == 0 else None,
            )
            if fused is None:
                fused = out
                continue
            if not isinstance(fused, torch.Tensor) or not isinstance(out, torch.Tensor):
                raise FormatError(
                    f"{self.layer_name}: this vLLM kernel defers the MoE output, which moeprune's width groups cannot sum"
                )
            fused = fused + out
        if self.novices_in_fused_output:
            assert self.novices is not None
            if not isinstance(fused, torch.Tensor):
                raise FormatError(
                    f"{self.layer_name}: this vLLM kernel defers the MoE output, which moeprune's novices cannot add to"
                )
            fused = fused + self.novices(weights, positions, hidden_states).to(fused.dtype)
        if shared_experts_overlapping:
            assert self._shared_experts is not None
            self._shared_experts.wait()
        return (self._shared_experts.output if self._shared_experts is not None else None, fused)

    def forward(self, hidden_states, router_logits, input_ids=None, shared_experts_input=None):
        out = super().forward(
            hidden_states, router_logits, input_ids=input_ids, shared_experts_input=shared_experts_input
        )
        if self.novices is None or self.novices_in_fused_output:
            return out
        if self.gate is not None:  # the runner computes the logits itself (router_logits is a placeholder)
            router_logits = self.gate(hidden_states)
            router_logits = router_logits[0] if isinstance(router_logits, tuple) else router_logits
        assert isinstance(self.router, GroupRouter)
        weights, ids = self.router.route(hidden_states, router_logits, None, input_ids)
        extra = self.novices(weights, ids, hidden_states)
        # The same scaling MoERunner applies to the routed output (routed_scaling_factor on the
        # output; in fp16 with shared experts it scales those down instead and the decoder
        # layer compensates, so the routed part, novices included, stays unscaled).
        if self.routed_scaling_factor != 1.0 and (out.dtype != torch.float16 or self.shared_experts is None):
            extra = extra * self.routed_scaling_factor
        return out + extra.to(out.dtype)


@dataclass
class BuiltLayer:
    """What `per_layer_moe` built for one MoE layer: its width groups (the first in the runner's
    own block), the blocks of the others, and its novice table."""

    layer: int  # decoder layer index
    groups: tuple[WidthGroup, ...]
    blocks: tuple[RoutedExperts, ...] = ()  # groups[1:]'s fused blocks
    novices: NoviceTable | None = None
    loaded: set[tuple[int, str]] = field(default_factory=set)  # (position, projection) put into blocks


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
    original: Callable, layout: dict[int, LayerStructure], family: str, built: dict[int, BuiltLayer]
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
        groups = layer.groups
        record = BuiltLayer(layer.layer, groups)
        a["intermediate_size"] = _tp_width(groups[0].width, tp)
        a["num_experts"] = len(groups[0].positions)
        if layer.novices or len(groups) > 1:
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
            table = GroupTable(layer, groups)
            record.blocks = tuple(
                _group_block(original, bound, GroupRouter(inner, table, g), group, tp, g)
                for g, group in enumerate(groups)
                if g > 0
            )
            if layer.novices:
                dtype = a["params_dtype"] or torch.get_default_dtype()
                record.novices = NoviceTable(layer, a["hidden_size"], dtype)
            a["router"] = GroupRouter(inner, table, 0)
            a["runner_cls"] = PrunedMoERunner
            a["runner_args"] = {
                **(a["runner_args"] or {}),
                "novices": record.novices,
                "groups": table,
                "width_groups": record.blocks,
            }
        built[layer.layer] = record
        return original(*bound.args, **bound.kwargs)

    return factory


def _tp_width(width: int, tp: int) -> int:
    """A block's width rounded up to a multiple of the TP size (zero neurons make it divisible)."""
    return -(-width // tp) * tp


def _group_block(
    original: Callable,
    bound: inspect.BoundArguments,
    router: GroupRouter,
    group: WidthGroup,
    tp: int,
    index: int,
) -> RoutedExperts:
    """The fused block (vLLM `RoutedExperts`: weights, kernel, weight loader, TP sharding) of one
    more width group, built by vLLM's own factory with the layer's arguments, its own count and
    width, and nothing the layer's first block already does (shared experts, gate, transforms).
    The factory's runner around it is dropped and taken out of vLLM's registry of MoE layers
    (which maps the fused-MoE op's calls to layers in order): only the layer's runner calls it."""
    a = dict(bound.arguments)
    prefix = f"{a['prefix']}.width_groups.{index - 1}"  # where it sits under the layer's runner
    a.update(
        prefix=prefix,
        num_experts=len(group.positions),
        intermediate_size=_tp_width(group.width, tp),
        router=router,
        e_score_correction_bias=None,
        gate=None,
        shared_experts=None,
        shared_expert_gate=None,
        routed_input_transform=None,
        routed_output_transform=None,
        runner_cls=None,
        runner_args=None,
        n_shared_experts=None,
    )
    runner = original(**a)
    compilation = get_current_vllm_config().compilation_config
    compilation.static_forward_context.pop(runner.layer_name, None)
    if runner.layer_name in compilation.static_all_moe_layers:
        compilation.static_all_moe_layers.remove(runner.layer_name)
    return runner.routed_experts


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
def per_layer_moe(layout: dict[int, LayerStructure], family: str) -> Iterator[dict[int, BuiltLayer]]:
    """While active, vLLM's MoE blocks are built with the checkpoint's per-layer shapes;
    yields {layer: what was built for it} for every MoE layer built."""
    built: dict[int, BuiltLayer] = {}
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
