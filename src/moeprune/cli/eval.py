"""`moeprune eval` and `moeprune report`: thin commands over moeprune.evaluate and moeprune.report."""

from __future__ import annotations

from pathlib import Path

import click

from moeprune.cli.main import command_line, main
from moeprune.cli.options import data_from_options, data_options, registry_help, vllm_options
from moeprune.errors import MoePruneError
from moeprune.evaluate import METRICS, EvalOptions, evaluate_models, parse_metrics
from moeprune.evaluate.lm_eval_bridge import (
    ENGINES,
    LmEvalOptions,
    check_engine,
    check_vllm_folders,
    parse_tasks,
    task_manager,
)
from moeprune.report.eval_plots import draw_directory, plot_acceptance
from moeprune.report.eval_report import to_markdown, write_report
from moeprune.report.summary import eval_lines
from moeprune.runtime.atomic import write_text
from moeprune.runtime.runlog import RunLog

_SPEC_MODES = {"greedy": ("greedy",), "sampled": ("sampled",), "both": ("greedy", "sampled")}


def _lm_eval_options(
    tasks: str | None, include: str | None, limit: float | None, batch_size: int, kwargs: dict
):
    """None without --lm-eval-tasks; else checked options (lm-eval installed, tasks known, and for
    --engine vllm a Python with vLLM and lm-eval), all before any model is loaded."""
    engine, vllm_python, vllm_option = kwargs["engine"], kwargs["vllm_python"], kwargs["vllm_option"]
    if not tasks:
        if include or limit is not None:
            raise MoePruneError("--lm-eval-include and --limit need --lm-eval-tasks")
        if engine != "hf" or vllm_python or vllm_option:
            raise MoePruneError(
                "--engine, --vllm-python and --vllm-option choose lm-eval's backend: they need --lm-eval-tasks"
            )
        return None
    if include and not Path(include).is_dir():
        raise MoePruneError(f"--lm-eval-include {include!r} is not a folder")
    if limit is not None and limit <= 0:
        raise MoePruneError(f"--limit must be positive, got {limit}")
    options = LmEvalOptions(
        tasks=parse_tasks(tasks),
        include=include,
        batch_size=batch_size,
        limit=None if limit is None else (limit if limit < 1 else int(limit)),
        engine=engine,
        vllm_python=vllm_python,
        vllm_options=vllm_options(vllm_option),
    )
    check_engine(options)
    task_manager(options)  # fails now, before any model is loaded
    return options


def _check_output(output: str | None, overwrite: bool) -> None:
    """The report, its Markdown and its run log are replaced only with --overwrite."""
    if not output or overwrite:
        return
    for path in (Path(output), Path(output).with_suffix(".md"), Path(output).with_suffix(".log")):
        if path.exists():
            raise MoePruneError(f"{str(path)!r} already exists; choose another --output or pass --overwrite")


@main.command("eval")
@click.argument("models", nargs=-1, required=True, metavar="MODEL...")
@click.option("--reference", "-r", required=True, type=click.Path(), help="The model MODEL was pruned from.")
@click.option("--compare", is_flag=True, help="Several MODELs side by side: eval --compare A B C -r REF.")
@click.option(
    "--metrics", default="all", show_default=True, help=registry_help(METRICS, "Comma list of, or all:")
)
@click.option(
    "--output",
    type=click.Path(),
    default=None,
    help="Report JSON (R.md, R.log and R_acceptance.png beside it); else print Markdown.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing report.")
@click.option("--plots/--no-plots", default=True, show_default=True, help="Draw PNGs beside --output.")
@click.option("--gamma", type=int, default=4, show_default=True, help="Speculative draft length.")
@click.option("--spec-mode", type=click.Choice(list(_SPEC_MODES)), default="both", show_default=True)
@click.option(
    "--spec-prompts", type=int, default=8, show_default=True, help="Prompts per data file for accept."
)
@click.option(
    "--spec-tokens", type=int, default=32, show_default=True, help="New tokens per prompt for accept."
)
@click.option("--temperature", type=float, default=1.0, show_default=True, help="Sampled speculative mode.")
@click.option(
    "--lm-eval-tasks", default=None, metavar="T1,T2", help="lm-eval-harness tasks (moeprune[eval])."
)
@click.option(
    "--lm-eval-include", type=click.Path(), default=None, help="Folder of extra lm-eval task YAMLs."
)
@click.option("--limit", type=float, default=None, help="lm-eval documents per task (< 1: a fraction).")
@click.option(
    "--engine",
    type=click.Choice(list(ENGINES)),
    default="hf",
    show_default=True,
    help="lm-eval backend: hf runs the loaded models here; vllm serves each folder in vLLM "
    "(moeprune's plugin), in a subprocess of --vllm-python.",
)
@click.option(
    "--vllm-python",
    type=click.Path(),
    default=None,
    help="--engine vllm: Python of an environment with vLLM, lm-eval and moeprune. Default: this one.",
)
@click.option(
    "--vllm-option",
    "vllm_option",
    multiple=True,
    metavar="KEY=VALUE",
    help="--engine vllm: extra vllm.LLM keyword (VALUE as JSON), e.g. max_model_len=2048 (repeatable).",
)
@data_options
def eval_command(models: tuple[str, ...], reference: str, **kwargs) -> None:
    """Evaluate pruned MODEL(s) against REFERENCE: esap, kl, nll, ppl, accept, routing, layer-error, size.

    Each --data file is evaluated and reported on its own (files are not mixed).
    """
    if len(models) > 1 and not kwargs["compare"]:
        raise MoePruneError(f"{len(models)} MODELs given: pass --compare to evaluate them side by side")
    output = kwargs["output"]
    _check_output(output, kwargs["overwrite"])
    options = EvalOptions(
        data=data_from_options(kwargs),
        metrics=parse_metrics(kwargs["metrics"]),
        tokenizer_path=kwargs["tokenizer_path"],
        dtype=kwargs["dtype"],
        device=kwargs.get("device"),
        gamma=kwargs["gamma"],
        spec_modes=_SPEC_MODES[kwargs["spec_mode"]],
        spec_prompts=kwargs["spec_prompts"],
        spec_tokens=kwargs["spec_tokens"],
        temperature=kwargs["temperature"],
        lm_eval=_lm_eval_options(
            kwargs["lm_eval_tasks"], kwargs["lm_eval_include"], kwargs["limit"], kwargs["batch_size"], kwargs
        ),
        log=(lambda _m: None) if kwargs["quiet"] else (lambda m: click.echo(m, err=True)),
        progress=not kwargs["quiet"],
    )
    if options.lm_eval is not None:  # vLLM's kernels for each folder, before any model loads
        check_vllm_folders(options.lm_eval, [*models, reference])
    with RunLog(command_line()) as log:
        doc = evaluate_models(list(models), reference, options)
        if not output:
            click.echo(to_markdown(doc))  # the whole table is the summary here
            return
        files = _write(doc, Path(output), kwargs["plots"])
        log_path = Path(output).with_suffix(".log")
        write_text(log_path, log.text())
    click.echo("\n".join(eval_lines(doc, [*files, log_path])))


def _write(doc: dict, output: Path, plots: bool) -> list[Path]:
    files = list(write_report(doc, output))
    if plots and any(d.get("accept") for m in doc["models"] for d in m["per_data"].values()):
        files.append(plot_acceptance(output.with_name(f"{output.stem}_acceptance.png"), doc))
    return files


@main.command("report")
@click.argument("folder", type=click.Path())
def report_command(folder: str) -> None:
    """(Re)draw plots and Markdown summaries from the JSON files in FOLDER (eval, plan, scores, search),
    and a pruned output's model card (README.md) from its report.json."""
    for path in draw_directory(folder):
        click.echo(f"wrote {path}")
