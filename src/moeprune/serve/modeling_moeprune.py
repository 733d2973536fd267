"""Load a moeprune result with stock transformers: `AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`. moeprune need not be installed.

moeprune (a toolkit that prunes Mixture-of-Experts language models) copied this file and the ones
it imports (moeprune_families.py: the family table; moeprune_layers.py: the expert modules;
moeprune_novices.py: low-rank novices; moeprune_loading.py: reading the weights; moeprune_format.py:
the structure, read and checked; moeprune_quantized.py: decoding quantized weights) into the folder
because the result is something the family's stock config cannot describe: MoE layers with
different numbers of experts, experts of different widths (intermediate neurons), or
"novices" (experts replaced by their mean output). config.json says so in its `moeprune`
section, one entry per MoE layer:

    {"layer": 3, "num_experts": 6, "expert_ids": [0, 1, 3, 4, 6, 7],
     "widths": [16, 16, null, 8, 16, 12], "novice": [2]}

Router output `p` of that layer is original expert `expert_ids[p]`, with `widths[p]` neurons,
or a novice (`null`). The format is described in moeprune's docs/checkpoint-format.md.

How a model is built: the stock transformers model of the base family is built from the config
(the `family` record of the `moeprune` section says how that family lays out its MoE blocks:
where block and router sit, the per-expert router tensors, the expert layout, the names on disk;
moeprune discovered it from the model), then each MoE layer is reshaped to its entry:

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
5.16.1 and 5.23, and with 5.24's families that run another family's causal LM).

A result that kept its input's quantization (block-scaled fp8, MXFP4, compressed-tensors
pack-/float-quantized; config.json keeps `quantization_config`) is decoded while loading: each
weight's codes and scales become float32 numbers, exactly, then the requested dtype. The model in
memory is therefore not quantized (it holds `dtype` weights and its config drops
`quantization_config`, so `save_pretrained` writes what it holds).

Not supported: `device_map` over several devices, quantizing on load, and training with
`output_router_logits=True` when layers have different expert counts (transformers'
load-balancing loss concatenates the layers' router logits, which then differ in width).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import TYPE_CHECKING, cast

import torch
import transformers

from .moeprune_families import LayerStructure, block_of, fail, family_of, read_structure
from .moeprune_format import ARCHITECTURE_PREFIX, auto_model_class, split_auto_model_class
from .moeprune_layers import (
    MoePruneExperts,
    MoePruneInputWeightedMoe,
    expert_disk_tensors,
    first_rows,
    get_tensor,
    replace_tensor,
    set_counts,
    slice_expert,
    to_disk,
)
from .moeprune_loading import (
    HUB_ARGUMENTS,
    default_dtype,
    load_weights,
    mtp_roots,
    plain_device,
    refuse_unsupported,
    resolve_dtype,
    resolve_folder,
)
from .moeprune_novices import novice_module
from .moeprune_quantized import read_as_compressed_tensors

MODELING_FILES = (
    "modeling_moeprune.py",
    "moeprune_layers.py",
    "moeprune_families.py",
    "moeprune_loading.py",
    "moeprune_format.py",
    "moeprune_quantized.py",
    "moeprune_novices.py",
)  # copied together


# ----------------------------------------------------------------------------- the model
if TYPE_CHECKING:
    _StockCausalLM = transformers.PreTrainedModel  # the stock class the mixin is placed before
else:
    _StockCausalLM = object


class MoePruneModelMixin(_StockCausalLM):
    """What every `MoePrune<Family>ForCausalLM` adds to the stock causal-LM class."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._moeprune_reshape(read_structure(config))

    # -- building
    def _moeprune_reshape(self, structure: list[LayerStructure]) -> None:
        """Narrow routers, replace experts: each MoE layer takes its saved shape."""
        family = family_of(self.config)
        config = self.config.get_text_config()
        decoder_layers = cast(torch.nn.ModuleList, self.get_submodule(family.layers))
        blocks = {
            i: block
            for i, layer in enumerate(decoder_layers)
            if hasattr(block := block_of(layer, family), "experts") and hasattr(block, family.router_attr)
        }
        if [entry.layer for entry in structure] != sorted(blocks):
            raise fail(
                f"config.json's 'moeprune' section describes layers {[e.layer for e in structure]} but the "
                f"{config.model_type} config has MoE layers {sorted(blocks)}; the checkpoint is damaged"
            )
        full_width = int(getattr(config, family.intermediate_field))
        most = int(getattr(config, family.count_field))
        for entry in structure:
            block = blocks[entry.layer]
            router, stock = getattr(block, family.router_attr), block.experts
            n = entry.num_experts
            top_k = int(getattr(router, "top_k", 1))
            if not top_k <= n <= most:
                raise fail(
                    f"layer {entry.layer} has {n} experts, outside {top_k}..{most} (top-k..{family.count_field})"
                )
            wide = [w for w in entry.widths if w is not None and w > full_width]
            if wide:
                raise fail(
                    f"layer {entry.layer} has widths {wide}, above {family.intermediate_field}={full_width}"
                )
            groups = getattr(router, "num_group", None) or 1  # group-limited top-k views [groups, n / groups]
            grouped = getattr(router, "topk_method", "group_limited_greedy") == "group_limited_greedy"
            if grouped and n % groups:
                raise fail(
                    f"layer {entry.layer} has {n} experts, which its {groups} routing groups cannot share"
                )
            if n < most:  # a layer keeping every expert keeps its router as built (a hash router
                # kept whole has none of the selection bias the family's learned routers hold)
                for path, dim in family.router_tensors:
                    replace_tensor(router, path, first_rows(family, get_tensor(router, path), dim, n, most))
                for path, dim in family.block_tensors:
                    replace_tensor(block, path, first_rows(family, get_tensor(block, path), dim, n, most))
            set_counts(family, (block, router), n)
            block.moeprune_expert_ids = list(entry.expert_ids)  # for readers: which original expert is where
            if entry.is_stock(full_width):
                for name, param in list(stock.named_parameters(recurse=False)):
                    replace_tensor(stock, name, first_rows(family, param.detach(), 0, n, most))
                set_counts(family, (stock,), n)
                continue
            hidden = int(config.hidden_size)
            experts = MoePruneExperts(
                [
                    novice_module(stock.down_proj.new_zeros(hidden), entry.novice_rank)
                    if width is None
                    else slice_expert(family, stock, p, width)
                    for p, width in enumerate(entry.widths)
                ],
                weight_on_input=family.weight_on_input,
                zero_experts=stock if family.extra_experts else None,
            )
            if family.extra_experts:
                set_counts(family, (stock,), n)
            if family.weight_on_input:
                block = MoePruneInputWeightedMoe(block, experts)
                block.moeprune_expert_ids = list(entry.expert_ids)
                decoder_layers[entry.layer].set_submodule(family.block_attr, block)
            else:
                block.experts = experts

    # -- names on disk
    def moeprune_disk_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(tensors, aliases): every tensor to fill, under the name a stock checkpoint of the family
        gives it (views into the model's tensors), and names of tied copies (lm_head.weight when
        tied to the embedding) mapped to the name that fills them."""
        family = family_of(self.config)
        experts_at = {}  # in-memory prefix of each MoE layer's experts -> the experts module
        for i, layer in enumerate(cast(torch.nn.ModuleList, self.get_submodule(family.layers))):
            block = block_of(layer, family)
            if hasattr(block, "experts") and hasattr(block, family.router_attr):
                path = ".".join(p for p in (family.layers, str(i), family.block_attr) if p)
                experts_at[f"{path}.experts."] = block.experts
        tensors: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        first_name: dict[int, str] = {}
        listed: set[str] = set()
        for name, tensor in self.state_dict(keep_vars=True).items():
            prefix = next((p for p in experts_at if name.startswith(p)), None)
            if prefix is not None:
                if prefix not in listed:  # the whole layer at its first tensor
                    listed.add(prefix)
                    tensors.update(expert_disk_tensors(family, to_disk(family, prefix), experts_at[prefix]))
                continue
            disk = to_disk(family, name)
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
        hub = {k: kwargs.pop(k) for k in HUB_ARGUMENTS if k in kwargs}
        folder = resolve_folder(str(pretrained_model_name_or_path), hub)
        dtype = kwargs.pop("dtype", None)
        legacy_dtype = kwargs.pop("torch_dtype", None)
        dtype = legacy_dtype if dtype is None else dtype
        device = plain_device(kwargs.pop("device_map", None))
        attn = kwargs.pop("attn_implementation", None)
        experts_impl = kwargs.pop("experts_implementation", None)
        loading_info = bool(kwargs.pop("output_loading_info", False))
        generation_config = kwargs.pop("generation_config", None)
        refuse_unsupported(kwargs)

        if config is None or isinstance(config, (str, os.PathLike)):
            config = cls.config_class.from_pretrained(folder if config is None else config)
        if attn is not None:
            config._attn_implementation = attn
        if experts_impl is not None:
            config._experts_implementation = experts_impl
        dtype = resolve_dtype(dtype, config, folder)
        with default_dtype(dtype), torch.device("meta"):
            model = cls(config)  # shapes only: nothing is allocated or initialised
        model._keep_in_fp32(dtype)
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gives tied parameters separate storage
        load_weights(model, folder, mtp_roots(config))
        quant = getattr(model.config, "quantization_config", None)
        if quant is not None:
            # dynamic fp8 input activations quantized as compressed-tensors' forward does
            read_as_compressed_tensors(model, quant if isinstance(quant, dict) else quant.to_dict(), folder)
            # quantized weights were decoded: the model in memory (and what it saves) holds dtype weights
            del model.config.quantization_config
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

    def save_pretrained(  # type: ignore[override]  # keyword-only by design; the rest is refused
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
            raise fail("save_pretrained writes safetensors only; drop safe_serialization=False")
        refuse_unsupported(kwargs, "save_pretrained")
        if not is_main_process:
            return
        from huggingface_hub import save_torch_state_dict

        os.makedirs(save_directory, exist_ok=True)
        self.config.save_pretrained(save_directory)
        if self.can_generate() and getattr(self, "generation_config", None) is not None:
            self.generation_config.save_pretrained(save_directory)
        here = os.path.dirname(os.path.abspath(__file__))
        for name in MODELING_FILES:  # this file and the three it imports
            source, target = os.path.join(here, name), os.path.join(save_directory, name)
            if not os.path.exists(target) or not os.path.samefile(source, target):
                shutil.copyfile(source, target)
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
                replace_tensor(self, name, tensor.detach().to(torch.float32))

    def _rebuild_non_persistent_buffers(self, dtype: torch.dtype, device: torch.device) -> None:
        """Buffers that checkpoints do not hold (RoPE's inverse frequencies) were built on the meta
        device: rebuild each module owning one from its config and copy the values over."""
        owners = {}
        for module_name, module in self.named_modules():
            for buffer_name in module._non_persistent_buffers_set:
                if module._buffers.get(buffer_name) is not None:
                    owners[module_name] = module
        for module_name, module in owners.items():
            if not hasattr(module, "config"):  # built from arguments: transformers' own init sets them
                self._init_buffers_only(module_name, module, device)
                continue
            try:
                with default_dtype(dtype), torch.device(device):
                    fresh = type(module)(module.config)
            except (AttributeError, TypeError) as exc:
                raise fail(
                    f"cannot rebuild the buffers of {module_name} ({type(module).__name__}): {exc}"
                ) from exc
            for buffer_name in module._non_persistent_buffers_set:
                if module._buffers.get(buffer_name) is not None:
                    module._buffers[buffer_name] = fresh._buffers[buffer_name].to(device)

    def _init_buffers_only(self, module_name: str, module: torch.nn.Module, device: torch.device) -> None:
        """Run the family's `_init_weights` on `module` with its (loaded) parameters set aside, so
        only its non-persistent buffers (Gemma-4's embedding scale) get their values."""
        loaded = dict(module._parameters)
        try:
            for name, param in loaded.items():
                if param is not None:
                    module._parameters[name] = torch.nn.Parameter(
                        torch.empty_like(param, device="meta"), False
                    )
            for buffer_name in module._non_persistent_buffers_set:
                buffer = module._buffers.get(buffer_name)
                if buffer is not None:
                    module._buffers[buffer_name] = torch.full_like(
                        buffer, _unset(buffer.dtype), device=device
                    )
            self._init_weights(module)
        finally:
            module._parameters.update(loaded)
        for buffer_name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(buffer_name)
            if (
                buffer is not None
                and buffer.dtype != torch.bool
                and bool((buffer == _unset(buffer.dtype)).any() | buffer.isnan().any())
            ):
                raise fail(
                    f"cannot rebuild the buffer {buffer_name} of {module_name} ({type(module).__name__})"
                )


def _unset(dtype: torch.dtype) -> float | int | bool:
    """What a buffer holds until `_init_weights` sets it: NaN, or the least integer (Inkling's
    audio token offsets are int64, which NaN cannot fill)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else int(torch.iinfo(dtype).min)


# ----------------------------------------------------------------------------- the classes
def _config_class(stock_config: type[transformers.PretrainedConfig]) -> type:
    """MoePrune<Config>: the stock config class under the model type `moeprune_<base>`."""
    name = f"MoePrune{stock_config.__name__}"
    if name not in globals():
        globals()[name] = type(
            name,
            (stock_config,),
            {
                "model_type": f"moeprune_{stock_config.model_type}",
                "__module__": __name__,
                "__doc__": f"{stock_config.__name__} of a moeprune result; `moeprune` holds each MoE layer's structure.",
            },
        )
    return globals()[name]


def _model_class(
    stock_model: type[transformers.PreTrainedModel],
    stock_config: type[transformers.PretrainedConfig] | None = None,
) -> type:
    """MoePrune<CausalLM> (or MoePrune<CausalLM>__<Config>): the stock causal-LM class with each MoE
    layer shaped as config.moeprune says, for configs of `stock_config` (default: the class's own).

    transformers refuses a remote model class whose `config_class` is not the config's class, and
    some families run another family's causal LM on a config class of their own (transformers
    5.24's sarvam_mla: DeepseekV3ForCausalLM on SarvamMLAConfig), so the class is made per
    (causal-LM class, config class) pair, named as the saver wrote it into auto_map."""
    # every stock causal-LM class names its config class (the stub allows None)
    own = cast("type[transformers.PretrainedConfig] | None", stock_model.config_class)
    config = stock_config or own
    if config is None:
        raise fail(f"transformers' {stock_model.__name__} names no config class")
    name = auto_model_class(stock_model.__name__, config.__name__, own.__name__ if own else None)
    if name not in globals():
        globals()[name] = type(
            name,
            (MoePruneModelMixin, stock_model),
            {
                "config_class": _config_class(config),
                "__module__": __name__,
                "__doc__": f"{stock_model.__name__} on {config.__name__} with each MoE layer shaped as "
                "config.moeprune says.",
            },
        )
    return globals()[name]


def _stock_class(name: str) -> type | None:
    stock = getattr(transformers, name, None)
    if stock is None and name.endswith(("Config", "ForCausalLM", "ForConditionalGeneration")):
        raise AttributeError(
            f"modeling_moeprune: transformers {transformers.__version__} has no {name}; upgrade transformers"
        )
    return stock if isinstance(stock, type) else None


def __getattr__(name: str):
    """MoePrune<Config>, MoePrune<CausalLM> and MoePrune<CausalLM>__<Config> of any family, built
    on first use (transformers asks for them by the names in config.json's auto_map) from the stock
    classes so named, so loading one family neither imports nor subclasses another."""
    if name.startswith(ARCHITECTURE_PREFIX) and not name.startswith(ARCHITECTURE_PREFIX + "_"):
        stock_name, config_name = split_auto_model_class(name)
        stock = _stock_class(stock_name)
        if config_name is not None:  # a causal LM run on another family's config class
            config = _stock_class(config_name)
            if (
                stock is not None
                and issubclass(stock, transformers.PreTrainedModel)
                and config is not None
                and issubclass(config, transformers.PretrainedConfig)
            ):
                return _model_class(stock, config)
        elif stock is not None and issubclass(stock, transformers.PretrainedConfig):
            return _config_class(stock)
        elif stock is not None and issubclass(stock, transformers.PreTrainedModel):
            return _model_class(stock)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
