"""`moeprune serve-check OUT`: serve a result in vLLM and compare it with moeprune's own loader."""

from __future__ import annotations

import sys

import click

from moeprune.cli.main import main
from moeprune.cli.options import vllm_options
from moeprune.evaluate.serve_check import LOGPROB_ATOL, ServeCheckOptions, serve_check
from moeprune.report.serve_check import record_serve_check, serve_check_lines


@main.command("serve-check")
@click.argument("output", type=click.Path(), metavar="OUT")
@click.option(
    "--prompts",
    "prompts",
    multiple=True,
    metavar="FILE",
    help="Prompt data file (repeatable; any format --data reads). Default: the calibration data in OUT's recipe.json.",
)
@click.option(
    "--tokenizer",
    "tokenizer_path",
    type=click.Path(),
    default=None,
    help="Folder with the tokenizer. Default: OUT's, else its base model's (from report.json).",
)
@click.option("--samples", type=int, default=8, show_default=True, help="Prompts taken from the files.")
@click.option("--prompt-length", type=int, default=32, show_default=True, help="Tokens per prompt, at most.")
@click.option(
    "--new-tokens", type=int, default=16, show_default=True, help="Greedy tokens generated per prompt."
)
@click.option("--top-k", type=int, default=5, show_default=True, help="Logprobs compared at each position.")
@click.option(
    "--atol",
    type=float,
    default=LOGPROB_ATOL,
    show_default=True,
    help="Largest |logprob difference| accepted (float32 rounding between the engines' kernels).",
)
@click.option(
    "--reference", type=click.Path(), default=None, help="Base model: timed in vLLM too (throughput ratio)."
)
@click.option(
    "--vllm-python",
    type=click.Path(),
    default=None,
    help="Python of an environment with vLLM and moeprune installed. Default: this one, if it has vLLM.",
)
@click.option(
    "--vllm-option",
    "vllm_option",
    multiple=True,
    metavar="KEY=VALUE",
    help="Extra vllm.LLM keyword (VALUE as JSON), e.g. kv_cache_memory_bytes=1073741824 (repeatable).",
)
def serve_check_command(output: str, **kwargs) -> None:
    """Serve OUT in vLLM and compare its greedy tokens and top-k logprobs with moeprune.load_pretrained(OUT).

    Both run in float32 on the same prompts. The verdict and figures (tokens compared, first
    difference, largest logprob difference, vLLM tokens/s) go into OUT's report.json and model
    card. Exit code 0: match; 1: mismatch (the first differing prompt and token are named); 2: bad input.
    """
    options = ServeCheckOptions(
        prompts=kwargs["prompts"],
        tokenizer_path=kwargs["tokenizer_path"],
        samples=kwargs["samples"],
        prompt_length=kwargs["prompt_length"],
        new_tokens=kwargs["new_tokens"],
        top_k=kwargs["top_k"],
        atol=kwargs["atol"],
        reference=kwargs["reference"],
        vllm_python=kwargs["vllm_python"],
        vllm_options=vllm_options(kwargs["vllm_option"]),
    )
    document = serve_check(output, options)
    files = record_serve_check(output, document)
    click.echo("\n".join(serve_check_lines(output, document, files)))
    if document["verdict"] != "match":
        sys.exit(1)
