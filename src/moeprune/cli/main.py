"""The `moeprune` command group: one line and exit code 2 for every user error, naming the flags
that fix it.

The library raises `MoePruneError` in its own terms with the API parameters that would fix the
problem (`options`); here, and only here, they become flags. A bad flag or value is one line too,
instead of click's usage block.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence

import click

from moeprune import __version__
from moeprune.cli.options import setting_options
from moeprune.errors import MoePruneError

ARGV = "moeprune.argv"  # the arguments as typed, kept for the model card's "Reproduce"


class MoePruneGroup(click.Group):
    """Turns MoePruneError and usage errors into one clear line and exit code 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[ARGV] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            where = f"moeprune {ctx.invoked_subcommand}" if ctx.invoked_subcommand else "moeprune"
            click.echo(f"moeprune: error: {exc.format_message()} (see '{where} --help')", err=True)
            sys.exit(2)
        except MoePruneError as exc:
            command = self.get_command(ctx, ctx.invoked_subcommand) if ctx.invoked_subcommand else None
            click.echo(f"moeprune: error: {exc}{flag_hint(command, exc.options)}", err=True)
            sys.exit(2)


@click.group(cls=MoePruneGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="moeprune")
def main() -> None:
    """Compress Mixture-of-Experts language models: observe, score, allocate, prune, evaluate."""


def command_line() -> str:
    """The command as typed."""
    return shlex.join(["moeprune", *click.get_current_context().meta.get(ARGV, sys.argv[1:])])


def flag_hint(command: click.Command | None, options: Sequence[str]) -> str:
    """ " (--overwrite)" for an error whose fix is the API parameter `overwrite`."""
    flags = []
    for name in options:
        param = next((p for p in (command.params if command else []) if p.name == name), None)
        long = [o for o in (param.opts if param else []) if o.startswith("--")]
        flags.append(long[0] if long else "--" + name.replace("_", "-"))
    return f" ({', '.join(flags)})" if flags else ""


def refuse_given(ctx: click.Context, names: Sequence[str], reason: str) -> None:
    """Refuse options the user typed that this run would silently ignore."""
    given = [n for n in names if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]
    if given:
        flags = ", ".join(flag_hint(ctx.command, (n,)).strip(" ()") for n in given)
        one = len(given) == 1
        raise MoePruneError(
            f"{flags} {'has' if one else 'have'} no effect {reason}; remove {'it' if one else 'them'}"
        )


def refuse_unread(ctx: click.Context, unread: Sequence[tuple[Sequence[str | type], str]]) -> None:
    """Refuse every typed option the library says this run would ignore: (settings, why) pairs,
    where a config class stands for all of its settings (moeprune.job.pipelines)."""
    for settings, why in unread:
        names = [n for s in settings for n in (setting_options(s) if isinstance(s, type) else [s])]
        refuse_given(ctx, names, why)
