"""`moeprune ...`: a thin command layer over the Python API in moeprune.pipeline.

User errors (MoePruneError) print one line on stderr and exit with code 2; nothing is written.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import click
import torch

from moeprune import __version__
from moeprune.criteria import list_criteria
from moeprune.errors import MoePruneError
from moeprune.models.spec import supported_families


class MoePruneGroup(click.Group):
    """Turns MoePruneError into one clear line and exit code 2, naming the flags that fix it."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[ARGV] = list(args)  # as typed, for the model card
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:  # a bad flag or value: one line, not click's usage block
            where = f"moeprune {ctx.invoked_subcommand}" if ctx.invoked_subcommand else "moeprune"
            click.echo(f"moeprune: error: {exc.format_message()} (see '{where} --help')", err=True)
            sys.exit(2)
        except MoePruneError as exc:
            command = self.get_command(ctx, ctx.invoked_subcommand) if ctx.invoked_subcommand else None
            click.echo(f"moeprune: error: {exc}{flag_hint(command, exc.options)}", err=True)
            sys.exit(2)


ARGV = "moeprune.argv"


def command_line() -> str:
    """The command as typed (for the model card's "Reproduce" section)."""
    import shlex

    return shlex.join(["moeprune", *click.get_current_context().meta.get(ARGV, sys.argv[1:])])


def flag_hint(command: click.Command | None, options: tuple[str, ...]) -> str:
    """" (--overwrite)" for an error whose fix is the API parameter `overwrite`."""
    flags = []
    for name in options:
        param = next((p for p in (command.params if command else []) if p.name == name), None)
        long = [o for o in (param.opts if param else []) if o.startswith("--")]
        flags.append(long[0] if long else "--" + name.replace("_", "-"))
    return f" ({', '.join(flags)})" if flags else ""


@click.group(cls=MoePruneGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="moeprune")
def main() -> None:
    """Compress Mixture-of-Experts language models: observe, score, allocate, prune, evaluate."""


def data_options(func):
    """Options shared by every command that reads calibration data."""
    options = [
        click.option("--data", "data", multiple=True, metavar="FILE[:WEIGHT]",
                     help="Data file (JSONL/.txt/.parquet/.arrow/save_to_disk folder); repeat for several."),
        click.option("--samples", type=click.IntRange(min=0), default=128, show_default=True,
                     help="Samples to draw (0 = all)."),
        click.option("--max-length", type=click.IntRange(min=1), default=512, show_default=True,
                     help="Truncate samples to L tokens."),
        click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True),
        click.option("--packing/--no-packing", default=False, show_default=True, help="Pack samples into full rows."),
        click.option("--tokenizer", "tokenizer_path", type=click.Path(), default=None,
                     help="Tokenizer folder, if the checkpoint has none."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
                     help="Model dtype [default: bf16 on GPU, fp32 on CPU]."),
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="torch CPU threads (default: torch's choice)."),
        click.option("--trust-remote-code", is_flag=True,
                     help="Allow a checkpoint's own Python code (tokenizer or config); never run otherwise."),
        click.option("--device", default=None,
                     help="cpu, cuda, cuda:N or auto (accelerate device_map over all GPUs) [default: GPU if any]."),
        click.option("--sequential", is_flag=True,
                     help="Observe one decoder layer at a time without loading the whole model (score, prune --no-load)."),
        click.option("--activations-dir", type=click.Path(file_okay=False), default=None,
                     help="--sequential: keep the cached activations in a temporary folder here (on disk) instead "
                          "of in memory; removed afterwards."),
        click.option("--quiet", is_flag=True, help="No progress bars."),
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return func


def data_from_options(kwargs) -> object:
    from moeprune.api import DataOptions

    if kwargs.get("threads"):
        torch.set_num_threads(kwargs["threads"])
    samples = kwargs["samples"]
    if kwargs.get("activations_dir") and not kwargs.get("sequential"):
        raise MoePruneError(
            "--activations-dir is for --sequential (layer-by-layer) observation; add --sequential"
        )
    return DataOptions(
        sources=kwargs["data"],
        samples=samples or None,
        max_length=kwargs["max_length"],
        batch_size=kwargs["batch_size"],
        seed=kwargs["seed"],
        packing=kwargs["packing"],
        device=kwargs.get("device"),
        sequential=kwargs.get("sequential", False),
        activations_dir=kwargs.get("activations_dir"),
    )


def refuse_given(ctx: click.Context, names: Sequence[str], reason: str) -> None:
    """Refuse options the user typed that this run would silently ignore."""
    given = [n for n in names if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
    if given:
        flags = ", ".join(flag_hint(ctx.command, (n,)).strip(" ()") for n in given)
        raise MoePruneError(f"{flags} {'has' if len(given) == 1 else 'have'} no effect {reason}; remove {'it' if len(given) == 1 else 'them'}")


def _check_criterion(name: str) -> str:
    from moeprune.criteria import get_criterion

    get_criterion(name)
    return name


@main.command()
@click.argument("model", required=False)
@click.option(
    "--tiny", type=click.Choice(supported_families()), help="Inspect a built-in tiny random model instead."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--trust-remote-code", is_flag=True, help="Allow the checkpoint's own config code; never run otherwise.")
def inspect(model: str | None, tiny: str | None, as_json: bool, trust_remote_code: bool) -> None:
    """Show a checkpoint's MoE structure and parameter counts (weights are not loaded)."""
    from moeprune.models.describe import describe_checkpoint, describe_model, format_description

    if tiny:
        from moeprune.models.factory import tiny_model

        info = describe_model(tiny_model(tiny), source=f"built-in tiny {tiny}")
    elif model:
        info = describe_checkpoint(model, trust_remote_code=trust_remote_code)
    else:
        raise MoePruneError("pass a MODEL folder, or --tiny FAMILY for a built-in tiny model")
    click.echo(json.dumps(info, indent=2) if as_json else format_description(info))


@main.command()
@click.argument("model")
@click.option("--criterion", required=True, help=f"One of: {', '.join(list_criteria())}.")
@click.option("--output", required=True, type=click.Path(), help="Where to write scores.json.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
@click.option("--streaming", is_flag=True,
              help="Weight-only criteria (aimer, magnitude, random) read expert by expert from the safetensors "
                   "shards; the model is never loaded (memory: about one expert).")  # fmt: skip
@data_options
def score(model: str, criterion: str, output: str, overwrite: bool, streaming: bool, **kwargs) -> None:
    """Score every routed expert of MODEL with one criterion and write the scores as JSON."""
    from moeprune.api import load_placed, prepare_score, score_experts, score_without_loading, scores_document
    from moeprune.checkpoint import write_json
    from moeprune.criteria import get_criterion
    from moeprune.models import MoEModel
    from moeprune.runtime.distributed import init_distributed

    _check_criterion(criterion)
    data = data_from_options(kwargs)
    if streaming and get_criterion(criterion).needs_data:
        raise MoePruneError(f"--streaming reads weights only; {criterion!r} needs data (use --sequential)")
    ctx = click.get_current_context()
    if streaming:
        refuse_given(ctx, ["data", "samples", "max_length", "batch_size", "packing", "sequential", "activations_dir"],
                     "with --streaming (weights only)")  # fmt: skip
    if not get_criterion(criterion).needs_data:
        refuse_given(ctx, ["data", "samples", "max_length", "batch_size", "packing", "tokenizer_path"],
                     f"with criterion {criterion} (it reads weights only)")  # fmt: skip
    # sequential observation tokenizes the data itself, layer by layer: only check it here
    model_path, tokenizer, sets = prepare_score(
        model, output, criterion, data=data, tokenizer_path=kwargs["tokenizer_path"], overwrite=overwrite,
        trust_remote_code=kwargs["trust_remote_code"], load_sets=not (streaming or data.sequential),
    )  # fmt: skip
    rank, _ = init_distributed()
    if streaming or data.sequential:
        crit, scores, stats, _ = score_without_loading(
            model_path, criterion, data=data, tokenizer_path=kwargs["tokenizer_path"], seed=kwargs["seed"],
            dtype=kwargs["dtype"], progress=not kwargs["quiet"] and rank == 0,
        )  # fmt: skip
    else:
        loaded, _ = load_placed(model_path, data, kwargs["dtype"])
        crit, scores, stats, _ = score_experts(
            MoEModel(loaded), criterion, tokenizer=tokenizer, data=data, seed=kwargs["seed"],
            progress=not kwargs["quiet"] and rank == 0, sets=sets,
        )  # fmt: skip
    if rank != 0:  # torchrun: every rank holds the reduced statistics; one writes
        return
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    write_json(output, scores_document(crit, scores, stats))
    click.echo(
        f"wrote {output} ({len(scores)} MoE layers, criterion {crit.name}, pruned first: {crit.prune_first})"
    )


@main.command()
@click.argument("model")
@click.option("--output", required=True, type=click.Path(), help="Folder for the pruned checkpoint.")
@click.option(
    "--criterion",
    required=True,
    help=f"One of: {', '.join(list_criteria())}; or auto (the best uniform plan on --search-data).",
)
@click.option(
    "--sparsity",
    required=True,
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    help="drop/novice: fraction of routed experts removed; neurons/tenp: fraction of routed-expert parameters.",
)
@click.option(
    "--allocation",
    type=click.Choice(["uniform", "global", "evo", "trapezoid"]),
    default=None,
    help="How many experts each layer loses [default: uniform; trapezoid for tenp].",
)
@click.option(
    "--method",
    type=click.Choice(["drop", "novice", "neurons", "tenp"]),
    default="drop",
    show_default=True,
    help="What happens to the chosen experts.",
)
@click.option(
    "--neuron-importance",
    type=click.Choice(["projection", "l2"]),
    default="projection",
    show_default=True,
    help="neurons/tenp: rank intermediate neurons by projection onto the expert output, or by L2 norm.",
)
@click.option(
    "--important-fraction",
    type=float,
    default=None,
    help="tenp: fraction of routed parameters kept as whole experts [default: half the kept budget].",
)
@click.option(
    "--slope",
    type=float,
    default=0.5,
    show_default=True,
    help="tenp: how fast the number of whole experts grows with depth (0 = flat, 1 = steepest).",
)
@click.option(
    "--search-data", multiple=True, metavar="FILE[:WEIGHT]", help="evo: search data (prompt/answer JSONL...)."
)
@click.option("--search-samples", type=click.IntRange(min=0), default=64, show_default=True,
              help="evo: search samples (0 = all); time grows linearly with them.")
@click.option("--fitness", type=click.Choice(["esap", "sap", "kl", "nll"]), default="esap", show_default=True,
              help="evo: what a candidate is scored by against the full model on the search data.")
@click.option("--population", type=click.IntRange(min=1), default=32, show_default=True,
              help="evo: candidates per generation; time grows linearly (cached candidates cost nothing).")
@click.option("--elites", type=click.IntRange(min=1), default=4, show_default=True,
              help="evo: best candidates kept as parents each generation (at most the population).")
@click.option("--generations", type=click.IntRange(min=1), default=50, show_default=True,
              help="evo: generations at most; time grows linearly.")
@click.option("--patience", type=click.IntRange(min=1), default=None,
              help="evo: stop once the best fitness has not improved for G generations [default: never; the "
                   "result then stays that of the full run]; saves the remaining generations' time.")
@click.option("--delta-max", type=click.IntRange(min=1), default=4, show_default=True,
              help="evo: most experts one mutation step moves between two layers.")
@click.option("--tau-max", type=click.IntRange(min=1), default=3, show_default=True,
              help="evo: most mutation steps composed into one offspring.")
@click.option("--search-seed", type=int, default=42, show_default=True,
              help="evo: seed of the search (same seed and data: same result).")
@click.option("--resume", is_flag=True,
              help="evo: continue the interrupted search for OUTPUT (same data and arguments); never replaces anything.")
@click.option("--expert-multiple", type=click.IntRange(min=1), default=1, show_default=True,
              help="Every layer keeps a multiple of N experts (vLLM expert parallelism needs counts divisible by the "
                   "EP size; kernels like multiples of 8).")
@click.option("--save-dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="dtype of the saved weights [default: the input checkpoint's].")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest weight file (e.g. 5GB, 500MB); bigger results are sharded with an index, like save_pretrained.")
@click.option("--dry-run", is_flag=True,
              help="Check everything, print the plan of work (model, budget per layer, data, output) and stop: "
                   "no weight is loaded, nothing is written.")
@click.option("--no-load", is_flag=True,
              help="Never load the model: score from the shards (weight-only criteria) or layer by layer (data), "
                   "then rewrite the shards one by one; --method drop or neurons, uniform allocation.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder (atomically, once the new one is complete).")
@data_options
def prune(model: str, output: str, criterion: str, sparsity: float, allocation: str | None, method: str,
          neuron_importance: str, important_fraction: float | None, slope: float, search_data: tuple[str, ...],
          search_samples: int, fitness: str, population: int, elites: int, generations: int, patience: int | None,
          delta_max: int,
          tau_max: int, search_seed: int, resume: bool, expert_multiple: int, save_dtype: str | None,
          max_shard_size: str, dry_run: bool, no_load: bool, overwrite: bool, **kwargs) -> None:  # fmt: skip
    """Prune MODEL and save the result with plan.json and report.json (and search.json for evo)."""
    from moeprune.api import MethodOptions, SaveOptions
    from moeprune.api import prune as run_prune
    from moeprune.runtime.distributed import init_distributed

    if criterion != "auto":
        _check_criterion(criterion)
    rank, _ = init_distributed()  # torchrun: data-parallel observation and search; rank 0 writes
    ctx = click.get_current_context()
    if no_load:
        from moeprune.api import prune_without_loading

        if method not in ("drop", "neurons") or (allocation or "uniform") != "uniform" or criterion == "auto":
            raise MoePruneError(
                "--no-load rewrites shards for --method drop or neurons with --allocation uniform and a named "
                f"criterion only (got --method {method}, --allocation {allocation or 'default'}, --criterion "
                f"{criterion}); load the model for the rest: drop --no-load"
            )
        refuse_given(ctx, ["resume", "dry_run", "save_dtype", "max_shard_size", "expert_multiple", "search_data",
                           "search_samples", "fitness", "population", "elites", "generations", "delta_max", "tau_max",
                           "search_seed", "patience", "important_fraction", "slope"],
                     "with --no-load (it copies the input's shards and dtype)")  # fmt: skip
        report = prune_without_loading(
            model, output, criterion=criterion, sparsity=sparsity, seed=kwargs["seed"], overwrite=overwrite,
            data=data_from_options(kwargs), tokenizer_path=kwargs["tokenizer_path"], dtype=kwargs["dtype"],
            progress=not kwargs["quiet"] and rank == 0, method=method,
            options=MethodOptions(neuron_importance=neuron_importance),
        )  # fmt: skip
        if rank != 0:
            return
        if method == "neurons":
            width = report["surgery"].get("intermediate_size")
            done = f"shrank every routed expert to {width} neurons" if width else "kept every neuron"
        else:
            done = f"pruned {report['budget_experts_removed']} experts"
        click.echo(f"{done} without loading the model; saved to {output}")
        return
    if allocation != "evo" and criterion != "auto":
        refuse_given(ctx, ["search_data", "search_samples", "fitness", "population", "elites", "generations", "delta_max",
                           "tau_max", "search_seed", "patience"], "without --allocation evo or --criterion auto")  # fmt: skip
    if method != "tenp":
        refuse_given(ctx, ["important_fraction", "slope"], "without --method tenp")
    if method not in ("neurons", "tenp"):
        refuse_given(ctx, ["neuron_importance"], "without --method neurons or tenp")
    refuse_given(ctx, ["activations_dir"], "without --sequential (it is where sequential observation caches activations)")
    search = dict(search_data=search_data, search_samples=search_samples, fitness=fitness, population=population,
                  elites=elites, generations=generations, delta_max=delta_max, tau_max=tau_max,
                  search_seed=search_seed, patience=patience)  # fmt: skip
    report = run_prune(
        model, output, criterion=criterion, sparsity=sparsity, allocation=allocation, method=method,
        data=data_from_options(kwargs), tokenizer_path=kwargs["tokenizer_path"], seed=kwargs["seed"], dtype=kwargs["dtype"],
        overwrite=overwrite, progress=not kwargs["quiet"] and rank == 0, search=search, resume=resume, dry_run=dry_run,
        options=MethodOptions(neuron_importance=neuron_importance, important_fraction=important_fraction, slope=slope),
        save=SaveOptions(dtype=save_dtype, max_shard_size=max_shard_size), expert_multiple=expert_multiple,
        trust_remote_code=kwargs["trust_remote_code"], command_line=command_line(),
    )  # fmt: skip
    if rank != 0:
        return
    if dry_run:
        click.echo(format_plan_of_work(report))
        return
    before, after = report["parameters_before"], report["parameters_after"]
    click.echo(
        f"pruned with {method} ({report['criterion']}, {report['allocation']}); parameters {before['total']:,} -> "
        f"{after['total']:,}, routed experts {before['routed_experts']:,} -> {after['routed_experts']:,}; "
        f"saved ({report['format']} format, {report['save_dtype']}) to {output}"
    )


def format_plan_of_work(plan: dict) -> str:
    """The --dry-run report: what prune would do, one fact per line."""
    lines = [
        f"model     {plan['model']} ({plan['family']}; MoE layers {plan['moe_layers']}, experts {plan['experts_per_layer']}, "
        f"top-k {plan['top_k']})",
        f"prune     criterion {plan['criterion']}, allocation {plan['allocation']}, method {plan['method']}, "
        f"sparsity {plan['sparsity']} of {plan['sparsity_unit']}",
    ]
    for key, label in (("budget_experts_removed", "budget    experts removed in total"),
                       ("removed_per_layer", "per layer experts removed"),
                       ("neurons_per_expert", "per layer neurons kept per expert"),
                       ("whole_experts_per_layer", "per layer whole experts kept"),
                       ("neuron_keep_ratio", "neurons   kept ratio of the other experts")):  # fmt: skip
        if key in plan:
            lines.append(f"{label}: {plan[key]}")
    if plan["allocation"] == "evo":
        lines.append("per layer searched (EvoESAP)")
    for data in plan["calibration"]:
        lines.append(f"data      {', '.join(data['sources'])}: {data['samples']} samples, {data['tokens']} tokens"
                     + (f" ({data['truncated']} truncated)" if data["truncated"] else ""))  # fmt: skip
    if plan["search_data"]:
        data = plan["search_data"]
        lines.append(f"search    {', '.join(data['sources'])}: {data['samples']} samples, {data['tokens']} tokens")
    lines.append(f"output    {plan['output']} ({plan['save_dtype']}){' resuming the search' if plan['resume'] else ''}")
    lines.append("dry run: nothing was loaded or written")
    return "\n".join(lines)
