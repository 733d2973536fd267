"""`moe_sparsity_config`, the metadata standard (compressed-tensors 0.20's ExpertSparsityConfig),
in the results of a tiny qwen3_moe: a stock drop, a moeprune-format global drop, novices, and a
kept compressed-tensors W4A16 input.

What must hold: each result carries the standard's per-decoder-layer retained counts, equal to its
plan's; neuron pruning (every expert kept) carries none; an unquantized result gets no
`quantization_config` (it must not look quantized), a quantized one carries the metadata inside
its own. Loading is unchanged: stock transformers (.venv, compressed-tensors 0.20.1) and the
compressed-tensors 0.19 stack (.venv-quant) compute exactly the logits of the same folder without
the metadata and build no quantizer for an unquantized result. compressed-tensors 0.20.0's own
classes (.venv-ct20, scripts/setup_ct20.sh) accept what moeprune writes and refuse what moeprune's
reader refuses. `inspect` reads the metadata from a checkpoint another tool wrote (hand-written).
vLLM 0.32 serves results carrying it: tests/serve/test_serve_vllm.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import run_cli, save_tiny_qwen, write_arithmetic
from moeprune.checkpoint.sparsity_metadata import QUANT_KEY, SPARSITY_KEY, read_sparsity
from moeprune.errors import MoePruneError
from moeprune.models.factory import tiny_model
from moeprune.quant.testing import save_compressed_checkpoint

pytestmark = pytest.mark.integration  # prunes tiny checkpoints end to end

ROOT = Path(__file__).resolve().parents[2]
QUANT_PYTHON = ROOT / ".venv-quant" / "bin" / "python"
CT20_PYTHON = ROOT / ".venv-ct20" / "bin" / "python"
IDS = [[5, 17, 99, 3, 42, 7, 8, 200]]
# results loaded in every environment, each beside a copy without the metadata
LOADED = ("drop", "global", "w4a16")

# Loads each folder named in argv[1] ({name: path}) on the token ids in argv[2] with stock transformers, in the environment
# running it; prints the compressed-tensors version, and per folder the logits and whether a
# quantizer was built.
LOAD_SCRIPT = """
import json, sys, torch, compressed_tensors
from transformers import AutoModelForCausalLM
out = {"compressed_tensors": compressed_tensors.__version__}
for name, path in json.loads(sys.argv[1]).items():
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(torch.tensor(json.loads(sys.argv[2]))).logits
    out[name] = {"logits": logits.tolist(), "quantizer": getattr(model, "hf_quantizer", None) is not None}
print("RESULT " + json.dumps(out))
"""

# Validates argv[1] ({name: [metadata, quantization_config or None]}) with compressed-tensors'
# own classes; prints per name "ok" or the error's first line.
CT20_SCRIPT = """
import json, sys
import compressed_tensors
from compressed_tensors.config import ExpertSparsityConfig
from compressed_tensors.quantization import QuantizationConfig
out = {"compressed_tensors": compressed_tensors.__version__}
for name, (metadata, quant) in json.loads(sys.argv[1]).items():
    try:
        parsed = ExpertSparsityConfig.model_validate(metadata)
        assert parsed.model_dump(mode="json") == metadata, parsed
        if quant is not None:
            assert QuantizationConfig.model_validate(quant).moe_sparsity_config == parsed
        out[name] = "ok"
    except Exception as exc:
        out[name] = type(exc).__name__
print("RESULT " + json.dumps(out))
"""


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _bare(folder: Path, into: Path) -> Path:
    """A copy of `folder` without the metadata: the result as moeprune wrote it before."""
    shutil.copytree(folder, into)
    config = _config(into)
    quant = config.get(QUANT_KEY)
    (quant if isinstance(quant, dict) else config).pop(SPARSITY_KEY)
    (into / "config.json").write_text(json.dumps(config, indent=2))
    return into


def _run(python: Path, script: str, *arguments: object) -> dict:
    done = subprocess.run(
        [str(python), "-c", script, *map(json.dumps, arguments)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sparsity-metadata")
    model, tokenizer = save_tiny_qwen(root / "in")  # 3 MoE layers of 8 experts, top-2
    save_compressed_checkpoint(model, root / "ct", scheme="w4a16", group_size=16, tokenizer=tokenizer)
    data = write_arithmetic(root / "calib.jsonl")
    common = ["--sparsity", "0.25", "--data", data, "--criterion", "frequency"]
    made = {}
    for name, source, flags in (
        ("drop", "in", []),
        ("global", "in", ["--allocation", "global"]),
        ("novice", "in", ["--method", "novice"]),
        ("neurons", "in", ["--method", "neurons", "--allow-super-experts"]),
        ("w4a16", "ct", []),
    ):
        made[name] = root / name
        run_cli("prune", root / source, "--output", made[name], *common, *flags)
    for name in LOADED:
        made[f"{name}-bare"] = _bare(made[name], root / f"{name}-bare")
    return made


def _planned_counts(folder: Path) -> list[int]:
    plan = json.loads((folder / "plan.json").read_text())
    return [
        len(lp["kept"]) - len(lp.get("novice", []))
        for lp in sorted(plan["layers"], key=lambda lp: lp["layer"])
    ]


@pytest.mark.parametrize(
    ("name", "method", "total"), [("drop", "prune", 18), ("global", "prune", 18), ("novice", "novice", 18)]
)
def test_result_carries_the_plans_retained_counts(results, name, method, total):
    config = _config(results[name])
    metadata = config[SPARSITY_KEY]
    assert metadata == {"method": method, "num_experts": _planned_counts(results[name])}
    assert sum(metadata["num_experts"]) == total  # 3 layers x 8 experts, a quarter removed
    assert QUANT_KEY not in config  # an unquantized result must not look quantized


def test_uniform_and_novice_results_keep_six_experts_per_layer(results):
    assert _config(results["drop"])[SPARSITY_KEY]["num_experts"] == [6, 6, 6]
    assert _config(results["novice"])[SPARSITY_KEY]["num_experts"] == [6, 6, 6]


def test_neuron_pruning_keeps_every_expert_and_writes_none(results):
    assert SPARSITY_KEY not in json.dumps(_config(results["neurons"]))


def test_quantized_result_carries_it_in_its_quantization_config(results):
    config = _config(results["w4a16"])
    assert SPARSITY_KEY not in config
    assert config[QUANT_KEY][SPARSITY_KEY] == {"method": "prune", "num_experts": [6, 6, 6]}
    assert config[QUANT_KEY]["quant_method"] == "compressed-tensors"  # the input's, kept


def _same_loading(loaded: dict) -> None:
    for name in LOADED:
        assert loaded[name]["logits"] == loaded[f"{name}-bare"]["logits"], name  # exactly
        assert loaded[name]["quantizer"] == loaded[f"{name}-bare"]["quantizer"] == (name == "w4a16"), name


def test_stock_transformers_loads_the_results_as_before(results):
    ids = torch.tensor(IDS)
    loaded = {}
    for name in (*LOADED, *(f"{n}-bare" for n in LOADED)):
        model = AutoModelForCausalLM.from_pretrained(
            results[name], dtype=torch.float32, trust_remote_code=True
        )
        model.eval()
        with torch.no_grad():
            loaded[name] = {
                "logits": model(ids).logits.tolist(),
                "quantizer": getattr(model, "hf_quantizer", None) is not None,
            }
    _same_loading(loaded)


def test_compressed_tensors_0_19_stack_loads_the_results_as_before(results):
    if not QUANT_PYTHON.is_file():
        pytest.skip(f"no quantization environment ({QUANT_PYTHON} absent): run scripts/setup_quant.sh")
    names = (*LOADED, *(f"{n}-bare" for n in LOADED))
    loaded = _run(QUANT_PYTHON, LOAD_SCRIPT, {n: str(results[n]) for n in names}, IDS)
    assert loaded["compressed_tensors"].startswith("0.19")
    _same_loading(loaded)


def test_compressed_tensors_0_20_validates_what_moeprune_writes_and_refuses_what_it_refuses(results):
    if not CT20_PYTHON.is_file():
        pytest.skip(
            f"no compressed-tensors 0.20 environment ({CT20_PYTHON} absent): run scripts/setup_ct20.sh"
        )
    cases = {}
    for name in ("drop", "global", "novice", "w4a16"):
        config = _config(results[name])
        quant = config.get(QUANT_KEY)
        metadata = quant[SPARSITY_KEY] if quant else config[SPARSITY_KEY]
        cases[name] = [metadata, quant]
    bad = {
        "unknown-method": {"method": "merge", "num_experts": [6, 6, 6]},
        "string-count": {"method": "prune", "num_experts": [6, "6", None]},
        "float-count": {"method": "prune", "num_experts": [6.0, 6, 6]},
    }
    for name, metadata in bad.items():
        cases[name] = [metadata, None]
        with pytest.raises(MoePruneError, match=SPARSITY_KEY):
            read_sparsity({SPARSITY_KEY: metadata})
    got = _run(CT20_PYTHON, CT20_SCRIPT, cases)
    assert got.pop("compressed_tensors") == "0.20.0"
    assert got == {
        **{n: "ok" for n in ("drop", "global", "novice", "w4a16")},
        **dict.fromkeys(bad, "ValidationError"),
    }


def test_inspect_reads_metadata_another_tool_wrote(tmp_path):
    tiny_model("qwen3_moe", num_hidden_layers=3, num_experts=6, mlp_only_layers=[]).save_pretrained(tmp_path)
    config = _config(tmp_path)
    config[SPARSITY_KEY] = {"method": "prune", "num_experts": [6, 6, 6]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = run_cli("inspect", tmp_path).output
    assert "moe_sparsity_config: method prune; experts per MoE layer 0:6 1:6 2:6" in out
    assert "expert parallel: EP sizes 1, 2, 3, 6" in out
    info = json.loads(run_cli("inspect", tmp_path, "--json").output)
    assert info[SPARSITY_KEY] == config[SPARSITY_KEY] and info["ep_sizes"] == [1, 2, 3, 6]
    config[SPARSITY_KEY] = {"method": "prune", "num_experts": "6,6,6"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    refused = run_cli("inspect", tmp_path, ok=False)
    assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1
    assert SPARSITY_KEY in refused.output


def test_inspect_reads_a_quantized_results_metadata(results):
    out = run_cli("inspect", results["w4a16"]).output
    assert "moe_sparsity_config: method prune; experts per MoE layer 0:6 1:6 2:6" in out
    assert "expert parallel: EP sizes 1, 2, 3, 6" in out
