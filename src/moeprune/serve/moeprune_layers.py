"""moeprune's expert modules, for stock transformers (part of modeling_moeprune.py; moeprune copies
these files into every moeprune-format folder): the modules that replace a layer's stock experts
when their widths differ or some are novices, and the helpers that slice and name their tensors.
The family table they follow is moeprune_families.py.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from .moeprune_families import FUSED, TRANSPOSED, UNGATED, Family, fail


# ----------------------------------------------------------------------------- routed experts
class MoePruneGatedExpert(nn.Module):
    """One expert of width K: gate and up rows fused in gate_up_proj [2K, d] (gate first), down_proj
    [d, K]; y = down(act(gate x) * up x), computed like transformers' fused experts, one matmul for
    gate and up. Checkpoints store gate, up and down as three tensors per expert, under the
    family's names (`gate_proj`, `up_proj`, `down_proj`; Mixtral: `w1`, `w3`, `w2`)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn, gate_fn=None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up)
        self.down_proj = nn.Parameter(down)
        self.act_fn = act_fn
        self.gate_fn = gate_fn  # the family's own gating of [gate; up], where it has one

    def extra_repr(self) -> str:
        return f"width={self.down_proj.shape[1]}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up_proj)
        if self.gate_fn is not None:
            return F.linear(self.gate_fn(gate_up), self.down_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj)


class MoePruneTransposedExpert(nn.Module):
    """One Llama-4 expert of width K: gate_up_proj [d, 2K] (gate columns, then up), down_proj [K, d]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn, gate_fn=None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up)
        self.down_proj = nn.Parameter(down)
        self.act_fn = act_fn
        self.gate_fn = gate_fn

    def extra_repr(self) -> str:
        return f"width={self.down_proj.shape[0]}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self.gate_up_proj
        if self.gate_fn is not None:
            return self.gate_fn(gate_up) @ self.down_proj
        gate, up = gate_up.chunk(2, dim=-1)
        return (self.act_fn(gate) * up) @ self.down_proj


class MoePruneUngatedExpert(nn.Module):
    """One expert of width K without a gate: up_proj [K, d], down_proj [d, K]; y = down(act(up x))."""

    def __init__(self, up: torch.Tensor, down: torch.Tensor, act_fn):
        super().__init__()
        self.up_proj = nn.Parameter(up)
        self.down_proj = nn.Parameter(down)
        self.act_fn = act_fn

    def extra_repr(self) -> str:
        return f"width={self.down_proj.shape[1]}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.act_fn(F.linear(x, self.up_proj)), self.down_proj)


class MoePruneClampedExpert(nn.Module):
    """One gpt_oss expert of width K: gate_up_proj [d, 2K] with gate and up columns alternating,
    its bias [2K], down_proj [K, d] and its bias [d]; the activation is gpt_oss's clamped SwiGLU
    (gate * sigmoid(alpha * gate) * (up + 1), gate clamped above and up on both sides at `limit`)."""

    def __init__(self, gate_up, gate_up_bias, down, down_bias, alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up)
        self.gate_up_proj_bias = nn.Parameter(gate_up_bias)
        self.down_proj = nn.Parameter(down)
        self.down_proj_bias = nn.Parameter(down_bias)
        self.alpha, self.limit = alpha, limit

    def extra_repr(self) -> str:
        return f"width={self.down_proj.shape[0]}, alpha={self.alpha}, limit={self.limit}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self.gate_up_proj + self.gate_up_proj_bias
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ self.down_proj + self.down_proj_bias


class MoePruneNovice(nn.Module):
    """A novice (MoNE): an expert replaced by its mean output over calibration tokens."""

    def __init__(self, mean_output: torch.Tensor):
        super().__init__()
        self.mean_output = nn.Parameter(mean_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mean_output.to(x.dtype).expand(x.shape[0], -1)


class MoePruneExperts(nn.ModuleList):
    """The routed experts of one layer, one module per router position (expert or novice).

    Called like the stock experts module, `experts(hidden [T, d], index [T, k], weights [T, k])`,
    it returns sum_j g_j * E_{i_j}(h) (Llama-4: sum_j E_{i_j}(g_j * h)), running each expert only
    on the tokens routed to it and summing in fp32, as moeprune and transformers' kernels do.
    """

    def __init__(
        self, experts: list[nn.Module], weight_on_input: bool, zero_experts: nn.Module | None = None
    ):
        super().__init__(experts)
        self.num_experts = len(experts)
        self.weight_on_input = weight_on_input
        if zero_experts is not None:
            # the stock experts module, emptied of weights, computes the zero experts the router
            # selects past the weighted ones (LongCat-Flash's identity): its own code, not a copy;
            # kept outside the module tree, so nothing of it is saved or loaded
            for name, _ in list(zero_experts.named_parameters(recurse=False)):
                zero_experts.register_parameter(name, None)
            self.__dict__["moeprune_zero_experts"] = zero_experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        top_k = top_k_index.shape[1]
        out = torch.zeros_like(hidden_states, dtype=torch.float32)
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights = top_k_weights.reshape(-1)
        start = 0
        for expert, n in zip(self, counts):
            if n == 0:
                continue
            picked = order[start : start + n]
            start += n
            rows = picked // top_k
            x = hidden_states[rows]
            g = flat_weights[picked].unsqueeze(1)
            if self.weight_on_input:
                contribution = expert(x * g.to(x.dtype))
            else:
                y = expert(x)
                contribution = y * g.to(y.dtype)
            out.index_add_(0, rows, contribution.to(out.dtype))
        zero_experts = self.__dict__.get("moeprune_zero_experts")
        for position in range(len(self), len(counts)):  # indices past the weighted experts
            n = counts[position]
            if n == 0:
                continue
            if zero_experts is None:
                raise fail(f"the router selected expert {position} of {len(self)}")
            picked = order[start : start + n]
            start += n
            rows = picked // top_k
            # two selections, the second weighted 0: LongCat's forward squeezes a one-column mask
            index = torch.full((n, 2), position, dtype=torch.long, device=rows.device)
            g = flat_weights[picked]
            weights = torch.stack((g, torch.zeros_like(g)), dim=1)
            y = type(zero_experts).forward(zero_experts, hidden_states[rows], index, weights)
            out.index_add_(0, rows, y.to(out.dtype))
        return out.to(hidden_states.dtype)


class MoePruneInputWeightedMoe(nn.Module):
    """Llama-4's MoE block for layers with novices or per-expert widths.

    The stock block runs every expert on every token (scores of unselected experts are zero);
    this one asks the stock router for its scores, picks the top-k as the router does, and runs
    only the selected experts, each on its input scaled by the routing weight.
    """

    moeprune_expert_ids: list[int]  # set by modeling_moeprune.py, like on the stock blocks

    def __init__(self, stock_block: Any, experts: MoePruneExperts):  # Any: Llama-4's stock block
        super().__init__()
        self.top_k = stock_block.top_k
        self.hidden_dim = stock_block.hidden_dim
        self.num_experts = experts.num_experts
        self.router = stock_block.router
        self.shared_expert = stock_block.shared_expert
        self.experts = experts

    def forward(self, hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, self.hidden_dim)
        scores, logits = self.router(hidden)
        index = torch.topk(logits, self.top_k, dim=1).indices
        weights = scores.gather(1, index)
        out = self.shared_expert(hidden) + self.experts(hidden, index, weights)
        return out, logits


def slice_expert(family: Family, stock: Any, p: int, width: int):  # Any: the family's stock experts
    """Router position p's expert of `width` neurons, holding the first `width` neurons of stock
    expert p (random values when the model is built from a config; replaced when loading)."""
    if family.layout == UNGATED:  # up [I, d], down [d, I]
        up, down = stock.up_proj[p], stock.down_proj[p]
        return MoePruneUngatedExpert(up[:width].clone(), down[:, :width].clone(), stock.act_fn)
    gate_up, down = stock.gate_up_proj[p], stock.down_proj[p]
    full = down.shape[1] if family.layout == FUSED else down.shape[0]
    act_fn, gate_fn = getattr(stock, "act_fn", None), _GateHolder(stock) if family.own_gate else None
    if family.layout == FUSED:  # gate_up [2I, d], down [d, I]
        both = torch.cat((gate_up[:width], gate_up[full : full + width]))
        return MoePruneGatedExpert(both, down[:, :width].clone(), act_fn, gate_fn)
    if family.layout == TRANSPOSED:  # gate_up [d, 2I], down [I, d]
        both = torch.cat((gate_up[:, :width], gate_up[:, full : full + width]), dim=1)
        return MoePruneTransposedExpert(both, down[:width].clone(), act_fn, gate_fn)
    return MoePruneClampedExpert(  # INTERLEAVED: neuron j is columns 2j (gate) and 2j + 1 (up)
        gate_up[:, : 2 * width].clone(),
        stock.gate_up_proj_bias[p, : 2 * width].clone(),
        down[:width].clone(),
        stock.down_proj_bias[p].clone(),
        float(stock.alpha),
        float(stock.limit),
    )


class _GateHolder(nn.Module):
    """A family's own `_apply_gate` with what it reads of its experts module (activation
    function, limits), without the module's expert tensors."""

    def __init__(self, stock: Any):  # Any: the family's stock experts module, which has _apply_gate
        super().__init__()
        for key, value in vars(stock).items():
            if not key.startswith("_") and not isinstance(value, torch.Tensor) and key != "training":
                setattr(self, key, value)
        for name, child in stock.named_children():
            self.add_module(name, child)
        self._gate = type(stock)._apply_gate

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._gate(self, gate_up)


def replace_tensor(module: nn.Module, dotted: str, value: torch.Tensor) -> None:
    """Set parameter or buffer `dotted` (below `module`) to `value`, keeping its kind."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        module = getattr(module, part)
    if leaf in module._parameters:
        param = cast(nn.Parameter, module._parameters[leaf])  # a named parameter, never None here
        setattr(module, leaf, nn.Parameter(value, requires_grad=param.requires_grad))
    else:
        module._buffers[leaf] = value


def get_tensor(module: nn.Module, dotted: str) -> torch.Tensor:
    value: Any = module
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def set_counts(family: Family, modules, count: int) -> None:
    for module in modules:
        for attr in family.count_attrs:
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, count)
        for attr in family.total_count_attrs:
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, count + family.extra_experts)


def first_rows(family: Family, tensor: torch.Tensor, dim: int, n: int, most: int) -> torch.Tensor:
    """The first `n` weighted rows of a stock-sized per-expert tensor along `dim`, followed by the
    extra experts' rows when it has them (it is `most + extra` long): those stay routed."""
    extra = family.extra_experts
    if extra and tensor.shape[dim] == most + extra:
        return torch.cat((tensor.narrow(dim, 0, n), tensor.narrow(dim, most, extra)), dim=dim).clone()
    return tensor.narrow(dim, 0, n).clone()


def expert_disk_tensors(family: Family, prefix: str, experts: nn.Module) -> dict[str, torch.Tensor]:
    """One layer's routed experts under their on-disk names (prefix: "<block on disk>.experts.").

    Families whose checkpoints store one tensor per expert (all but gpt_oss and Llama-4) get
    views of the fused gate/up rows; novices store `mean_output`; gpt_oss and Llama-4 store the
    stock fused tensors for a stock layer and one expert's slice per position otherwise.
    """
    names = family.disk_expert_names
    per_expert: list[Any]  # the stock module's (gate_up, down) pairs, or MoePruneExperts' modules
    if not isinstance(experts, MoePruneExperts):  # the stock module, narrowed
        if names is None:
            return {f"{prefix}{name}": tensor for name, tensor in experts.named_parameters()}
        per_expert = list(zip(get_tensor(experts, "gate_up_proj"), get_tensor(experts, "down_proj")))
    else:
        per_expert = list(experts)
    out: dict[str, torch.Tensor] = {}
    for p, expert in enumerate(per_expert):
        if isinstance(expert, MoePruneNovice) or names is None:  # a novice: mean_output (low rank: U, V)
            out.update({f"{prefix}{p}.{name}": tensor for name, tensor in expert.named_parameters()})
        else:
            gate_up, down = (
                (get_tensor(expert, "gate_up_proj"), get_tensor(expert, "down_proj"))
                if isinstance(expert, nn.Module)
                else expert
            )
            width = down.shape[1]
            out[f"{prefix}{p}.{names[0]}.weight"] = gate_up[:width]
            out[f"{prefix}{p}.{names[1]}.weight"] = gate_up[width:]
            out[f"{prefix}{p}.{names[2]}.weight"] = down
    return out


def to_disk(family: Family, name: str) -> str:
    for memory, disk in family.disk_renames:
        name = name.replace(memory, disk)
    return name
