"""Evaluate pruned models against their reference: divergences, speculative acceptance, routing
shift, per-layer error, sizes and (optionally) lm-eval-harness accuracies.

Why one orchestrator: every metric needs the same two models, the same tokenizer check and the
same per-file data; loading each model once and scoring every file with it keeps an evaluation
of several candidates (``--compare``) to one load per model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from moeprune import __version__
from moeprune.data.loading import CalibrationData, load_data
from moeprune.errors import DataError, MoePruneError
from moeprune.evaluate.divergence import DIVERGENCE_METRICS, divergence
from moeprune.evaluate.layers import layer_error
from moeprune.evaluate.routing import PLAN_FILE, original_ids, routing_shift, selection_frequencies
from moeprune.evaluate.size import measure_peak, model_size, warm_up_loading
from moeprune.evaluate.speculative import MODES, acceptance
from moeprune.models import MoEModel
from moeprune.runtime.finite import NonFiniteError, check_finite_weights

if TYPE_CHECKING:
    from moeprune.api import DataOptions
    from moeprune.evaluate.lm_eval_bridge import LmEvalOptions

METRICS = (*DIVERGENCE_METRICS, "accept", "routing", "layer-error", "size")
_ALIASES = {"layer_error": "layer-error", "perplexity": "ppl", "acceptance": "accept", "all": "all"}
_NO_DATA = "these metrics need evaluation data: pass --data FILE (repeat for several files)"

__all__ = ["METRICS", "EvalOptions", "Loaded", "evaluate_loaded", "evaluate_models", "parse_metrics"]


def parse_metrics(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """Metric names from "esap,kl" (or a list); "all" or nothing means every metric, in METRICS order."""
    names = spec.split(",") if isinstance(spec, str) else list(spec or ["all"])
    wanted = {_ALIASES.get(n.strip().lower(), n.strip().lower()) for n in names if n.strip()}
    if not wanted or "all" in wanted:
        return METRICS
    unknown = sorted(wanted - set(METRICS))
    if unknown:
        raise MoePruneError(
            f"unknown metric(s) {', '.join(unknown)}; choose from {', '.join(METRICS)} or all"
        )
    return tuple(m for m in METRICS if m in wanted)


@dataclass
class EvalOptions:
    """What to measure and how much of it; data options are moeprune.pipeline.DataOptions."""

    data: DataOptions | None = None  # None: no data (only size / lm-eval)
    metrics: Sequence[str] = METRICS
    tokenizer_path: str | None = None
    dtype: str | None = None
    device: str | None = None
    gamma: int = 4
    spec_modes: Sequence[str] = MODES
    spec_prompts: int = 8
    spec_tokens: int = 32
    temperature: float = 1.0
    lm_eval: LmEvalOptions | None = None
    log: Callable[[str], None] = field(default=lambda _msg: None)

    def needs_data(self) -> bool:
        return any(m != "size" for m in self.metrics)


@dataclass
class Loaded:
    """A model with what the metrics need to know about it."""

    label: str
    model: object  # PreTrainedModel
    tokenizer: object = None
    path: str | None = None
    load_info: dict = field(default_factory=dict)

    @property
    def moe(self) -> MoEModel:
        return MoEModel(self.model)

    @classmethod
    def from_path(cls, path: str, options: EvalOptions) -> Loaded:
        from moeprune.checkpoint import load_model
        from moeprune.runtime.distributed import placement

        _warm_up(path, measure="size" in options.metrics)
        device, dtype, device_map = placement(options.device, options.dtype)  # as score and prune do
        load = lambda: load_model(path, dtype=dtype, device=device, device_map=device_map)  # noqa: E731
        (model, tokenizer), info = measure_peak(load)
        return cls(label=_label(path), model=model, tokenizer=tokenizer, path=str(path), load_info=info)

    def vocab_size(self) -> int:
        head = self.model.get_output_embeddings()
        return int(head.weight.shape[0]) if head is not None else int(self.model.config.vocab_size)


def _warm_up(path: str, measure: bool) -> None:
    """Validate the config first (clear errors before any weight is read); warm the loader to measure."""
    from moeprune.checkpoint import load_config

    config = load_config(path)
    if measure:
        warm_up_loading(config.model_type)


def _label(path: str) -> str:
    return Path(path).name or str(path)


def check_compatible(model: Loaded, reference: Loaded) -> None:
    """Refuse pairs whose next-token distributions are not over the same tokens."""
    why = "metrics compare next-token distributions token by token, so both must share one vocabulary"
    if model.vocab_size() != reference.vocab_size():
        raise MoePruneError(
            f"{model.label} predicts over {model.vocab_size()} tokens but the reference {reference.label} over "
            f"{reference.vocab_size()}: {why}; evaluate against the model it was pruned from"
        )
    if model.tokenizer is not None and reference.tokenizer is not None:
        ours, theirs = model.tokenizer.get_vocab(), reference.tokenizer.get_vocab()
        differ = sum(ours.get(t) != i for t, i in theirs.items()) + len(set(ours) - set(theirs))
        if differ:
            raise MoePruneError(
                f"{model.label} and the reference {reference.label} have different tokenizers "
                f"({differ} tokens differ): {why}"
            )


def _tokenizer(reference: Loaded, models: Sequence[Loaded], options: EvalOptions):
    from moeprune.checkpoint import load_tokenizer

    if options.tokenizer_path:
        tok = load_tokenizer(options.tokenizer_path)
        if tok is None:
            raise MoePruneError(f"no tokenizer files in {options.tokenizer_path!r}")
        return tok
    for loaded in (reference, *models):
        if loaded.tokenizer is not None:
            return loaded.tokenizer
    raise MoePruneError(f"no tokenizer in {reference.path or reference.label!r}; pass --tokenizer PATH")


def load_eval_data(tokenizer, data_options: DataOptions | None) -> dict[str, CalibrationData]:
    """One data set per --data file: every metric is reported per file."""
    if data_options is None or not data_options.sources:
        raise DataError(_NO_DATA)
    return {
        str(source): load_data(
            [source],
            tokenizer,
            num_samples=data_options.samples,
            max_length=data_options.max_length,
            seed=data_options.seed,
            packing=data_options.packing,
        )  # fmt: skip
        for source in data_options.sources
    }


def spec_prompts(data: CalibrationData, count: int) -> tuple[list[list[int]], bool]:
    """Prompts for speculative decoding: each sample up to its answer (text only: its first half)."""
    prompts, halved = [], False
    for sample in data.samples[:count]:
        first = sample.answer_mask.index(True) if True in sample.answer_mask else len(sample.input_ids)
        if first == 0:
            first, halved = max(1, len(sample.input_ids) // 2), True
        prompts.append(sample.input_ids[:first])
    return prompts, halved


@dataclass
class _Context:
    """What is shared by every model of one evaluation: data, reference-only results, notes."""

    reference: Loaded
    tokenizer: object
    datasets: dict[str, CalibrationData]
    options: EvalOptions
    notes: list[str] = field(default_factory=list)
    reference_routing: dict[str, dict] = field(default_factory=dict)
    reference_lm_eval: dict | None = None  # filled once by the lm-eval bridge

    @property
    def pad(self) -> int:
        return getattr(self.tokenizer, "pad_token_id", None) or 0

    @property
    def batch_size(self) -> int:
        return self.options.data.batch_size

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            self.options.log(f"note: {text}")


def _frequencies(loaded: Loaded, role: str, ctx: _Context, source: str) -> dict:
    with _about(f"routing of {role} {loaded.label} on data file {source}"):
        freq, _ = selection_frequencies(
            loaded.moe,
            ctx.datasets[source],
            original_ids(loaded.moe, loaded.path),
            batch_size=ctx.batch_size,
            pad_token_id=ctx.pad,
        )
    return freq


def _reference_frequencies(ctx: _Context, source: str) -> dict:
    if source not in ctx.reference_routing:
        ctx.reference_routing[source] = _frequencies(ctx.reference, "the reference", ctx, source)
    return ctx.reference_routing[source]


@contextmanager
def _about(where: str) -> Iterator[None]:
    """NaN/inf found inside a metric: the error says which metric, model and data file."""
    try:
        yield
    except NonFiniteError as exc:
        raise exc.within(where) from None


def _names(model: Loaded, ctx: _Context) -> tuple[str, str]:
    return f"the model {model.label}", f"the reference {ctx.reference.label}"


def _per_file(model: Loaded, ctx: _Context, source: str) -> dict:
    """Every requested data metric of one model on one data file."""
    data, metrics, ref = ctx.datasets[source], ctx.options.metrics, ctx.reference
    out: dict[str, object] = {"samples": len(data.samples), "text_only": data.text_only}
    if data.text_only and set(metrics) & set(DIVERGENCE_METRICS):
        ctx.note(f"{source} is text only (no prompt/answer split): esap, kl, nll and ppl use all tokens")
    if set(metrics) & set(DIVERGENCE_METRICS):
        with _about(f"on data file {source}"):
            scores = divergence(
                model.model, ref.model, data, batch_size=ctx.batch_size, pad_token_id=ctx.pad,
                labels=_names(model, ctx),
            )  # fmt: skip
        out.update({k: v for k, v in scores.items() if k in metrics or k not in DIVERGENCE_METRICS})
        for key in ("ppl", "reference_ppl"):
            if key in out and out[key] is None:
                ctx.note(
                    f"{source}: {key} is null: the mean NLL is too large for its exponential to be a float"
                )
    if "accept" in metrics:
        out.update(_accept(model, ctx, source))
    if "routing" in metrics:
        out["routing"] = routing_shift(
            _frequencies(model, "the model", ctx, source), _reference_frequencies(ctx, source)
        )
    if "layer-error" in metrics:
        with _about(f"layer-error on data file {source}"):
            out["layer_error"] = layer_error(
                model.model, ref.model, data, batch_size=ctx.batch_size, pad_token_id=ctx.pad,
                labels=_names(model, ctx),
            )  # fmt: skip
    return out


def _accept(model: Loaded, ctx: _Context, source: str) -> dict:
    opts = ctx.options
    prompts, halved = spec_prompts(ctx.datasets[source], opts.spec_prompts)
    if halved:
        ctx.note(
            f"{source}: samples without a prompt/answer split use their first half as the speculative prompt"
        )
    with _about(f"speculative decoding on data file {source}"):
        results = acceptance(
            model.model, ctx.reference.model, prompts, gamma=opts.gamma, max_new_tokens=opts.spec_tokens,
            modes=opts.spec_modes, seed=opts.data.seed, temperature=opts.temperature,
            eos_token_id=getattr(ctx.tokenizer, "eos_token_id", None), labels=_names(model, ctx),
        )  # fmt: skip
    main = results.get("sampled") or next(iter(results.values()))
    if main["accept_rate"] is None:
        ctx.note(
            f"{source}: accept_rate is null: no token was drafted (one new token per prompt leaves no room)"
        )
    return {
        "accept_rate": main["accept_rate"],
        "accepted_per_call": main["mean_accepted_per_call"],
        "accept": results,
    }


def _plan_summary(path: str | None) -> dict | None:
    from moeprune.plan import Plan

    plan_path = Path(path) / PLAN_FILE if path else None
    if plan_path is None or not plan_path.is_file():
        return None
    plan = Plan.load(plan_path)
    return {
        "criterion": plan.criterion, "allocation": plan.allocation, "method": plan.method,
        "sparsity": plan.sparsity, "kept_per_layer": {str(lp.layer): len(lp.kept) for lp in plan.layers},
    }  # fmt: skip


def evaluate_pair(model: Loaded, ctx: _Context) -> dict:
    """One model's entry of the report."""
    entry: dict[str, object] = {"label": model.label, "model": model.path, "plan": _plan_summary(model.path)}
    entry["per_data"] = {}
    for source in ctx.datasets:
        ctx.options.log(f"{model.label}: {source}")
        entry["per_data"][source] = _per_file(model, ctx, source)
    if "size" in ctx.options.metrics:
        entry["size"] = model_size(model.moe, model.path, model.load_info)
    if ctx.options.lm_eval is not None:
        from moeprune.evaluate.lm_eval_bridge import lm_eval_entry

        entry["lm_eval"] = lm_eval_entry(model, ctx)
    return entry


def _context(reference: Loaded, first: Loaded, options: EvalOptions) -> _Context:
    wants_tokenizer = options.needs_data() or options.lm_eval is not None
    tokenizer = _tokenizer(reference, [first], options) if wants_tokenizer else reference.tokenizer
    datasets = load_eval_data(tokenizer, options.data) if options.needs_data() else {}
    ctx = _Context(reference, tokenizer, datasets, options)
    for source, data in datasets.items():
        for note in data.notes:
            ctx.note(f"{source}: {note}")
    return ctx


def evaluate_loaded(models: Iterable[Loaded], reference: Loaded, options: EvalOptions) -> dict:
    """The report document (see report.py) for `models`, consumed one at a time.

    Every model's weights, the reference's first, are checked for NaN and infinity before use.
    """
    check_finite_weights(reference.model, f"the reference {reference.path or reference.label}")
    ctx, entries = None, []
    for model in models:
        check_finite_weights(model.model, f"the model {model.path or model.label}")
        check_compatible(model, reference)
        ctx = ctx or _context(reference, model, options)
        entries.append(evaluate_pair(model, ctx))
    if ctx is None:
        raise MoePruneError("pass at least one MODEL to evaluate")
    return _document(ctx, entries)


def _document(ctx: _Context, entries: list[dict]) -> dict:
    opts, data = ctx.options, ctx.options.data
    doc: dict[str, object] = {
        "command": "eval",
        "moeprune_version": __version__,
        "reference": ctx.reference.path or ctx.reference.label,
        "metrics": list(opts.metrics),
        "data": {
            "files": list(ctx.datasets),
            "samples": getattr(data, "samples", None),
            "max_length": getattr(data, "max_length", None),
            "seed": getattr(data, "seed", None),
        },
        "speculative": {"gamma": opts.gamma, "modes": list(opts.spec_modes), "prompts": opts.spec_prompts,
                        "max_new_tokens": opts.spec_tokens, "temperature": opts.temperature},
        "models": entries,
        "notes": ctx.notes,
    }  # fmt: skip
    if "size" in opts.metrics:
        doc["reference_size"] = model_size(ctx.reference.moe, ctx.reference.path, ctx.reference.load_info)
    if opts.lm_eval is not None:
        from moeprune.evaluate.lm_eval_bridge import reference_entry

        doc["reference_lm_eval"] = reference_entry(ctx)
    return doc


def evaluate_models(models: Sequence[str], reference: str, options: EvalOptions) -> dict:
    """Load the reference once and each model in turn (only one candidate in memory at a time)."""
    if not models:
        raise MoePruneError("pass at least one MODEL to evaluate")
    if options.needs_data():
        _check_sources(options.data)
    ref = Loaded.from_path(reference, options)
    return evaluate_loaded((Loaded.from_path(p, options) for p in models), ref, options)


def _check_sources(data_options: DataOptions | None) -> None:
    """Fail on a missing data file before any model is loaded."""
    from moeprune.data.loading import parse_source

    sources = getattr(data_options, "sources", None)
    if not sources:
        raise DataError(_NO_DATA)
    for source in sources:
        path, _ = parse_source(str(source))
        if not Path(path).exists():
            raise DataError(f"data path {path} does not exist")
