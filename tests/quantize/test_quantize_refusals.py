"""`prune --quantize` refused in one line (exit 2) before any weight is loaded: these need no
quantization environment (where one must exist to get that far, any executable Python stands in).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import run_cli, save_tiny_qwen
from moeprune.job import run as run_module
from moeprune.quant.testing import save_compressed_checkpoint

pytestmark = pytest.mark.integration
LOAD_PLACED = run_module.load_placed


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """`model/` (tiny qwen3_moe, 16-wide experts, full precision), `ct/` (the same, W4A16), `calib.jsonl`."""
    root = tmp_path_factory.mktemp("quantize-refusals")
    model, tokenizer = save_tiny_qwen(root / "model", num_hidden_layers=2)
    save_compressed_checkpoint(model, root / "ct", scheme="w4a16", group_size=16, tokenizer=tokenizer)
    (root / "calib.jsonl").write_text("".join(json.dumps({"text": f"{i} plus {i}"}) + "\n" for i in range(4)))
    return root


@pytest.fixture(autouse=True)
def never_load(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr(run_module, "load_placed", refuse)


PY = ["--quant-python", sys.executable]
CASES = {
    "unknown scheme": (["--quantize", "w5a16", *PY], "unknown quantization scheme 'w5a16'; choose one of w4a16, w8a16"),
    "quantized input": (
        ["--quantize", "w4a16", "--quant-group-size", "16", *PY],
        "the input is already quantized (compressed-tensors",
    ),
    "group divides no width": (
        ["--quantize", "w4a16", *PY],
        "a group of 128 weights does not divide the quantized input widths 16, 32: the largest group size "
        "that divides every width is 16 (--quant-group-size)",
    ),
    "kept width": (
        ["--quantize", "w4a16", "--quant-group-size", "16", "--method", "neurons", "--width-multiple", "8",
         "--allow-super-experts", *PY],
        "does not divide the kept expert width 8: the largest group size that divides every width is 8",
    ),
    "width multiple the group does not divide": (
        ["--quantize", "w4a16", "--quant-group-size", "16", "--method", "neurons", "--width-multiple", "12",
         "--allow-super-experts", *PY],
        "does not divide the kept expert width 12: the largest group size that divides every width is 4",
    ),
    # TENP's trapezoid widths (8 and 12 of 16 on a step of 4) follow from the structure and options
    "tenp width multiple the group does not divide": (
        ["--quantize", "w4a16", "--quant-group-size", "16", "--method", "tenp", "--criterion", "tenp",
         "--width-multiple", "4", *PY],
        "does not divide the kept expert widths 8, 12: the largest group size that divides every width is 4",
    ),
    # the mixed method's uniform genes fix its widths: on an explicit multiple of 4 the group of 16
    # does not divide them (12 and 8 of 16)
    "mixed widths": (
        ["--quantize", "w4a16", "--quant-group-size", "16", "--method", "mixed", "--width-multiple", "4", *PY],
        "does not divide the kept expert widths 8, 12: the largest group size that divides every width is 4",
    ),
    # by default the mixed method's widths are multiples of the group: 16-wide experts keep none narrowed
    "mixed on the group's multiple": (
        ["--quantize", "w4a16", "--quant-group-size", "16", "--method", "mixed", *PY],
        "its 5 narrowed experts would keep 0 of 16 neurons (less than one block of 16)",
    ),
    "group size of a channel scheme": (
        ["--quantize", "fp8-dynamic", "--quant-group-size", "16", *PY],
        "fp8-dynamic scales each output channel",
    ),
    "gptq without data": (["--quantize", "w4a16", "--criterion", "magnitude", "--no-data", *PY], "GPTQ calibrates"),
    "no-load pipeline": (["--quantize", "w4a16", "--no-load", *PY], "quantizing runs on the in-memory pipeline"),
    "setting without --quantize": (["--quant-method", "rtn"], "quant_method set without quantize"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_in_one_line_before_loading(world, tmp_path, case):
    flags, message = CASES[case]
    model = world / ("ct" if case == "quantized input" else "model")
    sparsity = ["--sparsity", "0.5"] if case == "kept width" else ["--sparsity", "0.25"]
    data = [] if "--no-data" in flags else ["--data", world / "calib.jsonl"]
    flags = [f for f in flags if f != "--no-data"]
    if "--criterion" not in flags:
        flags = ["--criterion", "frequency", *flags]
    result = run_cli("prune", model, "--output", tmp_path / "out", *sparsity, *data, *flags, ok=False)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "out").exists()


def test_no_quantization_environment_names_the_setup_script(world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no .venv-quant here
    monkeypatch.setenv("MOEPRUNE_CACHE", str(tmp_path / "cache"))  # and none recorded by `setup quantize`
    result = run_cli(
        "prune", world / "model", "--output", tmp_path / "out", "--sparsity", "0.25", "--data", world / "calib.jsonl",
        "--criterion", "frequency", "--quantize", "w4a16", ok=False,
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "no quantization environment (none recorded by 'moeprune setup quantize', no .venv-quant/bin/python " \
        "here): run 'moeprune setup quantize' to make it" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_searched_widths_refused_before_the_surgery(world, tmp_path, monkeypatch):
    """The widths a mixed search chooses are known only after it: the plan is refused right then,
    before the surgery changes the model and before anything is written or quantized (an explicit
    multiple of 4 the group of 16 does not divide; by default the widths are the group's multiples)."""
    from moeprune import api

    monkeypatch.setattr(run_module, "load_placed", LOAD_PLACED)  # loading is expected here

    def no_surgery(*_a, **_k):
        raise AssertionError("the surgery ran before the refusal")

    monkeypatch.setattr(api, "fit_novices", no_surgery)
    monkeypatch.setattr(run_module, "quantize_folder", no_surgery)
    search = tmp_path / "search.jsonl"
    search.write_text("".join(json.dumps({"prompt": f"{i} plus {i} is", "answer": f" {2 * i}"}) + "\n" for i in range(2)))
    result = run_cli(
        "prune", world / "model", "--output", tmp_path / "out", "--sparsity", "0.25", "--data", world / "calib.jsonl",
        "--criterion", "frequency", "--method", "mixed", "--allocation", "evo", "--search-data", search,
        "--population", "2", "--elites", "1", "--generations", "1", "--search-samples", "2",
        "--quantize", "w4a16", "--quant-group-size", "16", "--width-multiple", "4", *PY, ok=False,
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "a group of 16 weights does not divide the kept expert width" in result.output.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()
