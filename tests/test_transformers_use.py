"""transformers_use.py, the rule of scripts/test.sh's second pass: a first pytest run records the
tests that built a transformers model or config (in the test, a fixture it uses, its module's
import or a cache filled from them) or started this Python again, and a second run keeps exactly
those, a parametrized test with all its parameters."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # two pytest runs in subprocesses (transformers imported)

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import transformers_use

def pytest_configure(config):
    transformers_use.register(config)
"""

TEST_A = """
import functools, subprocess, sys
import pytest
import transformers

@pytest.fixture(scope="module")
def config():
    return transformers.Qwen3MoeConfig(num_hidden_layers=1)

@functools.cache
def model_type():
    return transformers.Qwen3MoeConfig().model_type

def test_pure():
    assert sum(range(4)) == 6

def test_builds():
    assert transformers.Qwen3MoeConfig().num_experts > 0

def test_fixture_first(config):
    assert config.num_hidden_layers == 1

def test_fixture_again(config):
    assert config.num_hidden_layers == 1

@pytest.mark.parametrize("n", [1, 2])
def test_one_parameter_builds(n):
    if n == 2:
        transformers.Qwen3MoeConfig()

def test_cache_filled():
    assert model_type() == "qwen3_moe"

def test_cache_read():
    assert model_type() == "qwen3_moe"

def test_this_python_again():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_another_program():
    subprocess.run(["true"], check=True)
"""

TEST_B = """
import transformers

TYPES = [transformers.Qwen3MoeConfig().model_type]  # at import: every test of the module depends

def test_types():
    assert TYPES == ["qwen3_moe"]
"""

TEST_C = """
def test_plain():
    assert 2 * 3 == 6
"""


def _pytest(folder: Path, variable: str, record: Path) -> str:
    env = {**os.environ, variable: str(record)}
    env.pop(
        "MOEPRUNE_TRANSFORMERS_RECORD" if variable.endswith("SELECT") else "MOEPRUNE_TRANSFORMERS_SELECT",
        None,
    )
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_a.py", "test_b.py",
                           "test_c.py"], cwd=folder, env=env, capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_second_run_keeps_what_the_first_recorded(tmp_path):
    folder, record = tmp_path / "project", tmp_path / "record"
    folder.mkdir()
    record.mkdir()
    for name, text in {"conftest": CONFTEST, "test_a": TEST_A, "test_b": TEST_B, "test_c": TEST_C}.items():
        (folder / f"{name}.py").write_text(text)
    assert re.search(r"\b12 passed\b", _pytest(folder, "MOEPRUNE_TRANSFORMERS_RECORD", record))
    recorded = {line for f in record.glob("*.txt") for line in f.read_text().split()}
    depends = ("test_builds", "test_fixture_first", "test_fixture_again", "test_one_parameter_builds",
               "test_cache_filled", "test_cache_read", "test_this_python_again")  # fmt: skip
    assert recorded == {f"test_a.py::{name}" for name in depends} | {"test_b.py"}
    second = _pytest(folder, "MOEPRUNE_TRANSFORMERS_SELECT", record)
    assert re.search(r"\b9 passed, 3 deselected\b", second), second  # test_one_parameter_builds: both
