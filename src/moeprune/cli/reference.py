"""The command-line reference (docs/cli.md), rendered from the commands themselves.

docs/cli.md holds it between `<!-- cli -->` and `<!-- /cli -->`; `scripts/readme_tables.py`
rewrites it and a test fails when a flag, default or help text changes without the docs, so the
reference is always what `moeprune COMMAND --help` prints.
"""

from __future__ import annotations

import re

import click

from moeprune.cli.main import main
from moeprune.report.tables import fill_family_table, fill_tables
from moeprune.serve.vllm.version import vllm_requirement

_BLOCK = re.compile(r"(<!-- cli -->\n)(.*?)(<!-- /cli -->)", re.S)
# the tested vLLM range, inline in a sentence: <!-- vllm-range -->`vllm>=0.32,<0.33`<!-- /vllm-range -->
_RANGE = re.compile(r"(<!-- vllm-range -->)(.*?)(<!-- /vllm-range -->)")
WIDTH = 100  # the help's line width in the docs (a terminal's varies; the docs' must not)


def _help(command: click.Command, path: str, parent: click.Context | None = None) -> str:
    context = click.Context(
        command, info_name=path, parent=parent, max_content_width=WIDTH, terminal_width=WIDTH
    )
    return command.get_help(context)


def cli_reference_markdown() -> str:
    """`moeprune --help`, then every command's `--help`, in the group's order."""
    root = click.Context(
        main, info_name="moeprune", max_content_width=WIDTH, terminal_width=WIDTH, **main.context_settings
    )
    parts = ["```text\n$ moeprune --help\n" + main.get_help(root) + "\n```\n"]
    for name in main.list_commands(root):
        command = main.get_command(root, name)
        assert command is not None, name  # list_commands names only commands the group has
        parts += _sections(command, name, root, name)
    return "\n".join(parts)


def _sections(command: click.Command, name: str, parent: click.Context, path: str) -> list[str]:
    """`path`'s help, then (a group: `setup`) each subcommand's, as `## moeprune setup quantize`."""
    text = _help(command, name, parent=parent)
    out = [f"## moeprune {path}\n\n```text\n$ moeprune {path} --help\n{text}\n```\n"]
    if isinstance(command, click.Group):
        context = click.Context(
            command, info_name=name, parent=parent, max_content_width=WIDTH, terminal_width=WIDTH
        )
        for sub_name in command.list_commands(context):
            sub = command.get_command(context, sub_name)
            assert sub is not None, sub_name
            out += _sections(sub, sub_name, context, f"{path} {sub_name}")
    return out


def fill_cli_reference(text: str) -> str:
    """`text` with its cli block regenerated from the installed commands."""
    return _BLOCK.sub(lambda m: m.group(1) + cli_reference_markdown() + m.group(3), text)


def fill_vllm_range(text: str) -> str:
    """`text` with every inline vllm-range block set to the range the plugin checks."""
    return _RANGE.sub(lambda m: f"{m.group(1)}`{vllm_requirement()}`{m.group(3)}", text)


def fill_generated(text: str) -> str:
    """`text` (README.md or a page of docs/) with every generated block rewritten: the registry
    tables, the family table and summary, the command-line reference, the tested vLLM range."""
    return fill_vllm_range(fill_cli_reference(fill_family_table(fill_tables(text))))
