"""The evaluation metrics, registered: each one's help, what it needs, and how it is measured on
one model (and one data file) of an evaluation (evaluate/run.py calls them).

The measurements themselves live beside: divergence.py, speculative.py, routing.py, layers.py,
size.py. A new metric is one function here with `@METRICS.register(Metric(...))`.
"""

from __future__ import annotations

from moeprune.evaluate.divergence import divergence
from moeprune.evaluate.layers import layer_error
from moeprune.evaluate.registry import METRICS, Metric
from moeprune.evaluate.routing import original_ids, routing_shift, selection_frequencies
from moeprune.evaluate.run import Context, Loaded, about, names, spec_prompts
from moeprune.evaluate.size import model_size
from moeprune.evaluate.speculative import SpecOptions, acceptance

_DIVERGENCE = ("esap", "kl", "nll", "ppl")


def _divergences(model: Loaded, ctx: Context, source: str, wanted: list[str]) -> dict:
    """esap, kl, nll and ppl from one pass of both models over the file."""
    data = ctx.datasets[source]
    if data.text_only:
        ctx.note(f"{source} is text only (no prompt/answer split): esap, kl, nll and ppl use all tokens")
    with about(f"on data file {source}"):
        scores = divergence(
            model.model,
            ctx.reference.model,
            data,
            batch_size=ctx.batch_size,
            pad_token_id=ctx.pad,
            labels=names(model, ctx),
        )
    out = {k: v for k, v in scores.items() if k in wanted or k not in _DIVERGENCE}
    for key in ("ppl", "reference_ppl"):
        if key in out and out[key] is None:
            ctx.note(f"{source}: {key} is null: the mean NLL is too large for its exponential to be a float")
    return out


for _name, _help, _aliases in (
    ("esap", "sum_v min(p, q) = 1 - TV against the reference on answer tokens (expected acceptance)", ()),
    ("kl", "sum_v p log(p / q), the reference to the model, on answer tokens", ()),
    ("nll", "the model's mean answer-token NLL (per sample, then over samples)", ()),
    ("ppl", "exp of the token-weighted mean NLL (so not exp(nll))", ("perplexity",)),
):
    METRICS.add(Metric(_name, _help, aliases=_aliases, fn=_divergences))


@METRICS.register(
    Metric(
        "accept",
        "true speculative decoding, the model drafting for the reference: acceptance rate, "
        "accepted tokens per call, per draft position",
        aliases=("acceptance",),
    )
)
def _accept(model: Loaded, ctx: Context, source: str, wanted: list[str]) -> dict:
    opts = ctx.options
    prompts, halved = spec_prompts(ctx.datasets[source], opts.spec_prompts)
    if halved:
        ctx.note(
            f"{source}: samples without a prompt/answer split use their first half as the speculative prompt"
        )
    with about(f"speculative decoding on data file {source}"):
        spec = SpecOptions(
            gamma=opts.gamma,
            max_new_tokens=opts.spec_tokens,
            temperature=opts.temperature,
            eos_token_id=getattr(ctx.tokenizer, "eos_token_id", None),
        )
        results = acceptance(
            model.model,
            ctx.reference.model,
            prompts,
            spec,
            modes=opts.spec_modes,
            seed=opts.data.seed if opts.data is not None else 0,
            labels=names(model, ctx),
        )
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


def _frequencies(loaded: Loaded, role: str, ctx: Context, source: str) -> dict:
    with about(f"routing of {role} {loaded.label} on data file {source}"):
        freq, _ = selection_frequencies(
            loaded.moe,
            ctx.datasets[source],
            original_ids(loaded.moe, loaded.path),
            batch_size=ctx.batch_size,
            pad_token_id=ctx.pad,
        )
    return freq


@METRICS.register(
    Metric("routing", "change in expert selection frequency per layer, experts matched by original id")
)
def _routing(model: Loaded, ctx: Context, source: str, wanted: list[str]) -> dict:
    if source not in ctx.reference_routing:
        ctx.reference_routing[source] = _frequencies(ctx.reference, "the reference", ctx, source)
    mine = _frequencies(model, "the model", ctx, source)
    return {"routing": routing_shift(mine, ctx.reference_routing[source])}


@METRICS.register(
    Metric(
        "layer-error",
        "relative L2 distance of every decoder layer's output to the reference's",
        aliases=("layer_error",),
    )
)
def _layer_error(model: Loaded, ctx: Context, source: str, wanted: list[str]) -> dict:
    with about(f"layer-error on data file {source}"):
        errors = layer_error(
            model.model,
            ctx.reference.model,
            ctx.datasets[source],
            batch_size=ctx.batch_size,
            pad_token_id=ctx.pad,
            labels=names(model, ctx),
        )
    return {"layer_error": errors}


@METRICS.register(
    Metric(
        "size",
        "total, routed-expert and active-per-token parameters, bytes on disk, peak memory to load",
        per_file=False,
        needs=(),
        measures_loading=True,
    )
)
def _size(model: Loaded, ctx: Context) -> dict:
    return model_size(model.moe, model.path, model.load_info)
