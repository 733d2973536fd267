"""`prune --quantize auto:...` refused in one line, exit 2, before the weights are loaded: an
unknown or unmodelled scheme in the list, a single scheme after `auto:`, no calibration data, no
--target-size (nothing to trade), `--criterion auto` without --sparsity, a target even the
cheapest scheme misses (also for novices, priced by what they keep), a method that narrows experts
or keeps novices without --sparsity (the joint grid prices whole experts; mixed searches its forms
with the schemes: tests/quantize/test_precision_mixed.py); and the dry run's bytes
per scheme, which must be the one-scheme prediction of `--quantize SCHEME` for each scheme."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from helpers import run_cli
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.job import run as run_module
from moeprune.models.factory import tiny_model
from moeprune.quantize.pricing import ignored

pytestmark = pytest.mark.integration

AUTO = "auto:w4a16,w8a16"
S = ["--sparsity", "0.25"]
T = ["--target-size", "1000000"]
CASES = {
    "unknown": ("auto:w4a16,int3", [*S, *T], True, "unknown quantization scheme 'int3' in 'auto:w4a16,int3'"),
    "single": ("auto:w4a16", [*S, *T], True, "leaves nothing to choose: name two or more schemes after 'auto:'"),
    "nvfp4": ("auto:w4a16,nvfp4a16", [*S, *T], True, "nvfp4a16 has its own group size and scale format"),
    "no data": (AUTO, [*S, *T], False, "per-layer precision scores each layer's schemes on the calibration data"),
    "no target": (AUTO, S, True, f"{AUTO} chooses each layer's scheme under a size: give --target-size"),
    "joint with criterion auto": (
        AUTO,
        [*T, "--criterion", "auto", "--search-data", "{calib}"],
        True,
        f"{AUTO} without --sparsity scores a grid of sparsities by one named criterion's order",
    ),
    "joint unreachable": (
        AUTO,
        ["--target-size", "80000"],
        True,
        "even with every layer in w4a16 at sparsity 0.75 the result weighs",
    ),
    "unreachable": (
        AUTO,
        [*S, "--target-size", "100000"],
        True,
        "even with every layer in w4a16 the result weighs 122,735 bytes at sparsity 0.25, over the target 100,000",
    ),
    "method without a sparsity": (
        AUTO,
        [*T, "--method", "neurons"],
        True,
        "per-layer precision prices whole experts removed with their router rows (drop, merge) and searches mixed",
    ),
    # with --sparsity novice (neurons, tenp, mixed) plans are priced by what they keep (quantize/keeps.py):
    # drop's 122,735 bytes plus, for each of the 6 novices, its fp32 vector and router row (2 x 32 x 4)
    "novices unreachable": (
        AUTO,
        [*S, "--target-size", "100000", "--method", "novice"],
        True,
        "even with every layer in w4a16 the result weighs 124,271 bytes at sparsity 0.25, over the target 100,000",
    ),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A tiny qwen3_moe (3 MoE layers of 8 experts 16 wide) with a byte tokenizer, and calibration
    data; `linear_weights`: the weights of the Linears outside the experts that get quantized."""
    root = tmp_path_factory.mktemp("precision-refusals")
    tokenizer = byte_tokenizer()
    model = tiny_model("qwen3_moe", vocab_size=len(tokenizer), num_hidden_layers=3, mlp_only_layers=[])
    model.save_pretrained(root / "model")
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not ignored(n)]
    (root / "linear_weights").write_text(str(sum(m.weight.numel() for m in linears)))
    tokenizer.save_pretrained(root / "model")
    (root / "calib.jsonl").write_text("".join(json.dumps({"text": f"{i} plus {i}"}) + "\n" for i in range(4)))
    return root


@pytest.fixture(autouse=True)
def never_load(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr(run_module, "load_placed", refuse)


def _prune(world: Path, out: Path, scheme: str, *flags, data: bool = True, ok: bool = True):
    given = ["--data", world / "calib.jsonl"] if data else []
    criterion = [] if "--criterion" in flags else ["--criterion", "frequency"]
    return run_cli(
        "prune", world / "model", "--output", out, *criterion, *given, "--quantize", scheme,
        "--quant-method", "rtn", "--quant-group-size", "16", "--quant-python", sys.executable, *flags, ok=ok,
    )  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_auto_refused_in_one_line_before_loading(world, tmp_path, case):
    scheme, flags, has_data, message = CASES[case]
    flags = [str(f).replace("{calib}", str(world / "calib.jsonl")) for f in flags]
    result = _prune(world, tmp_path / "out", scheme, *flags, data=has_data, ok=False)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_each_schemes_bytes_and_whether_the_target_is_reachable(world, tmp_path):
    def predicted(text: str) -> int:
        return int(re.search(r"predicted .*?\(([\d,]+) bytes\)", text)[1].replace(",", ""))

    one = {s: predicted(_prune(world, tmp_path / "o", s, *S, "--dry-run").output) for s in ("w4a16", "w8a16")}
    assert one["w4a16"] < one["w8a16"]
    others = int((world / "linear_weights").read_text()) // 2
    between = (one["w4a16"] + one["w8a16"] - others) // 2
    out = _prune(world, tmp_path / "o", AUTO, *S, "--target-size", str(between), "--dry-run").output
    line = next(x for x in out.splitlines() if x.startswith("per-layer"))
    # the experts in one scheme, everything else in the base (w4a16): the all-w4a16 total is the
    # one-scheme prediction; the all-w8a16 one is w8a16's less the other Linears' int8 - int4 codes
    # (half a byte a weight; their scales and shapes weigh the same in both)
    w8 = one["w8a16"] - others
    assert line == (
        f"per-layer every layer's experts in one scheme: w4a16 {one['w4a16'] / 1e3:.2f} kB ({one['w4a16']:,} bytes), "
        f"w8a16 {w8 / 1e3:.2f} kB ({w8:,} bytes)"
    )
    assert f"({between:,} bytes): reachable;" in out
    assert not (tmp_path / "o").exists()


def test_dry_run_without_a_sparsity_prints_the_grid_it_will_try(world, tmp_path):
    """The grid runs from the smallest sparsity where every layer in w4a16 fits to the smallest
    where every layer in w8a16 does: at 0.25 (2 experts off each layer) the all-w4a16 result fits
    the target below, at 11/24 the all-w8a16 one does, and one step below each does not."""
    out = _prune(world, tmp_path / "o", AUTO, "--target-size", "123500", "--dry-run").output
    grid = [
        (float(s), int(a.replace(",", "")), int(b.replace(",", "")))
        for s, a, b in re.findall(r"grid      sparsity ([\d.]+): every layer in one scheme w4a16 ([\d,]+), w8a16 ([\d,]+)", out)
    ]
    assert len(grid) == 4 and [g[0] for g in grid] == sorted(g[0] for g in grid)
    assert grid[0][1] <= 123500 and grid[-1][2] <= 123500 and grid[-2][2] > 123500
    below = _prune(world, tmp_path / "o", "w4a16", "--sparsity", str(grid[0][0] - 1 / 24), "--dry-run").output
    assert int(re.search(r"predicted .*?\(([\d,]+) bytes\)", below)[1].replace(",", "")) > 123500
    assert "sparsity " + str(grid[0][0]) in out and not (tmp_path / "o").exists()


def test_joint_evo_refused_when_its_copies_do_not_fit_in_memory(world, tmp_path, monkeypatch):
    """The joint evo search holds every routed expert's fake-quantized copy per scheme beside the
    model (quantize/memory.py): 3 layers x 8 experts x 3 x 32 x 16 fp32 weights x 2 schemes =
    294,912 bytes, printed by the dry run; with less memory than copies plus model, one line."""
    from moeprune.models import MoEModel
    from moeprune.quantize.memory import model_bytes
    from moeprune.surgery import lowrank

    model = MoEModel(tiny_model("qwen3_moe", vocab_size=len(byte_tokenizer()), num_hidden_layers=3, mlp_only_layers=[]))
    need = 294_912 + model_bytes(model, torch.float32)
    flags = [*T, "--allocation", "evo", "--search-data", world / "calib.jsonl", "--device", "cpu"]
    monkeypatch.setattr(lowrank, "physical_memory", lambda: need)
    out = _prune(world, tmp_path / "out", AUTO, *flags, "--dry-run").output
    line = next(x for x in out.splitlines() if x.startswith("memory"))
    assert "(294,912 bytes, 2 schemes)" in line and f"of {need / 1e3:.2f} kB of RAM" in line, line
    monkeypatch.setattr(lowrank, "physical_memory", lambda: need - 1)
    result = _prune(world, tmp_path / "out", AUTO, *flags, ok=False)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "holds every routed expert's fake-quantized copy once per scheme" in lines[0]
    assert "(294,912 bytes)" in lines[0] and "give --sparsity" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
