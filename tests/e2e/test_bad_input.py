"""Bad input, as a table: each row is what a user typed (or what their files look like), the exit
code and the message fragment they get, and whether the refusal comes before any weight is
loaded. Every row also checks that nothing was lost or left behind: the hashes of every file in
the working folder (the input model, an existing output, the data) are the same after the
command, no file was added (no temporary folder, no lock), and the message is one line with no
traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import moeprune
from moeprune.checkpoint import load as load_module
from moeprune.cli.main import main
from moeprune.models import MoEModel
from moeprune.models.reshape import drop_experts
from moeprune.runtime.atomic import output_lock

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end


@dataclass
class World:
    """A scratch folder: `model/` (a tiny Qwen3-MoE with a tokenizer), `calib.jsonl`, `search.jsonl`."""

    root: Path

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def data(self) -> Path:
        return self.root / "calib.jsonl"

    def weights(self) -> Path:
        return self.model / "model.safetensors"

    def edit_weights(self, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
        tensors = load_file(self.weights())
        edit(tensors)
        save_file(tensors, self.weights(), metadata={"format": "pt"})

    def edit_config(self, edit: Callable[[dict], None], folder: Path | None = None) -> None:
        path = (folder or self.model) / "config.json"
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))

    def moeprune_format(self) -> Path:
        """A real moeprune-format result (uneven expert counts) at `pruned/`."""
        model = moeprune.load_pretrained(self.model)
        drop_experts(MoEModel(model), {0: [0, 1]})
        moeprune.save_pretrained(model, self.root / "pruned")
        shutil.copy(self.model / "tokenizer.json", self.root / "pruned")
        return self.root / "pruned"


PRUNE = ["--criterion", "reap", "--sparsity", "0.25", "--data", "{data}"]
MIXED_OVER = ["--mixed-whole", "0.75", "--mixed-novice", "0.5"]
# whole experts only: 70 % of 8 experts is 5.6 kept, not a count, and nothing narrowed absorbs the rest
MIXED_COUNTS = ["--criterion", "reap", "--sparsity", "0.3", "--data", "{data}", "--method", "mixed",
                "--mixed-whole", "0", "--mixed-width", "1"]  # fmt: skip


@dataclass
class Case:
    name: str
    args: list[str]  # {model}, {data}, {root} are substituted
    message: str
    before_load: bool = True  # refused before any weight is read
    setup: Callable[[World], None] | None = None
    code: int = 2


def _existing_output(world: World) -> None:
    (world.root / "out").mkdir()
    (world.root / "out" / "keep.txt").write_text("precious")


def _finished_output(world: World) -> None:
    _existing_output(world)


def _parent_is_a_file(world: World) -> None:
    (world.root / "file").write_text("not a folder")


def _fp8_input(world: World) -> None:
    """The world's model saved again as a block-scaled FP8 checkpoint (in place)."""
    from moeprune.quant.testing import save_fp8_checkpoint

    save_fp8_checkpoint(moeprune.load_pretrained(world.model), world.model)


def _drop_tensor(fragment: str) -> Callable[[World], None]:
    def edit(world: World) -> None:
        def remove(tensors: dict) -> None:
            name = next(k for k in tensors if fragment in k)
            del tensors[name]

        world.edit_weights(remove)

    return edit


def _extra_tensor(world: World) -> None:
    world.edit_weights(lambda tensors: tensors.update({"model.layers.0.mlp.surprise": torch.zeros(3)}))


def _nan_weight(world: World) -> None:
    def poison(tensors: dict) -> None:
        name = next(k for k in tensors if "layers.1.mlp.experts.2.down_proj" in k)
        tensors[name][0, 0] = float("nan")

    world.edit_weights(poison)


def _truncate(world: World) -> None:
    data = world.weights().read_bytes()
    world.weights().write_bytes(data[: len(data) // 2])


def _empty(world: World) -> None:
    world.weights().write_bytes(b"")


def _missing_shard(world: World) -> None:
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (world.model / "model.safetensors.index.json").write_text(json.dumps(index))


def _damaged_config(world: World) -> None:
    (world.model / "config.json").write_text('{"model_type": "qwen3_moe", "num_hidden')


def _structure(edit: Callable[[dict], None]) -> Callable[[World], None]:
    def setup(world: World) -> None:
        folder = world.moeprune_format()
        world.edit_config(lambda config: edit(config["moeprune"]), folder)

    return setup


def _duplicate_ids(section: dict) -> None:
    ids = section["layers"][0]["expert_ids"]
    ids[1] = ids[0]


def _out_of_range_layer(section: dict) -> None:
    section["layers"][-1]["layer"] = 40


def _count_disagrees(section: dict) -> None:
    section["layers"][1]["num_experts"] = 5


def _future_version(section: dict) -> None:
    section["format_version"] = 99


def _truncated_moeprune_config(world: World) -> None:
    folder = world.moeprune_format()
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text[: len(text) // 2])


def _remote_code(world: World) -> None:
    """A checkpoint whose config asks for its own Python, which would leave a marker if run."""
    world.edit_config(
        lambda c: c.update(model_type="sneaky_moe", auto_map={"AutoConfig": "sneaky.SneakyConfig"})
    )
    (world.model / "sneaky.py").write_text(f"open({str(world.root / 'RAN')!r}, 'w').write('ran')\n")


def _symlink_to_model(world: World) -> None:
    os.symlink(world.model, world.root / "alias")


CASES = [
    # a setting the run would ignore: only another method reads it (that method's registered knobs)
    Case(
        "a TENP setting with another method",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--slope", "0.3"],
        "--slope has no effect without --method tenp",
    ),
    # the output would destroy or modify the input
    Case(
        "output is the input",
        ["prune", "{model}", "--output", "{model}", "--overwrite", *PRUNE],
        "is the input",
    ),
    Case(
        "output is a symlink to the input",
        ["prune", "{model}", "--output", "{root}/alias", "--overwrite", *PRUNE],
        "is the input",
        setup=_symlink_to_model,
    ),
    Case(
        "output inside the input",
        ["prune", "{model}", "--output", "{model}/sub", *PRUNE],
        "lies inside the input",
    ),
    Case(
        "output contains the input",
        ["prune", "{model}", "--output", "{root}", "--overwrite", *PRUNE],
        "contains the input",
    ),
    Case(
        "scores file inside the input",
        ["score", "{model}", "--criterion", "aimer", "--output", "{model}/s.json"],
        "lies inside the input",
    ),
    Case(
        "existing output without --overwrite",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE],
        "already exists",
        setup=_existing_output,
    ),
    Case(
        "output under a file",
        ["prune", "{model}", "--output", "{root}/file/out", *PRUNE],
        "is a file, not a folder",
        setup=_parent_is_a_file,
    ),
    # --resume never deletes anything
    Case(
        "--resume without evo",
        ["prune", "{model}", "--output", "{root}/out", "--resume", *PRUNE],
        "--resume has no effect without --allocation evo",
    ),
    Case(
        "--resume of a finished folder",
        [
            "prune",
            "{model}",
            "--output",
            "{root}/out",
            "--resume",
            *PRUNE,
            "--allocation",
            "evo",
            "--search-data",
            "{data}",
        ],
        "not a search in progress",
        setup=_finished_output,
    ),
    Case(
        "--resume with no search",
        [
            "prune",
            "{model}",
            "--output",
            "{root}/out",
            "--resume",
            *PRUNE,
            "--allocation",
            "evo",
            "--search-data",
            "{data}",
        ],
        "nothing to resume",
    ),
    # damaged or incomplete checkpoints
    Case(
        "attention tensor missing",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE],
        "missing tensors model.layers.0.self_attn.q_proj.weight",
        before_load=False,
        setup=_drop_tensor("layers.0.self_attn.q_proj"),
    ),
    Case(
        "expert tensor missing",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE],
        "missing tensors model.layers.1.mlp.experts",
        before_load=False,
        setup=_drop_tensor("layers.1.mlp.experts.3.up_proj"),
    ),
    Case(
        "unexpected tensor",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE],
        "unexpected tensors model.layers.0.mlp.surprise",
        before_load=False,
        setup=_extra_tensor,
    ),
    Case(
        "NaN in a weight",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE],
        "holds NaN",
        before_load=False,
        setup=_nan_weight,
    ),
    Case(
        "truncated weights",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE],
        "is truncated",
        setup=_truncate,
    ),
    Case(
        "empty weights",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE],
        "empty or truncated",
        setup=_empty,
    ),
    Case(
        "shard missing from the index",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE],
        "names 1 shard(s) that are not in the folder",
        setup=_missing_shard,
    ),
    Case("damaged config.json", ["inspect", "{model}"], "is damaged", setup=_damaged_config),
    Case(
        "checkpoint code is never run",
        ["inspect", "{model}"],
        "runs checkpoint code only when told",
        setup=_remote_code,
    ),
    # moeprune-format metadata is checked, never trusted
    Case(
        "duplicate expert ids", ["inspect", "{root}/pruned"], "appear twice", setup=_structure(_duplicate_ids)
    ),
    Case(
        "layer out of range",
        ["inspect", "{root}/pruned"],
        "does not exist",
        setup=_structure(_out_of_range_layer),
    ),
    Case(
        "count disagrees with the ids",
        ["inspect", "{root}/pruned"],
        "disagrees with",
        setup=_structure(_count_disagrees),
    ),
    Case(
        "format version from the future",
        ["inspect", "{root}/pruned"],
        "upgrade moeprune",
        setup=_structure(_future_version),
    ),
    Case(
        "truncated moeprune config",
        ["inspect", "{root}/pruned"],
        "is damaged",
        setup=_truncated_moeprune_config,
    ),
    # impossible requests, refused from the config alone
    Case(
        "sparsity above what top-k allows",
        [
            "prune",
            "{model}",
            "--output",
            "{root}/out",
            "--criterion",
            "reap",
            "--sparsity",
            "0.9",
            "--data",
            "{data}",
        ],
        "outside the feasible range",
    ),
    Case(
        "expert multiple that divides no layer",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--expert-multiple", "3"],
        "not a multiple of 3",
    ),
    Case(
        "neuron sparsity leaving no neuron",
        [
            "prune",
            "{model}",
            "--output",
            "{root}/out",
            "--criterion",
            "reap",
            "--sparsity",
            "0.99",
            "--method",
            "neurons",
            "--data",
            "{data}",
        ],
        "lower the sparsity",
    ),
    Case(
        "missing data file",
        [
            "prune",
            "{model}",
            "--output",
            "{root}/out",
            "--criterion",
            "reap",
            "--sparsity",
            "0.25",
            "--data",
            "{root}/nope.jsonl",
        ],
        "does not exist",
    ),
    Case(
        "data criterion without data",
        ["prune", "{model}", "--output", "{root}/out", "--criterion", "reap", "--sparsity", "0.25"],
        "needs calibration data",
    ),
    Case(
        "unknown device",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--device", "banana"],
        "unknown device 'banana'",
    ),
    # option values and options a run would ignore
    Case(
        "--batch-size 0",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--batch-size", "0"],
        "Invalid value for '--batch-size'",
    ),
    Case(
        "--max-length 0",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--max-length", "0"],
        "Invalid value for '--max-length'",
    ),
    Case(
        "negative --samples",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--samples", "-1"],
        "Invalid value for '--samples'",
    ),
    Case(
        "--threads 0",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--threads", "0"],
        "Invalid value for '--threads'",
    ),
    Case(
        "sparsity 0",
        ["prune", "{model}", "--output", "{root}/out", "--criterion", "aimer", "--sparsity", "0"],
        "Invalid value for '--sparsity'",
    ),
    Case(
        "sparsity 1",
        ["prune", "{model}", "--output", "{root}/out", "--criterion", "aimer", "--sparsity", "1"],
        "Invalid value for '--sparsity'",
    ),
    Case(
        "search option without a search",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--population", "8"],
        "--population has no effect",
    ),
    # mixed shares the budget or the structure cannot reach (the tiny model: 8 experts per layer)
    Case(
        "mixed shares above every expert",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--method", "mixed", *MIXED_OVER],
        "add up to more than every expert",
    ),
    Case(
        "mixed whole experts above the budget",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--method", "mixed", "--mixed-whole", "0.875"],
        "keep more than 0.75 of its parameters",
    ),
    Case(
        "mixed counts that cannot meet the budget",
        ["prune", "{model}", "--output", "{root}/out", *MIXED_COUNTS],
        "no expert is narrowed to absorb them",
    ),
    Case(
        "mixed with a fixed allocation",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--method", "mixed", "--allocation", "trapezoid"],
        "the mixed method goes with the uniform or evo or gradient allocation, not trapezoid",
    ),
    Case(
        "tenp option without tenp",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--slope", "0.2"],
        "--slope has no effect",
    ),
    Case(
        "--save-dtype with --no-load",
        [
            "prune",
            "{model}",
            "--output",
            "{root}/out",
            "--criterion",
            "aimer",
            "--sparsity",
            "0.25",
            "--no-load",
            "--save-dtype",
            "bf16",
        ],
        "--save-dtype has no effect",
    ),
    Case(
        "negative novice rank",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--method", "novice", "--novice-rank", "-1"],
        "Invalid value for '--novice-rank'",
    ),
    Case(
        "novice rank above the hidden size",
        [
            "prune",
            "{model}",
            "--output",
            "{root}/out",
            *PRUNE,
            "--method",
            "novice",
            "--novice-rank",
            "100000",
        ],
        "larger than the hidden size",
    ),
    Case(
        "novice rank with another method",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--novice-rank", "2"],
        "--novice-rank has no effect without --method novice",
    ),
    Case(
        "repair without calibration data",
        ["prune", "{model}", "--output", "{root}/out", "--criterion", "aimer", "--sparsity", "0.25", "--repair"],
        "--repair (it distils on the calibration tokens) needs calibration data",
    ),
    Case(
        "repair without loading",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--repair", "--no-load"],
        "repair trains the loaded model and the no-load pipeline never loads it",
    ),
    Case(
        "repair of a quantized input kept quantized",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--repair"],
        "is quantized and the result keeps its format",
        setup=lambda world: _fp8_input(world),
    ),
    Case(
        "repair setting without --repair",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--repair-steps", "5"],
        "--repair-steps has no effect without --repair",
    ),
    Case(
        "bad shard size",
        ["prune", "{model}", "--output", "{root}/out", *PRUNE, "--max-shard-size", "lots"],
        "is not a size",
    ),
]


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
        if not p.is_symlink()
    }


@pytest.fixture
def world(tiny_checkpoint, tmp_path, data) -> World:
    shutil.copytree(tiny_checkpoint, tmp_path / "model")
    shutil.copy(data, tmp_path / "calib.jsonl")
    return World(tmp_path)


@pytest.fixture
def no_weight_loading(monkeypatch):
    """Make any weight load fail loudly, for the rows refused before loading."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the bad input was refused")

    for name in ("_load_stock", "_load_auto", "fill_from_disk", "_load_legacy"):
        monkeypatch.setattr(load_module, name, refuse)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_clearly_and_loses_nothing(case, world, monkeypatch, request):
    if case.setup:
        case.setup(world)
    if case.before_load:
        request.getfixturevalue("no_weight_loading")
    before = _snapshot(world.root)
    args = [a.format(model=world.model, data=world.data, root=world.root) for a in case.args]
    result = CliRunner().invoke(main, args, catch_exceptions=False, input="y\ny\n")  # a prompt would read 'y'
    assert result.exit_code == case.code, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("moeprune: error:")]
    assert len(lines) == 1 and case.message in lines[0], result.output
    assert "Traceback" not in result.output
    assert _snapshot(world.root) == before  # nothing lost, changed or left behind
    assert not (world.root / "RAN").exists()  # no checkpoint code ran


def test_second_writer_of_the_same_output_is_refused_naming_the_first(world, no_weight_loading):
    """Two prunes into one output: the second refuses while the first holds the lock."""
    out = world.root / "out"
    before = _snapshot(world.root)
    with output_lock(out):
        args = ["prune", str(world.model), "--output", str(out), "--criterion", "reap", "--sparsity", "0.25",
                "--data", str(world.data)]  # fmt: skip
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 2 and f"is being written by moeprune pid {os.getpid()}" in result.output
    assert _snapshot(world.root) == before and not out.exists()


def test_stale_lock_of_a_dead_process_is_taken_over(world):
    """A lock file left by a killed run (no process holds its flock) does not block anyone."""
    out = world.root / "out"
    (world.root / ".out.lock").write_text("moeprune pid 999999 on elsewhere since 00:00:00\n")
    args = [
        "prune",
        str(world.model),
        "--output",
        str(out),
        "--criterion",
        "aimer",
        "--sparsity",
        "0.25",
        "--quiet",
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (out / "plan.json").is_file() and not (world.root / ".out.lock").exists()


def test_score_on_cpu_needs_no_accelerate(world, monkeypatch):
    """A plain install has no accelerate: loading on the CPU must not ask for a device map."""
    import sys

    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate now fails
    args = [
        "score",
        str(world.model),
        "--criterion",
        "aimer",
        "--output",
        str(world.root / "s.json"),
        "--device",
        "cpu",
    ]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
