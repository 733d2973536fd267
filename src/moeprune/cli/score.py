"""`moeprune score`: one score per routed expert under one criterion, as JSON."""

from __future__ import annotations

import click

from moeprune.api import prepare_score, score_loaded
from moeprune.checkpoint import write_json
from moeprune.cli.main import main, refuse_given
from moeprune.cli.options import data_from_options, data_options, registry_help
from moeprune.config import RunOptions
from moeprune.criteria import CRITERIA, get_criterion, scores_document, unseen_experts
from moeprune.errors import MoePruneError
from moeprune.report.summary import score_lines
from moeprune.runtime.distributed import init_distributed
from moeprune.shards.prune import score_without_loading


@main.command()
@click.argument("model")
@click.option(
    "--criterion",
    required=True,
    type=click.Choice(CRITERIA.names()),
    help=registry_help(CRITERIA, "How experts are ranked:"),
)
@click.option("--output", required=True, type=click.Path(), help="Where to write scores.json.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
@click.option(
    "--streaming",
    is_flag=True,
    help="Weight-only criteria (aimer, magnitude, random) read expert by expert from the safetensors "
    "shards; the model is never loaded (memory: about one expert).",
)
@data_options
def score(model: str, criterion: str, output: str, overwrite: bool, streaming: bool, **kwargs) -> None:
    """Score every routed expert of MODEL with one criterion and write the scores as JSON."""
    data = data_from_options(kwargs)
    needs_data = get_criterion(criterion).needs_data
    if streaming and needs_data:
        raise MoePruneError(f"--streaming reads weights only; {criterion!r} needs data (use --sequential)")
    ctx = click.get_current_context()
    if streaming:
        refuse_given(
            ctx,
            ["data", "samples", "max_length", "batch_size", "packing", "sequential", "activations_dir"],
            "with --streaming (weights only)",
        )
    if not needs_data:
        refuse_given(
            ctx,
            ["data", "samples", "max_length", "batch_size", "packing", "tokenizer_path"],
            f"with criterion {criterion} (it reads weights only)",
        )
    # sequential observation tokenizes the data itself, layer by layer: only check it here
    model_path, tokenizer, sets = prepare_score(
        model,
        output,
        criterion,
        data=data,
        tokenizer_path=kwargs["tokenizer_path"],
        overwrite=overwrite,
        trust_remote_code=kwargs["trust_remote_code"],
        load_sets=not (streaming or data.sequential),
    )
    rank, _ = init_distributed()
    progress = not kwargs["quiet"] and rank == 0
    if streaming or data.sequential:
        crit, scores, stats, _ = score_without_loading(
            model_path,
            criterion,
            data=data,
            tokenizer_path=kwargs["tokenizer_path"],
            seed=kwargs["seed"],
            progress=progress,
        )
        document = {**scores_document(crit, scores, stats), "unseen": unseen_experts(stats) if stats else {}}
    else:
        document = score_loaded(
            model_path,
            criterion,
            sets,
            data,
            tokenizer=tokenizer,
            seed=kwargs["seed"],
            run=RunOptions(progress=progress, trust_remote_code=kwargs["trust_remote_code"]),
        )
    if rank != 0:  # torchrun: every rank holds the reduced statistics; one writes
        return
    write_json(output, document)
    click.echo("\n".join(score_lines(document, output)))
