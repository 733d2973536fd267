"""Shared fixtures.

One torch thread: the test machine has two cores shared with other jobs, where a single thread
is faster than two fighting for them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def trained_moe() -> tuple[Path, Path]:
    """``(model_dir, corpus_dir)`` of a small Qwen3-MoE that has learned (the FIXTURE preset).

    Trained once (about a minute) and cached under ``$MOEPRUNE_CACHE`` or ``~/.cache/moeprune``,
    so later sessions reuse it. Treat it as read-only: copy before modifying.
    """
    from moeprune.demo.train import CORPUS_SUBDIR, FIXTURE, get_demo_model

    model_dir = get_demo_model(FIXTURE, progress=False, threads=1)
    return model_dir, model_dir / CORPUS_SUBDIR
