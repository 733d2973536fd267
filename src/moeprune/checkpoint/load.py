"""Loading checkpoints: stock ones through transformers, moeprune's own through its structure.

Nothing here runs a checkpoint's own Python: transformers is always asked with
`trust_remote_code=False` (it then refuses instead of prompting on stdin), unless the caller
passes True. A weight that was not read is an error naming it, never a random initialisation:
stock loads are checked with transformers' loading report, moeprune-format loads fill every
tensor of the model from the file by name and refuse anything missing or unexpected.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import cast

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import convert_and_load_state_dict_in_model
from transformers.initialization import no_init_weights
from transformers.modeling_utils import LoadStateDictConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.utils import logging as hf_logging

from moeprune.checkpoint import files, structure
from moeprune.checkpoint.names import beside_stack, disk_tensors
from moeprune.checkpoint.quantized import QuantizedSources, quantization_format
from moeprune.checkpoint.structure import read_config_dict
from moeprune.checkpoint.zero_rows import unstored_rows
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel, check_config
from moeprune.models.adapter import EXPERT_IDS_ATTR
from moeprune.models.classes import model_class
from moeprune.models.packed import pack_like
from moeprune.models.reshape import drop_experts
from moeprune.runtime.device import Placement, resolve_dtype
from moeprune.runtime.finite import check_finite_weights
from moeprune.serve.moeprune_format import FormatError
from moeprune.serve.moeprune_quantized import quantize_linear_inputs, read_as_compressed_tensors

_MOEPRUNE_KEYS = ("moeprune", "auto_map")  # config.json entries only the saved folder needs


def check_model_path(path: str | Path) -> Path:
    """A local checkpoint folder, or the cached snapshot of a Hugging Face model id (offline)."""
    given = str(path)
    path = Path(path)
    if not path.exists() and _looks_like_model_id(given):
        path = _cached_snapshot(given)
    if not path.exists():
        raise MoePruneError(
            f"model path {given!r} does not exist; pass a local checkpoint folder or a cached model id"
        )
    if not path.is_dir() or not (path / structure.CONFIG).is_file():
        raise MoePruneError(
            f"{str(path)!r} has no config.json; pass a transformers checkpoint folder (the one save_pretrained wrote)"
        )
    return path


def _looks_like_model_id(name: str) -> bool:
    """'org/name' (or 'name'): no path syntax that only a local path would use."""
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not name.startswith((".", "~")) and "\\" not in name


def _cached_snapshot(model_id: str) -> Path:
    """The local snapshot of `model_id` in the Hugging Face cache; nothing is downloaded."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(model_id, local_files_only=True, cache_dir=os.environ.get("HF_HUB_CACHE"))
        )
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, OSError) as exc:
        raise MoePruneError(
            f"{model_id!r} is neither a local folder nor a model in the local Hugging Face cache; moeprune never "
            f"downloads: fetch it first (huggingface-cli download {model_id}) or pass a local folder"
        ) from exc


def load_config(path: str | Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The model's config (for moeprune's format: the base family's), checked to be a supported MoE."""
    path = check_model_path(path)
    data = structure.read_config_dict(path)
    saved = structure.read(path)
    if saved is not None and saved.version >= 3:
        config = _base_config(data, saved.base_model_type, path)
    elif "auto_map" in data and data.get("model_type") not in CONFIG_MAPPING and not trust_remote_code:
        raise MoePruneError(
            f"{path / structure.CONFIG} asks to run the checkpoint's own Python code (auto_map, model type "
            f"{data.get('model_type')!r}); moeprune runs checkpoint code only when told to trust it",
            options=("trust_remote_code",),
        )
    else:
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (ValueError, KeyError, OSError, TypeError) as exc:
            raise MoePruneError(f"cannot read {path / structure.CONFIG}: {_first_line(exc)}") from exc
    check_config(config)
    return config


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _base_config(data: dict, base: str, path: Path) -> PretrainedConfig:
    if base not in CONFIG_MAPPING:
        raise MoePruneError(
            f"{path} was pruned from a {base!r} model, which this transformers does not know; upgrade transformers"
        )
    plain = {k: v for k, v in data.items() if k not in _MOEPRUNE_KEYS}
    plain["model_type"] = base
    plain["architectures"] = [
        a.removeprefix(structure.ARCHITECTURE_PREFIX) for a in data.get("architectures") or []
    ]
    try:
        return CONFIG_MAPPING[base].from_dict(plain)
    except (ValueError, KeyError, TypeError) as exc:
        raise MoePruneError(f"cannot read {path / structure.CONFIG}: {_first_line(exc)}") from exc


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase | None:
    path = Path(path)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / n).exists() for n in names):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise MoePruneError(f"cannot load the tokenizer in {path}: {_first_line(exc)}") from exc


def build_skeleton(path: Path, dtype: torch.dtype = torch.float32, meta: bool = False) -> PreTrainedModel:
    """The model a checkpoint describes (per-layer counts, widths, novices), weights not loaded:
    uninitialised memory, or the meta device (nothing allocated)."""
    path = Path(path)
    config = load_config(path)
    if hasattr(config, "quantization_config"):  # built in full precision: dequantized weights go in
        del config.quantization_config
    saved = structure.read(path)
    cls = model_class(config)
    if meta:
        with torch.device("meta"):
            model = cls._from_config(config, dtype=dtype)
    else:
        with no_init_weights():
            model = cls._from_config(config, dtype=dtype)
        model.tie_weights()  # no_init_weights also skips tying (lm_head must share the embedding)
    if saved is not None:
        shape_like(MoEModel(model), saved, path)
    return model


def shape_like(moe: MoEModel, saved: structure.Structure, path: Path) -> None:
    """Narrow and pack each MoE layer of a freshly built model to the saved structure."""
    where = str(path / structure.CONFIG)
    by_layer = {entry.layer: entry for entry in saved.layers}
    indices = [m.index for m in moe.layers]
    if sorted(by_layer) != indices:
        raise MoePruneError(
            f"{where}: the saved structure covers layers {sorted(by_layer)} but the model's MoE layers are "
            f"{indices}; the checkpoint is damaged, re-create it with moeprune prune"
        )
    cuts = {}
    for m in moe.layers:
        entry = by_layer[m.index]
        if not m.top_k <= entry.num_experts <= m.num_experts:
            raise MoePruneError(
                f"{where}: layer {m.index} keeps {entry.num_experts} experts, outside {m.top_k}..{m.num_experts} "
                "(top-k..the config's count); the checkpoint is damaged"
            )
        cuts[m.index] = _surplus(m, entry.num_experts)
    drop_experts(moe, cuts)
    for m in moe.layers:
        entry = structure.resolve_widths(by_layer[m.index], m.intermediate_size, where)
        setattr(m.block, EXPERT_IDS_ATTR, list(entry.expert_ids))
        if entry.packed(m.intermediate_size):
            widths = {str(p): w for p, w in enumerate(entry.widths) if w is not None}
            pack_like(m, {"novice": entry.novices, "widths": widths, "novice_rank": entry.novice_rank})


def _surplus(layer, keep: int) -> list[int]:
    """Positions to cut so `keep` remain (group-balanced; the weights are loaded afterwards)."""
    groups, extra = layer.n_group, layer.num_experts - keep
    if groups <= 1:
        return list(range(keep, layer.num_experts))
    size = layer.num_experts // groups
    return [g * size + size - 1 - j for g in range(groups) for j in range(extra // groups)]


def load_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None
) -> PreTrainedModel:
    """Reload any moeprune output or stock checkpoint; every weight must come from the files."""
    path = check_model_path(path)
    saved = structure.read(path)
    if saved is None:
        model = _load_stock(path, dtype, device)
    elif saved.version >= 3:
        model = build_skeleton(path, dtype)
        fill_from_disk(MoEModel(model), path, saved.mtp.roots if saved.mtp is not None else ())
        read_activations(model, path)
    else:
        model = _load_legacy(path, dtype)
    # transformers declares PreTrainedModel.to with @wraps(nn.Module.to), which typeshed's _Wrapped leaves unbound
    moved = model.to(device) if device is not None and saved is not None else model  # type: ignore[arg-type]
    return moved.eval()


def _load_stock(path: Path, dtype: torch.dtype, device=None) -> PreTrainedModel:
    files.check_weights(path)
    load_config(path)
    if quantization_format(path) is not None:
        model = load_dequantized(path, dtype)
        read_activations(model, path)
        return model if device is None else model.to(device)
    on_gpu = device is not None and torch.device(device).type != "cpu"
    placed = {"device_map": {"": str(device)}} if on_gpu and _has_accelerate() else {}  # straight to the GPU
    try:
        model = _from_pretrained(path, dtype=dtype, **placed)
    except MoePruneError:
        # a release storing fewer rows than the model holds (LongCat-Flash's zero experts)
        rows = unstored_rows(build_skeleton(path, dtype, meta=True), files.stored_tensors(path))
        if not rows:
            raise
        model = load_dequantized(path, dtype, rows)
    return model if placed or device is None else model.to(device)


def read_activations(model: PreTrainedModel, path: Path, experts: bool = True) -> None:
    """Make the loaded `model` compute what transformers with compressed-tensors computes from the
    same files (serve.moeprune_quantized.read_as_compressed_tensors): the inputs of the Linears
    whose config group quantizes activations (fp8-dynamic) quantized as the library's forward
    does, and (`experts`) fp8 routed experts held in bf16 where transformers < 5.21 holds them so."""
    quant = read_config_dict(path).get("quantization_config")
    if isinstance(quant, dict):
        try:
            read = read_as_compressed_tensors if experts else quantize_linear_inputs
            read(model, quant, str(path))
        except FormatError as exc:
            raise MoePruneError(str(exc).removeprefix("modeling_moeprune: ")) from None


def load_dequantized(
    path: Path, dtype: torch.dtype, unstored: dict[str, torch.Tensor] | None = None
) -> PreTrainedModel:
    """A quantized stock checkpoint as the full-precision model it stands for, on the CPU: each
    weight dequantized in float32 (checkpoint.quantized), then converted to the in-memory layout
    and cast to `dtype` by transformers' own loading code, as `from_pretrained` would load the
    dequantized checkpoint. The model's config no longer names a quantization: it is not quantized.
    `unstored`: tensors the release does not store, given to the loader as if it did
    (`checkpoint.zero_rows`).
    """
    model = build_skeleton(path, dtype)
    sources = QuantizedSources.of(path)
    settings = LoadStateDictConfig(
        device_map={"": torch.device("cpu")},
        dtype=dtype,
        dtype_plan=model._get_dtype_plan(dtype),
        weight_mapping=get_model_conversion_mapping(model),  # type: ignore[arg-type]  # its own list type, narrower stub
    )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with ExitStack() as stack:
            state = {**sources.sources(list(sources.weight_keys()), stack), **(unstored or {})}
            info, _ = convert_and_load_state_dict_in_model(model, state, settings)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.tie_weights()
    missing = {name for name in info.missing_keys if _tied_partner(model, name) is None}
    problems = {
        "missing_keys": sorted(missing),
        "unexpected_keys": _unexpected(model, info.unexpected_keys),
        "mismatched_keys": sorted(info.mismatched_keys),
    }
    if any(problems.values()) or info.conversion_errors:
        detail = _describe(problems) or str(next(iter(info.conversion_errors.values())))
        raise MoePruneError(
            f"{path} does not match its config: {detail}; the checkpoint is incomplete or damaged"
        )
    return model


def _from_pretrained(path: Path, **kwargs) -> PreTrainedModel:
    """transformers' loader, quiet, with every unread or unplaced tensor turned into one clear error."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report is a table on the console; we say it in one line
    try:
        model, info = cast(  # output_loading_info=True: (model, info), which the stub's return type omits
            "tuple[PreTrainedModel, dict[str, list[str]]]",
            model_class(load_config(path)).from_pretrained(
                path, trust_remote_code=False, output_loading_info=True, **kwargs
            ),
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise MoePruneError(f"cannot load {path}: {_diagnose(path) or _first_line(exc)}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    problems = {k: sorted(info.get(k) or []) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems["unexpected_keys"] = _unexpected(model, problems["unexpected_keys"])
    if any(problems.values()):
        raise MoePruneError(
            f"{path} does not match its config: {_describe(problems)}; the checkpoint is incomplete or damaged"
        )
    return model


def _unexpected(model: PreTrainedModel, keys) -> list[str]:
    """Stored tensors the model did not take, but those of the layers a release keeps beside the
    stack (multi-token prediction: moeprune carries them into the result, pruned)."""
    count = int(model.config.get_text_config().num_hidden_layers)
    return sorted(k for k in keys if not beside_stack(k, count))


def _diagnose(path: Path) -> str:
    """Which stored tensors differ from what a stock checkpoint of this config holds (for messages)."""
    try:
        expected = set(disk_tensors(MoEModel(build_skeleton(path, meta=True))))
        stored = set(files.stored_tensors(path))
    except MoePruneError:
        return ""
    problems = {"missing_keys": sorted(expected - stored), "unexpected_keys": sorted(stored - expected)}
    return _describe(problems) + "; the checkpoint is incomplete or damaged" if any(problems.values()) else ""


def _describe(problems: dict[str, list]) -> str:
    parts = []
    for kind, names in problems.items():
        if names:
            shown = ", ".join(str(n if isinstance(n, str) else n[0]) for n in names[:3])
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            parts.append(f"{kind.replace('_keys', '')} tensors {shown}{more}")
    return "; ".join(parts)


def _has_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def fill_from_disk(moe: MoEModel, path: Path, beside: tuple[str, ...] = ()) -> None:
    """Copy every stored tensor into the model by its on-disk name; strict both ways, but for the
    keys under `beside` (the MTP layers the structure records, which transformers never builds:
    they stay on disk for vLLM's drafts). Quantized weights (a result that kept its input's
    quantization) are dequantized as they are read."""
    targets = disk_tensors(moe)
    sources = QuantizedSources.of(path)
    stored = [key for key in sources.weight_keys() if not (beside and key.startswith(beside))]
    missing, unexpected = sorted(set(targets) - set(stored)), sorted(set(stored) - set(targets))
    if missing or unexpected:
        problems = {"missing_keys": missing, "unexpected_keys": unexpected}
        raise MoePruneError(
            f"{path} does not match its structure: {_describe(problems)}; the checkpoint is damaged"
        )
    with torch.no_grad(), ExitStack() as stack:
        for name, source in sources.sources(list(stored), stack).items():
            value = source[...]
            target = targets[name]
            if tuple(target.shape) != tuple(value.shape):
                raise MoePruneError(
                    f"{path}: tensor {name} has shape {tuple(value.shape)}, the structure says {tuple(target.shape)}; "
                    "the checkpoint is damaged"
                )
            target.copy_(value)


def _load_legacy(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """Versions 1-2: transformers' internal tensor names in one model.safetensors."""
    from safetensors.torch import load_model as load_into

    model = build_skeleton(path, dtype)
    weights = path / files.SINGLE
    if not weights.is_file():
        raise MoePruneError(f"{path} has no {files.SINGLE}; it is not a complete moeprune checkpoint")
    files.read_header(weights)
    missing, unexpected = load_into(model, str(weights), strict=False)
    if unexpected:
        raise MoePruneError(
            f"{weights} does not match {structure.LEGACY_FILE}: unexpected tensors {unexpected[:5]}"
        )
    tied = {name for name in missing if _tied_partner(model, name) is not None}
    if set(missing) - tied:
        raise MoePruneError(
            f"{weights} does not match {structure.LEGACY_FILE}: missing tensors {sorted(set(missing) - tied)[:5]}"
        )
    if tied:
        model.tie_weights()
    return model


def _tied_partner(model: PreTrainedModel, name: str) -> str | None:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    pairs = list(tied.items()) if isinstance(tied, dict) else []
    return next((a if b == name else b for a, b in pairs if name in (a, b)), None)


def load_model(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    device_map: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a stock or moeprune-format checkpoint in eval mode, plus its tokenizer if it has one.

    `device_map="auto"` (accelerate) spreads a stock checkpoint over every visible GPU.
    """
    path = check_model_path(path)
    load_config(path, trust_remote_code)  # dense, unsupported and damaged configs fail before any weight
    quantized = quantization_format(path)  # a format moeprune does not read fails here
    files.check_weights(path)
    if quantized is not None and device_map:
        raise MoePruneError(
            f"{str(path)!r} is quantized (fp8): moeprune dequantizes it on one device, and device_map='auto' "
            "would leave the dequantization to accelerate; choose one device",
            options=("device",),
        )
    if structure.is_moeprune_format(path):
        if device_map:
            raise MoePruneError(
                f"{str(path)!r} is in moeprune's own format, which loads on one device; device_map='auto' "
                "(accelerate) splits stock checkpoints only: choose one device"
            )
        model = load_pretrained(path, dtype=resolve_dtype(dtype), device=device)
    elif device_map:
        if not _has_accelerate():
            raise MoePruneError("splitting a model over GPUs needs accelerate: pip install accelerate")
        model = _load_auto(path, resolve_dtype(dtype), device_map)
    else:
        model = _load_stock(path, resolve_dtype(dtype), device)
    model.eval()
    return model, load_tokenizer(path, trust_remote_code)


def _load_auto(path: Path, dtype: torch.dtype, device_map: str) -> PreTrainedModel:
    model = _from_pretrained(path, dtype=dtype, device_map=device_map)
    check_not_offloaded(model)
    return model


def load_placed(
    path: str | Path, placement: Placement, trust_remote_code: bool = False
) -> tuple[PreTrainedModel, object | None]:
    """Load where `placement` says, and refuse weights holding NaN or inf, naming the first such tensor."""
    model, tokenizer = load_model(
        path,
        dtype=placement.dtype,
        device=placement.device,
        device_map=placement.device_map,
        trust_remote_code=trust_remote_code,
    )
    check_finite_weights(model, f"the model {path}")
    return model, tokenizer


def require_tokenizer(
    model_path: str | Path, tokenizer_path: str | Path | None = None, trust_remote_code: bool = False
):
    """The tokenizer of `tokenizer_path` or of the checkpoint; a clear error when there is none."""
    where = tokenizer_path or model_path
    tokenizer = load_tokenizer(where, trust_remote_code)
    if tokenizer is None:
        raise MoePruneError(
            f"no tokenizer found in {str(where)!r}; give a folder with tokenizer files",
            options=("tokenizer_path",),
        )
    return tokenizer


def check_not_offloaded(model: PreTrainedModel) -> None:
    """Refuse a model accelerate spilled to CPU or disk: it leaves those weights on the meta device
    and loads them only inside each module's own forward, while moeprune reads expert weights
    and router rows directly (routed compute, masks, surgery)."""
    offloaded = sorted({name.rsplit(".", 1)[0] for name, p in model.named_parameters() if p.is_meta})
    if offloaded:
        raise MoePruneError(
            f"the model does not fit on the GPUs: accelerate offloaded {len(offloaded)} modules to CPU or disk "
            f"(first: {offloaded[0]}), and moeprune needs every weight on a device; observe layer by layer "
            "(sequential observation), prune without loading, or use more GPUs"
        )
