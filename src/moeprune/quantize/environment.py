"""The quantization environment: llm-compressor and its compressed-tensors stack in a virtual
environment of their own, made by `moeprune setup quantize` (a pip install of moeprune needs
nothing else) or by scripts/setup_quant.sh in a clone (which adds moeprune for the tests).

Why apart: llm-compressor 0.14.0.1 pins transformers to 5.15-5.17 and compressed-tensors to 0.19,
which moeprune's own environment (the newest transformers) does not share. `prune --quantize`
saves the pruned model and runs the oneshot driver (a script that never imports moeprune) in this
environment's Python.

Standard library only, so that the clone's set-up script can run this file with the system Python
before any environment exists: `python3 environment.py PATH [--torch SPEC] [--force]`.

Order of the installs matters: torch first, pinned, so that pip takes the wheel this machine's
index serves for that version and never swaps it for another build later (it stays pinned in
every later command); then llm-compressor with transformers and compressed-tensors pinned in the
same command, so the resolver cannot pick other versions. A stamp file inside the environment
records the pins it certifies: a second run with the same pins is instant.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import venv
from collections.abc import Callable
from pathlib import Path

PINS = {
    "torch": "2.13.0",
    "llmcompressor": "0.14.0.1",
    "transformers": "5.17.0",
    "compressed-tensors": "0.19.0",
}
STAMP = ".moeprune-quant-installed"
# Checked after the installs: fail at set-up, not in the first quantization.
CHECK = """
import compressed_tensors, llmcompressor, torch, transformers
pins = {pins!r}
assert torch.__version__.split("+")[0] == pins["torch"], torch.__version__
assert transformers.__version__ == pins["transformers"], transformers.__version__
assert compressed_tensors.__version__.startswith(pins["compressed-tensors"]), compressed_tensors.__version__
print(f"llmcompressor {{llmcompressor.__version__}}, compressed-tensors {{compressed_tensors.__version__}}, "
      f"torch {{torch.__version__}}, transformers {{transformers.__version__}}")
"""


def python_of(path: Path) -> Path:
    """The Python of the environment at `path` (POSIX and Windows layouts)."""
    posix = path / "bin" / "python"
    return posix if posix.exists() or sys.platform != "win32" else path / "Scripts" / "python.exe"


def stamp_value(torch_spec: str) -> str:
    """What a finished environment's stamp holds: the pins and the torch requirement it took."""
    return hashlib.sha256(json.dumps([PINS, torch_spec], sort_keys=True).encode()).hexdigest()


def is_ready(path: Path, torch_spec: str | None = None) -> bool:
    """Whether `path` holds an environment this version of moeprune set up with these pins."""
    stamp = path / STAMP
    spec = torch_spec or f"torch=={PINS['torch']}"
    return python_of(path).is_file() and stamp.is_file() and stamp.read_text().strip() == stamp_value(spec)


def make_environment(
    path: Path,
    torch_spec: str | None = None,
    force: bool = False,
    echo: Callable[[str], None] = print,
) -> Path:
    """Make (or refresh) the environment at `path`; returns its Python. `torch_spec` replaces the
    pinned torch requirement (e.g. a CUDA build's version); "skip" keeps the torch already there."""
    path = Path(path).absolute()
    spec = torch_spec or f"torch=={PINS['torch']}"
    if not force and is_ready(path, spec):
        echo(f"{path}: ready (pins unchanged)")
        return python_of(path)
    if not python_of(path).is_file():
        echo(f"{path}: making a virtual environment")
        venv.EnvBuilder(with_pip=True, clear=False).create(path)
    python = python_of(path)
    (path / STAMP).unlink(missing_ok=True)  # half-made until the check passes
    torch = [] if spec == "skip" else [spec]
    pinned = [f"{name}=={version}" for name, version in PINS.items() if name != "torch"]
    if torch:
        echo(f"{path}: installing {spec}")
        _pip(python, torch)
    echo(f"{path}: installing {', '.join(pinned)}")
    _pip(python, [*torch, *pinned])
    found = subprocess.run(
        [str(python), "-c", CHECK.format(pins=PINS if torch else {**PINS, "torch": _torch_of(python)})],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise RuntimeError(f"the quantization environment at {path} did not keep its pins:\n{found.stderr}")
    (path / STAMP).write_text(stamp_value(spec) + "\n")
    echo(f"{path}: ready ({found.stdout.strip().splitlines()[-1]})")
    return python


def _pip(python: Path, requirements: list[str]) -> None:
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *requirements], check=True
    )


def _torch_of(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().split("+")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Make moeprune's quantization environment (llm-compressor).")
    parser.add_argument("path", type=Path, help="the environment's folder")
    parser.add_argument("--torch", default=None, help=f"torch requirement [default: torch=={PINS['torch']}]")
    parser.add_argument("--force", action="store_true", help="reinstall even if the stamp matches")
    args = parser.parse_args(argv)
    make_environment(args.path, args.torch, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
