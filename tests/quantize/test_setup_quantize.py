"""Quantization for a pip install: moeprune installed from this folder into an empty virtual
environment (.venv-pip, not editable, no extras: scripts/setup_quant.sh makes it), its own
`moeprune setup quantize` making the llm-compressor environment, then `moeprune prune --quantize
w4a16` from a folder that holds no clone's `.venv-quant`, with no `--quant-python`.

What must hold: the command finds the environment the set-up recorded (in $MOEPRUNE_CACHE), the
result's experts are w4a16 (codes, scales and shape per kept expert projection), and the refusal
before set-up names the command to run. The environment itself is .venv-quant, which the script
made with this same command: run here again it is ready at once (its stamp matches the pins), so
this test re-checks the recording and the use, not the download.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import write_arithmetic

pytestmark = pytest.mark.quant_env

ROOT = Path(__file__).resolve().parents[2]
PIP_MOEPRUNE = ROOT / ".venv-pip" / "bin" / "moeprune"
QUANT_ENV = ROOT / ".venv-quant"


def _moeprune(*args, cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["MOEPRUNE_CACHE"] = str(cache)
    return subprocess.run([str(PIP_MOEPRUNE), *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True)


def test_pip_install_then_setup_quantize_then_prune_quantize(tmp_path):
    if not PIP_MOEPRUNE.is_file() or not (QUANT_ENV / "bin" / "python").is_file():
        pytest.skip("no .venv-pip / .venv-quant: run scripts/setup_quant.sh")
    from moeprune.data.tokenizer import byte_tokenizer
    from moeprune.models.factory import tiny_model

    # the pip install is not this checkout's editable one: moeprune is imported from site-packages
    where = subprocess.run(
        [str(PIP_MOEPRUNE.parent / "python"), "-c", "import moeprune; print(moeprune.__file__)"],
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "site-packages" in where and str(ROOT / "src") not in where, where
    tokenizer = byte_tokenizer()
    tiny_model("qwen3_moe", vocab_size=len(tokenizer), num_hidden_layers=2, mlp_only_layers=[]).save_pretrained(
        tmp_path / "model"
    )
    tokenizer.save_pretrained(tmp_path / "model")
    data = write_arithmetic(tmp_path / "calib.jsonl")
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    prune = ["prune", tmp_path / "model", "--data", data, "--criterion", "frequency", "--sparsity", "0.25"]
    prune += ["--quantize", "w4a16", "--quant-group-size", "16", "--quant-method", "rtn"]

    refused = _moeprune(*prune, "--output", work / "early", cwd=work, cache=cache)
    assert refused.returncode == 2, refused.stderr
    assert "moeprune setup quantize" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert not (work / "early").exists()

    made = _moeprune("setup", "quantize", "--path", QUANT_ENV, cwd=work, cache=cache)
    assert made.returncode == 0, made.stdout + made.stderr
    assert json.loads((cache / "quant-env.json").read_text())["python"] == str(QUANT_ENV.absolute() / "bin" / "python")

    done = _moeprune(*prune, "--output", work / "out", cwd=work, cache=cache)
    assert done.returncode == 0, done.stdout + done.stderr
    config = json.loads((work / "out" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    index = work / "out" / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text())["weight_map"])
    else:
        from safetensors import safe_open

        with safe_open(work / "out" / "model.safetensors", "pt") as f:
            names = set(f.keys())
    expert = "model.layers.0.mlp.experts.0.down_proj"
    assert {f"{expert}.weight_packed", f"{expert}.weight_scale", f"{expert}.weight_shape"} <= names
    assert "model.layers.0.mlp.gate.weight" in names  # the router stays unquantized
