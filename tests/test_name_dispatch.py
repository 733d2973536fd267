"""Generic code asks the resolved entry, never its name (docs/architecture.md).

The package is read as source (AST): outside `cli/` (where names are parsed), `demo/`, the plan
format (`plan.py`) and the self-contained serving files, no comparison with a registered name
(a method, allocation, criterion, search or quantization scheme), and no table (a dict, tuple,
list or set literal) holding two names of one registry; `X.get(config.method)` and
`config.allocation or ...` after `check_config` are refused too. A registration (the arguments of
`REGISTRY.register(...)` / `REGISTRY.add(...)`) declares its names and is not a table, and the
module that registers a name may use it (its own definitions).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import moeprune.api  # noqa: F401 - every registry filled (the searches register with the api's imports)
import moeprune.evaluate.run  # noqa: F401
import moeprune.job  # noqa: F401
from moeprune.allocate.registry import ALLOCATIONS
from moeprune.criteria.registry import CRITERIA
from moeprune.search.registry import SEARCHES
from moeprune.surgery.registry import METHODS

pytestmark = pytest.mark.unit  # reads source files only

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "moeprune"
# the writers of quantized test checkpoints and the quantize stage's scheme drivers still switch on
# a scheme's name: schemes become records their consumers read (issue 44 item 4, not done here)
SCHEME_PENDING = {
    "quantize/driver.py",
    "quantize/fake.py",
    "quantize/pricing.py",
    "quant/testing.py",
}


def registered() -> dict[str, set[str]]:
    """Each registry's names (the quantization schemes' from their table, wherever it lives)."""
    kinds = {r.kind: set(r.names()) for r in (METHODS, ALLOCATIONS, CRITERIA, SEARCHES)}
    try:
        from moeprune.quant.schemes import SCHEMES
    except ImportError:  # moved: the quantize stage
        from moeprune.quantize.schemes import SCHEMES  # type: ignore[no-redef]
    kinds["scheme"] = set(SCHEMES)
    return kinds


def _exempt(path: Path) -> bool:
    rel = path.relative_to(PACKAGE)
    return (
        rel.parts[0] in ("cli", "demo")
        or str(rel) == "plan.py"
        or path.name.startswith(("modeling_", "moeprune_"))
    )


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _registrations(tree: ast.AST) -> tuple[set[int], set[str]]:
    """ids of every node inside a `X.register(...)` or `X.add(...)` call (declarations), and the
    names the file registers (each spec's first argument)."""
    inside: set[int] = set()
    own: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("register", "add")
        ):
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                inside |= {id(n) for n in ast.walk(arg)}
                if isinstance(arg, ast.Call) and arg.args:
                    own |= set(_strings(arg.args[0]))
    return inside, own


def dispatch_in(path: Path, names: dict[str, set[str]], root: Path = PACKAGE) -> list[str]:
    tree = ast.parse(path.read_text())
    declared, own = _registrations(tree)
    names = {kind: known - own for kind, known in names.items()}
    every = set().union(*names.values())
    where = path.relative_to(root)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            asked = [s for c in (node.left, *node.comparators) for s in _strings(c) if s in every]
            if asked:
                hits.append(f"{where}:{node.lineno} compares {', '.join(asked)}")
        elif isinstance(node, ast.Dict | ast.Tuple | ast.List | ast.Set) and id(node) not in declared:
            keys = node.keys if isinstance(node, ast.Dict) else node.elts
            values = [s for k in keys if k is not None for s in _strings(k)]
            for kind, known in names.items():
                if len(set(values) & known) >= 2:
                    hits.append(
                        f"{where}:{node.lineno} a table of {kind} names {sorted(set(values) & known)}"
                    )
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
            and isinstance(node.args[0], ast.Attribute)
            and node.args[0].attr in ("method", "allocation")
            and "config" in ast.unparse(node.args[0].value)  # a document's name (a report) is not
            and path.name != "registry.py"
        ):
            hits.append(f"{where}:{node.lineno} looks up .{node.args[0].attr} by name")
        elif (
            isinstance(node, ast.BoolOp)
            and isinstance(node.op, ast.Or)
            and isinstance(node.values[0], ast.Attribute)
            and node.values[0].attr in ("method", "allocation")
        ):
            hits.append(f"{where}:{node.lineno} defaults .{node.values[0].attr} again")
    return hits


def test_no_stage_dispatches_on_a_registered_name():
    names = registered()
    unschemed = {kind: known for kind, known in names.items() if kind != "scheme"}
    hits = [
        h
        for f in sorted(PACKAGE.rglob("*.py"))
        if not _exempt(f)
        for h in dispatch_in(f, unschemed if str(f.relative_to(PACKAGE)) in SCHEME_PENDING else names)
    ]
    assert hits == [], "ask the resolved entry (a hook or a flag), not its name:\n" + "\n".join(hits)


def test_the_scan_finds_what_it_refuses(tmp_path):
    """The scan itself: a comparison, a table and a lookup by name are each found; a registration is not."""
    source = tmp_path / "stage.py"
    source.write_text(
        "def f(config, METHODS):\n"
        "    if config.method == 'mixed':\n"
        "        return METHODS.get(config.method)\n"
        "    KEPT = ('neurons', 'tenp')\n"
        "    NOTE = {'drop': 1, 'novice': 2}\n"
        "    METHODS.register(Method('x', ('uniform', 'global')))\n"
        "    return config.allocation or 'uniform'\n"
    )
    hits = dispatch_in(source, registered(), tmp_path)
    assert sorted(h.split(" ", 1)[1] for h in hits) == sorted(
        [
            "compares mixed",
            "looks up .method by name",
            "a table of method names ['neurons', 'tenp']",
            "a table of method names ['drop', 'novice']",
            "defaults .allocation again",
        ]
    )
