"""`moeprune prune`: the options of a PruneConfig (choices and help read from the registries),
`--config recipe.json` to repeat an earlier run, and the dry-run's plan of work."""

from __future__ import annotations

from dataclasses import Field, fields

import click

from moeprune.allocate import ALLOCATIONS
from moeprune.allocate.fitness import FITNESSES
from moeprune.allocate.registry import searches
from moeprune.cli.main import command_line, main, refuse_unread
from moeprune.cli.options import (
    config_from_options,
    config_options,
    data_from_options,
    data_options,
    field_options,
    option_name,
    options_of,
    registry_help,
    registry_option,
    setting_help,
    settings_of,
)
from moeprune.config import PruneConfig, Recipe, RepairConfig, RunOptions, SaveOptions, SearchConfig
from moeprune.criteria import AUTO, CRITERIA
from moeprune.errors import MoePruneError
from moeprune.job.pipelines import PIPELINES, PruneRequest, prune_checkpoint, unread_settings
from moeprune.quant.fp8 import FP8_SAVE_DTYPE
from moeprune.quantize.options import DEFAULT_GROUP, DEFAULT_PYTHON, SETUP, QuantizeOptions
from moeprune.quantize.schemes import QUANT_METHODS, SCHEMES, taking_group
from moeprune.report.summary import format_lines, prune_facts
from moeprune.runtime.distributed import init_distributed
from moeprune.surgery import METHODS
from moeprune.surgery.auto import AUTO_METHOD, NO_SEARCH_DATA, NO_SEARCH_DATA_LABEL

# flag value -> torch name; fp8 keeps an fp8 input's blocks (the default for one; a full-precision
# choice saves it dequantized)
SAVE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": FP8_SAVE_DTYPE}


def method_settings_by_name() -> dict[str, Field]:
    """Every registered method's own settings, by name (a setting two methods share is one flag)."""
    out: dict[str, Field] = {}
    for method in METHODS:
        for setting in fields(method.options) if method.options is not None else ():
            out.setdefault(setting.name, setting)
    return out


def method_settings() -> list[Field]:
    return list(method_settings_by_name().values())


def _recipe_defaults(ctx: click.Context, _param: click.Parameter, path: str | None) -> str | None:
    """--config: an earlier run's recipe.json (or a bare PruneConfig) becomes this run's defaults;
    options you type on the command line still win."""
    if path is None:
        return None
    recipe = Recipe.load(path)  # unknown or mistyped keys: an error naming them
    defaults = options_of(recipe.config) | options_of(recipe.config.search) | options_of(recipe.config.repair)
    own = recipe.config.options
    defaults.update(own if isinstance(own, dict) else options_of(own) if own is not None else {})
    data = recipe.data
    defaults |= {"data": tuple(data.sources), "search_data": tuple(recipe.search_data)}
    defaults |= {"max_length": data.max_length, "batch_size": data.batch_size, "seed": data.seed}
    defaults |= {"packing": data.packing, "samples": data.samples or 0, "pipeline": recipe.pipeline}
    by_torch_name = {v: k for k, v in SAVE_DTYPES.items()}
    if recipe.save.dtype in by_torch_name:
        defaults["save_dtype"] = by_torch_name[str(recipe.save.dtype)]
    defaults["max_shard_size"] = str(recipe.save.max_shard_size)
    defaults["drop_mtp"] = recipe.save.drop_mtp or None
    if recipe.quantize is not None:  # the scheme, method and group size it was quantized with
        quantize = recipe.quantize
        defaults |= {"quantize": quantize["scheme"], "quant_method": quantize.get("method")}
        defaults["quant_group_size"] = quantize.get("group_size")
        defaults["target_size"] = quantize.get("target_size")  # auto:'s budget, beside the sparsity
    ctx.default_map = {k: v for k, v in defaults.items() if v is not None and v != ()}
    return path


@main.command()
@click.argument("model")
@click.option("--output", required=True, type=click.Path(), help="Folder for the pruned checkpoint.")
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    is_eager=True,
    expose_value=False,
    callback=_recipe_defaults,
    help="Repeat an earlier run: its recipe.json (written beside every result) sets the defaults of every "
    "option below; options you type still win.",
)
@field_options(
    settings_of(PruneConfig, "criterion", "sparsity", "target_size", "allocation", "method"),
    choices={"criterion": [*CRITERIA.names(), AUTO]},
    helps={
        "criterion": registry_help(CRITERIA, setting_help(PruneConfig, "criterion"))
        + f" {AUTO}: the best uniform plan on --search-data. Without --criterion and --method: "
        f"--method {AUTO} with --search-data, else {NO_SEARCH_DATA_LABEL}."
    },
    registries={"allocation": ALLOCATIONS, "method": METHODS},
    optional=("criterion",),
)
@field_options(method_settings())
@click.option(
    "--search-data",
    multiple=True,
    metavar="FILE[:WEIGHT]",
    help="evo/gradient/auto: search data (prompt/answer JSONL...).",
)
@config_options(SearchConfig, registries={"fitness": FITNESSES})
@click.option(
    "--resume",
    is_flag=True,
    help="evo: continue the interrupted search for OUTPUT (same data and arguments); never replaces anything.",
)
@config_options(RepairConfig)
@field_options(settings_of(PruneConfig, "expert_multiple", "ep_size", "allow_super_experts"))
@click.option(
    "--save-dtype",
    type=click.Choice(list(SAVE_DTYPES)),
    default=None,
    help="dtype of the saved weights [default: the input checkpoint's; a quantized input (fp8, MXFP4, "
    "compressed-tensors) keeps its format, a full-precision choice saves it dequantized; fp8 asks for an "
    "fp8 input's blocks].",
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    help="Largest weight file (e.g. 5GB, 500MB); bigger results are sharded with an index, like save_pretrained.",
)
@click.option(
    "--drop-mtp",
    is_flag=True,
    help="Leave out the multi-token-prediction layers a release stores beside the decoder stack "
    "(DeepSeek-V3, GLM-4.5, Qwen3-Next, MiMo...); by default they are kept, pruned to the result's expert "
    "count, for vLLM's MTP drafts (docs/families.md).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Check everything, print the plan of work (model, budget per layer, data, output, the weight "
    "bytes in and predicted out, a size target's solved sparsity) and stop: no weight is loaded, nothing is "
    "written.",
)
@click.option(
    "--quantize",
    metavar="SCHEME",
    default=None,
    help=f"Quantize the pruned model with llm-compressor, in its own environment (--quant-python): "
    f"{'; '.join(f'{n}: {s.help}' for n, s in SCHEMES.items())}. Routers and lm_head stay unquantized; the "
    "result is a compressed-tensors checkpoint; --target-size then counts quantized bytes. auto:A,B[,...] "
    "(with --target-size): each MoE layer's experts in the scheme of the list that costs the fitness least "
    "under the target, the rest in A; without --sparsity the sparsity is chosen with them.",
)
@click.option(
    "--quant-method",
    type=click.Choice(list(QUANT_METHODS)),
    default="gptq",
    show_default=True,
    help=f"--quantize: {' or '.join(f'{m.name} ({m.help})' for m in QUANT_METHODS.values())}.",
)
@click.option(
    "--quant-group-size",
    type=int,
    default=None,
    help=f"--quantize {'/'.join(taking_group())}: weights sharing one scale [default: {DEFAULT_GROUP}].",
)
@click.option(
    "--quant-sparsity-grid",
    type=int,
    default=4,
    show_default=True,
    help="--quantize auto:... with --target-size and no --sparsity: the sparsities tried, each with its "
    "per-layer schemes, between the one where the cheapest scheme fits and the one where the most "
    "expensive does (uniform splits; docs/large-models.md).",
)
@click.option(
    "--quant-python",
    default=None,
    help=f"--quantize: the Python of an environment with llmcompressor [default: {DEFAULT_PYTHON} under the "
    f"current folder, else the environment '{SETUP}' made].",
)
@registry_option("--pipeline", PIPELINES, "How the job runs:", default="in-memory", show_default=True)
@click.option(
    "--no-load",
    is_flag=True,
    help="Never load the model: score from the shards (weight-only criteria) or layer by layer (data), "
    "then rewrite the shards one by one; --method drop or neurons, uniform allocation "
    "(the same as --pipeline no-load).",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace an existing output folder (atomically, once the new one is complete).",
)
@data_options
def prune(model: str, output: str, **options) -> None:
    """Prune MODEL and save the result with its evidence: plan.json, recipe.json, report.json,
    README.md (model card), density.png (and search.json, search_curve.png for evo)."""
    ctx = click.get_current_context()
    if (
        options["target_size"] is not None
        and _from_recipe(ctx, "sparsity")
        and not _from_recipe(ctx, "target_size")
    ):
        options["sparsity"] = None  # a typed target wins over the sparsity a recipe solved or set
    chosen = _default_recipe(ctx, options)
    method = METHODS.get(options["method"])
    own = {name: options.pop(option_name(f)) for name, f in method_settings_by_name().items()}
    # a flag several methods share has the first one's default: one not typed takes this method's own
    default = click.core.ParameterSource.DEFAULT
    untyped = [
        n for n, f in method_settings_by_name().items() if ctx.get_parameter_source(option_name(f)) is default
    ]
    own |= {n: getattr(method.options(), n) for n in untyped if n in method.knobs}
    search = config_from_options(SearchConfig, options)
    repair = config_from_options(RepairConfig, options)
    config = config_from_options(  # a copy of the options: --seed seeds the data, too
        PruneConfig,
        dict(options),
        search=search,
        repair=repair,
        options={name: value for name, value in own.items() if name in method.knobs} or None,
    )
    pipeline = PIPELINES.get("no-load" if options["no_load"] else options["pipeline"])
    rank, _ = init_distributed()  # torchrun: data-parallel observation and search; rank 0 writes
    pipeline.check(config)
    refuse_unread(ctx, unread_settings(pipeline, config))  # typed but never read: refused
    quantize = _quantize_options(ctx, options)
    request = PruneRequest(
        model,
        output,
        config,
        data=data_from_options(options),
        search_data=options["search_data"],
        tokenizer_path=options["tokenizer_path"],
        save=SaveOptions(
            dtype=SAVE_DTYPES.get(options["save_dtype"]),
            max_shard_size=options["max_shard_size"],
            drop_mtp=options["drop_mtp"],
        ),
        run=RunOptions(
            progress=not options["quiet"] and rank == 0,
            overwrite=options["overwrite"],
            resume=options["resume"],
            dry_run=options["dry_run"],
            trust_remote_code=options["trust_remote_code"],
            command_line=command_line(),
        ),
        quantize=quantize,
    )
    report = prune_checkpoint(request, pipeline.name)
    if rank != 0:
        return
    if options["dry_run"]:
        click.echo(format_plan_of_work(report))
        return
    click.echo("\n".join(format_lines(prune_facts(report, output))))
    if chosen:
        click.echo(chosen)


def _default_recipe(ctx: click.Context, options: dict) -> str:
    """Without --criterion: `--method auto` with search data, else the best recipe that needs none
    (named from the evidence, surgery/auto.py); with --method, --criterion is still needed unless
    it is auto. Returns the summary's sentence about a recipe chosen for the user ('' if none)."""
    if options["criterion"] is not None:
        return ""
    typed = ctx.get_parameter_source("method") not in (None, click.core.ParameterSource.DEFAULT)
    if typed and METHODS.get(options["method"]).portfolio is None:
        raise MoePruneError(
            f"--method {options['method']} needs a criterion: give --criterion", options=("criterion",)
        )
    if typed or options["search_data"]:
        options["criterion"], options["method"] = AUTO, AUTO_METHOD
        return ""
    options["criterion"], options["method"] = NO_SEARCH_DATA.criterion, NO_SEARCH_DATA.method
    return (
        f"recipe    {NO_SEARCH_DATA_LABEL}: the best recipe that needs no search data "
        "(docs/allocation.md); give --search-data to choose among them all (--method auto)"
    )


def _quantize_options(ctx: click.Context, options: dict) -> QuantizeOptions | None:
    """--quantize and its settings; a setting typed without --quantize is refused (never read)."""
    names = ("quant_method", "quant_group_size", "quant_python", "quant_sparsity_grid")
    if options["quantize"] is None:
        typed = [n for n in names if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
        if typed:
            raise MoePruneError(
                f"{', '.join(typed)} set without quantize: give a quantization scheme, or leave them out",
                options=("quantize", *typed),
            )
        return None
    return QuantizeOptions(
        options["quantize"],
        options["quant_method"],
        options["quant_group_size"],
        options["quant_python"],
        sparsity_grid=options["quant_sparsity_grid"],
    )


def _from_recipe(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) is click.core.ParameterSource.DEFAULT_MAP


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def size_lines(plan: dict) -> list[str]:
    """The dry run's sizes: the input's weights as stored, the output's as planned, and the target."""
    if "input_bytes" not in plan:
        return []
    lines = [
        f"input     {plan['input_format']}, {_bytes(plan['input_bytes'])} of weights ({plan['input_bytes']:,} bytes)",
        f"output    {plan['output_format']}, predicted {_bytes(plan['predicted_bytes'])} of weights "
        f"({plan['predicted_bytes']:,} bytes)",
    ]
    if plan.get("target_bytes") is not None:
        below = (
            f"; {plan['step_below']:.6g} would predict {_bytes(plan['step_below_bytes'])}"
            if plan.get("step_below") is not None
            else ""
        )
        lines.append(
            f"target    {_bytes(plan['target_bytes'])} ({plan['target_bytes']:,} bytes): sparsity "
            f"{plan['solved_sparsity']:.6g} solved, the smallest step that fits{below}"
        )
    if plan.get("precision_schemes"):
        every = ", ".join(
            f"{s} {_bytes(b)} ({b:,} bytes)" for s, b in plan["precision_every_layer_at"].items()
        )
        lines.append(f"per-layer every layer's experts in one scheme: {every}")
        for point in plan.get("precision_grid") or []:
            every = ", ".join(f"{s} {b:,}" for s, b in point["every_layer_at"].items())
            lines.append(
                f"grid      sparsity {point['sparsity']:.6g}: every layer in one scheme {every} bytes"
            )
        if plan.get("precision_search"):
            lines.append(f"search    {plan['precision_search']}")
        if plan.get("joint_copies_bytes") is not None:
            copies, model, memory = (
                plan["joint_copies_bytes"],
                plan["joint_model_bytes"],
                plan["joint_memory_bytes"],
            )
            room = (
                f", of {_bytes(memory)} of RAM"
                if memory is not None
                else " (on the accelerator: not checked)"
            )
            lines.append(
                f"memory    the search holds every routed expert's fake-quantized copy per scheme: "
                f"{_bytes(copies)} ({copies:,} bytes, {plan['joint_copies_schemes']} schemes) beside the "
                f"{_bytes(model)} model{room}"
            )
        reach = "reachable" if plan["precision_reachable"] else "not reachable"
        searched = plan.get("precision_search")
        when = (
            "searched with the experts under it"
            if searched
            else "chosen under it once the experts are pruned"
        )
        lines.append(
            f"target    {_bytes(plan['precision_target_bytes'])} ({plan['precision_target_bytes']:,} bytes): "
            f"{reach}; each layer's scheme is {when}"
        )
    return lines


def format_plan_of_work(plan: dict) -> str:
    """The --dry-run report: what prune would do, one fact per line."""
    lines = [
        f"model     {plan['model']} ({plan['family']}; MoE layers {plan['moe_layers']}, experts {plan['experts_per_layer']}, "
        f"top-k {plan['top_k']})",
        f"prune     criterion {plan['criterion']}, allocation {plan['allocation']}, method {plan['method']}, "
        f"sparsity {plan['sparsity']} of {plan['sparsity_unit']}",
    ]
    for key, label in (
        ("budget_experts_removed", "budget    experts removed in total"),
        ("removed_per_layer", "per layer experts removed"),
        ("neurons_per_expert", "per layer neurons kept per expert"),
        ("whole_experts_per_layer", "per layer whole experts kept"),
        ("neuron_keep_ratio", "neurons   kept ratio of the other experts"),
    ):
        if key in plan:
            lines.append(f"{label}: {plan[key]}")
    if "portfolio" not in plan and searches(plan["allocation"]):
        how = "gradient-trained keep logits" if plan["allocation"] == "gradient" else "EvoESAP"
        lines.append(f"per layer searched ({how})")
    for data in plan["calibration"]:
        lines.append(
            f"data      {', '.join(data['sources'])}: {data['samples']} samples, {data['tokens']} tokens"
            + (f" ({data['truncated']} truncated)" if data["truncated"] else "")
        )
    if plan["search_data"]:
        data = plan["search_data"]
        lines.append(
            f"search    {', '.join(data['sources'])}: {data['samples']} samples, {data['tokens']} tokens"
        )
    if plan.get("repair"):
        lines.append(f"repair    after surgery: {plan['repair']}")
    lines.append(
        f"output    {plan['output']} ({plan['save_dtype']}){' resuming the search' if plan['resume'] else ''}"
    )
    lines += size_lines(plan)
    lines += portfolio_lines(plan)
    lines.append("dry run: nothing was loaded or written")
    return "\n".join(lines)


def portfolio_lines(plan: dict) -> list[str]:
    """The dry run of --method auto: each recipe it would try, with a rough estimate of its time."""
    if "portfolio" not in plan:
        return []
    lines = [f"auto      {len(plan['portfolio'])} recipes, cheapest first; {plan['halving']}"]
    if "estimated_s" in plan:
        lines.append(f"  estimated  ~{plan['estimated_s']:.6g} s for the whole contest on this machine")
    for row in plan["portfolio"]:
        what = (
            f"{row['criterion']} order, {row['method']} / {row['allocation']}, sparsity {row['sparsity']:.6g}"
        )
        cost = (
            f"not run: {row['refused']}"
            if "refused" in row
            else f"~{row['estimated_s']:.6g} s at its full budget"
        )
        lines.append(f"  recipe  {row['label']} ({what}): {cost}")
    return lines
