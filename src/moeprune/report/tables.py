"""The documentation's generated tables: criteria, allocations, methods, fitnesses and metrics
from the registries, and the MoE families of the installed transformers.

README.md and docs/*.md hold each table between `<!-- registry: NAME -->` and
`<!-- /registry -->` (families: `<!-- families: transformers VERSION -->`); `scripts/readme_tables.py`
rewrites them and a test fails when they drift, so the help a user reads in the docs is the help
`--help` prints. Rendering only: nothing here decides what an entry does.
"""

from __future__ import annotations

import re

from moeprune.allocate import ALLOCATIONS
from moeprune.allocate.fitness import FITNESSES
from moeprune.config import Registry
from moeprune.criteria import CRITERIA
from moeprune.evaluate import METRICS
from moeprune.surgery import METHODS

_BLOCK = re.compile(r"(<!-- registry: (\w+) -->\n)(.*?)(<!-- /registry -->)", re.S)


def _needs(entry) -> str:
    return ", ".join(entry.needs) or "nothing"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _rows(registry: Registry, *columns) -> list[list[str]]:
    return [[f"`{e.name}`", *[column(e) for column in columns]] for e in registry]


def registry_tables() -> dict[str, str]:
    """Markdown table per registry, in registration order."""
    return {
        "criteria": _table(
            ["criterion", "score", "pruned first", "needs"],
            _rows(CRITERIA, lambda c: c.help, lambda c: c.prune_first, _needs),
        ),
        "allocations": _table(
            ["allocation", "what it decides", "needs"], _rows(ALLOCATIONS, lambda a: a.help, _needs)
        ),
        "methods": _table(
            ["method", "what happens", "`--sparsity` counts", "allocations", "needs"],
            _rows(
                METHODS,
                lambda m: m.help,
                lambda m: m.sparsity_unit,
                lambda m: ", ".join(m.allocations),
                _needs,
            ),
        ),
        "fitnesses": _table(
            ["fitness", "per answer position", "better", "needs"],
            _rows(FITNESSES, lambda f: f.help, lambda f: "higher" if f.higher_is_better else "lower", _needs),
        ),
        "metrics": _table(
            ["metric", "what it measures", "per data file", "needs"],
            _rows(METRICS, lambda m: m.help, lambda m: "yes" if m.per_file else "no", _needs),
        ),
    }


def fill_tables(text: str) -> str:
    """`text` (a documentation file) with every registry block replaced by the current table."""
    tables = registry_tables()

    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in tables:
            raise KeyError(
                f"the documentation names an unknown registry table {name!r}; known: {', '.join(tables)}"
            )
        return match.group(1) + tables[name] + match.group(4)

    return _BLOCK.sub(replace, text)


def blocks(text: str) -> dict[str, str]:
    """The registry blocks a documentation file holds now, by name."""
    return {m.group(2): m.group(3) for m in _BLOCK.finditer(text)}


# ------------------------------------------------------------------------- MoE families
# The full table (docs/families.md) and the README's summary, each generated for one transformers.
_FAMILIES = re.compile(
    r"(<!-- (families|family-summary): transformers ([\w.]+) -->\n)(.*?)(<!-- /\2 -->)", re.S
)


def family_table_markdown() -> str:
    """The family table: every MoE family of the installed transformers, as
    `models.families` finds it (tiny model built, structure discovered, or why not)."""
    from moeprune.models.families import family_table

    rows = [[f"`{s.model_type}`", s.status, _layers(s), s.detail] for s in family_table()]
    return _table(["model type", "status", "MoE layers of the tiny model", "found, or why not"], rows)


def family_summary_markdown() -> str:
    """One line per status, naming the families in it (the README's short form of the table)."""
    from moeprune.models.families import family_table

    by_status: dict[str, list[str]] = {}
    for status in family_table():
        by_status.setdefault(status.status, []).append(f"`{status.model_type}`")
    total = sum(map(len, by_status.values()))
    lines = [
        f"- **{status}** ({len(names)} of {total}): {', '.join(names)}" for status, names in by_status.items()
    ]
    return "\n".join(lines) + "\n"


def _layers(status) -> str:
    if not status.moe_layers:
        return ""
    return f"{', '.join(map(str, status.moe_layers))} of {status.decoder_layers}"


def fill_family_table(text: str) -> str:
    """`text` with its family blocks (table and summary) regenerated for the installed transformers."""
    import transformers

    render = {"families": family_table_markdown, "family-summary": family_summary_markdown}

    def replace(match: re.Match) -> str:
        head = f"<!-- {match.group(2)}: transformers {transformers.__version__} -->\n"
        return head + render[match.group(2)]() + match.group(5)

    return _FAMILIES.sub(replace, text)


def family_table_version(text: str) -> str | None:
    """The transformers version a text's family blocks were generated with (None: it has none)."""
    versions = {match.group(3) for match in _FAMILIES.finditer(text)}
    if len(versions) > 1:
        raise ValueError(f"family blocks generated with different transformers versions: {sorted(versions)}")
    return versions.pop() if versions else None
