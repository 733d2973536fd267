"""The documentation's generated blocks are what they are made from: the registries (criteria,
allocations, methods, fitnesses, metrics), the MoE family enumeration of this transformers, and
the commands' own --help (docs/cli.md). Regenerate with python scripts/readme_tables.py."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import click
import pytest

from moeprune.cli.reference import cli_reference_markdown, fill_cli_reference
from moeprune.report.tables import (
    blocks,
    family_table_version,
    fill_family_table,
    fill_tables,
    registry_tables,
)

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DOCS = _script().documentation()


def test_every_registry_has_a_table_and_the_readme_shows_the_main_three():
    found = set()
    for path in DOCS:
        found |= set(blocks(path.read_text()))
    assert found == set(registry_tables()), "every registry has its table in the docs"
    assert set(blocks((ROOT / "README.md").read_text())) == {"criteria", "allocations", "methods"}


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_registry_tables_and_cli_reference_are_current(path):
    text = path.read_text()
    assert fill_tables(text) == text, (
        f"{path.name}: registry tables are stale: run python scripts/readme_tables.py"
    )
    assert fill_cli_reference(text) == text, (
        f"{path.name}: the CLI reference is stale: run python scripts/readme_tables.py"
    )


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_family_blocks_are_the_enumeration(path):
    """Checked on the transformers the blocks were generated with (the other end of the tested
    range enumerates other families)."""
    import transformers

    text = path.read_text()
    version = family_table_version(text)
    if version is None:
        return
    if version != transformers.__version__:
        pytest.skip(f"{path.name}'s family blocks were generated with transformers {version}")
    assert fill_family_table(text) == text, (
        f"{path.name}: family blocks are stale: run python scripts/readme_tables.py"
    )


def test_cli_reference_covers_every_command_and_flag():
    """docs/cli.md holds every command's help, so every long flag of every command appears."""
    from moeprune.cli import main

    reference = (ROOT / "docs" / "cli.md").read_text()
    assert cli_reference_markdown() in reference
    commands = [(name, command) for name, command in main.commands.items()]
    for name, command in commands:
        assert f"## moeprune {name}" in reference
        if isinstance(command, click.Group):  # `setup quantize`: each subcommand has its own section
            commands += [(f"{name} {sub}", c) for sub, c in command.commands.items()]
        for param in command.params:
            for flag in (o for o in param.opts if o.startswith("--")):
                assert flag in reference, f"{flag} of moeprune {name} is missing from docs/cli.md"


def test_documentation_links_resolve():
    """Every relative link between the README, CONTRIBUTING.md and docs/ points at a file that exists."""
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target:
                continue
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_readme_is_a_front_page():
    """The README leads with what moeprune is and the two quick-start commands, and stays short;
    reference material lives in docs/."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 260
    quick = text.index("## Quick start")
    assert quick < text.index("## Install") < text.index("## Prune a model")
    assert "./setup.sh && .venv/bin/moeprune demo" in text[quick:] and "./scripts/test.sh" in text[quick:]
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("./scripts/test.sh"), (
        ".ci/run runs the README's command"
    )
