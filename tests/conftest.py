"""Shared fixtures.

One torch thread: the test machine has two cores shared with other jobs, where a single thread
is faster than two fighting for them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


def _child_environment() -> None:
    """What the processes the tests start (vLLM engines, CLI runs, torchrun ranks, the warm shared
    interpreters) inherit from this one.

    - One core per test worker. vLLM's CPU build binds its OpenMP threads by itself: with `auto` on
      2 cores it reserves the last core for its scheduler and binds every engine to core 0, so two
      workers' engines ran on one core while the other waited. Worker N's engines are bound to core
      N, and other children get one OpenMP thread, as this process has. An explicit setting in the
      environment wins; a single-process run keeps vLLM's own choice.
    - vllm_site/sitecustomize.py on PYTHONPATH: in vLLM's environment, vLLM's explicit full garbage
      collections (three quarters of serving a tiny model) collect the young generations only."""
    site = str(TESTS / "vllm_site")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    os.environ["PYTHONPATH"] = os.pathsep.join([site, *paths])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    if worker.startswith("gw"):
        cores = sorted(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[int(worker[2:]) % len(cores)]))
        os.environ.setdefault("OMP_NUM_THREADS", "1")

# The tests mirror the package (tests/<stage>/test_<module>.py). Test modules share a few helpers
# by module name (helpers.py here; `from test_observe import calibration`), so every folder is
# importable by name, as the workers started in subprocesses also arrange (tests_on_path).
TESTS = Path(__file__).resolve().parent
QUANT_PYTHON = TESTS.parent / ".venv-quant" / "bin" / "python"
VLLM_PYTHON = TESTS.parent / ".venv-vllm" / "bin" / "python"
sys.path[:0] = [str(TESTS), *(str(p) for p in sorted(TESTS.iterdir()) if p.is_dir() and not p.name.startswith((".", "_")))]
_child_environment()


@pytest.fixture(scope="session")
def trained_moe() -> tuple[Path, Path]:
    """``(model_dir, corpus_dir)`` of a small Qwen3-MoE that has learned (the FIXTURE preset).

    Trained once (about a minute) and cached under ``$MOEPRUNE_CACHE`` or ``~/.cache/moeprune``,
    so later sessions reuse it. Treat it as read-only: copy before modifying.
    """
    from moeprune.demo.train import CORPUS_SUBDIR, FIXTURE, get_demo_model

    model_dir = get_demo_model(FIXTURE, progress=False, threads=1)
    return model_dir, model_dir / CORPUS_SUBDIR


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE (4 MoE layers, 8 experts) with a byte-level tokenizer saved beside it.

    Read-only: tests that modify a model copy it first.
    """
    from moeprune.data.tokenizer import byte_tokenizer
    from moeprune.models.factory import tiny_model

    path = tmp_path_factory.mktemp("tiny") / "ref"
    tokenizer = byte_tokenizer()
    tiny_model(
        "qwen3_moe", vocab_size=len(tokenizer), num_hidden_layers=4, mlp_only_layers=[]
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def quant_python() -> Iterator[Path]:
    """The quantization environment's Python (.venv-quant) for `--quant-python`, shared: one warm
    process per test worker runs the oneshot driver of every quant_env test in turn
    (shared_python.py), so llm-compressor's imports (about 12 s on 2 cores) are paid once, not once
    per quantized folder. Skipped, naming the setup script, where the environment is absent."""
    if not QUANT_PYTHON.is_file():
        pytest.skip(f"no quantization environment ({QUANT_PYTHON} absent): run scripts/setup_quant.sh")
    from shared_python import shared_python

    with shared_python(QUANT_PYTHON, preload=("torch", "transformers", "datasets", "llmcompressor")) as python:
        yield python


@pytest.fixture(scope="session")
def shared_vllm_python() -> Iterator[Path]:
    """vLLM's environment's Python (.venv-vllm) for `--vllm-python` and the serving drivers, shared:
    one warm process per test worker runs in turn the drivers of the serving tests that assert
    nothing of a fresh process (shared_python.py), so vLLM's imports (about 20 s of CPU) are paid
    once. Tests that check what a vLLM process imported, patch vLLM before its import, time its
    start-up or end on a refused start (which may leave state behind) start .venv-vllm's own."""
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"{VLLM_PYTHON} is missing: run ./scripts/setup_vllm.sh", pytrace=False)
    from shared_python import shared_python

    with shared_python(VLLM_PYTHON, preload=("torch", "transformers", "vllm", "vllm.entrypoints.llm")) as python:
        yield python


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A small calibration JSONL: prompt/answer pairs and text-only code records."""
    path = tmp_path_factory.mktemp("data") / "calib.jsonl"
    rows = [
        {"prompt": f"Question {i}: what is {i} plus {i}?", "answer": f" It is {2 * i}."} for i in range(12)
    ]
    rows += [{"text": "def add(a, b):\n    return a + b\n" * (1 + i % 3)} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def pytest_configure(config) -> None:
    """scripts/test.sh's record of the tests that run transformers' model code (first pass) and
    their selection (second pass): transformers_use.py."""
    import transformers_use

    transformers_use.register(config)


TIERS = ("unit", "integration", "vllm", "quant_env", "distributed")


def pytest_collection_modifyitems(config, items) -> None:
    """Every test belongs to exactly one tier (a module's `pytestmark`), so `pytest -m unit` and
    the others together run the whole suite; a test file without a tier fails collection."""
    untiered = sorted({item.nodeid.split("::")[0] for item in items
                       if sum(1 for tier in TIERS if item.get_closest_marker(tier)) != 1})  # fmt: skip
    if untiered:
        raise pytest.UsageError(f"give these test files one tier marker ({', '.join(TIERS)}): {', '.join(untiered)}")
