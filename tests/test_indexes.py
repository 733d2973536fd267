"""Honest indexes: every module of a package is named in its folder's `__init__` docstring, so a
newcomer reading the folder's index sees all of it (a moved or new module without its line fails)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # reads source files only

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "moeprune"


def packages() -> list[Path]:
    """Every subpackage (the top's modules are the verbs, listed in docs/architecture.md)."""
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)


@pytest.mark.parametrize("folder", packages(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_every_module_is_named_in_its_folders_index(folder: Path):
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    modules = [p.name for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"]
    modules += [f"{p.name}/" for p in sorted(folder.iterdir()) if (p / "__init__.py").is_file()]
    missing = [m for m in modules if m not in doc and m.rstrip("/") + "/" not in doc]
    assert not missing, f"{folder.relative_to(PACKAGE.parent)}/__init__.py does not name {', '.join(missing)}"
