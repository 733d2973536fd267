"""The part of driver.py that quantizes a result in moeprune's format (per-layer expert
counts, novices, per-expert widths), in the quantization environment. Like the driver it imports
torch, transformers, llm-compressor and the standard library only, never moeprune: the folder's
own modeling files (`trust_remote_code`) build the model, so llm-compressor sees the very modules
moeprune's reader and the modeling files compute with.

Three things make such a model quantizable by llm-compressor, which expects stock experts:

- a layer whose stock experts module holds fewer experts (or narrower ones) than the model's config
  says gets its own config copy with its count and width: llm-compressor's linearization reads the
  expert count and `moe_intermediate_size` from `module.config`;
- a layer of moeprune's own experts (`MoePruneExperts`: novices or per-expert widths) has each
  expert's fused [gate; up] and down parameters split into three `nn.Linear` (gate_proj, up_proj,
  down_proj), the very names each expert has on disk, and its forward runs every expert on every
  token, weighted by the router (0 where not picked): the output is the routed one, and every kept
  expert's GPTQ statistics see the whole calibration set, as `moe_calibrate_all_experts` does for
  stock layers. Novices (a constant, or low-rank factors) are parameters, not Linears: they stay
  in the model's dtype;
- the result is written by names, not by `save_pretrained` (which the modeling files refuse): every
  tensor of the saved folder is copied, and each quantized Linear's `<m>.weight` is replaced by its
  compressed-tensors tensors (`<m>.weight_packed`, `.weight_scale`, ...), shard by shard; config.json
  gains the `quantization_config` compressed-tensors writes.
"""

from __future__ import annotations

import copy
import json
import shutil
import types
from pathlib import Path

import torch
from torch import nn

COUNT_KEYS = ("num_local_experts", "moe_num_experts", "num_experts", "n_routed_experts")


class LinearExpert(nn.Module):
    """One moeprune expert of width K as three Linears: down(act(gate x) * up x)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn):
        super().__init__()
        width = down.shape[1]
        self.gate_proj = nn.Linear(gate_up.shape[1], width, bias=False, dtype=gate_up.dtype)
        self.up_proj = nn.Linear(gate_up.shape[1], width, bias=False, dtype=gate_up.dtype)
        self.down_proj = nn.Linear(width, down.shape[0], bias=False, dtype=down.dtype)
        with torch.no_grad():
            self.gate_proj.weight.copy_(gate_up[:width])
            self.up_proj.weight.copy_(gate_up[width:])
            self.down_proj.weight.copy_(down)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _all_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """MoePruneExperts' output, every expert computing on every token (weight 0 where not picked)."""
    out = torch.zeros_like(hidden_states, dtype=torch.float32)
    for position, expert in enumerate(self):
        weight = (top_k_weights * (top_k_index == position)).sum(dim=1, keepdim=True)
        out += (expert(hidden_states) * weight.to(hidden_states.dtype)).to(out.dtype)
    return out.to(hidden_states.dtype)


def per_layer_experts(model) -> dict[str, nn.ModuleList]:
    """Make the model's experts quantizable as the module docstring says; returns moeprune's own
    experts modules by name (their experts' tokens are counted by `count_own_tokens`)."""
    from llmcompressor.modeling.moe.helpers import FusedExpertsProtocol

    own = {}
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "MoePruneExperts":
            for position, expert in enumerate(module):
                kind = type(expert).__name__
                if kind == "MoePruneGatedExpert" and expert.gate_fn is None:
                    module[position] = LinearExpert(
                        expert.gate_up_proj.data, expert.down_proj.data, expert.act_fn
                    )
                elif "Novice" not in kind:
                    raise SystemExit(f"{name}.{position}: a {kind} is not quantized by moeprune yet")
            module.forward = types.MethodType(_all_experts_forward, module)
            own[name] = module
        elif isinstance(module, FusedExpertsProtocol):
            down = module.down_proj  # [experts, hidden, width]
            config = copy.copy(getattr(module, "config", model.config))
            for key in COUNT_KEYS:
                if getattr(config, key, None) is not None:
                    setattr(config, key, down.shape[0])
            config.moe_intermediate_size = down.shape[2]
            module.config = config
    return own


def count_own_tokens(own: dict[str, nn.ModuleList]) -> dict[str, list[int]]:
    """Forward pre-hooks on moeprune's Linear experts: tokens each one computed on, per layer, in
    router order (novices, which are not quantized, left out)."""
    counts: dict[str, list[int]] = {}
    for name, module in own.items():
        experts = [e for e in module if isinstance(e, LinearExpert)]
        counts[name] = [0] * len(experts)
        for position, expert in enumerate(experts):

            def hook(_module, args, _name=name, _position=position):
                counts[_name][_position] += args[0].shape[:-1].numel()

            expert.register_forward_pre_hook(hook)
    return counts


def _shards(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def write_compressed(model, folder: str, output: str) -> None:
    """The saved folder's tensors with every quantized Linear compressed, into `output` (shards of
    the same names, the index and config.json)."""
    from compressed_tensors.compressors import ModelCompressor
    from safetensors import safe_open
    from safetensors.torch import save_file

    compressor = ModelCompressor.from_pretrained_model(model)
    quantized = {
        name for name, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None
    }
    compressor.compress_model(model)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    src, dst = Path(folder), Path(output)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map, written = {}, set()
    for shard in _shards(src):
        tensors = {}
        with safe_open(src / shard, "pt") as handle:
            for key in handle.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                module = key.removesuffix(".weight")
                if key.endswith(".weight") and module in quantized:
                    parts = {k: v for k, v in state.items() if k.rsplit(".", 1)[0] == module}
                    tensors.update(parts)
                    written.add(module)
                else:
                    tensors[key] = handle.get_tensor(key)
        save_file(tensors, dst / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    missing = sorted(quantized - written)
    if missing:
        raise SystemExit(f"quantized modules with no weight on disk: {', '.join(missing[:5])}")
    if (src / "model.safetensors.index.json").is_file():
        total = sum((dst / s).stat().st_size for s in set(weight_map.values()))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    shutil.copy(src / "config.json", dst / "config.json")
    compressor.update_config(str(dst))
