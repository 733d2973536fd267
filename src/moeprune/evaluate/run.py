"""One evaluation: the reference and each model loaded once, every requested metric measured on
every data file, and the report document.

Why one orchestrator: every metric needs the same two models, the same tokenizer check and the
same per-file data; loading each model once and scoring every file with it keeps an evaluation
of several candidates (`--compare`) to one load per model. The metrics themselves are the
METRICS registry's (evaluate/metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from moeprune import __version__
from moeprune.checkpoint import load_config, load_model, load_tokenizer
from moeprune.config import DataOptions
from moeprune.data.loading import CalibrationData, load_data, parse_source
from moeprune.errors import DataError, MoePruneError
from moeprune.evaluate.lm_eval_bridge import lm_eval_entry, reference_entry
from moeprune.evaluate.registry import METRICS, Metric, parse_metrics
from moeprune.evaluate.routing import PLAN_FILE
from moeprune.evaluate.size import measure_peak, warm_up_loading
from moeprune.evaluate.speculative import MODES
from moeprune.models import MoEModel
from moeprune.plan import Plan
from moeprune.runtime.device import Placement
from moeprune.runtime.finite import NonFiniteError, check_finite_weights
from moeprune.runtime.progress import stage, transformers_bars_off

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from moeprune.evaluate.lm_eval_bridge import LmEvalOptions

_NO_DATA = "these metrics need evaluation data: give data files (each is reported on its own)"


@dataclass
class EvalOptions:
    """What to measure and how much of it."""

    data: DataOptions | None = None  # None: no data (only size / lm-eval)
    metrics: Sequence[str] = field(default_factory=lambda: parse_metrics("all"))
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
    progress: bool = False  # a line per model load and per metric (see runtime.progress)

    def needs_data(self) -> bool:
        return any(METRICS.get(m).per_file for m in self.metrics)


@dataclass
class Loaded:
    """A model with what the metrics need to know about it."""

    label: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None = None
    path: str | None = None
    load_info: dict = field(default_factory=dict)

    @property
    def moe(self) -> MoEModel:
        return MoEModel(self.model)

    @classmethod
    def from_path(cls, path: str, options: EvalOptions) -> Loaded:
        _warm_up(path, measure=any(METRICS.get(m).measures_loading for m in options.metrics))
        placed = Placement.choose(options.device, options.dtype)  # as score and prune do
        device, dtype, device_map = placed.device, placed.dtype, placed.device_map
        load = lambda: load_model(path, dtype=dtype, device=device, device_map=device_map)  # noqa: E731
        with stage(f"loading {path}", options.progress), transformers_bars_off():
            (model, tokenizer), info = measure_peak(load)
        return cls(label=_label(path), model=model, tokenizer=tokenizer, path=str(path), load_info=info)

    def vocab_size(self) -> int:
        head = self.model.get_output_embeddings()
        return int(head.weight.shape[0]) if head is not None else int(self.model.config.vocab_size)


def _warm_up(path: str, measure: bool) -> None:
    """Validate the config first (clear errors before any weight is read); warm the loader to measure."""
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
    if options.tokenizer_path:
        tok = load_tokenizer(options.tokenizer_path)
        if tok is None:
            raise MoePruneError(f"no tokenizer files in {options.tokenizer_path!r}")
        return tok
    for loaded in (reference, *models):
        if loaded.tokenizer is not None:
            return loaded.tokenizer
    raise MoePruneError(
        f"no tokenizer in {reference.path or reference.label!r}; give its path", options=("tokenizer",)
    )


def load_eval_data(tokenizer, data_options: DataOptions | None) -> dict[str, CalibrationData]:
    """One data set per data file: every metric is reported per file."""
    if data_options is None or not data_options.sources:
        raise DataError(_NO_DATA, options=("data",))
    return {
        str(source): load_data(
            [source],
            tokenizer,
            num_samples=data_options.samples,
            max_length=data_options.max_length,
            seed=data_options.seed,
            packing=data_options.packing,
        )
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
class Context:
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
        data = self.options.data
        assert data is not None, _NO_DATA  # asked by the data metrics only
        return data.batch_size

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            self.options.log(f"note: {text}")


@contextmanager
def about(where: str) -> Iterator[None]:
    """NaN/inf found inside a metric: the error says which metric, model and data file."""
    try:
        yield
    except NonFiniteError as exc:
        raise exc.within(where) from None


def names(model: Loaded, ctx: Context) -> tuple[str, str]:
    return f"the model {model.label}", f"the reference {ctx.reference.label}"


def per_file(model: Loaded, ctx: Context, source: str) -> dict:
    """Every requested data metric of one model on one data file (a shared computation runs once)."""
    data = ctx.datasets[source]
    out: dict[str, object] = {"samples": len(data.samples), "text_only": data.text_only}
    wanted = [METRICS.get(m) for m in ctx.options.metrics if METRICS.get(m).per_file]
    done = []
    for metric in wanted:
        if metric.fn in done:
            continue
        done.append(metric.fn)
        names = [m.name for m in wanted if m.fn is metric.fn]
        with stage(f"{model.label}: {', '.join(names)} on {Path(source).name}", ctx.options.progress):
            out.update(_fn(metric)(model, ctx, source, names))
    return out


def _fn(metric: Metric) -> Callable:
    assert metric.fn is not None, f"metric {metric.name!r} registered without a function"
    return metric.fn


def _plan_summary(path: str | None) -> dict | None:
    plan_path = Path(path) / PLAN_FILE if path else None
    if plan_path is None or not plan_path.is_file():
        return None
    plan = Plan.load(plan_path)
    return {
        "criterion": plan.criterion,
        "allocation": plan.allocation,
        "method": plan.method,
        **({"reroute": plan.extra["reroute"]} if "reroute" in plan.extra else {}),  # drop --reroute none
        "sparsity": plan.sparsity,
        "kept_per_layer": {str(lp.layer): len(lp.kept) for lp in plan.layers},  # router positions
    }


def evaluate_pair(model: Loaded, ctx: Context) -> dict:
    """One model's entry of the report."""
    entry: dict[str, object] = {"label": model.label, "model": model.path, "plan": _plan_summary(model.path)}
    per_data: dict[str, dict] = {}
    entry["per_data"] = per_data
    for source in ctx.datasets:
        per_data[source] = per_file(model, ctx, source)
    for name in ctx.options.metrics:
        metric = METRICS.get(name)
        if not metric.per_file:
            with stage(f"{model.label}: {name}", ctx.options.progress):
                entry[metric.report_key or name] = _fn(metric)(model, ctx)
    if ctx.options.lm_eval is not None:
        with stage(f"{model.label}: lm-eval {', '.join(ctx.options.lm_eval.tasks)}", ctx.options.progress):
            entry["lm_eval"] = lm_eval_entry(model, ctx)
    return entry


def _context(reference: Loaded, first: Loaded, options: EvalOptions) -> Context:
    wants_tokenizer = options.needs_data() or options.lm_eval is not None
    tokenizer = _tokenizer(reference, [first], options) if wants_tokenizer else reference.tokenizer
    datasets = load_eval_data(tokenizer, options.data) if options.needs_data() else {}
    ctx = Context(reference, tokenizer, datasets, options)
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


def _document(ctx: Context, entries: list[dict]) -> dict:
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
        "speculative": {
            "gamma": opts.gamma,
            "modes": list(opts.spec_modes),
            "prompts": opts.spec_prompts,
            "max_new_tokens": opts.spec_tokens,
            "temperature": opts.temperature,
        },
        "models": entries,
        "notes": ctx.notes,
    }
    for name in opts.metrics:
        metric = METRICS.get(name)
        if not metric.per_file:
            doc[f"reference_{metric.report_key or name}"] = _fn(metric)(ctx.reference, ctx)
    if opts.lm_eval is not None:
        doc["reference_lm_eval"] = reference_entry(ctx)
        doc["lm_eval_engine"] = opts.lm_eval.engine  # hf or vllm: the scores' kernels differ
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
    sources = getattr(data_options, "sources", None)
    if not sources:
        raise DataError(_NO_DATA, options=("data",))
    for source in sources:
        path, _ = parse_source(str(source))
        if not Path(path).exists():
            raise DataError(f"data path {path} does not exist")
