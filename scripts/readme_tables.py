"""Rewrite the README's registry tables (criteria, allocations, methods, fitnesses, metrics) and
its MoE family table (generated for the installed transformers).

    python scripts/readme_tables.py          # rewrite README.md in place
    python scripts/readme_tables.py --check  # exit 1 when a table differs from the registries

tests/test_readme.py runs the check, so a new registry entry without a README update fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

from moeprune.report.tables import fill_family_table, fill_tables

README = Path(__file__).resolve().parents[1] / "README.md"


def main() -> int:
    text = README.read_text()
    filled = fill_family_table(fill_tables(text))
    if "--check" in sys.argv:
        if filled != text:
            print("README.md's registry tables are out of date: run python scripts/readme_tables.py")
            return 1
        return 0
    README.write_text(filled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
