"""`recipe.json`: a PruneConfig plus what a run read and wrote, enough to repeat it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moeprune import __version__
from moeprune.config.options import DataOptions, PruneConfig, SaveOptions
from moeprune.errors import MoePruneError

RECIPE_FILE = "recipe.json"
RECIPE_FORMAT = "moeprune-recipe"
RECIPE_VERSION = 1
_RECIPE_DATA = ("samples", "max_length", "batch_size", "seed", "packing")  # the DataOptions a recipe records


@dataclass
class Recipe:
    """What a run was asked to do, enough to repeat it: `recipe.json` beside every result, written
    by both pipelines and read back by `moeprune prune --config` and `moeprune serve-check`.

    Where the data came from and how it was read (not where the model ran: that is the machine's),
    how the result was saved, and which pipeline ran. A size target is recorded beside the sparsity
    it solved, so the recipe repeats the same plan while saying what was asked.
    """

    config: PruneConfig
    data: DataOptions = field(default_factory=DataOptions)
    search_data: Sequence[str] = ()
    save: SaveOptions = field(default_factory=SaveOptions)  # dtype None: the input's (a kept quantization)
    pipeline: str = "in-memory"
    target_size: int | None = None  # the bytes asked for, when `config.sparsity` was solved from them
    moeprune_version: str | None = None  # of the run that wrote it
    # `--quantize`: {"scheme", "method", "group_size"} (the Python that ran it is the machine's)
    quantize: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": RECIPE_FORMAT,
            "format_version": RECIPE_VERSION,
            "moeprune_version": self.moeprune_version or __version__,
            "pipeline": self.pipeline,
            "config": self.config.to_dict(),
            "data": {
                "calibration": list(self.data.sources),
                "search": list(self.search_data),
                **{name: getattr(self.data, name) for name in _RECIPE_DATA},
            },
            "save": {
                "dtype": self.save.dtype,
                "max_shard_size": self.save.max_shard_size,
                **({"drop_mtp": True} if self.save.drop_mtp else {}),
            },
        }
        if self.target_size is not None:
            out["target"] = {"target_size": self.target_size, "solved_sparsity": self.config.sparsity}
        if self.quantize is not None:
            out["quantize"] = dict(self.quantize)
        return out

    @classmethod
    def from_json(cls, document: Any) -> Recipe:
        """The recipe a recipe.json holds: this format, the unversioned files written before it (the
        same keys), or a bare PruneConfig object; unknown config keys are an error naming them."""
        if not isinstance(document, dict):
            raise MoePruneError(
                f"the config is not a JSON object but {type(document).__name__}; give a recipe.json "
                "written beside a result",
                options=("config",),
            )
        version = document.get("format_version", RECIPE_VERSION)
        if document.get("format", RECIPE_FORMAT) != RECIPE_FORMAT or version != RECIPE_VERSION:
            raise MoePruneError(
                f"not a moeprune recipe of format version {RECIPE_VERSION} (format "
                f"{document.get('format')!r}, version {version!r}); give a recipe.json written beside a result",
                options=("config",),
            )
        if "config" not in document:
            return cls(PruneConfig.from_dict(document))
        data, save = document.get("data") or {}, document.get("save") or {}
        for name, part in (("data", data), ("save", save)):
            if not isinstance(part, dict):
                raise MoePruneError(
                    f"the recipe's {name!r} must be an object, got {part!r}", options=("config",)
                )
        options = DataOptions(sources=tuple(data.get("calibration") or ()))
        options = replace(options, **{name: data[name] for name in _RECIPE_DATA if name in data})
        target = document.get("target") or {}
        quantize = document.get("quantize")
        if quantize is not None and (not isinstance(quantize, dict) or "scheme" not in quantize):
            raise MoePruneError(
                f"the recipe's 'quantize' must be an object with a 'scheme', got {quantize!r}",
                options=("config",),
            )
        return cls(
            PruneConfig.from_dict(document["config"]),
            options,
            tuple(data.get("search") or ()),
            SaveOptions(
                dtype=save.get("dtype"),
                max_shard_size=save.get("max_shard_size") or SaveOptions.max_shard_size,
                drop_mtp=bool(save.get("drop_mtp", False)),
            ),
            pipeline=document.get("pipeline", "in-memory"),
            target_size=target.get("target_size"),
            moeprune_version=document.get("moeprune_version"),
            quantize=quantize,
        )

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        """Read a recipe.json (or a folder holding one); a missing or unreadable file is one line."""
        path = Path(path)
        if path.is_dir():
            path = path / RECIPE_FILE
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise MoePruneError(
                f"cannot read the config {path}: {exc}; give a recipe.json written beside a result",
                options=("config",),
            ) from None
        return cls.from_json(document)
