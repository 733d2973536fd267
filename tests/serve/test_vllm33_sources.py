"""Every vLLM name moeprune's plugin touches exists, with its members and parameters, in each
vLLM release of the tested range: 0.32 (.venv-vllm, the CPU build the serving tests run) and 0.33
(.venv-vllm33, the GPU wheel installed --no-deps by scripts/setup_vllm33.sh, which cannot run
here). Read from each release's own Python sources with `ast`: nothing of vLLM is imported.

The table checked is serve/vllm/touchpoints.py; the first test proves it covers every vLLM name
the plugin's modules import, so a new touch point cannot go unchecked.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import moeprune
from moeprune.serve.vllm.touchpoints import PLUGIN_MODULES, TOUCHPOINTS, Touch
from moeprune.serve.vllm.version import TESTED_VLLM

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SRC = Path(moeprune.__file__).resolve().parents[1]
RELEASES = {"0.32": ".venv-vllm", "0.33": ".venv-vllm33"}


def vllm_root(release: str) -> Path:
    found = sorted((ROOT / RELEASES[release]).glob("lib/python3*/site-packages/vllm"))
    if not found:
        pytest.skip(
            f"{RELEASES[release]} is not set up (scripts/setup_vllm{'33' if release == '0.33' else ''}.sh)"
        )
    root = found[0]
    version = (root / "version.py").read_text() if (root / "version.py").is_file() else ""
    dist = sorted(root.parent.glob("vllm*-*.dist-info"))
    assert dist and dist[0].name.split("-")[1].startswith(release + "."), (dist, version)
    return root


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def module_file(root: Path, module: str) -> Path:
    parts = module.split(".")[1:]
    base = root.joinpath(*parts)
    return base / "__init__.py" if (base / "__init__.py").is_file() else base.with_suffix(".py")


def top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """Names a module defines or imports at its top level (also under `if`/`try`)."""
    names: dict[str, ast.AST] = {}
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop(0)
        if isinstance(node, (ast.If, ast.Try)):
            nodes.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                nodes.extend(handler.body)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({t.id: node for t in targets if isinstance(t, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    return names


def resolve(root: Path, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST]:
    """(module, node) where `name` seen from `module` is defined, following re-exports."""
    assert depth < 8, (module, name)
    path = module_file(root, module)
    assert path.is_file(), f"vLLM has no module {module}"
    names = top_level(parsed(path))
    node = names.get(name)
    if node is None:  # `from .x import *` (vllm.distributed re-exports its modules so)
        stars = [n for n in parsed(path).body if isinstance(n, ast.ImportFrom) and n.names[0].name == "*"]
        for star in stars:
            try:
                return resolve(root, absolute(module, path, star), name, depth + 1)
            except AssertionError:
                continue
    assert node is not None, f"{module} defines no {name}"
    if isinstance(node, ast.ImportFrom):
        original = next(a.name for a in node.names if (a.asname or a.name) == name)
        return resolve(root, absolute(module, path, node), original, depth + 1)
    return module, node


def absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module an import statement of `module` (file `path`) reads from."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    return ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))


def class_members(root: Path, module: str, node: ast.ClassDef, depth: int = 0) -> set[str]:
    """Methods, class attributes, fields and `self.x =` attributes of a class and its vLLM bases."""
    members: set[str] = set()
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
        if isinstance(item, (ast.Assign, ast.AnnAssign)):
            for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                value = target.value if isinstance(target, ast.Attribute) else None
                if isinstance(target, ast.Attribute) and isinstance(value, ast.Name) and value.id == "self":
                    members.add(target.attr)
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else None
        if name is None or depth > 6:
            continue
        try:
            where, found = resolve(root, module, name)
        except AssertionError:  # a base from outside vLLM (torch, pydantic, enum)
            continue
        if isinstance(found, ast.ClassDef):
            members |= class_members(root, where, found, depth + 1)
    return members


def parameters(node: ast.AST) -> set[str]:
    if isinstance(node, ast.ClassDef):
        node = next((i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "__init__"), node)
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), ast.dump(node)[:80]
    args = node.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    return names


def plugin_imports() -> set[tuple[str, str]]:
    """(module, name) of every `from vllm... import name` in the plugin's modules."""
    found = set()
    for relative in PLUGIN_MODULES:
        for node in ast.walk(parsed(SRC / relative)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                found.update((node.module, a.name) for a in node.names)
    return found


def test_the_table_lists_every_vllm_name_the_plugin_imports():
    listed = {(t.module, t.name) for t in TOUCHPOINTS}
    modules = {t.module for t in TOUCHPOINTS}  # `from vllm.x import module`: its names are listed
    missing = {(m, n) for m, n in plugin_imports() - listed if f"{m}.{n}" not in modules}
    assert not missing, f"serve/vllm/touchpoints.py lacks {sorted(missing)}: add them, with what they are for"
    assert plugin_imports(), "the plugin imports vLLM names: the parser must find them"


def test_the_tested_range_is_the_releases_checked_here():
    low, high = TESTED_VLLM
    checked = sorted(tuple(map(int, r.split("."))) for r in RELEASES)
    assert checked[0] == low and (checked[-1][0], checked[-1][1] + 1) == high


@pytest.mark.parametrize("release", sorted(RELEASES))
@pytest.mark.parametrize("touch", TOUCHPOINTS, ids=lambda t: f"{t.module.split('.')[-1]}.{t.name}")
def test_vllm_has_what_the_plugin_touches(release: str, touch: Touch):
    root = vllm_root(release)
    module, node = resolve(root, touch.module, touch.name)
    if touch.members:
        assert isinstance(node, ast.ClassDef), f"vLLM {release}: {touch.name} is no class"
        missing = set(touch.members) - class_members(root, module, node)
        assert not missing, f"vLLM {release}'s {touch.name} lacks {sorted(missing)} ({touch.why})"
    if touch.params:
        missing = set(touch.params) - parameters(node)
        assert not missing, f"vLLM {release}'s {touch.name} takes no {sorted(missing)} ({touch.why})"


def test_the_checker_sees_a_missing_name_member_and_parameter():
    """The checks can fail: names, members and parameters vLLM 0.32 does not have are found missing."""
    root = vllm_root("0.32")
    with pytest.raises(AssertionError, match="defines no"):
        resolve(root, "vllm.config.speculative", "NoSuchConfig")
    module, node = resolve(root, "vllm.model_executor.layers.fused_moe.layer", "FusedMoEFactory")
    assert "no_such_parameter" not in parameters(node) and "num_experts" in parameters(node)
    module, node = resolve(root, "vllm.config.speculative", "SpeculativeConfig")
    assert isinstance(node, ast.ClassDef)
    members = class_members(root, module, node)
    assert "hf_config_override" in members and "no_such_member" not in members
