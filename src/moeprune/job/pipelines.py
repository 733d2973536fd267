"""How a prune runs: pipelines by execution mode, registered like criteria and methods.

- `in-memory`: load the model (one GPU, several with `device="auto"`, or the CPU), observe, search,
  cut, save (`job.prune_checkpoint`). Every criterion, allocation and method.
- `no-load`: never hold the whole model: weight-only scores streamed from the shards or statistics
  observed one decoder layer at a time, then the shards rewritten one tensor at a time
  (`job.no_load.prune_without_loading`). Whole experts dropped by the uniform or global
  allocation (different counts per layer, as the global allocation or DeepSeek-V4's kept-whole
  hash layers give, written in moeprune's format), or one neuron width for every expert.

Each pipeline declares what it supports, so an unsupported combination is refused here in one
sentence, before anything is read, and `unread_settings` lists the settings a run would silently
ignore (the command line refuses those when they are typed). The command line only chooses the
pipeline by name; it holds no rule of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from moeprune.allocate.registry import ALLOCATIONS, Allocator
from moeprune.config import DataOptions, PruneConfig, Registry, RepairConfig, RunOptions, SearchConfig
from moeprune.criteria import AUTO, get_criterion, scores_document, unseen_experts
from moeprune.criteria.super_experts import found_in, guard_document
from moeprune.errors import MoePruneError
from moeprune.job.auto import prune_auto
from moeprune.job.no_load import prune_without_loading, score_without_loading
from moeprune.job.prepare import PruneRequest
from moeprune.job.run import prune_in_memory
from moeprune.job.score import prepare_score, score_loaded
from moeprune.quantize.per_layer import resolve_auto
from moeprune.runtime.atomic import write_json
from moeprune.runtime.distributed import init_distributed
from moeprune.surgery.planning import check_config, requirements
from moeprune.surgery.registry import METHODS, Method, ResolvedConfig

Setting = str | type  # a setting's name, or a config class standing for all of its settings
# the settings only one searched allocation reads (its `knobs`), under their former names
EVO_SETTINGS, GRADIENT_SETTINGS = ALLOCATIONS.get("evo").knobs, ALLOCATIONS.get("gradient").knobs

# repair's own settings besides --repair itself (read only with it)
REPAIR_SETTINGS = tuple(
    f.metadata["flag"].lstrip("-").replace("-", "_") for f in fields(RepairConfig) if f.name != "enabled"
)


@dataclass(frozen=True)
class Pipeline:
    name: str
    help: str
    needs: tuple[str, ...] = ()
    # which (method, allocation) pairs it runs, from what the registries say of them; None: every pair
    supports: Callable[[Method, Allocator], bool] | None = None
    auto_criterion: bool = True  # can it choose the criterion itself (it evaluates plans on a loaded model)
    repairs: bool = True  # can it run --repair (it trains a loaded model)
    why_limited: str = ""  # why the limits above, for the refusal
    unread: tuple[tuple[tuple[Setting, ...], str], ...] = ()  # settings it never reads, and why
    # whether it runs the quantize stage's steps (quantize/stage.py): llm-compressor loads the result
    quantizes: bool = False
    fn: Callable[[PruneRequest], dict] | None = None

    def check(self, config: PruneConfig) -> None:
        """Refuse, in one sentence naming what it supports, a config this pipeline cannot run (its
        names resolved; its numbers are checked with the rest of the job's inputs)."""
        config = ResolvedConfig.of(config)
        if config.method_spec.portfolio is not None and not self.auto_criterion:
            raise MoePruneError(
                f"the {config.method} method scores its recipes' plans on the loaded model and the "
                f"{self.name} pipeline never loads it: prune in memory, or name one recipe",
                options=("method", "pipeline"),
            )
        if config.criterion == AUTO and not self.auto_criterion:
            raise MoePruneError(
                f"the {self.name} pipeline needs a named criterion ({self.why_limited}); name one",
                options=("criterion", "pipeline"),
            )
        if config.repair.enabled and not self.repairs:
            raise MoePruneError(
                f"repair trains the loaded model and the {self.name} pipeline never loads it; prune in "
                "memory to repair, or leave out repair",
                options=("repair", "pipeline"),
            )
        method = config.method_spec
        if self.supports is not None and not self.supports(config.surgery, config.allocator):  # drop
            # --reroute none: routed
            by_allocation: dict[str, list[str]] = {}  # what it runs, in the registries' words
            for m in METHODS:
                for a in m.allocations:
                    if a in ALLOCATIONS and self.supports(m, ALLOCATIONS.get(a)):
                        by_allocation.setdefault(a, []).append(m.name)
            pairs = [
                f"the {' or '.join(names)} method with the {a} allocation"
                for a, names in by_allocation.items()
            ]
            raise MoePruneError(
                f"the {self.name} pipeline runs {' or '.join(pairs)} ({self.why_limited}); "
                f"{config.described()} with the {config.allocation} allocation needs the in-memory pipeline",
                options=(
                    "pipeline",
                    "method",
                    *(method.knobs if config.surgery != method else ()),
                ),
            )


PIPELINES: Registry[Pipeline] = Registry("pipeline", "pipeline")


def unread_settings(pipeline: Pipeline, config: PruneConfig) -> list[tuple[tuple[Setting, ...], str]]:
    """(settings, why) for every setting this run would ignore: the pipeline's own, then the ones
    only a search, another method or neuron pruning read."""
    config = ResolvedConfig.of(config)
    unread = list(pipeline.unread)
    needs = requirements(config)
    # each other allocation's own settings first, so the refusal names the allocation that reads them
    chooses = config.method_spec.portfolio is not None  # auto: its recipes read every search's settings
    unread += [
        (a.knobs, f"without --allocation {a.name}")
        for a in ALLOCATIONS
        if a.knobs and a != config.allocator and not chooses
    ]
    if not config.repair.enabled:
        unread.append((REPAIR_SETTINGS, "without --repair"))
    if not needs.reads_search(True):  # repair reads search data too, when it is given
        unread.append(
            (("search_data", SearchConfig), "without --allocation evo or gradient or --criterion auto")
        )
    unread += [(tuple(knobs), f"without --method {other}") for other, knobs in needs.other_knobs.items()]
    return unread


def prune_checkpoint(request: PruneRequest, pipeline: str = "in-memory") -> dict:
    """Prune a checkpoint folder as `request` says, on the named pipeline ("in-memory": load,
    observe, search, cut, save; "no-load": never hold the whole model): the config resolved once,
    the pipeline's refusals, then the job; returns report.json (with `request.run.dry_run`, the
    plan of work). What `moeprune prune` runs."""
    name = pipeline
    pipeline_spec = PIPELINES.get(name)
    config, quantize = resolve_auto(request.config, request.quantize, bool(request.data.sources))
    config = check_config(config)  # names, numbers and combinations; the allocation resolved
    pipeline_spec.check(config)
    if request.quantize is not None and not pipeline_spec.quantizes:
        which = " or ".join(p.name for p in PIPELINES if p.quantizes)
        raise MoePruneError(
            f"quantizing runs on the {which} pipeline (llm-compressor loads the pruned model); the {name} "
            "pipeline copies the input's shards: prune in memory, or without quantizing",
            options=("quantize", "pipeline"),
        )
    if config.method_spec.portfolio is not None:  # auto: a contest of recipes, then the winner's job
        return prune_auto(replace(request, quantize=quantize))  # the config as given: auto checks it
    assert pipeline_spec.fn is not None, f"pipeline {name} registered without a function"
    return pipeline_spec.fn(replace(request, config=config, quantize=quantize))


@PIPELINES.register(
    Pipeline(
        "in-memory",
        help="load the model, observe, search, cut and save (the default)",
        quantizes=True,
        unread=(
            (
                ("activations_dir",),
                "without --sequential (it is where sequential observation caches activations)",
            ),
        ),
    )
)
def _in_memory(request: PruneRequest) -> dict:
    return prune_in_memory(request)


@PIPELINES.register(
    Pipeline(
        "no-load",
        help="never hold the whole model: score from the shards or layer by layer, rewrite the shards one by one",
        # the counts of whole-expert drops follow from the streamed scores (uniform or global: per-layer
        # counts are written in moeprune's format); neuron widths must be one for all (a stock result)
        supports=lambda method, allocation: (
            (method.whole_experts and allocation.counts is not None and not allocation.searches)
            or (method.one_width and allocation.fixed)
        ),
        auto_criterion=False,
        repairs=False,
        why_limited="it never runs the loaded model: no search, no per-layer neuron widths",
        unread=(
            (
                (
                    "resume",
                    "save_dtype",
                    "max_shard_size",
                    "expert_multiple",
                    "ep_size",
                ),
                "with --no-load (it copies the input's shards and dtype)",
            ),
        ),
    )
)
def _no_load(request: PruneRequest) -> dict:
    return prune_without_loading(request)


# ----------------------------------------------------------------------------- scoring
@dataclass
class ScoreRequest:
    """One `moeprune score` job: the input, the criterion, where the scores go, and the options."""

    model_path: str | Path
    output: str | Path
    criterion: str
    data: DataOptions = field(default_factory=DataOptions)
    tokenizer_path: str | Path | None = None
    seed: int = 0
    run: RunOptions = field(default_factory=RunOptions)
    allow_super_experts: bool = False  # False: each layer's order puts its super experts last


@dataclass(frozen=True)
class ScorePipeline:
    name: str
    help: str
    needs: tuple[str, ...] = ()
    weights_only: bool = False  # only weight criteria (it never runs the model)
    unread: tuple[tuple[tuple[Setting, ...], str], ...] = ()
    fn: Callable[[ScoreRequest, Any, list], dict] | None = None  # (request, tokenizer, loaded data sets)

    def check(self, criterion: str) -> None:
        if self.weights_only and get_criterion(criterion).needs_data:
            raise MoePruneError(
                f"--{self.name} reads weights only; {criterion!r} needs data (use --sequential)",
                options=("criterion",),
            )


SCORE_PIPELINES: Registry[ScorePipeline] = Registry("score pipeline", "pipeline")
_DATA_SETTINGS = ("data", "samples", "max_length", "batch_size", "packing")


def score_pipeline(streaming: bool, data: DataOptions) -> ScorePipeline:
    """The score pipeline the options ask for: streamed weights, layer by layer, or the loaded model."""
    return SCORE_PIPELINES.get(
        "streaming" if streaming else "layer-by-layer" if data.sequential else "in-memory"
    )


def score_unread_settings(pipeline: ScorePipeline, criterion: str) -> list[tuple[tuple[Setting, ...], str]]:
    """(settings, why) for every setting this scoring run would ignore."""
    unread = list(pipeline.unread)
    if not get_criterion(criterion).needs_data:
        unread.append(
            ((*_DATA_SETTINGS, "tokenizer_path"), f"with criterion {criterion} (it reads weights only)")
        )
    return unread


def run_score(name: str, request: ScoreRequest) -> dict:
    """Check, score and write scores.json (rank 0 under torchrun); returns the scores document."""
    pipeline = SCORE_PIPELINES.get(name)
    pipeline.check(request.criterion)
    model_path, tokenizer, sets = prepare_score(
        request.model_path,
        request.output,
        request.criterion,
        data=request.data,
        tokenizer_path=request.tokenizer_path,
        overwrite=request.run.overwrite,
        trust_remote_code=request.run.trust_remote_code,
        load_sets=name == "in-memory",  # the others tokenize the data themselves
    )
    assert pipeline.fn is not None, f"score pipeline {name} registered without a function"
    rank, _ = init_distributed()  # torchrun: data-parallel observation; rank 0 writes
    run = replace(request.run, progress=request.run.progress and rank == 0)
    document = pipeline.fn(replace(request, model_path=model_path, run=run), tokenizer, sets)
    document = guard_document(document, request.allow_super_experts)  # the order prune would follow
    if rank == 0:
        write_json(request.output, document)
    return document


def _without_loading(request: ScoreRequest, _tokenizer, _sets) -> dict:
    crit, scores, stats, _ = score_without_loading(
        request.model_path,
        request.criterion,
        data=request.data,
        tokenizer_path=request.tokenizer_path,
        seed=request.seed,
        progress=request.run.progress,
    )
    return {
        **scores_document(crit, scores, stats),
        "unseen": unseen_experts(stats) if stats else {},
        "super_experts": found_in(stats),
    }


def _loaded(request: ScoreRequest, tokenizer, sets) -> dict:
    return score_loaded(
        Path(request.model_path),
        request.criterion,
        sets,
        request.data,
        tokenizer=tokenizer,
        seed=request.seed,
        run=request.run,
    )


SCORE_PIPELINES.add(ScorePipeline("in-memory", "load the model and observe it (the default)", fn=_loaded))
SCORE_PIPELINES.add(
    ScorePipeline(
        "layer-by-layer",
        "observe one decoder layer at a time from the shards (--sequential)",
        fn=_without_loading,
    )
)
SCORE_PIPELINES.add(
    ScorePipeline(
        "streaming",
        "weight-only criteria read expert by expert from the shards; the model is never loaded (--streaming)",
        weights_only=True,
        unread=(((*_DATA_SETTINGS, "sequential", "activations_dir"), "with --streaming (weights only)"),),
        fn=_without_loading,
    )
)
