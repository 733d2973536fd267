"""`moeprune score`: one score per routed expert under one criterion, as JSON."""

from __future__ import annotations

import click

from moeprune.cli.main import main, refuse_unread
from moeprune.cli.options import data_from_options, data_options, registry_help
from moeprune.config import RunOptions
from moeprune.criteria import CRITERIA
from moeprune.job.pipelines import ScoreRequest, run_score, score_pipeline, score_unread_settings
from moeprune.report.summary import score_lines
from moeprune.runtime.distributed import rank_and_world


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
@click.option(
    "--allow-super-experts",
    is_flag=True,
    help="Give each layer's pruning order as the criterion ranks it; by default the super experts found in "
    "the calibration data come last, as moeprune prune keeps them.",
)
@data_options
def score(
    model: str,
    criterion: str,
    output: str,
    overwrite: bool,
    streaming: bool,
    allow_super_experts: bool,
    **kwargs,
) -> None:
    """Score every routed expert of MODEL with one criterion and write the scores as JSON."""
    data = data_from_options(kwargs)
    pipeline = score_pipeline(streaming, data)
    pipeline.check(criterion)
    ctx = click.get_current_context()
    refuse_unread(ctx, score_unread_settings(pipeline, criterion))  # typed but never read: refused
    request = ScoreRequest(
        model,
        output,
        criterion,
        data=data,
        tokenizer_path=kwargs["tokenizer_path"],
        seed=kwargs["seed"],
        allow_super_experts=allow_super_experts,
        run=RunOptions(
            progress=not kwargs["quiet"], overwrite=overwrite, trust_remote_code=kwargs["trust_remote_code"]
        ),
    )
    document = run_score(pipeline.name, request)
    if rank_and_world()[0] == 0:  # torchrun: every rank holds the reduced statistics; one wrote them
        click.echo("\n".join(score_lines(document, output)))
