"""`moeprune setup quantize`: make the quantization environment from the installed package.

`prune --quantize` runs llm-compressor in an environment of its own (its pins conflict with
moeprune's: quantize/environment.py says why). A clone has scripts/setup_quant.sh; a pip install has
only this command, which makes the same environment and records where it is, so that `prune
--quantize` finds it from any folder without `--quant-python`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import click

from moeprune.cli.main import main
from moeprune.errors import MoePruneError
from moeprune.quantize.environment import PINS, make_environment
from moeprune.quantize.schemes import record_quant_python
from moeprune.runtime.cache import cache_root


@main.group()
def setup() -> None:
    """Make the environments that optional steps run in (e.g. llm-compressor for --quantize)."""


@setup.command()
@click.option(
    "--path",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to make the environment [default: venv-quant in moeprune's cache folder, "
    "$MOEPRUNE_CACHE or ~/.cache/moeprune].",
)
@click.option(
    "--torch",
    "torch_spec",
    default=None,
    help=f"The torch requirement to install [default: torch=={PINS['torch']}; name a build of your "
    "own, or 'skip' to keep the torch the folder already has].",
)
@click.option("--force", is_flag=True, help="Reinstall even when the environment is ready with these pins.")
def quantize(path: Path | None, torch_spec: str | None, force: bool) -> None:
    """Make the llm-compressor environment that `prune --quantize` runs in, and record it."""
    where = path or cache_root() / "venv-quant"
    if where.exists() and not where.is_dir():
        raise MoePruneError(f"{where} is a file, not a folder: give another --path")
    pins = ", ".join(f"{k} {v}" for k, v in PINS.items())
    click.echo(f"quantization environment: {where} ({pins})")
    try:
        python = make_environment(where, torch_spec, force, echo=click.echo)
    except subprocess.CalledProcessError as exc:
        raise MoePruneError(
            f"pip failed while making {where} (exit {exc.returncode}; its output is above): check the "
            "network or the package index, then run the command again (--force starts over)"
        ) from None
    except RuntimeError as exc:
        raise MoePruneError(f"{str(exc).splitlines()[0]}: run again with --force") from None
    record = record_quant_python(python)
    click.echo(f"recorded in {record}: `moeprune prune --quantize ...` now uses {python}")
