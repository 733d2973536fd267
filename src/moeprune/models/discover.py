"""Find a model's MoE structure from the model itself, not from a list of family names.

transformers 5 builds every routed-experts module the same way: one module `experts` holding
3-D tensors with the expert on the first axis (`gate_up_proj` [E, 2I, d] and `down_proj`
[E, d, I], or their transposes), which records its layout on the instance (`has_gate`,
`has_bias`, `is_transposed`, `is_concatenated`, `has_post_expert_norm`), and a router beside it
whose forward returns (logits [T, E], weights [T, k], index [T, k]). So the structure is read
off the instance: the decoder layers, the block holding `experts`, the router (the sibling
holding an [E, d] matrix), every per-expert tensor on the router or the block, the config
fields holding the expert count and width (the ones whose values match the tensors), and the
names `save_pretrained` gives the experts on disk (asked of transformers' own save-time
conversion). `spec.OVERRIDES` adds only what cannot be inferred (Llama-4 weights the expert
input). A structure moeprune cannot compute exactly is refused in one line naming the part.
"""

from __future__ import annotations

import copy
import inspect
import json
import warnings
from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from moeprune.errors import UnsupportedModelError
from moeprune.models.disk_names import disk_names, names_agree
from moeprune.models.routers import (
    find_router,
    learned_block,
    no_router_message,
    per_expert_tensors,
    router_index_position,
)
from moeprune.models.spec import (
    DOWN_IS_D_BY_I,
    FUSED,
    INTERLEAVED,
    OVERRIDES,
    TRANSPOSED,
    UNGATED,
    FamilySpec,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_EXPERT_TENSORS = ("gate_up_proj", "up_proj", "down_proj")
_COUNT_PREFERENCE = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_NOT_A_COUNT = ("per_tok", "per_token", "shared", "group", "top", "zero", "capacity", "period", "offset")
_WIDTH_WORDS = ("intermediate", "ffn", "expert_dim", "expert_hidden")


def text_config(config):
    """The language model's config (the config itself for a causal LM, `text_config` for a wrapper)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if getter is not None else config


def routed_experts_module(module: nn.Module) -> bool:
    """Whether `module` holds routed experts as transformers 5 stores them (3-D, expert axis first)."""
    down = getattr(module, "down_proj", None)
    return (
        isinstance(down, torch.Tensor)
        and down.dim() == 3
        and (
            isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
            or isinstance(getattr(module, "up_proj", None), torch.Tensor)
        )
    )


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(qualified name, list) of the decoder layers holding routed experts, also inside a
    multimodal wrapper; the first `layers` list when none holds experts; None without any."""
    lists = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"
    ]
    for name, mod in lists:
        if any(routed_experts_module(m) for layer in mod for m in layer.modules()):
            return name, mod
    return lists[0] if lists else None


def moe_blocks(layers: nn.ModuleList) -> list[tuple[int, str, nn.Module]]:
    """(decoder layer index, path of the block inside the layer, block) for every layer whose
    block holds an `experts` module of routed experts ('' when the layer itself holds it)."""
    found = []
    for index, layer in enumerate(layers):
        for name, module in layer.named_modules():
            experts = getattr(module, "experts", None)
            if isinstance(experts, nn.Module) and routed_experts_module(experts):
                found.append((index, name, module))
                break
    return found


def _expert_count(experts: nn.Module) -> tuple[int, int]:
    """(weighted experts, extra rows): the weighted count is the smallest first axis of the expert
    tensors; a tensor one block of rows longer holds rows for extra experts that carry no weights
    of their own (LongCat-Flash's `gate_up_proj` spans its zero experts too, `down_proj` not)."""
    counts = {
        name: int(t.shape[0])
        for name in _EXPERT_TENSORS
        if isinstance(t := getattr(experts, name, None), torch.Tensor)
    }
    if len(set(counts.values())) > 2:
        raise UnsupportedModelError(
            f"{type(experts).__name__} holds tensors of more than two expert counts ({counts}): not supported"
        )
    count = min(counts.values())
    return count, max(counts.values()) - count


def _layout(experts: nn.Module, hidden: int) -> str:
    name = type(experts).__name__
    if getattr(experts, "has_gate", True) is False or not hasattr(experts, "gate_up_proj"):
        if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
            raise UnsupportedModelError(
                f"{name} experts are not gated and transposed or biased: not supported yet"
            )
        if getattr(experts, "has_post_expert_norm", False):
            raise UnsupportedModelError(
                f"{name} normalises each expert's output (post-expert norm): not supported yet"
            )
        return UNGATED
    if getattr(experts, "has_post_expert_norm", False):
        raise UnsupportedModelError(
            f"{name} normalises each expert's output (post-expert norm): not supported yet"
        )
    transposed = getattr(experts, "is_transposed", None)
    if transposed is None:  # no layout flags (Llama-4): read it from the shapes
        transposed = (
            int(_tensor(experts, "gate_up_proj").shape[1]) == hidden
            and int(_tensor(experts, "down_proj").shape[2]) == hidden
        )
    if not getattr(experts, "is_concatenated", True):
        if not transposed:
            raise UnsupportedModelError(
                f"{name} interleaves gate and up rows untransposed: not supported yet"
            )
        return INTERLEAVED
    if getattr(experts, "has_bias", False):
        raise UnsupportedModelError(
            f"{name} experts carry biases in a concatenated layout: not supported yet"
        )
    return TRANSPOSED if transposed else FUSED


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    """A stock module's tensor attribute (nn.Module's __getattr__ is typed Tensor | Module)."""
    return cast(torch.Tensor, getattr(module, name))


def _count_field(config, count: int) -> str:
    """The config field holding the expert count: one of its own fields whose value is the
    count (the usual names first), else an alias the config maps onto one."""
    own = [
        k
        for k, v in vars(config).items()
        if isinstance(v, int)
        and not isinstance(v, bool)
        and v == count
        and "expert" in k
        and not any(w in k for w in _NOT_A_COUNT)
    ]
    own.sort(key=lambda k: _COUNT_PREFERENCE.index(k) if k in _COUNT_PREFERENCE else len(_COUNT_PREFERENCE))
    if own and (len(own) == 1 or own[0] in _COUNT_PREFERENCE):
        return own[0]
    aliased = [k for k in _COUNT_PREFERENCE if getattr(config, k, None) == count]
    if not own and aliased:
        return aliased[0]
    raise UnsupportedModelError(
        f"cannot tell which field of the {config.model_type} config holds the expert count {count} "
        f"(candidates: {own or 'none'})"
    )


def _width_field(config, width: int) -> str:
    fields = [
        k
        for k, v in vars(config).items()
        if isinstance(v, int)
        and not isinstance(v, bool)
        and v == width
        and any(w in k for w in _WIDTH_WORDS)
        and "shared" not in k
        and "dense" not in k
    ]
    fields.sort(key=lambda k: (not ("moe" in k or "expert" in k), k))
    if not fields:
        raise UnsupportedModelError(
            f"cannot find the field of the {config.model_type} config holding the expert width {width}"
        )
    return fields[0]


def _count_attrs(modules: list[nn.Module], count: int) -> tuple[str, ...]:
    names: list[str] = []
    for module in modules:
        for attr, value in vars(module).items():
            if (
                attr.startswith("_")
                or isinstance(value, bool)
                or value != count
                or not isinstance(value, int)
            ):
                continue
            if (
                "expert" in attr or (attr == "out_features" and isinstance(module, nn.Linear))
            ) and attr not in names:
                names.append(attr)
    return tuple(names)


def _takes_routing(experts: nn.Module) -> bool:
    params = list(inspect.signature(experts.forward).parameters)
    return len(params) >= 3


def discover_spec(model: nn.Module) -> FamilySpec:
    """The FamilySpec of a transformers MoE model, read off the instance (meta tensors suffice).

    Kept for the process by the instance's structure (`_structure_key`): another instance built
    the same way (the same class, config, modules, tensor shapes and plain attributes) has the
    same spec, and discovery (a probe of the router, transformers' save-time conversion on meta
    tensors, two meta builds) cost 20-40 ms a model: a tenth of the test suite's time, which
    builds thousands of tiny models. A refusal is not kept (it is raised each time)."""
    key = _structure_key(model)
    if key is None:
        return _discover(model)
    spec = _DISCOVERED.get(key)
    if spec is None:
        if len(_DISCOVERED) >= _DISCOVERED_MAX:
            _DISCOVERED.clear()
        spec = _DISCOVERED[key] = _discover(model)
    return spec


_DISCOVERED: dict[tuple, FamilySpec] = {}
_DISCOVERED_MAX = 4096


def _structure_key(model: nn.Module) -> tuple | None:
    """Everything discovery reads of an instance: its class and config, each module's name, class
    and plain attributes, and each tensor's name, shape, dtype and device. None (not kept) when a
    module's forward was replaced on the instance itself."""
    modules = []
    for name, module in model.named_modules():
        own = vars(module)
        if "forward" in own:
            return None
        plain = tuple(
            sorted((k, v) for k, v in own.items() if type(v) in (int, float, bool, str, type(None)))
        )
        modules.append((name, type(module), plain))
    tensors = tuple(
        (name, tuple(t.shape), t.dtype, t.device.type)
        for name, t in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
    )
    return type(model), _config_key(model.config), tuple(modules), tensors


def _discover(model: nn.Module) -> FamilySpec:
    config = text_config(model.config)
    # the family is the whole model's type (a multimodal wrapper's, whose language model it prunes)
    model_type = str(getattr(model.config, "model_type", None) or getattr(config, "model_type", ""))
    found = find_decoder_layers(model)
    if found is None:
        raise UnsupportedModelError(f"cannot find the decoder layers of {type(model).__name__}")
    stacks = [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and moe_blocks(mod)
    ]
    if len(stacks) > 1:
        raise UnsupportedModelError(
            f"{type(model).__name__} holds routed experts in several layer stacks ({', '.join(stacks)}): "
            "not supported (moeprune prunes one decoder stack)"
        )
    blocks = moe_blocks(found[1])
    if not blocks:
        raise UnsupportedModelError(no_moe_message(model_type, names_experts(config)))
    paths = {path for _, path, _ in blocks}
    if len(paths) != 1:
        raise UnsupportedModelError(
            f"{model_type}: MoE blocks sit at different places in its layers ({sorted(paths)})"
        )
    _, block_attr, block = learned_block(blocks, model_type)
    experts = cast(nn.Module, block.experts)  # moe_blocks found it
    hidden = int(config.hidden_size)
    count, carried = _expert_count(experts)  # carried: extra rows on the experts' own tensors
    layout = _layout(experts, hidden)
    override = OVERRIDES.get(model_type) or OVERRIDES.get(getattr(config, "model_type", ""), {})
    if not _takes_routing(experts) and not override.get("weight_on_input"):
        raise UnsupportedModelError(
            f"{type(experts).__name__}.forward takes no routing indices (it runs every expert): not supported yet"
        )
    router_attr, weight_path, extra = find_router(block, count, hidden, carried)
    router = getattr(block, router_attr)
    index_position, scored = (
        (2, None)
        if override.get("weight_on_input")
        else router_index_position(router, weight_path, count, extra)
    )
    # extra experts the router selects (its logits span them) are computed by the experts module
    # (LongCat's identity); when the router could not be asked, its experts' extra rows say so
    if extra and scored is None and not carried:  # a wider matrix that is no router (Zaya's MLP gate)
        raise UnsupportedModelError(no_router_message(block, count, hidden))
    extra_routed = bool(extra) and (scored == count + extra if scored is not None else True)
    router_tensors = per_expert_tensors(router, count, recurse=True, extra=extra)
    router_tensors.sort(key=lambda pd: pd[0] != weight_path)  # the [E, d] matrix first
    block_tensors = per_expert_tensors(block, count, recurse=False, extra=extra)
    selection = next(
        (
            p
            for p, _ in router_tensors + block_tensors
            if p not in (weight_path,) and p.rsplit(".", 1)[-1] != "bias"
        ),
        None,
    )
    shared = tuple(a for a, _ in block.named_children() if "shared" in a)
    down = _tensor(experts, "down_proj")
    width = int(down.shape[2] if layout in DOWN_IS_D_BY_I else down.shape[1])
    group = getattr(router, "num_group", None) or getattr(router, "n_group", None)
    spec = FamilySpec(
        model_type=model_type,
        block_attr=block_attr,
        router_attr=router_attr,
        count_field=_count_field(config, count),
        intermediate_field=_width_field(config, width),
        layout=layout,
        routing=_describe_routing(selection, group, extra, extra_routed),
        router_tensors=tuple(router_tensors),
        block_tensors=tuple(block_tensors),
        selection_bias=selection,
        shared_attrs=shared,
        group_routing=group is not None,
        layers=found[0],
        router_index_position=index_position,
        count_attrs=_count_attrs([block, router, experts], count),
        extra_experts=extra,
        extra_routed=extra_routed,
        total_count_attrs=_count_attrs([block, router, experts], count + extra) if extra else (),
    )
    spec = replace(spec, **disk_names(model, found[0], blocks, spec))
    if spec.disk_names_known and not names_agree(model, found[0], blocks, spec):
        spec = replace(spec, disk_names_known=False)
    if not spec.disk_names_known:  # moeprune's own format keeps transformers' internal names then
        spec = replace(spec, disk_expert_names=None, disk_renames=())
    shared_grows, others_grow = _width_followers(model, spec.intermediate_field, block_attr, blocks[0][0])
    if "shared_width_derived" not in override:
        spec = replace(spec, shared_width_derived=bool(shared) and shared_grows)
    spec = replace(spec, dense_width_derived=others_grow)
    return replace(spec, **override)


def _describe_routing(selection: str | None, group, extra: int = 0, routed: bool = False) -> str:
    text = "router's own top-k"
    if selection:
        text += f", per-expert {selection.rsplit('.', 1)[-1]}"
    if group:
        text += ", group-limited"
    if extra:
        kind = "zero (identity) experts it selects" if routed else "extra rows scored apart (never selected)"
        text += f", {kind}: {extra}, kept"
    return text


def no_moe_message(model_type: str, names_experts: bool = False) -> str:
    if names_experts:  # Doge's retrieval experts, JetMoE's attention experts
        return (
            f"model type {model_type!r} has experts, but no decoder layer holds them as a routed-experts module "
            "(3-D expert tensors beside a router, as transformers builds MoE blocks): not supported"
        )
    return (
        f"this model has no MoE layers (model type {model_type!r} has no routed-experts module in its decoder "
        "layers); moeprune prunes MoE models"
    )


def names_experts(config) -> bool:
    """Whether the config sets a positive expert count (the model means to have experts)."""
    return any(
        "expert" in k and "per_tok" not in k and isinstance(v, int) and not isinstance(v, bool) and v > 1
        for k, v in vars(config).items()
    )


def _width_followers(model: nn.Module, field: str, block_attr: str, index: int) -> tuple[bool, bool]:
    """(shared experts, other modules): whether their shapes follow the routed width field.
    The model is rebuilt on the meta device with that field doubled and compared: DeepSeek's
    shared expert is `n_shared_experts` routed widths; Jamba's dense MLP layers read the same
    field as its experts."""
    # a class is hashable: mypy checks nn.Module's instance __hash__ against lru_cache's Hashable
    return _probe_widths(type(model), _config_key(model.config), field, block_attr, index)  # type: ignore[arg-type]


def _config_key(config) -> str:
    """The config as the probe's cache key: every field but where it was loaded from, which builds
    nothing (the same model saved in two folders is probed once)."""
    fields = json.loads(config.to_json_string(use_diff=False))
    fields.pop("_name_or_path", None)
    return json.dumps(fields, sort_keys=True)


@lru_cache(maxsize=4096)  # a few KB each; the test suite probes ~100 families in a process
def _probe_widths(
    cls: type[PreTrainedModel], config_json: str, field: str, block_attr: str, index: int
) -> tuple[bool, bool]:
    config_class = _config_class(cls)
    if config_class is None:
        return False, False

    def shapes(cfg) -> tuple[list, list]:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built = cls._from_config(cfg)
        found = find_decoder_layers(built)
        assert found is not None  # (caught below, like any probe that fails)
        layers = found[1]
        blocks = moe_blocks(layers)
        block = layers[index].get_submodule(block_attr) if block_attr else layers[index]
        shared = [
            tuple(p.shape) for a, child in block.named_children() if "shared" in a for p in child.parameters()
        ]
        routed = {id(p) for _, _, b in blocks for p in cast(nn.Module, b.experts).parameters()}
        routed |= {
            id(p)
            for _, _, b in blocks
            for a, child in b.named_children()
            if "shared" in a
            for p in child.parameters()
        }
        others = [tuple(p.shape) for p in built.parameters() if id(p) not in routed]
        return shared, others

    try:
        config = config_class.from_dict(json.loads(config_json))
        shared, others = shapes(config)
        probe = copy.deepcopy(config)
        target = text_config(probe)
        setattr(target, field, 2 * getattr(target, field))
        shared2, others2 = shapes(probe)
        return shared2 != shared, others2 != others
    except Exception:  # noqa: BLE001 - a config that rejects the probe: assume independent widths
        return False, False


def _config_class(cls: type):
    return getattr(cls, "config_class", None)
