"""`moeprune demo`: the embedded default job on a small MoE trained locally."""

from __future__ import annotations

import click
import torch

from moeprune.cli.main import command_line, main
from moeprune.demo.run import run_demo
from moeprune.demo.train import FAMILIES
from moeprune.report.summary import demo_lines
from moeprune.runtime.runlog import RunLog


@main.command("demo")
@click.option(
    "--output",
    type=click.Path(),
    default="moeprune-demo",
    show_default=True,
    help="Folder for results.json, results.md and plots.",
)
@click.option("--quick", is_flag=True, help="Smaller model and fewer configurations (about 2 minutes).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--rebuild", is_flag=True, help="Retrain the cached demo model.")
@click.option(
    "--threads",
    type=int,
    default=1,
    show_default=True,
    help="torch CPU threads (one is fastest on a busy 2-core machine).",
)
@click.option(
    "--family",
    type=click.Choice(FAMILIES),
    default="qwen3_moe",
    show_default=True,
    help="The demo model's architecture (deepseek_v3: sigmoid router with a selection bias, a shared "
    "expert, a dense first layer).",
)
@click.option("--quiet", is_flag=True, help="No progress bars.")
def demo(
    output: str, quick: bool, overwrite: bool, rebuild: bool, threads: int, family: str, quiet: bool
) -> None:
    """Train (or reuse) a small MoE on local text, prune it many ways, print the comparison."""
    torch.set_num_threads(threads)
    with RunLog(command_line()):  # the demo's moeprune.log names this command
        results = run_demo(
            output,
            quick=quick,
            overwrite=overwrite,
            progress=not quiet,
            rebuild=rebuild,
            threads=threads,
            family=family,
        )
    click.echo(results["table"])
    click.echo(
        "\nNLL: held-out answer tokens per domain (lower is better); ESAP: expected speculative "
        "acceptance vs the full model (higher is better).\n"
    )
    click.echo("\n".join(demo_lines(results, output)))
