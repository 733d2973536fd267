"""Load a moeprune result with stock transformers: `AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`. moeprune need not be installed.

moeprune (a toolkit that prunes Mixture-of-Experts language models) copied this file into the
folder because the result is something the family's stock config cannot describe: MoE layers
with different numbers of experts, experts of different widths (intermediate neurons), or
"novices" (experts replaced by their mean output). config.json says so in its `moeprune`
section, one entry per MoE layer:

    {"layer": 3, "num_experts": 6, "expert_ids": [0, 1, 3, 4, 6, 7],
     "widths": [16, 16, null, 8, 16, 12], "novice": [2]}

Router output `p` of that layer is original expert `expert_ids[p]`, with `widths[p]` neurons,
or a novice (`null`). The format is described in moeprune's docs/checkpoint-format.md.

How a model is built: the stock transformers model of the base family (named in the table
`FAMILIES` below) is built from the config, then each MoE layer is reshaped to its entry:

- The stock router stays and runs its own code, on per-expert tensors (router rows, router
  bias, selection bias) narrowed to the layer's count. Softmax or sigmoid scoring, selection
  biases, group-limited top-k and renormalisation therefore behave as in the stock model.
- A layer whose experts all keep the config's width and that has no novice keeps the stock
  experts module (and its fused kernels), narrowed to the layer's count.
- Any other layer gets `MoePruneExperts`: one module per router position, an expert with its
  own width or a novice. It runs each expert on the tokens routed to it and adds
  `g * expert(h)` (Llama-4: `expert(g * h)`); a novice adds `g * mean_output` (Llama-4:
  `mean_output`, the mean of `expert(g * h)`). This is exactly what moeprune computes.

Weights are read from the safetensors files by the names a stock checkpoint of the family uses
(`save_pretrained`'s names), strictly: a missing or unexpected tensor is an error naming it,
never a random initialisation. `save_pretrained` (and so `push_to_hub`) writes the same format
back. Only torch, transformers, safetensors and huggingface_hub are imported, and only public
transformers APIs are used, so the file works with transformers 5.16 and later (tested with
5.16.1 and 5.23).

Not supported: `device_map` over several devices, quantization on load, and training with
`output_router_logits=True` when layers have different expert counts (transformers'
load-balancing loss concatenates the layers' router logits, which then differ in width).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import transformers
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

FORMAT = "moeprune-checkpoint"
FORMAT_VERSION = 3  # the newest structure this file reads
MEAN_OUTPUT = "mean_output"  # a novice's stored vector
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

FUSED = "fused"  # gate_up_proj [E, 2I, d] (gate rows, then up rows); down_proj [E, d, I]
TRANSPOSED = "transposed"  # Llama-4: gate_up_proj [E, d, 2I] (gate columns, then up); down_proj [E, I, d]
INTERLEAVED = "interleaved"  # gpt_oss: [E, d, 2I] with gate/up columns alternating, plus biases


@dataclass(frozen=True)
class Family:
    """How one transformers MoE family lays out its MoE blocks, in memory and on disk."""

    config_class: str  # the stock config class in transformers
    causal_lm_class: str  # the stock causal-LM class in transformers
    block_attr: str  # decoder-layer attribute holding the MoE block
    router_attr: str  # block attribute holding the router
    count_field: str  # config field with the number of routed experts (the largest layer's here)
    intermediate_field: str  # config field with the routed experts' full width
    layout: str  # FUSED, TRANSPOSED or INTERLEAVED
    # Per-expert router tensors: (dotted path below the router, expert dimension).
    router_tensors: tuple[tuple[str, int], ...] = (("weight", 0),)
    # Attributes holding the expert count on the block, the router and the experts module.
    count_attrs: tuple[str, ...] = ("num_experts",)
    # Fragments of in-memory names that stock checkpoints spell differently: (in memory, on disk).
    disk_renames: tuple[tuple[str, str], ...] = ()
    # Per-expert tensor names on disk (gate, up, down: "<B>.experts.<p>.<name>.weight"), or None
    # where checkpoints keep the fused tensors (gpt_oss, Llama-4).
    disk_expert_names: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    weight_on_input: bool = False  # Llama-4 multiplies the routing weight into the expert input


_BIASED = (("weight", 0), ("e_score_correction_bias", 0))  # DeepSeek-V3, GLM-4-MoE selection bias

FAMILIES: dict[str, Family] = {
    "olmoe": Family("OlmoeConfig", "OlmoeForCausalLM", "mlp", "gate", "num_experts", "intermediate_size", FUSED),
    "qwen2_moe": Family(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "mlp", "gate", "num_experts", "moe_intermediate_size", FUSED
    ),
    "qwen3_moe": Family(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "mlp", "gate", "num_local_experts", "moe_intermediate_size", FUSED
    ),
    "qwen3_next": Family(
        "Qwen3NextConfig", "Qwen3NextForCausalLM", "mlp", "gate", "num_experts", "moe_intermediate_size", FUSED
    ),
    "mixtral": Family(
        "MixtralConfig", "MixtralForCausalLM", "mlp", "gate", "num_local_experts", "intermediate_size", FUSED,
        disk_renames=((".mlp.", ".block_sparse_moe."),), disk_expert_names=("w1", "w3", "w2"),
    ),
    "deepseek_v2": Family(
        "DeepseekV2Config", "DeepseekV2ForCausalLM", "mlp", "gate", "n_routed_experts", "moe_intermediate_size", FUSED
    ),
    "deepseek_v3": Family(
        "DeepseekV3Config", "DeepseekV3ForCausalLM", "mlp", "gate", "n_routed_experts", "moe_intermediate_size", FUSED,
        router_tensors=_BIASED,
    ),
    "glm4_moe": Family(
        "Glm4MoeConfig", "Glm4MoeForCausalLM", "mlp", "gate", "n_routed_experts", "moe_intermediate_size", FUSED,
        router_tensors=_BIASED,
    ),
    "ernie4_5_moe": Family(
        "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", "mlp", "gate", "moe_num_experts", "moe_intermediate_size",
        FUSED, router_tensors=(("weight", 0), ("moe_statics.e_score_correction_bias", 1)),
        disk_renames=((".mlp.gate.moe_statics.", ".mlp.moe_statics."),),
    ),
    "gpt_oss": Family(
        "GptOssConfig", "GptOssForCausalLM", "mlp", "router", "num_local_experts", "intermediate_size", INTERLEAVED,
        router_tensors=(("weight", 0), ("bias", 0)), disk_expert_names=None,
    ),
    "llama4_text": Family(
        "Llama4TextConfig", "Llama4ForCausalLM", "feed_forward", "router", "num_local_experts", "intermediate_size",
        TRANSPOSED, count_attrs=("num_experts", "out_features"), disk_expert_names=None, weight_on_input=True,
    ),
}  # fmt: skip


def _fail(message: str) -> ValueError:
    return ValueError(f"modeling_moeprune: {message}")


# ----------------------------------------------------------------------------- the structure
@dataclass(frozen=True)
class LayerStructure:
    """One MoE layer of config.json's `moeprune` section."""

    layer: int  # decoder layer index
    expert_ids: tuple[int, ...]  # original expert id of each router position
    widths: tuple[int | None, ...]  # neurons of each router position; None for a novice

    @property
    def num_experts(self) -> int:
        return len(self.expert_ids)

    def is_stock(self, full_width: int) -> bool:
        """Whether the stock experts module holds this layer: no novice, every expert at full width."""
        return all(w == full_width for w in self.widths)


def read_structure(config) -> list[LayerStructure]:
    """The `moeprune` section of the config, checked: a damaged or hand-edited section is one clear
    error here, never a model of the wrong shape."""
    section = getattr(config, "moeprune", None)
    where = "config.json's 'moeprune' section"
    if not isinstance(section, dict) or section.get("format") != FORMAT:
        raise _fail(f"{where} is missing or is not a {FORMAT!r}; this folder was not written by moeprune")
    version = section.get("format_version")
    if not isinstance(version, int) or not 3 <= version <= FORMAT_VERSION:
        raise _fail(
            f"{where} is format version {version!r} but this file reads version {FORMAT_VERSION}; "
            "use the modeling_moeprune.py saved with the checkpoint"
        )
    base = section.get("base_model_type")
    if base != _base_model_type(config):
        raise _fail(f"{where} is for a {base!r} model but config.json's model type is {config.model_type!r}")
    entries = section.get("layers")
    if not isinstance(entries, list) or not entries:
        raise _fail(f"{where} has no 'layers'")
    layers = []
    for entry in entries:
        ok = isinstance(entry, dict) and all(
            isinstance(entry.get(key), t)
            for key, t in (("layer", int), ("expert_ids", list), ("widths", list))
        )
        if not ok:
            raise _fail(
                f"{where}: layer entry {entry!r} lacks an integer 'layer' or the lists 'expert_ids' and 'widths'"
            )
        ids, widths, at = entry["expert_ids"], entry["widths"], f"{where}, layer {entry['layer']}"
        if entry.get("num_experts") != len(ids) or len(widths) != len(ids) or not ids:
            raise _fail(f"{at}: num_experts, expert_ids and widths disagree on the number of experts")
        if not all(w is None or (isinstance(w, int) and w > 0) for w in widths):
            raise _fail(f"{at}: widths must be positive neuron counts or null, got {widths}")
        if sorted(entry.get("novice", [])) != [p for p, w in enumerate(widths) if w is None]:
            raise _fail(f"{at}: 'novice' disagrees with the null widths")
        layers.append(LayerStructure(entry["layer"], tuple(ids), tuple(widths)))
    indices = [entry.layer for entry in layers]
    if indices != sorted(set(indices)):
        raise _fail(f"{where}: layers {indices} are not unique and ascending")
    return layers


def _base_model_type(config) -> str:
    return str(config.model_type).removeprefix("moeprune_")


# ----------------------------------------------------------------------------- routed experts
class MoePruneGatedExpert(nn.Module):
    """One expert of width K: gate and up rows fused in gate_up_proj [2K, d] (gate first), down_proj
    [d, K]; y = down(act(gate x) * up x), computed like transformers' fused experts, one matmul for
    gate and up. Checkpoints store gate, up and down as three tensors per expert, under the
    family's names (`gate_proj`, `up_proj`, `down_proj`; Mixtral: `w1`, `w3`, `w2`)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn):
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up)
        self.down_proj = nn.Parameter(down)
        self.act_fn = act_fn

    def extra_repr(self) -> str:
        return f"width={self.down_proj.shape[1]}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj)


class MoePruneTransposedExpert(nn.Module):
    """One Llama-4 expert of width K: gate_up_proj [d, 2K] (gate columns, then up), down_proj [K, d]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn):
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up)
        self.down_proj = nn.Parameter(down)
        self.act_fn = act_fn

    def extra_repr(self) -> str:
        return f"width={self.down_proj.shape[0]}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.gate_up_proj).chunk(2, dim=-1)
        return (self.act_fn(gate) * up) @ self.down_proj


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

    def __init__(self, experts: list[nn.Module], weight_on_input: bool):
        super().__init__(experts)
        self.num_experts = len(experts)
        self.weight_on_input = weight_on_input

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
        return out.to(hidden_states.dtype)


class MoePruneInputWeightedMoe(nn.Module):
    """Llama-4's MoE block for layers with novices or per-expert widths.

    The stock block runs every expert on every token (scores of unselected experts are zero);
    this one asks the stock router for its scores, picks the top-k as the router does, and runs
    only the selected experts, each on its input scaled by the routing weight.
    """

    def __init__(self, stock_block: nn.Module, experts: MoePruneExperts):
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


def _slice_expert(family: Family, stock: nn.Module, p: int, width: int):
    """Router position p's expert of `width` neurons, holding the first `width` neurons of stock
    expert p (random values when the model is built from a config; replaced when loading)."""
    gate_up, down = stock.gate_up_proj[p], stock.down_proj[p]
    full = down.shape[1] if family.layout == FUSED else down.shape[0]
    if family.layout == FUSED:  # gate_up [2I, d], down [d, I]
        both = torch.cat((gate_up[:width], gate_up[full : full + width]))
        return MoePruneGatedExpert(both, down[:, :width].clone(), stock.act_fn)
    if family.layout == TRANSPOSED:  # gate_up [d, 2I], down [I, d]
        both = torch.cat((gate_up[:, :width], gate_up[:, full : full + width]), dim=1)
        return MoePruneTransposedExpert(both, down[:width].clone(), stock.act_fn)
    return MoePruneClampedExpert(  # INTERLEAVED: neuron j is columns 2j (gate) and 2j + 1 (up)
        gate_up[:, : 2 * width].clone(), stock.gate_up_proj_bias[p, : 2 * width].clone(),
        down[:width].clone(), stock.down_proj_bias[p].clone(), float(stock.alpha), float(stock.limit),
    )  # fmt: skip


def _replace_tensor(module: nn.Module, dotted: str, value: torch.Tensor) -> None:
    """Set parameter or buffer `dotted` (below `module`) to `value`, keeping its kind."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        module = getattr(module, part)
    if leaf in module._parameters:
        setattr(module, leaf, nn.Parameter(value, requires_grad=module._parameters[leaf].requires_grad))
    else:
        module._buffers[leaf] = value


def _get_tensor(module: nn.Module, dotted: str) -> torch.Tensor:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def _set_counts(family: Family, modules, count: int) -> None:
    for module in modules:
        for attr in family.count_attrs:
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, count)


# ----------------------------------------------------------------------------- the model
class MoePruneModelMixin:
    """What every `MoePrune<Family>ForCausalLM` adds to the stock causal-LM class."""

    moeprune_family: str = ""  # key of FAMILIES, set on each generated class

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._moeprune_reshape(read_structure(config))

    # -- building
    def _moeprune_reshape(self, structure: list[LayerStructure]) -> None:
        """Narrow routers, replace experts: each MoE layer takes its saved shape."""
        family = FAMILIES[self.moeprune_family]
        config = self.config
        decoder_layers = self.model.layers
        blocks = {
            i: block
            for i, layer in enumerate(decoder_layers)
            if hasattr(block := getattr(layer, family.block_attr, None), "experts")
            and hasattr(block, family.router_attr)
        }
        if [entry.layer for entry in structure] != sorted(blocks):
            raise _fail(
                f"config.json's 'moeprune' section describes layers {[e.layer for e in structure]} but the "
                f"{config.model_type} config has MoE layers {sorted(blocks)}; the checkpoint is damaged"
            )
        full_width = int(getattr(config, family.intermediate_field))
        most = int(getattr(config, family.count_field))
        for entry in structure:
            block = blocks[entry.layer]
            router, stock = getattr(block, family.router_attr), block.experts
            n = entry.num_experts
            if not int(router.top_k) <= n <= most:
                raise _fail(
                    f"layer {entry.layer} has {n} experts, outside {router.top_k}..{most} (top-k..{family.count_field})"
                )
            wide = [w for w in entry.widths if w is not None and w > full_width]
            if wide:
                raise _fail(
                    f"layer {entry.layer} has widths {wide}, above {family.intermediate_field}={full_width}"
                )
            groups = getattr(router, "num_group", None) or 1  # group-limited top-k views [groups, n / groups]
            grouped = getattr(router, "topk_method", "group_limited_greedy") == "group_limited_greedy"
            if grouped and n % groups:
                raise _fail(
                    f"layer {entry.layer} has {n} experts, which its {groups} routing groups cannot share"
                )
            for path, dim in family.router_tensors:
                _replace_tensor(router, path, _get_tensor(router, path).narrow(dim, 0, n).clone())
            _set_counts(family, (block, router), n)
            block.moeprune_expert_ids = list(entry.expert_ids)  # for readers: which original expert is where
            if entry.is_stock(full_width):
                for name, param in list(stock.named_parameters(recurse=False)):
                    _replace_tensor(stock, name, param.detach()[:n].clone())
                _set_counts(family, (stock,), n)
                continue
            hidden = int(config.hidden_size)
            experts = MoePruneExperts(
                [
                    MoePruneNovice(stock.down_proj.new_zeros(hidden))
                    if width is None
                    else _slice_expert(family, stock, p, width)
                    for p, width in enumerate(entry.widths)
                ],
                weight_on_input=family.weight_on_input,
            )
            if family.weight_on_input:
                block = MoePruneInputWeightedMoe(block, experts)
                block.moeprune_expert_ids = list(entry.expert_ids)
                setattr(decoder_layers[entry.layer], family.block_attr, block)
            else:
                block.experts = experts

    # -- names on disk
    def moeprune_disk_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(tensors, aliases): every tensor to fill, under the name a stock checkpoint of the family
        gives it (views into the model's tensors), and names of tied copies (lm_head.weight when
        tied to the embedding) mapped to the name that fills them."""
        family = FAMILIES[self.moeprune_family]
        experts_at = {}  # in-memory prefix of each MoE layer's experts -> the experts module
        for i, layer in enumerate(self.model.layers):
            block = getattr(layer, family.block_attr, None)
            if hasattr(block, "experts") and hasattr(block, family.router_attr):
                experts_at[f"model.layers.{i}.{family.block_attr}.experts."] = block.experts
        tensors: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        first_name: dict[int, str] = {}
        listed: set[str] = set()
        for name, tensor in self.state_dict(keep_vars=True).items():
            prefix = next((p for p in experts_at if name.startswith(p)), None)
            if prefix is not None:
                if prefix not in listed:  # the whole layer at its first tensor
                    listed.add(prefix)
                    tensors.update(_expert_disk_tensors(family, _to_disk(family, prefix), experts_at[prefix]))
                continue
            disk = _to_disk(family, name)
            if id(tensor) in first_name:
                aliases[disk] = first_name[id(tensor)]
                continue
            first_name[id(tensor)] = disk
            tensors[disk] = tensor
        return tensors, aliases

    # -- loading
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        """Build the model a moeprune folder describes and fill it from its safetensors files.

        transformers' own loader cannot do this: it maps names by the model type (unknown here)
        and expects every layer to have the config's shapes. Supported arguments: `dtype` (or
        `torch_dtype`; "auto", the default, uses the saved dtype), `device_map` naming one device
        ("cpu", "cuda:0", 0, or {"": device}), `attn_implementation`, `experts_implementation`,
        `output_loading_info`, `generation_config` and the Hub arguments (revision, cache_dir,
        token, local_files_only, force_download, proxies, subfolder). Anything else is refused
        rather than silently ignored.
        """
        if model_args:
            raise TypeError(
                f"modeling_moeprune: from_pretrained takes no extra positional arguments, got {model_args!r}"
            )
        hub = {k: kwargs.pop(k) for k in _HUB_ARGUMENTS if k in kwargs}
        folder = _resolve_folder(str(pretrained_model_name_or_path), hub)
        dtype = kwargs.pop("dtype", None)
        legacy_dtype = kwargs.pop("torch_dtype", None)
        dtype = legacy_dtype if dtype is None else dtype
        device = _plain_device(kwargs.pop("device_map", None))
        attn = kwargs.pop("attn_implementation", None)
        experts_impl = kwargs.pop("experts_implementation", None)
        loading_info = bool(kwargs.pop("output_loading_info", False))
        generation_config = kwargs.pop("generation_config", None)
        _refuse_unsupported(kwargs)

        if config is None or isinstance(config, (str, os.PathLike)):
            config = cls.config_class.from_pretrained(folder if config is None else config)
        if attn is not None:
            config._attn_implementation = attn
        if experts_impl is not None:
            config._experts_implementation = experts_impl
        dtype = _resolve_dtype(dtype, config, folder)
        with _default_dtype(dtype), torch.device("meta"):
            model = cls(config)  # shapes only: nothing is allocated or initialised
        model._keep_in_fp32(dtype)
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gives tied parameters separate storage
        _load_weights(model, folder)
        model._rebuild_non_persistent_buffers(dtype, device)
        model.config.dtype = dtype
        model.config.name_or_path = str(pretrained_model_name_or_path)
        if generation_config is not None:
            model.generation_config = generation_config
        elif model.can_generate() and os.path.isfile(os.path.join(folder, "generation_config.json")):
            model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
        model.eval()
        if loading_info:
            return model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
        return model

    def save_pretrained(
        self,
        save_directory,
        *,
        is_main_process: bool = True,
        max_shard_size="5GB",
        safe_serialization=True,
        **kwargs,
    ):
        """Save in the same format (config.json with its `moeprune` section, this file, the stock
        tensor names), so the folder loads again here and in moeprune; `push_to_hub` saves through
        it too. The tensors are copied to host memory before writing: saving needs room for one copy
        of the model there."""
        if not safe_serialization:
            raise _fail("save_pretrained writes safetensors only; drop safe_serialization=False")
        _refuse_unsupported(kwargs, "save_pretrained")
        if not is_main_process:
            return
        from huggingface_hub import save_torch_state_dict

        os.makedirs(save_directory, exist_ok=True)
        self.config.save_pretrained(save_directory)
        if self.can_generate() and getattr(self, "generation_config", None) is not None:
            self.generation_config.save_pretrained(save_directory)
        target = os.path.join(save_directory, os.path.basename(__file__))
        if not os.path.exists(target) or not os.path.samefile(__file__, target):
            shutil.copyfile(__file__, target)
        tensors, _ = self.moeprune_disk_tensors()  # views: gate and up share one fused tensor
        copies = {name: tensor.detach().to("cpu", copy=True) for name, tensor in tensors.items()}
        save_torch_state_dict(
            copies, save_directory, max_shard_size=max_shard_size, metadata={"format": "pt"}
        )

    def _keep_in_fp32(self, dtype: torch.dtype) -> None:
        """Keep in fp32 what stock transformers keeps in fp32 at this dtype (selection biases,
        ERNIE's router, gpt_oss's norms in fp16), as its `_keep_in_fp32_modules*` lists say."""
        names = (
            list(getattr(self, "_keep_in_fp32_modules_strict", None) or [])
            if dtype in (torch.float16, torch.bfloat16)
            else []
        )
        if dtype == torch.float16:
            names += list(getattr(self, "_keep_in_fp32_modules", None) or [])
        if not names:
            return
        pattern = re.compile(r"(^|\.)(" + "|".join(re.escape(n) for n in names) + r")($|\.)")
        for name, tensor in list(self.named_parameters()) + list(self.named_buffers()):
            if pattern.search(name) and tensor.is_floating_point():
                _replace_tensor(self, name, tensor.detach().to(torch.float32))

    def _rebuild_non_persistent_buffers(self, dtype: torch.dtype, device: torch.device) -> None:
        """Buffers that checkpoints do not hold (RoPE's inverse frequencies) were built on the meta
        device: rebuild each module owning one from its config and copy the values over."""
        owners = {}
        for module_name, module in self.named_modules():
            for buffer_name in module._non_persistent_buffers_set:
                if module._buffers.get(buffer_name) is not None:
                    owners[module_name] = module
        for module_name, module in owners.items():
            try:
                with _default_dtype(dtype), torch.device(device):
                    fresh = type(module)(module.config)
            except (AttributeError, TypeError) as exc:
                raise _fail(
                    f"cannot rebuild the buffers of {module_name} ({type(module).__name__}): {exc}"
                ) from exc
            for buffer_name in module._non_persistent_buffers_set:
                if module._buffers.get(buffer_name) is not None:
                    module._buffers[buffer_name] = fresh._buffers[buffer_name].to(device)


def _expert_disk_tensors(family: Family, prefix: str, experts: nn.Module) -> dict[str, torch.Tensor]:
    """One layer's routed experts under their on-disk names (prefix: "<block on disk>.experts.").

    Families whose checkpoints store one tensor per expert (all but gpt_oss and Llama-4) get
    views of the fused gate/up rows; novices store `mean_output`; gpt_oss and Llama-4 store the
    stock fused tensors for a stock layer and one expert's slice per position otherwise.
    """
    names = family.disk_expert_names
    if not isinstance(experts, MoePruneExperts):  # the stock module, narrowed
        if names is None:
            return {f"{prefix}{name}": tensor for name, tensor in experts.named_parameters()}
        per_expert = list(zip(experts.gate_up_proj, experts.down_proj))
    else:
        per_expert = list(experts)
    out = {}
    for p, expert in enumerate(per_expert):
        if isinstance(expert, MoePruneNovice):
            out[f"{prefix}{p}.{MEAN_OUTPUT}"] = expert.mean_output
        elif names is None:
            out.update({f"{prefix}{p}.{name}": tensor for name, tensor in expert.named_parameters()})
        else:
            gate_up, down = (
                (expert.gate_up_proj, expert.down_proj) if isinstance(expert, nn.Module) else expert
            )
            width = down.shape[1]
            out[f"{prefix}{p}.{names[0]}.weight"] = gate_up[:width]
            out[f"{prefix}{p}.{names[1]}.weight"] = gate_up[width:]
            out[f"{prefix}{p}.{names[2]}.weight"] = down
    return out


def _to_disk(family: Family, name: str) -> str:
    for memory, disk in family.disk_renames:
        name = name.replace(memory, disk)
    return name


# ----------------------------------------------------------------------------- loading helpers
_HUB_ARGUMENTS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "revision",
    "subfolder",
    "token",
)
# Passed by transformers' Auto classes or harmless here (this loader never initialises, always
# reads safetensors and maps nothing): ignored.
_IGNORED = ("_from_auto", "_commit_hash", "trust_remote_code", "code_revision", "adapter_kwargs", "low_cpu_mem_usage",
            "use_safetensors", "weights_only", "disable_mmap", "mirror", "_fast_init", "offload_state_dict",
            "ignore_mismatched_sizes", "adapter_name")  # fmt: skip


def _refuse_unsupported(kwargs: dict, what: str = "from_pretrained") -> None:
    unsupported = sorted(
        k for k, v in kwargs.items() if k not in _IGNORED and v is not None and v is not False and v != {}
    )
    if kwargs.get("use_safetensors") is False:
        unsupported.append("use_safetensors=False")
    if unsupported:
        raise _fail(
            f"{what} does not support {', '.join(unsupported)} for moeprune checkpoints; "
            "use dtype and a single device, then adapt the model"
        )


def _resolve_folder(name: str, hub: dict) -> str:
    """The local folder holding the checkpoint: `name` itself, or its snapshot from the Hub."""
    subfolder = hub.pop("subfolder", None) or ""
    if os.path.isdir(name):
        folder = os.path.join(name, subfolder)
    else:
        from huggingface_hub import snapshot_download

        patterns = [f"{subfolder}/*" if subfolder else "*"]
        hub.pop("proxies", None)
        folder = os.path.join(snapshot_download(name, allow_patterns=patterns, **hub), subfolder)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise OSError(f"modeling_moeprune: {folder} has no config.json; pass the folder moeprune saved")
    return folder


def _plain_device(device_map) -> torch.device:
    """The one device a `device_map` names; placements over several devices are refused."""
    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            raise _fail("a device_map placing modules on several devices is not supported; name one device")
        device_map = device_map[""]
    if device_map is None:
        return torch.device("cpu")
    if isinstance(device_map, int):
        return torch.device("cuda", device_map)
    if isinstance(device_map, str) and device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
        raise _fail(f"device_map={device_map!r} is not supported; name one device (for example 'cuda:0')")
    return torch.device(device_map)


_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
_STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def _resolve_dtype(dtype, config, folder: str) -> torch.dtype:
    """A torch dtype from `dtype`: a dtype or its name; "auto" or None (the default, as in stock
    transformers 5) uses config.json's dtype, else the stored weights' dtype."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if dtype is None:
            return _stored_dtype(folder)
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.removeprefix("torch."))
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise _fail(f"dtype must be one of {', '.join(_DTYPES)} or 'auto', got {dtype!r}")
    return dtype


def _stored_dtype(folder: str) -> torch.dtype:
    for shard in _shards(folder):
        with safe_open(os.path.join(folder, shard), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                stored = _STORED_DTYPES.get(handle.get_slice(key).get_dtype())
                if stored is not None:
                    return stored
    return torch.float32


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _shards(folder: str) -> list[str]:
    """The safetensors files of the folder: those the index names, or the single file."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            try:
                weight_map = json.load(handle)["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise _fail(f"{index} is damaged ({exc}); copy the checkpoint again") from exc
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise OSError(
                f"modeling_moeprune: {index} names shards that are not in the folder: {', '.join(missing)}"
            )
        return shards
    if os.path.isfile(os.path.join(folder, SINGLE_FILE)):
        return [SINGLE_FILE]
    raise OSError(f"modeling_moeprune: {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def _listed(names, limit: int = 5) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _load_weights(model: nn.Module, folder: str) -> None:
    """Copy every stored tensor into the model by its on-disk name; strict both ways."""
    targets, aliases = model.moeprune_disk_tensors()
    shards = _shards(folder)
    stored: dict[str, str] = {}
    for shard in shards:
        with safe_open(os.path.join(folder, shard), framework="pt") as handle:
            stored.update(dict.fromkeys(handle.keys(), shard))
    filled = {aliases.get(name, name) for name in stored}
    missing = set(targets) - filled
    unexpected = set(stored) - set(targets) - set(aliases)
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing tensors {_listed(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors {_listed(unexpected)}")
        raise _fail(
            f"{folder} does not match its config.json: {'; '.join(problems)}; the checkpoint is incomplete or damaged"
        )
    with torch.no_grad():
        for shard in shards:
            with safe_open(os.path.join(folder, shard), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    target = targets[aliases.get(name, name)]
                    value = handle.get_tensor(name)
                    if tuple(value.shape) != tuple(target.shape):
                        raise _fail(
                            f"{folder}: tensor {name} has shape {tuple(value.shape)} but config.json's structure "
                            f"gives {tuple(target.shape)}; the checkpoint is damaged"
                        )
                    target.copy_(value)


# ----------------------------------------------------------------------------- the classes
def _make_classes(base: str, family: Family) -> None:
    """Define MoePrune<Config> and MoePrune<CausalLM> for one family in this module."""
    try:
        stock_config = getattr(transformers, family.config_class)
        stock_model = getattr(transformers, family.causal_lm_class)
    except AttributeError:
        raise AttributeError(
            f"modeling_moeprune: transformers {transformers.__version__} has no {family.causal_lm_class} "
            f"(the {base} family); upgrade transformers"
        ) from None
    config_class = type(
        f"MoePrune{family.config_class}",
        (stock_config,),
        {
            "model_type": f"moeprune_{base}",
            "__module__": __name__,
            "__doc__": f"{family.config_class} of a moeprune result; `moeprune` holds each MoE layer's structure.",
        },
    )
    model_class = type(
        f"MoePrune{family.causal_lm_class}",
        (MoePruneModelMixin, stock_model),
        {
            "config_class": config_class,
            "moeprune_family": base,
            "__module__": __name__,
            "__doc__": f"{family.causal_lm_class} with each MoE layer shaped as config.moeprune says.",
        },
    )
    globals()[config_class.__name__] = config_class
    globals()[model_class.__name__] = model_class


def __getattr__(name: str):
    """MoePrune<Config> and MoePrune<CausalLM> of a family, built on first use (transformers asks
    for them by the names in config.json's auto_map), so that loading one family neither imports
    nor subclasses the other ten."""
    for base, family in FAMILIES.items():
        if name in (f"MoePrune{family.config_class}", f"MoePrune{family.causal_lm_class}"):
            _make_classes(base, family)
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
