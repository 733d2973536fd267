"""Which tests run transformers' model code: recorded by the first pass of scripts/test.sh, run
again by its second (the lowest supported transformers, in .venv-vllm).

The rule: a test depends on the installed transformers when, while it runs (its setup, call and
teardown), while a fixture it uses is set up (a module's or the session's trained or pruned
models, built before the test itself), or while its module is imported (parameters enumerated from
the installed families), one of these happens:

- a transformers model or config is built (`PreTrainedModel.__init__`, `PretrainedConfig.__init__`
  or, where configs are dataclasses, its `__post_init__`:
  every model made, loaded, converted or rebuilt from a config, moeprune's own modeling classes
  included, since they derive from transformers');
- moeprune's family code (`moeprune.models`) answers from one of its caches (the families of the
  installed transformers, their status, probed widths), which were computed from such models once
  per process;
- this Python starts another of itself (`python -m moeprune ...`, torchrun), which does the same.

Everything else (formulas, allocations, plans, codecs on plain tensors, reports read from disk,
the data files, bad-input refusals before loading) computes the same on any transformers, so the
second pass leaves it out. The tiers `vllm` and `quant_env` are left out too: their engines run in
.venv-vllm and .venv-quant, at those environments' own transformers, in the first pass already.

`MOEPRUNE_TRANSFORMERS_RECORD=DIR` records: each test process writes `DIR/<pid>.txt`, one line per
dependent test (its node id without parameters: a parametrized test counts once, whatever
families the other transformers enumerates) or module (`<path>`, when its import was). Then
`MOEPRUNE_TRANSFORMERS_SELECT=DIR` keeps, of the tests collected, those recorded.
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

SKIPPED_TIERS = ("vllm", "quant_env")
_uses = [0]  # transformers models, configs, family caches and child Pythons met so far, in this process


def _counted(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        _uses[0] += 1
        return function(*args, **kwargs)

    return wrapper


def _cache_counted(cached):
    """A cached function that counts its answers once one of its computations counted."""
    computed_from_transformers = [False]

    @functools.wraps(cached)
    def wrapper(*args, **kwargs):
        before, misses = _uses[0], cached.cache_info().misses
        answer = cached(*args, **kwargs)
        if cached.cache_info().misses == misses and computed_from_transformers[0]:
            _uses[0] += 1
        computed_from_transformers[0] |= _uses[0] != before
        return answer

    return wrapper


def count_caches(modules: list) -> None:
    """Wrap the module-level cached functions defined in `modules` (_cache_counted), in those
    modules and wherever moeprune's or the tests' modules imported them by name."""
    wrapped = {}
    for module in modules:
        for value in vars(module).values():
            if hasattr(value, "cache_info") and getattr(value, "__module__", None) == module.__name__:
                wrapped[id(value)] = _cache_counted(value)
    if not wrapped:
        return
    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if id(value) in wrapped:
                setattr(module, name, wrapped[id(value)])


def _popen(start):
    def popen(self, args, *rest, **kwargs):
        if not isinstance(args, (str, bytes, os.PathLike)):
            args = list(args)
        program = os.fsdecode(
            args if isinstance(args, (str, bytes, os.PathLike)) else args[0] if args else ""
        )
        if os.path.abspath(program) == os.path.abspath(sys.executable):  # this Python, not another venv's
            _uses[0] += 1
        start(self, args, *rest, **kwargs)

    return popen


def _count_transformers() -> None:
    """Count every transformers model and config built, every answer of moeprune.models' caches
    and every child started from this Python (the module docstring's three cases)."""
    import transformers

    import moeprune.models as family_code

    for cls in (transformers.PreTrainedModel, transformers.PretrainedConfig):
        for method in ("__init__", "__post_init__"):  # configs: dataclasses on newer transformers
            if method in vars(cls):
                setattr(cls, method, _counted(vars(cls)[method]))
    names = [info.name for info in pkgutil.walk_packages(family_code.__path__, "moeprune.models.")]
    count_caches([importlib.import_module(name) for name in names])
    subprocess.Popen.__init__ = _popen(subprocess.Popen.__init__)


def _test_id(item: pytest.Item) -> str:
    return item.nodeid.split("[", 1)[0]


class Recorder:
    """Writes the dependent tests and modules of this process (the module docstring's rule)."""

    def __init__(self, folder: Path) -> None:
        _count_transformers()
        self.path = folder / f"{os.getpid()}.txt"
        self.found: set[str] = set()
        self.fixtures: set[int] = set()  # ids of fixture definitions whose setup counted

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector):
        """A test module's import and parametrization; its own caches counted from then on."""
        before = _uses[0]
        report = yield
        if isinstance(collector, pytest.Module) and report.passed:
            if _uses[0] != before:
                self.found.add(collector.nodeid)
            count_caches([collector.obj])
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        before = _uses[0]
        try:
            return (yield)
        finally:
            if _uses[0] != before:
                self.fixtures.add(id(fixturedef))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = _uses[0]
        result = yield
        if any(item.get_closest_marker(tier) for tier in SKIPPED_TIERS):
            return result
        used = {id(d) for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs}
        if _uses[0] != before or used & self.fixtures:
            self.found.add(_test_id(item))
        return result

    def pytest_sessionfinish(self) -> None:
        self.path.write_text("".join(f"{line}\n" for line in sorted(self.found)))


class Selector:
    """Deselects the tests that the first pass did not record."""

    def __init__(self, folder: Path) -> None:
        self.recorded = {line for f in folder.glob("*.txt") for line in f.read_text().split()}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items) -> None:
        keep, drop = [], []
        for item in items:
            chosen = _test_id(item) in self.recorded or item.nodeid.split("::", 1)[0] in self.recorded
            skipped = any(item.get_closest_marker(tier) for tier in SKIPPED_TIERS)
            (keep if chosen and not skipped else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep


def register(config: pytest.Config) -> None:
    """The recorder or the selector, as the environment asks (scripts/test.sh)."""
    if os.environ.get("MOEPRUNE_TRANSFORMERS_RECORD"):
        config.pluginmanager.register(Recorder(Path(os.environ["MOEPRUNE_TRANSFORMERS_RECORD"])))
    if os.environ.get("MOEPRUNE_TRANSFORMERS_SELECT"):
        config.pluginmanager.register(Selector(Path(os.environ["MOEPRUNE_TRANSFORMERS_SELECT"])))
