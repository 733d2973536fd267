"""Layer-by-layer observation for models that do not fit in memory (``--sequential``).

The model is built on the meta device (no weights). One pass of the model's own forward, with every
decoder layer replaced by a recorder, captures what each layer receives for every calibration batch:
the hidden states entering the first layer and the exact call arguments of each layer (attention
mask of that layer's type, rotary position embeddings, position ids). The masks and embeddings thus
come from the family's own code (``create_causal_mask``, sliding-window, chunked and linear-attention
masks picked by ``config.layer_types``), not from a re-implementation. Then each decoder layer in
turn is materialised from the safetensors shards (only its keys, converted to the in-memory fused
layout by transformers' own conversion mapping), run over the cached hidden states of every batch
with moeprune's routed computation recording statistics, and sent back to the meta device.

Memory: one decoder layer's weights (transiently up to about three copies while transformers fuses
the per-expert tensors; the embedding only during the capture pass) and the cached
activations: for each batch, ``B * L * d`` hidden values in the model dtype, its masks (sdpa:
``B * L * L`` bytes per distinct layer type, often none without padding) and rotary tables
(``2 * L * head_dim`` values). With ``offload_dir`` the activations live on disk instead and only
one batch is in memory at a time.
"""

from __future__ import annotations

import ctypes
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    convert_and_load_state_dict_in_model,
    rename_source_key,
)
from transformers.modeling_utils import LoadStateDictConfig
from transformers.utils import logging as hf_logging

from moeprune.checkpoint import build_skeleton, check_model_path
from moeprune.checkpoint.load import read_activations
from moeprune.checkpoint.quantized import QuantizedSources
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel, decoder_layers
from moeprune.models.routed import RoutedOptions, override_routed
from moeprune.observe.distributed import data_parallel
from moeprune.observe.kinds import DEFAULT, Statistic
from moeprune.observe.observer import _Accumulator, asked
from moeprune.observe.stats import ExpertStats, LayerStats
from moeprune.runtime.device import Placement
from moeprune.runtime.finite import NonFiniteError, check_finite_weights, first_nonfinite_output
from moeprune.runtime.progress import progress_bar

OUTER = -1  # group id of the weights outside the decoder layers


@dataclass
class _Call:
    """One decoder layer call: everything but the hidden states (shared tensors across layers)."""

    args: tuple
    kwargs: dict


@dataclass
class _Captured:
    """One calibration batch as the decoder layers see it."""

    hidden: torch.Tensor  # [B, L, d] input of the next layer to run
    calls: list[_Call]  # per decoder layer
    valid: torch.Tensor  # [B*L] bool, non-padding rows


class _Stop(Exception):
    """Raised by the recorder of the last needed layer: nothing after it has weights."""


class _BatchStore:
    """Captured batches in memory, or on disk (one file per batch) when `directory` is given."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        self.items: list[_Captured | None] = []

    def __len__(self) -> int:
        return len(self.items)

    def append(self, item: _Captured) -> None:
        if self.directory is None:
            self.items.append(item)
            return
        index = len(self.items)
        self.items.append(None)
        torch.save({"calls": item.calls, "valid": item.valid}, self.directory / f"calls-{index}.pt")
        self.set_hidden(index, item.hidden)

    def get(self, index: int, device: torch.device) -> _Captured:
        if self.directory is None:
            return self.items[index]
        calls = torch.load(self.directory / f"calls-{index}.pt", map_location=device, weights_only=False)
        hidden = torch.load(self.directory / f"hidden-{index}.pt", map_location=device, weights_only=True)
        return _Captured(hidden, calls["calls"], calls["valid"])

    def set_hidden(self, index: int, hidden: torch.Tensor) -> None:
        if self.directory is None:
            self.items[index].hidden = hidden
        else:
            torch.save(hidden.cpu(), self.directory / f"hidden-{index}.pt")


# --------------------------------------------------------------------------- weights


class _Shards:
    """Which safetensors keys feed which decoder layer, after transformers' key conversion."""

    def __init__(self, path: Path, model: nn.Module):
        self.path = path
        self.sources = QuantizedSources.of(path)  # quantized weights are dequantized as they are read
        self.mapping = get_model_conversion_mapping(model)
        renamings = [m for m in self.mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in self.mapping if isinstance(m, WeightConverter)]
        targets = model.state_dict()
        layer_of = _layer_prefixes(model)
        skipped = _output_prefixes(model)
        self.groups: dict[int, dict[str, list[str]]] = {}  # group -> file -> keys
        if not self.sources.tensors:
            raise MoePruneError(
                f"{path} has no safetensors weights; layer-by-layer observation reads safetensors checkpoints only",
                options=("sequential",),
            )
        for key, file in self.sources.weight_keys().items():  # a quantized weight: its model key
            target = _target_key(key, renamings, converters, model.base_model_prefix, targets)
            if target is None or target.startswith(skipped):
                continue
            group = next((i for p, i in layer_of.items() if target.startswith(p)), OUTER)
            self.groups.setdefault(group, {}).setdefault(file, []).append(key)

    def load(self, model: nn.Module, group: int, device: torch.device, dtype: torch.dtype) -> None:
        """Materialise one group's weights in `model` (converted exactly as from_pretrained would)."""
        files = self.groups.get(group, {})
        with ExitStack() as stack:
            state = self.sources.sources([k for keys in files.values() for k in keys], stack)
            config = LoadStateDictConfig(
                device_map={"": device},
                dtype=dtype,
                dtype_plan=model._get_dtype_plan(dtype),
                weight_mapping=self.mapping,
            )
            with _quiet_transformers():
                info, _ = convert_and_load_state_dict_in_model(model, state, config)
        if info.mismatched_keys or info.conversion_errors:
            raise MoePruneError(
                f"{self.path}: weights do not match the model ({sorted(info.mismatched_keys)[:3]} "
                f"{list(info.conversion_errors)[:3]})"
            )


def _target_key(key: str, renamings, converters, prefix: str, targets: dict) -> str | None:
    """The model parameter a checkpoint key loads into (None: not part of this model)."""
    renamed, _ = rename_source_key(key, renamings, converters, prefix, targets)
    if renamed not in targets and key in targets:  # transformers' own fallback
        renamed = key
    return renamed if renamed in targets else None


def _layer_prefixes(model: nn.Module) -> dict[str, int]:
    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(layer)]}.": i for i, layer in enumerate(decoder_layers(model))}


def _output_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The LM head: never run during observation, and as large as the embedding."""
    head = model.get_output_embeddings()
    if head is None or head is model.get_input_embeddings():
        return ()
    return tuple(f"{n}." for n, m in model.named_modules() if m is head)


def _materialise_buffers(model: nn.Module, module: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary inv_freq) are not in checkpoints: recompute them as loading does.

    Call before loading the weights: `_init_weights` may also initialise the owner's parameters.
    """
    for owner in module.modules():
        meta = [n for n, b in owner.named_buffers(recurse=False) if b is not None and b.is_meta]
        if not meta:
            continue
        for name in meta:
            owner._buffers[name] = torch.zeros_like(owner._buffers[name], device=device)  # never garbage
        try:
            model._init_weights(owner)
        except AttributeError:  # a multimodal wrapper's init reads fields only its text config has
            _text_model(model, module)._init_weights(owner)


def _text_model(model: nn.Module, module: nn.Module) -> nn.Module:
    """The innermost transformers model holding `module` (the language model inside a wrapper)."""
    holders = [
        m for m in model.modules() if hasattr(m, "_init_weights") and any(x is module for x in m.modules())
    ]
    return holders[-1]


def _prefix(model: nn.Module, module: nn.Module) -> str:
    """The dotted name of `module` inside `model`, with a trailing dot ("model.layers.3.")."""
    name = next(n for n, m in model.named_modules() if m is module)
    return f"{name}." if name else ""


def _release_memory() -> None:
    """Give freed layer weights back to the OS.

    glibc keeps freed heap blocks (and per-thread arenas of the parallel loader); without a trim
    the resident size grows by about one layer per layer although the live tensors do not. (No
    gc.collect: nothing here is held by reference cycles, and it costs ~0.3 s per layer.)
    """
    with suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _check_materialised(module: nn.Module, what: str) -> None:
    missing = [n for n, p in module.named_parameters() if p.is_meta]
    missing += [n for n, b in module.named_buffers() if b.is_meta]
    if missing:
        raise MoePruneError(f"the checkpoint has no weights for {what}: {missing[:5]}")


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No per-layer "Loading weights" bars and load reports."""
    bars = hf_logging.is_progress_bar_enabled()
    level = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------- capture


@contextmanager
def _recording(
    layers: list[nn.Module], calls: list[_Call], first_hidden: list[torch.Tensor]
) -> Iterator[None]:
    """Replace each layer's forward by one that records its call and passes the hidden states on."""
    last = len(layers) - 1

    def recorder(index: int):
        def forward(*args, **kwargs):
            hidden = args[0] if args else kwargs.pop("hidden_states")
            if index == 0:
                first_hidden.append(hidden)
            calls.append(_Call(tuple(args[1:]), kwargs))
            if index == last:
                raise _Stop
            return hidden

        return forward

    for i, layer in enumerate(layers):
        layer.forward = recorder(i)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _capture(model: nn.Module, layers: list[nn.Module], batch, device: torch.device) -> _Captured:
    """Embeddings and per-layer call arguments of one batch, from the model's own forward."""
    calls: list[_Call] = []
    first: list[torch.Tensor] = []
    mask = batch.attention_mask.to(device)
    try:
        with _recording(layers, calls, first), suppress(_Stop):
            model(input_ids=batch.input_ids.to(device), attention_mask=mask, use_cache=False)
    except MoePruneError:
        raise  # moeprune's own refusal from inside the forward, already one clear line
    except (ValueError, TypeError) as exc:  # the model's loop wanted more back than the hidden states
        raise MoePruneError(
            f"{type(model).__name__} passes more than the hidden states from one decoder layer to the next "
            f"({str(exc).strip().splitlines()[0]}), so its layers cannot be run one at a time: drop "
            "--sequential and load the model"
        ) from exc
    if len(calls) != len(layers):
        raise MoePruneError(f"{type(model).__name__} did not call its decoder layers in order")
    return _Captured(first[0], calls, mask.reshape(-1).bool())


def _run_layer(layer: nn.Module, item: _Captured, index: int) -> torch.Tensor:
    call = item.calls[index]
    out = layer(item.hidden, *call.args, **call.kwargs)
    return out[0] if isinstance(out, tuple) else out


# --------------------------------------------------------------------------- observer


@dataclass(frozen=True)
class SequentialOptions:
    """Where a layer-by-layer pass keeps things: each decoder layer runs on `placement` (its device
    and dtype; `device_map` does not apply, one layer is on one device), and the captured
    activations stay in memory, or with `offload_dir` on disk in a temporary folder inside it,
    for calibration sets whose hidden states do not fit. `statistics`: the kinds it records
    (observe/kinds.py), as `observe(statistics=...)`."""

    placement: Placement = Placement(torch.device("cpu"), torch.float32)
    offload_dir: str | Path | None = None
    statistics: frozenset[Statistic] = DEFAULT


def observe_sequential(
    checkpoint_path: str | Path,
    data: CalibrationData,
    *,
    batch_size: int = 8,
    neurons: bool = False,
    pad_token_id: int = 0,
    options: SequentialOptions | None = None,
    progress: bool = True,
    domain: str = "",
) -> ExpertStats:
    """The statistics `observe` returns (the same kinds asked the same way), holding one decoder
    layer's weights at a time.

    `options` says where layers run and where the cached activations live (SequentialOptions).
    """
    options = options or SequentialOptions()
    offload_dir = options.offload_dir
    path = check_model_path(checkpoint_path)
    device, dtype = torch.device(options.placement.device), options.placement.dtype
    start = time.perf_counter()
    model = build_skeleton(path, dtype, meta=True).eval()
    read_activations(model, path)  # fp8-dynamic inputs quantized, fp8 experts held as the library does
    data.check_vocabulary(model)
    moe = MoEModel(model)
    layers = list(decoder_layers(model))[: max(m.index for m in moe.layers) + 1]
    run = _Pass(model, layers, _Shards(path, model), device, dtype, progress)
    if offload_dir:
        Path(offload_dir).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="moeprune-acts-", dir=offload_dir)) if offload_dir else None
    try:
        with torch.no_grad():
            store, tokens = _capture_all(run, data, batch_size, pad_token_id, scratch)
            stats = _observe_layers(run, moe, store, asked(options.statistics, neurons))
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    note = f"observed {tokens} tokens layer by layer in {time.perf_counter() - start:.1f}s"
    return ExpertStats.from_pass(stats, tokens, data, domain, note)


@dataclass(frozen=True)
class _Pass:
    """What both phases of one layer-by-layer pass (capture, then each layer) share."""

    model: nn.Module  # on the meta device but for the part being run
    layers: list[nn.Module]  # the decoder layers up to the last MoE layer
    shards: _Shards
    device: torch.device
    dtype: torch.dtype
    progress: bool


def _outer_modules(model: nn.Module) -> list[nn.Module]:
    """The modules around the decoder layers (embedding, rotary, norm): the base model's children
    but the layers, and where the layers sit deeper (a multimodal wrapper's decoder is a causal LM
    holding the backbone), the children of every module on the way down to them. Never a module
    that holds the layers: its buffers would be materialised, and checked, before theirs load."""
    container = decoder_layers(model)
    outer: list[nn.Module] = []
    module: nn.Module | None = model.get_decoder() if hasattr(model, "get_decoder") else model
    while module is not None:
        holder = None
        for child in module.children():
            if child is container:
                continue
            if any(m is container for m in child.modules()):
                holder = child
            else:
                outer.append(child)
        module = holder
    return outer


def _capture_all(run: _Pass, data: CalibrationData, batch_size: int, pad_token_id: int, scratch: Path | None):
    """Load the outer weights, capture every batch's layer inputs, then free the outer weights."""
    model, layers, shards, device, dtype = run.model, run.layers, run.shards, run.device, run.dtype
    progress = run.progress
    outer = _outer_modules(model)
    for module in outer:
        _materialise_buffers(model, module, device)
    shards.load(model, OUTER, device, dtype)
    _check_materialised(model.get_input_embeddings(), "the input embedding")
    for module in outer:
        check_finite_weights(module, f"{shards.path}", prefix=_prefix(model, module))
    store = _BatchStore(scratch)
    tokens = 0
    total = (len(data.samples) + batch_size - 1) // batch_size
    batches = data.batches(batch_size, pad_token_id)
    for batch in progress_bar(batches, total=total, desc="observe (inputs)", unit="batch", enabled=progress):
        store.append(_capture(model, layers, batch, device))
        tokens += int(batch.attention_mask.sum())
    for module in outer:
        module.to("meta")
    _release_memory()
    return store, tokens


def _observe_layers(
    run: _Pass, moe: MoEModel, store: _BatchStore, statistics: frozenset[Statistic]
) -> list[LayerStats]:
    model, layers, shards, device, dtype = run.model, run.layers, run.shards, run.device, run.dtype
    progress = run.progress
    acc = _Accumulator(moe, statistics)
    if not len(store):  # e.g. a torchrun rank without batches: nothing to load
        return [acc.stats[m.index] for m in moe.layers]
    for stats in acc.stats.values():
        stats.to(device)
    options = RoutedOptions(on_layer=acc, need_intermediate=acc.neurons)
    with override_routed(moe, options):
        for index in progress_bar(
            range(len(layers)), desc="observe (layers)", unit="layer", enabled=progress
        ):
            layer = layers[index]
            _materialise_buffers(model, layer, device)
            shards.load(model, index, device, dtype)
            _check_materialised(layer, f"decoder layer {index}")
            check_finite_weights(layer, f"{shards.path}", prefix=_prefix(model, layer))
            last = index == len(layers) - 1
            for b in range(len(store)):
                item = store.get(b, device)
                acc.set_valid(item.valid)
                try:
                    out = _run_layer(layer, item, index)
                    acc.check_finite()
                except NonFiniteError as exc:
                    name = first_nonfinite_output(layer, partial(_run_layer, layer, item, index))
                    where = f"decoder layer {index} ({_prefix(model, layer)}{name})" if name else ""
                    raise exc.located(where) from None
                if not last:
                    store.set_hidden(b, out)
            layer.to("meta")
            _release_memory()
    for stats in acc.stats.values():
        stats.to("cpu")
    return [acc.stats[m.index] for m in moe.layers]


def observe_sequential_distributed(
    checkpoint_path: str | Path, data: CalibrationData, *, batch_size: int = 8, **observe_kwargs
) -> ExpertStats:
    """`observe_sequential` (one layer in memory per rank) split over torchrun ranks, reduced exactly."""
    return data_parallel(observe_sequential, checkpoint_path, data, batch_size, observe_kwargs)
