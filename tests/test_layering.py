"""The packages import in pipeline order: no package imports a later stage, at module level or
inside a function. The order is the one docs/architecture.md describes; a new package takes its
place in STAGES, and an import that breaks the order is a design change to make on purpose."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # reads source files only

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "moeprune"
STAGES = (
    ("errors", "config", "plan"),  # the vocabulary every stage shares
    ("models",),  # structure discovery, the MoEModel view
    ("serve",),  # the on-disk format's reader and the engines' modeling code: copied into outputs,
    # they import no other stage of moeprune (the decoding of quantized weights lives there too)
    ("quant",),  # quantized inputs' formats (fp8, MXFP4, compressed-tensors): read and checked
    ("runtime",),  # devices, torchrun, progress, run log, finite checks, the atomic writer
    ("checkpoint",),  # load and save: a pruned layout is rebuilt by models' packed storage and reshape
    ("data",),
    ("observe",),
    ("criteria",),
    ("allocate",),  # budgets, the allocations' declarations, the search's fitnesses
    ("surgery",),
    ("search",),  # EvoESAP evaluates candidate plans through surgery's masks, saves its state atomically
    ("evaluate",),
    ("report",),
    ("shards",),  # byte-level work on the shards: layer-by-layer observation, streamed scores, rewrites
    ("quantize",),  # the result quantized (llm-compressor) and the per-layer scheme choice: its joint
    # searches are EvoESAP spaces (after search), its oneshot runs through evaluate's driver runner
    ("api",),  # the one verb on a loaded model
    ("job", "demo"),  # the file-level jobs around it: both pipelines, their evidence, scoring; the demo
    ("cli", "__main__"),
)
RANK = {name: rank for rank, names in enumerate(STAGES) for name in names}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, first package name) of every `moeprune.*` import in a file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "moeprune":
            parts = node.module.split(".")
            targets = [parts[1]] if len(parts) > 1 else [alias.name for alias in node.names]
            found += [(node.lineno, t) for t in targets]
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name.split(".")[1]) for a in node.names if a.name.startswith("moeprune.")
            ]
    return found


def test_every_package_has_a_stage():
    packages = {
        p.name if p.is_dir() else p.stem for p in PACKAGE.iterdir() if not p.name.startswith(("_", "."))
    }
    packages -= {"py"}  # py.typed
    assert packages - set(RANK) == set(), "place the new package in STAGES"


def test_no_package_imports_a_later_stage():
    late = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if own == "__init__":
            continue  # the top-level package re-exports lazily
        for line, target in imports_of(path):
            if target in RANK and RANK[target] > RANK[own]:
                late.append(f"{path.relative_to(PACKAGE)}:{line} imports moeprune.{target}")
    assert late == [], "\n".join(late)
