"""Running a driver script in another Python (vLLM's environment) and reading its JSON answer.

vLLM often lives in a venv of its own (its CPU build pins other versions of torch and
transformers), so `serve-check` and `eval --engine vllm` hand it a JSON spec and a driver script,
and read back a JSON result. The engine's own console output goes to a log file, of which the
last line names the failure in the one-line error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from moeprune.errors import MoePruneError


def find_vllm_python(given: str | None) -> str:
    """The Python that runs vLLM: the one given, else this one when it can import vllm."""
    if given:
        if not Path(given).is_file() or not os.access(given, os.X_OK):
            raise MoePruneError(f"{given!r} is not an executable Python", options=("vllm_python",))
        return given
    if importlib.util.find_spec("vllm") is None:
        raise MoePruneError(
            f"vLLM is not installed in this Python ({sys.executable}); give the Python of an environment "
            "with vLLM and moeprune installed",
            options=("vllm_python",),
        )
    return sys.executable


def run_driver(
    python: str, driver: Path, spec: dict[str, Any], timeout_s: float, what: str, where: str = ""
) -> dict:
    """`python driver spec.json out.json`; the JSON it wrote. `what` names the job in errors
    ("vLLM", "lm-eval on vLLM"), `where` what it ran on (" on out/")."""
    with tempfile.TemporaryDirectory(prefix="moeprune-driver-") as work:
        spec_path, out_path, log_path = (Path(work) / n for n in ("spec.json", "out.json", "vllm.log"))
        spec_path.write_text(json.dumps(spec))
        with log_path.open("w") as log:
            try:
                done = subprocess.run(
                    [python, str(driver), str(spec_path), str(out_path)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                raise MoePruneError(f"{what} did not finish within {timeout_s:.0f} s") from exc
        if done.returncode != 0 or not out_path.is_file():
            lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
            raise MoePruneError(
                f"{what} ({python}) stopped with exit code {done.returncode}{where}: "
                f"{lines[-1] if lines else 'no output'}"
            )
        return json.loads(out_path.read_text())
