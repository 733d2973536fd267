"""Options several commands share, with choices and help read from the registries."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, Field, fields
from typing import Any

import click
import torch

from moeprune.config import DataOptions, PruneConfig, Registry
from moeprune.errors import MoePruneError
from moeprune.runtime.device import DTYPES


def data_options(func):
    """Options of every command that reads calibration or evaluation data and loads a model."""
    options = [
        click.option(
            "--data",
            "data",
            multiple=True,
            metavar="FILE[:WEIGHT]",
            help="Data file (JSONL/.txt/.parquet/.arrow/save_to_disk folder); repeat for several.",
        ),
        click.option(
            "--samples",
            type=click.IntRange(min=0),
            default=128,
            show_default=True,
            help="Samples to draw (0 = all).",
        ),
        click.option(
            "--max-length",
            type=click.IntRange(min=1),
            default=512,
            show_default=True,
            help="Truncate samples to L tokens.",
        ),
        click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True),
        click.option(
            "--packing/--no-packing", default=False, show_default=True, help="Pack samples into full rows."
        ),
        click.option(
            "--tokenizer",
            "tokenizer_path",
            type=click.Path(),
            default=None,
            help="Tokenizer folder, if the checkpoint has none.",
        ),
        field_options(settings_of(PruneConfig, "seed")),  # --seed: also the data's
        click.option(
            "--dtype",
            type=click.Choice(list(DTYPES)),
            default=None,
            help="Model dtype [default: bf16 on GPU, fp32 on CPU].",
        ),
        click.option(
            "--threads",
            type=click.IntRange(min=1),
            default=None,
            help="torch CPU threads (default: torch's choice).",
        ),
        click.option(
            "--trust-remote-code",
            is_flag=True,
            help="Allow a checkpoint's own Python code (tokenizer or config); never run otherwise.",
        ),
        click.option(
            "--device",
            default=None,
            help="cpu, cuda, cuda:N or auto (accelerate device_map over all GPUs) [default: GPU if any].",
        ),
        click.option(
            "--sequential",
            is_flag=True,
            help="Observe one decoder layer at a time without loading the whole model (score, prune --no-load).",
        ),
        click.option(
            "--activations-dir",
            type=click.Path(file_okay=False),
            default=None,
            help="--sequential: keep the cached activations in a temporary folder here (on disk) instead "
            "of in memory; removed afterwards.",
        ),
        click.option("--quiet", is_flag=True, help="No progress bars."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def data_from_options(kwargs: dict) -> DataOptions:
    if kwargs.get("threads"):
        torch.set_num_threads(kwargs["threads"])
    if kwargs.get("activations_dir") and not kwargs.get("sequential"):
        raise MoePruneError(
            "--activations-dir is for --sequential (layer-by-layer) observation; add --sequential"
        )
    return DataOptions(
        sources=kwargs["data"],
        samples=kwargs["samples"] or None,
        max_length=kwargs["max_length"],
        batch_size=kwargs["batch_size"],
        seed=kwargs["seed"],
        packing=kwargs["packing"],
        device=kwargs.get("device"),
        dtype=kwargs.get("dtype"),
        sequential=kwargs.get("sequential", False),
        activations_dir=kwargs.get("activations_dir"),
    )


class RegistryChoice(click.Choice):
    """The entries of a registry as they are when the command line is parsed: an entry registered
    after the CLI was imported (a plugin's method, a test's) is a valid choice too."""

    def __init__(self, registry) -> None:
        self.registry = registry
        super().__init__(registry.names())

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self.registry.names())

    @choices.setter
    def choices(self, value) -> None:  # click.Choice's own assignment: the registry answers instead
        pass


def registry_option(flag: str, registry, lead: str, **kwargs: Any) -> Callable:
    """A click option choosing one entry of `registry`, its --help listing every entry's own help."""
    return click.option(flag, type=RegistryChoice(registry), help=registry_help(registry, lead), **kwargs)


def registry_help(registry, lead: str) -> str:
    """`lead` and every entry's help, for --help."""
    return f"{lead} " + "; ".join(f"{spec.name}: {spec.help}" for spec in registry) + "."


# ----------------------------------------------------------------------------- options from config fields
def option_name(setting: Field) -> str:
    """The CLI parameter a config field becomes: its flag without dashes (`--search-seed` ->
    search_seed), or the field's own name."""
    flag = setting.metadata.get("flag")
    return flag.lstrip("-").replace("-", "_") if flag else setting.name


def settings_of(cls: type, *names: str) -> list[Field]:
    """The `setting` fields of `cls` named, in that order (the order of their flags in --help)."""
    by_name = {f.name: f for f in fields(cls) if "help" in f.metadata}
    return [by_name[name] for name in names]


class SettingOption(click.Option):
    """A click option made from a config field by `field_options`; `setting` is that field."""

    def __init__(self, *args: Any, setting: Field, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.setting = setting


def config_options(
    cls: type,
    *,
    choices: dict[str, list[str]] | None = None,
    helps: dict[str, str] | None = None,
    registries: dict[str, Registry] | None = None,
) -> Callable:
    """Decorator: one click option per `setting` field of the config class `cls` (see `field_options`)."""
    return field_options(fields(cls), choices=choices, helps=helps, registries=registries)


_JSON_TYPES = {"str": str, "float": float, "int": int}


def _value_type(setting: Field) -> type:
    """The Python type a typed value becomes: text when the field takes text (`int | str`: a size
    like "40GiB"), else its annotation's first non-None part (`float | None`)."""
    parts = [part.strip() for part in str(setting.type).split("|")]
    return str if "str" in parts else next((_JSON_TYPES[p] for p in parts if p in _JSON_TYPES), str)


def _option_type(setting: Field, choices: Sequence[str] | None) -> Any:
    """The click type of a setting's option: its choices, its range, or its value type."""
    meta = setting.metadata
    if choices:
        return click.Choice(list(choices))
    low, high, open_ = meta.get("min"), meta.get("max"), bool(meta.get("open"))
    if low is None and high is None:
        return _value_type(setting)
    range_type = click.FloatRange if _value_type(setting) is float else click.IntRange
    return range_type(low, high, min_open=open_, max_open=open_)


def field_options(
    settings: Iterable[Field],
    *,
    choices: dict[str, list[str]] | None = None,
    helps: dict[str, str] | None = None,
    registries: dict[str, Registry] | None = None,
    optional: Sequence[str] = (),
) -> Callable:
    """Decorator: one click option per `setting` field, with the field's default (none: a required
    option), range, choices, metavar and help, so a setting is declared once and the flag follows
    it. What a config module cannot import is passed in: a registry (`registries`: its names are
    the choices, its entries' help follows the field's), or `choices` and `helps` themselves.
    `optional`: required fields the command fills in itself when left out (prune's criterion)."""
    choices, helps, registries = choices or {}, helps or {}, registries or {}

    def decorate(func: Callable) -> Callable:
        for setting in reversed([f for f in settings if "help" in f.metadata]):
            meta, name = setting.metadata, setting.name
            registry = registries.get(name)
            allowed = choices.get(name) or (registry.names() if registry else meta.get("choices"))
            help = helps.get(name) or (registry_help(registry, meta["help"]) if registry else meta["help"])
            required = setting.default is MISSING and name not in optional  # and then no default
            default = {} if required else {"default": None if setting.default is MISSING else setting.default}
            flag = str(setting.type).strip() == "bool"  # a switch: on when given, the default off
            kind = (
                {"is_flag": True}
                if flag
                else {
                    "type": RegistryChoice(registry)
                    if registry and name not in choices
                    else _option_type(setting, allowed)
                }
            )
            func = click.option(
                meta.get("flag") or "--" + name.replace("_", "-"),
                option_name(setting),
                cls=SettingOption,
                setting=setting,
                required=required,
                show_default=setting.default not in (None, MISSING) and not flag,
                metavar=meta.get("metavar"),
                help=help,
                **kind,
                **default,
            )(func)
        return func

    return decorate


def config_from_options(cls: type, values: dict[str, Any], /, **given: Any) -> Any:
    """The config the command line's option `values` describe (`given`: its fields that are no
    setting, e.g. a nested config); its settings' values are taken out of `values`."""
    settings = {f.name: values.pop(option_name(f)) for f in fields(cls) if "help" in f.metadata}
    return cls(**settings, **given)


def options_of(config: Any) -> dict[str, Any]:
    """{CLI parameter: value} of a config's settings (recipe.json's values as the command's defaults)."""
    return {option_name(f): getattr(config, f.name) for f in fields(config) if "help" in f.metadata}


def setting_options(cls: type) -> list[str]:
    """The CLI parameters the settings of `cls` become."""
    return [option_name(f) for f in fields(cls) if "help" in f.metadata]


def setting_help(cls: type, name: str) -> str:
    """The help a config field carries."""
    return next(f for f in fields(cls) if f.name == name).metadata["help"]


def vllm_options(pairs: tuple[str, ...]) -> dict:
    """--vllm-option KEY=VALUE pairs (VALUE read as JSON, else taken as a string) for vllm.LLM
    (serve-check and eval --engine vllm)."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise MoePruneError(f"--vllm-option {pair!r} is not KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options
