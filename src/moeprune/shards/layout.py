"""A safetensors checkpoint mapped onto its model's MoE layers, from the shard headers alone.

Checkpoint naming is not the in-memory naming. transformers 5 fuses the experts in memory
(`experts.gate_up_proj [E, 2I, d]`) but `save_pretrained` writes most families back in their hub
naming, one tensor per expert (`mlp.experts.3.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.3.w1.weight`), while gpt_oss and Llama-4 stay fused. Rather than a
table per family, every key goes through transformers' own load-time conversion
(`get_model_conversion_mapping`): its renamings and converter give the in-memory parameter the
key feeds, the converter's wildcard gives the expert number, and the position of the matching
source pattern gives the part (gate 0, up 1 of `gate_up_proj`). A naming transformers can load,
we can stream; a conversion beyond stacking experts and concatenating parts (transposes, other
quantizers' scales) is refused with a clear error instead of being guessed. Block-scaled fp8
checkpoints are read as they are stored: each `weight_scale_inv` goes with its weight. The renamings are applied with
`rename_source_key` (what loading itself calls, in every release from 5.16 on; the newer helper
`apply_renamings` is missing up to 5.19 at least). The model is only ever built on the meta
device (no storage), to find its MoE layers with the very rules of the adapter.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

from moeprune.checkpoint import (
    check_model_path,
    is_moeprune_format,
    load_config,
)
from moeprune.checkpoint.files import INDEX, SINGLE, StoredTensor, read_header, shard_names
from moeprune.checkpoint.quantized import coded_pairs, decoder, fp8_scales, logical_shape, quantization_format
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.adapter import MoELayer
from moeprune.models.classes import model_class
from moeprune.models.spec import FamilySpec
from moeprune.quant.fp8 import Fp8Format


# --------------------------------------------------------------------------- checkpoint naming
@dataclass(frozen=True)
class Address:
    """Where one checkpoint tensor goes in the model: its parameter, and for per-expert naming
    the expert number and the part (position among the converter's sources)."""

    internal: str
    expert: int | None = None
    part: int = 0
    cat_dim: int = 0  # dimension of one expert along which its parts are concatenated
    converted: bool = False  # a whole tensor that transformers reshapes or merges when loading


def _cat_dim(converter: WeightConverter) -> int:
    """Per-expert parts are stacked on dim 0 then (optionally) concatenated: the dim within one expert."""
    ops = list(converter.operations)
    stacked = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    rest = ops[1:]
    if stacked and not rest:
        return 0
    if stacked and len(rest) == 1 and isinstance(rest[0], Concatenate) and rest[0].dim >= 1:
        return rest[0].dim - 1
    raise MoePruneError(
        f"checkpoint conversion {converter!r} does more than stacking experts and concatenating parts; "
        "streaming cannot read this checkpoint: load the model instead"
    )


def _expert_number(pattern: str, renamed: str) -> int:
    pieces = pattern.split("*")
    match = re.search(r"(\d+)".join(pieces), renamed) if len(pieces) == 2 else None
    if match is None:
        raise MoePruneError(f"cannot find the expert number of {renamed!r} with pattern {pattern!r}")
    return int(match.group(1))


@dataclass(frozen=True)
class ExtraLayer:
    """A decoder layer a release stores beside the stack transformers builds (a multi-token-
    prediction layer): its stored key prefix, the number it gets after the stack's last layer
    (`index`: num_hidden_layers + its own number), and the stack layer whose MoE it is laid out
    like (`like`: its keys are read as that layer's, then given `index`)."""

    prefix: str  # "model.layers.61." (DeepSeek-V3, GLM-4.5), "mtp.layers.0." (Qwen3-Next), ...
    index: int
    like_prefix: str  # stored prefix of the stack layer it is read as ("model.layers.60.")
    like_internal: str  # that layer's in-memory prefix ("model.layers.60.")
    internal: str  # the in-memory prefix it is given ("model.layers.61.")
    root: str  # every stored key of the MTP module starts with it ("model.layers.61.", "mtp.")


# Qwen3-Next's mtp.layers.0., MiMo's model.mtp.layers.0., DeepSeek's reference naming mtp.0.
_MTP_STACK = re.compile(r"^((?:\w+\.)*?mtp\.(?:layers\.)?)(\d+)\.")
_NUMBERED = re.compile(r"^(.*?\.)(\d+)\.")


def extra_layers(keys: list[str], naming: Naming, stack: str, count: int, like: int) -> list[ExtraLayer]:
    """The multi-token-prediction layers a checkpoint stores beyond its `count` stack layers, read
    off the stored keys: layers numbered past the stack's last one under the stack's own prefix
    (DeepSeek-V3 and GLM-4.5 store their MTP layer as `model.layers.{num_hidden_layers}`), or an
    `mtp.layers.{i}` list (Qwen3-Next, Qwen3.5, MiMo, DeepSeek-V4). Each is read as stack layer
    `like` (the last MoE layer: the MTP layer is a decoder layer of the same kind)."""
    like_internal = f"{stack}.{like}."
    stored_stack = None
    for key in keys:
        match = _NUMBERED.match(key)
        if match and int(match.group(2)) == like and naming.address(key).internal.startswith(like_internal):
            stored_stack = match.group(1)
            break
    if stored_stack is None:
        return []
    found: dict[str, tuple[int, str]] = {}
    for key in keys:
        match = _MTP_STACK.match(key)
        if match:
            found.setdefault(
                match.group(0), (count + int(match.group(2)), match.group(1).removesuffix("layers."))
            )
        elif key.startswith(stored_stack):
            number = key[len(stored_stack) :].split(".", 1)[0]
            if number.isdigit() and int(number) >= count:
                found.setdefault(f"{stored_stack}{number}.", (int(number), f"{stored_stack}{number}."))
    return [
        ExtraLayer(prefix, index, f"{stored_stack}{like}.", like_internal, f"{stack}.{index}.", root)
        for prefix, (index, root) in sorted(found.items(), key=lambda item: item[1][0])
    ]


class Naming:
    """transformers' own load-time conversion of checkpoint keys, asked one key at a time.

    Keys of a release's extra layers (`extras`: multi-token-prediction layers transformers does
    not build) are read as the keys of the stack layer they are laid out like, then given their
    own layer number: `mtp.layers.0.mlp.experts.3.gate_proj.weight` of a 48-layer Qwen3-Next is
    expert 3's gate of `model.layers.48.mlp.experts.gate_up_proj`."""

    def __init__(self, model: torch.nn.Module, extras: tuple[ExtraLayer, ...] = ()):
        assert isinstance(model, PreTrainedModel), "transformers' conversion mapping is a PreTrainedModel's"
        transforms = get_model_conversion_mapping(model)
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.extras = extras

    def address(self, key: str) -> Address:
        extra = next((e for e in self.extras if key.startswith(e.prefix)), None)
        if extra is not None:
            addr = self._address(extra.like_prefix + key[len(extra.prefix) :])
            if addr.internal.startswith(extra.like_internal):
                return replace(addr, internal=extra.internal + addr.internal[len(extra.like_internal) :])
            return addr
        return self._address(key)

    def _address(self, key: str) -> Address:
        renamed, _ = rename_source_key(key, self.renamings, [])  # renamings only, in order
        for converter in self.converters:  # at most one converter applies, as when loading
            internal, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                if pattern.count("*") != 1:  # a whole tensor converted, not one expert's piece
                    return Address(internal, converted=bool(converter.operations))
                part = converter.source_patterns.index(pattern)
                return Address(internal, _expert_number(pattern, renamed), part, _cat_dim(converter))
        return Address(renamed)

    def renumber(self, key: str, new: int) -> str:
        """`key` with its expert number replaced by `new`: the dotted component whose change moves
        the expert (not, say, the layer number that happens to be equal)."""
        old = self.address(key)
        if old.expert == new:
            return key
        parts = key.split(".")
        for i, part in enumerate(parts):
            if part == str(old.expert):
                candidate = ".".join([*parts[:i], str(new), *parts[i + 1 :]])
                moved = self.address(candidate)
                if moved.expert == new and (moved.internal, moved.part) == (old.internal, old.part):
                    return candidate
        raise MoePruneError(f"cannot renumber expert {old.expert} in checkpoint key {key!r}")


# --------------------------------------------------------------------------- layer layouts
@dataclass
class ExpertParam:
    """One fused expert parameter of the model (gate_up_proj, down_proj, biases) as stored on disk."""

    internal: str
    shape: tuple[int, ...]  # in-memory shape [E, ...]
    fused: str | None = None  # key of the whole [E, ...] tensor
    parts: dict[int, dict[int, str]] = field(default_factory=dict)  # expert -> part -> key
    cat_dim: int = 0
    scales: dict[str, str] = field(default_factory=dict)  # fp8 weight key -> its weight_scale_inv key
    # rows past the weighted experts' that the model sizes the parameter for (LongCat-Flash's
    # gate_up_proj holds its zero experts' rows too, never computed), and how many are stored
    # (transformers' save writes them, the release does not)
    extra_rows: int = 0
    extra_stored: int = 0

    def keys(self, expert: int) -> list[str]:
        return [self.parts[expert][p] for p in sorted(self.parts[expert])]


@dataclass
class LayerLayout:
    """Where one MoE layer's experts and router live in the checkpoint."""

    index: int
    spec: FamilySpec
    num_experts: int
    experts: dict[str, ExpertParam]  # by parameter name on the experts module
    router: dict[str, tuple[str, int]]  # router tensor path -> (checkpoint key, expert dim)
    fp8: Fp8Format | None = None  # the checkpoint's block-scaled fp8 format, when it has one
    # codes key -> (companion keys, the function decoding codes + companions): mxfp4, compressed-tensors
    coded: dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor]]] = field(default_factory=dict)


def meta_model(path: str | Path, config: PretrainedConfig | None = None) -> MoEModel:
    """The checkpoint's model on the meta device (allocates nothing), seen through the adapter.

    Its layers give the MoE layer indices, expert counts, top-k and routing groups the plan and
    allocation code need (`pipeline.build_plan` accepts it), with the same rules as a loaded model.
    """
    quantization_format(path)  # a quantization moeprune cannot read is refused before anything else
    config = config or load_config(path)
    with torch.device("meta"):
        model = model_class(config)._from_config(config)
    return MoEModel(model)


class CheckpointLayout:
    """A checkpoint folder mapped onto its model's MoE layers, without reading any weight.

    In a block-scaled fp8 checkpoint (`fp8`), `scales` maps every fp8 weight key to its
    `weight_scale_inv` key; the scales are not model parameters, so they have no address and
    travel with their weight (read to dequantize it, copied with it when experts are dropped).
    """

    def __init__(self, path: str | Path):
        self.path = check_model_path(path)
        if is_moeprune_format(self.path):
            raise MoePruneError(
                f"{str(self.path)!r} is in moeprune's own format (per-layer expert counts); streaming reads stock "
                "checkpoints: load it with moeprune.load_pretrained instead"
            )
        fmt = self.fmt = quantization_format(self.path)
        self.fp8 = fmt if isinstance(fmt, Fp8Format) else None
        self.config = load_config(self.path)
        self.moe = meta_model(self.path, self.config)
        files = shard_names(self.path)
        if not files:
            raise MoePruneError(
                f"{str(self.path)!r} has no safetensors weights ({SINGLE} or {INDEX}); checkpoint streaming reads "
                "safetensors only: load the model instead"
            )
        self.index = json.loads((self.path / INDEX).read_text()) if (self.path / INDEX).is_file() else None
        self.tensors: dict[str, StoredTensor] = {}
        self.file_metadata: dict[str, dict[str, str]] = {}
        for name in files:
            tensors, self.file_metadata[name] = read_header(self.path / name)
            self.tensors.update(tensors)
        plain_or_fp8 = fmt is None or isinstance(fmt, Fp8Format)  # other formats pair their own tensors
        self.scales = fp8_scales(self.path, self.tensors, self.fp8) if plain_or_fp8 else {}
        # mxfp4 and compressed-tensors: the codes stand for the parameter, their companions (scales,
        # shapes, zero points) travel with them and are never addresses of their own
        pairs = coded_pairs(self.path, self.tensors, fmt)
        self.companions = {stored[0]: stored[1:] for stored in pairs.values()}  # codes key -> the others
        self.coded = {stored[0]: base for base, stored in pairs.items()}  # codes key -> model key
        self.shapes = {codes: logical_shape(fmt, codes, self.tensors[codes]) for codes in self.coded}
        scale_keys = set(self.scales.values()) | {k for others in self.companions.values() for k in others}
        last = self.moe.layers[-1]
        stored_keys = [self.coded.get(k, k) for k in self.tensors if k not in scale_keys]
        self.extras = tuple(
            extra_layers(
                stored_keys,
                Naming(self.moe.model),
                last.spec.layers,
                int(self.config.get_text_config().num_hidden_layers),
                last.index,
            )
        )
        self.naming = Naming(self.moe.model, self.extras)
        self.addresses = {
            key: self.naming.address(self.coded.get(key, key))
            for key in self.tensors
            if key not in scale_keys
        }
        self.stored_as: dict[str, list[str]] = defaultdict(list)  # in-memory name -> checkpoint keys
        for key, addr in self.addresses.items():
            self.stored_as[addr.internal].append(key)
        blocks = {id(m): name for name, m in self.moe.model.named_modules()}
        self.layers = [self._layout(layer, blocks[id(layer.block)]) for layer in self.moe.layers]
        # the MTP layers' MoE, laid out like the last stack layer's (those holding experts)
        like = blocks[id(last.block)]
        self.extra_layers = [
            self._layout(last, extra.internal + like[len(extra.like_internal) :], extra.index)
            for extra in self.extras
            if any(
                a.internal.startswith(extra.internal) and a.expert is not None
                for a in self.addresses.values()
            )
        ]
        self.roles = {  # in-memory name -> (layer, expert dim) of every per-expert tensor
            **{p.internal: (lay.index, 0) for lay in self.all_layers for p in lay.experts.values()},
            **{
                self.addresses[key].internal: (lay.index, dim)
                for lay in self.all_layers
                for key, dim in lay.router.values()
            },
        }
        self._check_unknown_expert_tensors()

    def ignored_keys(self) -> list[str]:
        """Stored keys the model class declares it skips on load (`_keys_to_ignore_on_load_unexpected`:
        a vision tower under a text-only config, say), but the MTP layers' (pruned and kept apart)."""
        patterns = [
            re.compile(p)
            for p in getattr(type(self.moe.model), "_keys_to_ignore_on_load_unexpected", None) or []
        ]
        roots = tuple(extra.root for extra in self.extras)
        return sorted(
            key
            for key in self.addresses
            if any(p.search(key) for p in patterns) and not (roots and key.startswith(roots))
        )

    @property
    def all_layers(self) -> list[LayerLayout]:
        """The stack's MoE layers, then the release's extra (MTP) layers holding experts."""
        return self.layers + self.extra_layers

    def _layout(self, layer: MoELayer, block: str, index: int | None = None) -> LayerLayout:
        """Where `layer`'s experts and router are stored; with `index`, those of the extra layer
        of that number laid out like `layer`, its block at `block`."""
        n, extra = layer.num_experts, layer.spec.extra_experts
        params = {
            name: ExpertParam(f"{block}.experts.{name}", tuple(p.shape), extra_rows=p.shape[0] - n)
            for name, p in layer.experts.named_parameters(recurse=False)
            if p.dim() >= 1 and p.shape[0] in (n, n + extra)
        }
        for param in params.values():
            for key in self.stored_as.get(param.internal, ()):
                addr = self.addresses[key]
                if addr.converted:
                    raise MoePruneError(
                        f"checkpoint {self.path} stores {param.internal} as {key}, which transformers converts "
                        "when loading; streaming reads stored bytes as they are: load the model instead"
                    )
                if addr.expert is None:
                    param.fused = key
                else:
                    param.parts.setdefault(addr.expert, {})[addr.part] = key
                    param.cat_dim = addr.cat_dim
                if key in self.scales:
                    param.scales[key] = self.scales[key]
            self._check_param(param, n)
        router = {}
        # the routing tensors the layer holds (a hash router, kept whole, has no selection bias)
        routing = [
            (f"{layer.spec.router_attr}.{p}" if owner is layer.router else p, d)
            for owner, p, d in layer.routing_tensors()
        ]
        for path, dim in routing:
            internal = f"{block}.{path}"
            keys = self.stored_as.get(internal)
            if not keys:
                raise MoePruneError(f"checkpoint {self.path} has no tensor for router parameter {internal}")
            router[path] = (keys[0], dim)
        param_keys = {
            k
            for p in params.values()
            for k in ([p.fused] if p.fused else [k for e in p.parts for k in p.keys(e)])
        }
        coded = {
            k: (self.companions[k], decoder(self.fmt, self.coded[k]))
            for k in param_keys
            if k in self.companions
        }
        return LayerLayout(
            layer.index if index is None else index, layer.spec, n, params, router, self.fp8, coded
        )

    def _check_param(self, param: ExpertParam, n: int) -> None:
        total = n + param.extra_rows
        if param.fused is not None:
            got = self.shape_of(param.fused)
        elif sorted(param.parts) in (list(range(n)), list(range(total))):
            param.extra_stored = len(param.parts) - n  # the release stores the weighted experts only
            got = (total, *self.expert_shape(param, 0))
            if any(self.expert_shape(param, e) != got[1:] for e in param.parts):
                got = ()  # experts of different shapes
        else:
            raise MoePruneError(
                f"checkpoint {self.path} does not hold all {n} experts of {param.internal} "
                f"(found experts {sorted(param.parts)})"
            )
        if tuple(got) != param.shape:
            raise MoePruneError(
                f"checkpoint {self.path}: {param.internal} is stored as {list(got)}, the config expects "
                f"{list(param.shape)}; is config.json the one of these weights?"
            )

    def shape_of(self, key: str) -> tuple[int, ...]:
        """The shape of the parameter a stored tensor holds (quantized codes: what they decode to)."""
        return self.shapes.get(key, self.tensors[key].shape)

    def expert_shape(self, param: ExpertParam, expert: int) -> tuple[int, ...]:
        """Shape of one expert's slice of `param`, once its parts are concatenated."""
        shapes = [self.shape_of(k) for k in param.keys(expert)]
        d = param.cat_dim
        return (*shapes[0][:d], sum(s[d] for s in shapes), *shapes[0][d + 1 :])

    def _check_unknown_expert_tensors(self) -> None:
        """Refuse per-expert tensors the model has no parameter for (quantization scales...)."""
        prefixes = [
            p.internal.rsplit(".", 1)[0] + "." for lay in self.all_layers for p in lay.experts.values()
        ]
        under = re.compile("|".join(re.escape(p) for p in set(prefixes)))
        for key, addr in self.addresses.items():
            if under.match(addr.internal) and addr.internal not in self.roles:
                raise MoePruneError(
                    f"checkpoint tensor {key!r} belongs to routed experts but matches no parameter of the model "
                    "(a quantized checkpoint?); streaming handles plain floating-point checkpoints: load the model instead"
                )
