"""The settings a pruning is given, as dataclasses validated once: PruneConfig (with its SearchConfig
and each method's options) and the data, save and run options; JSON round trips for recipe.json."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from moeprune.config.fields import check_bounds, setting
from moeprune.config.repair import RepairConfig
from moeprune.errors import MoePruneError


# ----------------------------------------------------------------------------- data and saving
@dataclass
class DataOptions:
    """Where calibration (or evaluation) data comes from, how much of it, and where the model runs."""

    sources: Sequence[str] = ()  # files, FILE:WEIGHT to mix them
    samples: int | None = 128  # None: every sample
    max_length: int = 512
    batch_size: int = 8
    seed: int = 0
    packing: bool = False
    device: str | None = None  # None: the GPU when there is one, else the CPU; "auto": device_map="auto"
    dtype: str | None = None  # the model's dtype while it runs; None: bf16 on GPUs, fp32 on the CPU
    sequential: bool = False  # observe one decoder layer at a time, never loading the whole model
    activations_dir: str | None = None  # sequential: cached activations on disk under this folder


@dataclass
class SaveOptions:
    """How a result is written (docs/checkpoint-format.md)."""

    dtype: str | None = None  # None: the dtype the input checkpoint stores (bf16 stays bf16)
    max_shard_size: int | str = "5GB"
    # leave out the multi-token-prediction layers a release stores beside the stack (kept and
    # pruned by default: vLLM drafts with them)
    drop_mtp: bool = False


@dataclass
class RunOptions:
    """How one job runs, none of which changes what it computes: what it may overwrite, whether it
    continues a checkpointed search, whether it only plans, what it prints."""

    progress: bool = True
    overwrite: bool = False  # replace an existing output folder (never the input)
    resume: bool = False  # continue the EvoESAP search checkpointed in the output (or `search_state`)
    dry_run: bool = False  # check the inputs and print the plan's sizes; load and write nothing
    trust_remote_code: bool = False  # run a checkpoint's own modeling code (transformers' flag)
    command_line: str | None = None  # how the user asked for it (the model card's "Reproduce")
    # sees the plan before any surgery and may refuse it (MoePruneError): what only the plan tells,
    # such as a searched width a quantization group does not divide, fails before the model changes
    check_plan: Callable[[Any], None] | None = field(default=None, repr=False, compare=False)
    # experts removed per MoE layer, chosen already by the caller (the joint search of experts and
    # schemes, quantize/evo.py), or the mixed method's genes, one (whole, narrowed, novice,
    # dropped, width) tuple per MoE layer (quantize/mixed.py): the allocation and its search
    # are not run
    removed: tuple[int, ...] | tuple[tuple[int, ...], ...] | None = field(default=None, compare=False)
    # (criterion, scores, statistics) of this model on this calibration data, observed already by the
    # caller (the joint precision searches observe the full model before `prune`): not observed again
    observed: Any = field(default=None, repr=False, compare=False)
    # every routed expert's rank-R novice fit, made already by the caller (the joint mixed search):
    # the plan's novices are taken from it, not fitted again
    novices: Any = field(default=None, repr=False, compare=False)


# ----------------------------------------------------------------------------- the recipe
def _check_type(value: Any, kinds: tuple[type, ...], where: str) -> None:
    ok = False
    for kind in kinds:
        ok |= isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
    if not ok:
        raise MoePruneError(f"{where} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")


_TYPES: dict[str, tuple[tuple[type, ...], bool]] = {}  # field name -> (types, optional), filled below


@dataclass(frozen=True)
class MethodOptions:
    """The base of every method's own settings (`Method.options`; a method without settings takes
    it as it is): what generic code asks of any method's options, with the answers of a method
    that has none, so a stage asks the resolved options and never checks which class they are.
    A subclass is a frozen dataclass of `setting` fields (each a command-line flag) that validates
    itself in `__post_init__`, and overrides the answers its settings change."""

    @property
    def keeps_routing(self) -> bool:
        """True when the settings keep every router row (drop's `--reroute none`): Method.configured."""
        return False

    @property
    def label(self) -> str:
        """What refusals add to 'the drop method' (Method.described): '' unless the settings change it."""
        return ""

    @property
    def novice_rank(self) -> int:
        """The rank of low-rank novices (0: constant novices, or none at all)."""
        return 0

    @property
    def width_multiple(self) -> int | None:
        """Narrowed widths are multiples of this (None: the default multiple, surgery/widths.py)."""
        return None

    def candidate_context(self, moe: Any) -> Callable | None:
        """How a search applies a candidate under these settings (Method.search_context); None: the
        method's own context."""
        return None

    def check_model(self, moe: Any) -> None:
        """Refuse settings the model's structure cannot take (before any weight loads)."""


@dataclass
class SearchConfig:
    """EvoESAP's settings (defaults: the paper's, P=32, m=4, T=50, Delta=4, tau=3). The one place
    they are declared and checked: the search core, the CLI flags and recipe.json all read it."""

    fitness: str = setting(
        "esap", "evo: what a candidate is scored by against the full model (all cost the same):"
    )
    samples: int = setting(
        64,
        "evo/gradient: search samples (0 = all); time grows linearly with them.",
        flag="--search-samples",
        minimum=0,
    )
    population: int = setting(
        32, "evo: candidates per generation; time grows linearly (cached candidates cost nothing).", minimum=1
    )
    elites: int = setting(
        4,
        "evo: best candidates kept as parents each generation (at most the population); elites "
        "are not re-evaluated, so more elites mean fewer evaluations per generation.",
        minimum=1,
    )
    generations: int = setting(50, "evo: generations at most; time grows linearly.", minimum=1)
    patience: int | None = setting(
        None,
        "evo: stop once the best fitness has not improved for G generations "
        "[default: never; the result then stays that of the full run]; saves the "
        "remaining generations' time.",
        minimum=1,
    )
    delta_max: int = setting(
        4,
        "evo: most experts one mutation step moves between two layers; larger steps explore "
        "faster, at the same cost per generation.",
        minimum=1,
    )
    tau_max: int = setting(
        3,
        "evo: most mutation steps composed into one offspring; no effect on time per generation.",
        minimum=1,
    )
    seed: int = setting(
        42,
        "evo/gradient: seed of the search (same seed and data: same result); no effect on time.",
        flag="--search-seed",
    )

    # the gradient allocation's own settings (search/gradient.py); the seed, fitness and search
    # samples above are shared with evo
    steps: int = setting(
        120,
        "gradient: training steps (one search batch and one Gumbel draw each); time grows linearly.",
        flag="--gradient-steps",
        minimum=1,
    )
    learning_rate: float = setting(
        0.2,
        "gradient: Adam's learning rate on the per-expert keep logits.",
        flag="--gradient-lr",
        minimum=0,
        open_bounds=True,
    )
    temperature: float = setting(
        1.0,
        "gradient: Gumbel temperature at the first step; it falls geometrically to the end temperature.",
        flag="--gradient-temperature",
        minimum=0,
        open_bounds=True,
    )
    temperature_end: float = setting(
        0.1,
        "gradient: Gumbel temperature at the last step.",
        flag="--gradient-temperature-end",
        minimum=0,
        open_bounds=True,
    )
    kl_top_k: int = setting(
        0,
        "gradient: the training loss is the KL from the full model on its k most likely tokens, "
        "renormalised (0 = the whole vocabulary).",
        flag="--gradient-kl-top-k",
        minimum=0,
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Impossible settings are one line naming the parameter, before any model runs."""
        check_bounds(self, "search")
        if self.population < self.elites:
            raise MoePruneError(f"evo population ({self.population}) must be >= elites ({self.elites})")
        if self.seed < 0:
            raise MoePruneError(f"evo seed must be >= 0, got {self.seed}")


@dataclass
class PruneConfig:
    """What to prune and how; see docs/python-api.md. Round-trips through JSON."""

    # a registered criterion, or "auto" (the best uniform plan on the search data); the CLI adds
    # the registry's names and help (cli/prune.py)
    criterion: str = setting(MISSING, "How experts are ranked:")
    # None only with `target_size`, which solves it (job.prepare / the no-load pipeline, before any
    # weight loads)
    sparsity: float | None = setting(
        None,
        "drop/novice: fraction of routed experts removed; neurons/tenp: fraction of routed-expert "
        "parameters. Give it or --target-size.",
        minimum=0,
        maximum=1,
        open_bounds=True,
    )
    # None: the method's default (uniform; trapezoid for tenp)
    allocation: str | None = setting(None, "How many experts each layer loses [default: the method's first]:")
    method: str = setting("drop", "What happens to the chosen experts:")
    expert_multiple: int = setting(
        1,
        "Every layer keeps a multiple of N experts (vLLM expert parallelism needs counts divisible "
        "by the EP size; kernels like multiples of 8).",
        minimum=1,
    )
    # the expert-parallel degree the result is meant for (models/expert_parallel.py); None: not declared
    ep_size: int | None = setting(
        None,
        "The expert-parallel size the result is served with: for families whose vLLM classes need "
        "every layer's expert count divisible by it (DeepSeek-V4, Kimi-K3, Muse-Spark, Step-5), "
        "--expert-multiple defaults to N and a plan that breaks it is refused before loading.",
        minimum=1,
        metavar="N",
    )
    # the random criterion's permutation; the CLI's --seed (every command's) also seeds the data
    seed: int = setting(0, "Seed of the data sampling and of the random criterion.")
    search: SearchConfig = field(default_factory=SearchConfig)
    # the weights' bytes on disk the result must fit in ("40GiB", "500MB", or bytes as an int)
    target_size: int | str | None = setting(
        None,
        "Instead of --sparsity: the bytes of weights the result may hold on disk, in the format it "
        "is saved in (e.g. 40GiB, 500MB, 123456; kB/MB/GB/TB are powers of 10, KiB/MiB/GiB/TiB of "
        "2); the smallest sparsity that fits is solved before any weight is loaded.",
        metavar="SIZE",
    )
    # the method's own settings: an instance of its options class (`Method.options`, e.g. TenpOptions),
    # or a dict of its fields (JSON); None: its defaults. Resolved with the names (check_config).
    options: Any = None
    # False (the default): the super experts found in the calibration statistics are never removed,
    # made novices, narrowed or merged (criteria/super_experts.py); True turns that guard off
    allow_super_experts: bool = setting(
        False,
        "Let the plan remove, make novices of or narrow the super experts (the few experts with massive "
        "activations, found in the calibration data; removing them can collapse the model). By default they "
        "are kept and a sparsity only their removal could meet is refused.",
    )
    # --repair: distil the pruned model toward the full one, training small tensors (moeprune.repair)
    repair: RepairConfig = field(default_factory=RepairConfig)

    def sparsity_value(self) -> float:
        """The sparsity, given or solved from the target size (a stage that plans needs one)."""
        if self.sparsity is None:
            raise MoePruneError(
                "no sparsity: give one, or a target size to solve it from a checkpoint",
                options=("sparsity", "target_size"),
            )
        return self.sparsity

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON; `target_size` only when set, so a recipe of a run with a given
        sparsity keeps exactly the keys it always had."""
        out = {
            f.name: getattr(self, f.name) for f in fields(PruneConfig)
        }  # a ResolvedConfig's entries stay out
        out["search"], out["repair"] = asdict(self.search), asdict(self.repair)
        out["options"] = asdict(self.options) if isinstance(self.options, MethodOptions) else self.options
        if out["target_size"] is None:
            del out["target_size"]
        if self.options is None or (isinstance(self.options, MethodOptions) and not out["options"]):
            del out["options"]  # none given, or a method without settings
        if not out["allow_super_experts"]:  # recipes of guarded runs keep the keys they always had
            del out["allow_super_experts"]
        if not self.repair.enabled:  # and recipes without --repair too
            del out["repair"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PruneConfig:
        """The config a dict (e.g. recipe.json's "config") describes; unknown or mistyped keys are an
        error naming them, never silently ignored."""
        if not isinstance(data, dict):
            raise MoePruneError(f"a prune config is a JSON object, got {type(data).__name__}")
        search, repair = data.get("search", {}), data.get("repair", {})
        for name, part in (("search", search), ("repair", repair)):
            if not isinstance(part, dict):
                raise MoePruneError(
                    f"the config's {name!r} must be an object, got {part!r}", options=("config",)
                )
        options = data.get("options") or {}
        if not isinstance(options, dict):
            raise MoePruneError(
                f"the config's 'options' must be an object, got {options!r}", options=("config",)
            )
        options = dict(options)
        for key, default in _FORMER_OPTION_KEYS.items():  # recipes written before options were nested
            if key in data and data[key] != default:
                options.setdefault(key, data[key])
        nested = ("search", "repair", "options", *_FORMER_OPTION_KEYS)
        flat = {k: v for k, v in data.items() if k not in nested}
        values = _read(cls, flat, "config")
        values["options"] = options or None
        if values.get("sparsity") is None and values.get("target_size") is None:
            raise MoePruneError("config lacks sparsity (or target_size, which solves it)")
        return cls(
            **values,
            search=SearchConfig(**_read(SearchConfig, search, "config.search")),
            repair=RepairConfig(**_read(RepairConfig, repair, "config.repair")),
        )


# Method settings recipe.json held as top-level config keys before they moved into `options`, with
# the value they had when unset (a frozen table of the format's past: new options never join it)
_FORMER_OPTION_KEYS = {"neuron_importance": "projection", "important_fraction": None, "slope": 0.5}


_NESTED = ("search", "repair", "options")  # PruneConfig's fields that are no JSON scalar


def _read(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    known = {f.name: f for f in fields(cls) if f.name not in _NESTED}
    unknown = sorted(set(data) - set(known))
    if unknown:
        also = ", search, repair, options" if cls is PruneConfig else ""  # read separately
        raise MoePruneError(
            f"{where} has unknown keys {unknown}; remove them or use the known ones: "
            f"{', '.join(known)}{also}",
            options=("config",),
        )
    missing = [
        n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING and n not in data
    ]
    if missing:
        raise MoePruneError(f"{where} lacks {', '.join(missing)}")
    for name, value in data.items():
        kind, optional = _TYPES[f"{cls.__name__}.{name}"]
        if not (optional and value is None):
            _check_type(value, kind, f"{where}.{name}")
    return dict(data)


def _field_types() -> None:
    """The JSON type of each field, from the annotations (`int | None` is an optional int)."""
    names = {"str": str, "float": float, "int": int, "bool": bool}
    for cls in (SearchConfig, RepairConfig, PruneConfig):
        for f in fields(cls):
            if f.name in _NESTED:
                continue
            parts = [part.strip() for part in str(f.type).split("|")]
            kinds = tuple(names[part] for part in parts if part != "None")
            _TYPES[f"{cls.__name__}.{f.name}"] = (kinds, "None" in parts)


_field_types()
