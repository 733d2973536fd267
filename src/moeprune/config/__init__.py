"""What a pruning is asked to do (PruneConfig), and the registries that name what it can ask for.

Every named choice (criterion, allocation, surgery method, fitness, evaluation metric) is one
entry of one `Registry`, declared once beside its implementation with its help text and what it
needs; the command line's choices and help, the validation of a config and the README's tables
are all read from the registries, so adding a criterion is one module and one decorator.

`PruneConfig` is a plain dataclass that round-trips through JSON (`to_dict` / `from_dict`): the
`recipe.json` beside every output is one, and `moeprune prune MODEL --config recipe.json` reads
it back. This module imports nothing of moeprune but its errors, so every stage can register here.

- fields.py  `setting`: a config field that carries its command-line flag, help and bounds (every
  config class of moeprune.config declares its fields with it)
- options.py  The settings a pruning is given, as dataclasses validated once: PruneConfig (with its
  SearchConfig and each method's options) and the data, save and run options; JSON ...
- recipe.py  `recipe.json`: a PruneConfig plus what a run read and wrote, enough to repeat it
- registry.py  The registries: every named choice (criterion, allocation, surgery method, fitness,
  metric) is one entry of one `Registry`, declared beside its implementation with ...
- repair.py  `--repair`'s settings (RepairConfig): what the distillation after surgery trains, how
  long, and what it is checked on
- sizes.py  Sizes as people write them ("40GiB", "500MB", bytes): `--target-size`, `--max-shard-
  size`
"""

from moeprune.config.options import (
    DataOptions,
    MethodOptions,
    PruneConfig,
    RunOptions,
    SaveOptions,
    SearchConfig,
    setting,
)
from moeprune.config.recipe import RECIPE_FILE, RECIPE_FORMAT, RECIPE_VERSION, Recipe
from moeprune.config.registry import CALIBRATION, NEURON_STATS, SEARCH_DATA, WEIGHTS, Registry
from moeprune.config.repair import REPAIR_PARTS, RepairConfig
from moeprune.config.sizes import parse_bytes, parse_target_size

__all__ = [
    "CALIBRATION",
    "NEURON_STATS",
    "RECIPE_FILE",
    "RECIPE_FORMAT",
    "RECIPE_VERSION",
    "REPAIR_PARTS",
    "SEARCH_DATA",
    "WEIGHTS",
    "DataOptions",
    "MethodOptions",
    "PruneConfig",
    "Recipe",
    "Registry",
    "RepairConfig",
    "RunOptions",
    "SaveOptions",
    "SearchConfig",
    "parse_bytes",
    "parse_target_size",
    "setting",
]
