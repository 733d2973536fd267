"""`moeprune inspect`: a checkpoint's MoE structure and parameter counts, without loading weights."""

from __future__ import annotations

import json

import click

from moeprune.cli.main import main
from moeprune.errors import MoePruneError
from moeprune.models.factory import moe_families, tiny_model
from moeprune.report.describe import describe_checkpoint, describe_model, format_description


@main.command()
@click.argument("model", required=False)
@click.option(
    "--tiny",
    metavar="FAMILY",
    help="Inspect a built-in tiny random model of any MoE family of the installed transformers (a model type).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--trust-remote-code", is_flag=True, help="Allow the checkpoint's own config code; never run otherwise."
)
def inspect(model: str | None, tiny: str | None, as_json: bool, trust_remote_code: bool) -> None:
    """Show a checkpoint's MoE structure and parameter counts (weights are not loaded)."""
    if tiny:
        if tiny not in moe_families():
            raise MoePruneError(
                f"{tiny!r} is not an MoE family of the installed transformers; families: {', '.join(moe_families())}"
            )
        try:
            tiny_moe = tiny_model(tiny)
        except ValueError as exc:
            raise MoePruneError(str(exc)) from exc
        info = describe_model(tiny_moe, source=f"built-in tiny {tiny}")
    elif model:
        info = describe_checkpoint(model, trust_remote_code=trust_remote_code)
    else:
        raise MoePruneError("pass a MODEL folder, or --tiny FAMILY for a built-in tiny model")
    click.echo(json.dumps(info, indent=2) if as_json else format_description(info))
