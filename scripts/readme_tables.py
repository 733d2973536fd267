"""Rewrite the generated blocks of the documentation (README.md, CONTRIBUTING.md, docs/*.md): the
registry tables (criteria, allocations, methods, fitnesses, metrics), the MoE family table and
summary (for the installed transformers), and the command-line reference (docs/cli.md).

    python scripts/readme_tables.py          # rewrite the files in place
    python scripts/readme_tables.py --check  # exit 1 when a block differs from what it is made from

tests/report/test_docs.py runs the check, so a new registry entry, flag or family without a docs update fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

from moeprune.cli.reference import fill_generated

ROOT = Path(__file__).resolve().parents[1]


def documentation() -> list[Path]:
    """Every documentation file that may hold generated blocks."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def main() -> int:
    stale = []
    for path in documentation():
        text = path.read_text()
        filled = fill_generated(text)
        if filled != text:
            stale.append(path.relative_to(ROOT))
            if "--check" not in sys.argv:
                path.write_text(filled)
    if stale and "--check" in sys.argv:
        print(f"generated blocks are out of date in {', '.join(map(str, stale))}: run python scripts/readme_tables.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
