"""`prune --quantize auto:w4a16,w8a16 --target-size T --sparsity S` for methods that narrow experts or
keep novices, in the quantization environment (.venv-quant; skipped with the reason when absent):
a tiny qwen3_moe (3 MoE layers, 8 experts 32 wide) pruned by the mixed method at 25 % (whole,
narrowed on the group's multiple of 16 and novice experts in every layer) and by the neurons method
at 50 % (every expert 16 wide: a stock result). One prune each (about 45 s), shared by the module.

T lies halfway between every layer at w4a16 and every layer at w8a16, as `--dry-run` predicts them
before loading. What must hold (quantize/keeps.py): the dry run's prediction is the byte table
the choice is made on after the surgery (the uniform plan is exact); each layer's expert tensors
weigh that table's bytes for the chosen scheme (less the byte model's header bound), the novices
stay unquantized outside it; the choice is the brute-force optimum of the reported table; the file
is within the predicted bytes and T.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import (
    assert_expert_header_bound,
    brute_force_choice,
    header_entries,
    prune_auto_halfway,
    stored_tensors,
    write_arithmetic,
)
from moeprune.checkpoint import load_pretrained
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models.factory import tiny_model

pytestmark = pytest.mark.quant_env

QUANT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-quant" / "bin" / "python"
GROUP, LAYERS = 16, ("0", "1", "2")
CASES = {
    "mixed": ["--method", "mixed", "--mixed-novice", "0.125", "--sparsity", "0.25"],
    "neurons": ["--method", "neurons", "--sparsity", "0.5", "--allow-super-experts"],
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pruned(request, tmp_path_factory) -> dict:
    if not QUANT_PYTHON.is_file():
        pytest.skip(f"no quantization environment ({QUANT_PYTHON} absent): run scripts/setup_quant.sh")
    root = tmp_path_factory.mktemp(f"precision-kept-{request.param}")
    tokenizer = byte_tokenizer()
    model = tiny_model("qwen3_moe", vocab_size=len(tokenizer), num_hidden_layers=3, mlp_only_layers=[],
                       moe_intermediate_size=32)  # fmt: skip
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    data = write_arithmetic(root / "calib.jsonl")
    common = [root / "model", "--data", data, "--criterion", "frequency", *CASES[request.param],
              "--quantize", "auto:w4a16,w8a16", "--quant-method", "rtn", "--quant-group-size", str(GROUP),
              "--quant-python", QUANT_PYTHON]  # fmt: skip
    target, every = prune_auto_halfway(common, root / "out")
    out = root / "out"
    report = json.loads((out / "report.json").read_text())
    return {"case": request.param, "out": out, "target": target, "every": every, "report": report}


def test_the_dry_run_prediction_is_the_table_chosen_on_and_the_choice_its_optimum(pruned):
    precision = pruned["report"]["quantization"]["precision"]
    assert precision["every_layer_at"] == pruned["every"]  # before loading = after the surgery
    losses = precision["losses"]
    best = brute_force_choice(precision, pruned["target"])
    assert precision["chosen"] == best
    assert set(best.values()) == {"w4a16", "w8a16"}  # the target leaves a real choice
    assert pruned["report"]["quantization"]["layer_schemes"] == precision["chosen"]
    assert all(losses[lay]["w4a16"] > losses[lay]["w8a16"] for lay in LAYERS)  # the packed layers were fake-quantized


def test_each_layer_weighs_its_prediction_and_novices_stay_unquantized(pruned):
    out, precision = pruned["out"], pruned["report"]["quantization"]["precision"]
    tensors = stored_tensors(out)
    widths = set()
    for layer, scheme in precision["chosen"].items():
        prefix = f"model.layers.{layer}.mlp.experts."
        experts = {k for k in tensors if k.startswith(prefix) and not k.endswith("mean_output")}
        holders = {k[len(prefix) :].split(".")[0] for k in experts}
        novices = [k for k in tensors if k.startswith(prefix) and k.endswith("mean_output")]
        assert all(tensors[k].dtype == torch.float32 for k in novices)
        assert bool(novices) == (pruned["case"] == "mixed")
        widths |= {int(tensors[k][1]) for k in experts if k.endswith("down_proj.weight_shape")}
        stored = sum(tensors[k].nbytes for k in experts)
        assert header_entries(out, prefix, ("mean_output",))[0] == len(holders) * 3 * 3
        assert_expert_header_bound(
            precision["expert_bytes"][layer][scheme], stored, out, prefix, skip=("mean_output",)
        )
    assert widths == ({16, 32} if pruned["case"] == "mixed" else {16}), widths  # on the group's multiple
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert written == precision["written_bytes"] <= precision["predicted_bytes"] <= pruned["target"]
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    with torch.no_grad():
        assert torch.isfinite(load_pretrained(out).eval()(ids).logits).all()
