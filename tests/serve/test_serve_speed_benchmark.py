"""benchmarks/serve_speed.py on a tiny model: the table it prints has one row per result with
every batch size, and the weights vLLM holds are moeprune's prediction, parameter for parameter.

The benchmark is run as a user runs it (a subprocess of this Python, starting `.venv-vllm` for
vLLM) with the smallest sizes that still exercise every part: two batch sizes, two timed rounds,
a stock result (uniform), an uneven-count one (global, moeprune format) and a per-expert-width one
(TENP, padded in vLLM today). The timings themselves are noise at this size and are checked only
for being there and consistent (a model's ratio to itself is exactly 1). The memory check is exact:
`held_weights` counts the model vLLM built, including the linear layers vLLM's CPU build repacks
out of its parameters; missing those (the first version of the count) loses every attention and
router weight, and any change in what the plugin builds moves the count off the prediction.
The model's vocabulary is a multiple of 64 because vLLM pads the embedding to one, which the
prediction does not count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model

pytestmark = pytest.mark.vllm  # drives vLLM's CPU build in a subprocess (.venv-vllm)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BENCHMARK = ROOT / "benchmarks" / "serve_speed.py"
KINDS = ("uniform", "global", "tenp")
BATCHES = (1, 2)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[dict, str]:
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"{VLLM_PYTHON} is missing: run ./scripts/setup_vllm.sh", pytrace=False)
    root = tmp_path_factory.mktemp("serve_speed")
    tokenizer = byte_tokenizer()
    model = tiny_model(
        "qwen3_moe", vocab_size=320, hidden_size=64, num_hidden_layers=4, max_position_embeddings=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, moe_intermediate_size=32,
        intermediate_size=64, mlp_only_layers=[],
    )  # fmt: skip
    with torch.no_grad():  # six experts of one magnitude in layer 0: AIMER-like uneven global counts
        for tensor in MoEModel(model).layers[0].experts.parameters():
            if tensor.dim() == 3:
                tensor[:6] = 0.01 * torch.sign(tensor[:6])
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    data = root / "calib.jsonl"
    rows = [{"text": f"def f{i}(a, b):\n    return a * {i} + b  # {'xyz' * i}\n"} for i in range(16)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = root / "table.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--model", str(root / "base"), "--data", str(data),
         "--kinds", ",".join(KINDS), "--samples", "16", "--max-length", "64", "--sparsity", "0.25",
         "--batch-sizes", ",".join(map(str, BATCHES)), "--prompt-length", "8", "--new-tokens", "4",
         "--repeats", "2", "--kv-cache-bytes", str(1 << 24), "--dtype", "float32",
         "--vllm-python", str(VLLM_PYTHON), "--outputs", str(root / "outputs"), "--json", str(out)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_table_has_every_result_and_batch_size(measured):
    table, printed = measured
    rows = {row["result"]: row for row in table["rows"]}
    assert list(rows) == ["base", *KINDS]
    for row in rows.values():
        for batch in map(str, BATCHES):
            tps = row["tokens_per_second"][batch]
            assert tps["rounds"] == 2 and 0 < tps["median"] <= tps["best"]
            assert row["vs_base"][batch]["best"] > 0 and row["vs_uniform"][batch]["paired"] > 0
    for batch in map(str, BATCHES):  # ratios against itself: exactly 1
        assert rows["base"]["vs_base"][batch] == {"best": 1.0, "paired": 1.0}
        assert rows["uniform"]["vs_uniform"][batch] == {"best": 1.0, "paired": 1.0}
        best = (
            rows["global"]["tokens_per_second"][batch]["best"]
            / rows["uniform"]["tokens_per_second"][batch]["best"]
        )
        assert rows["global"]["vs_uniform"][batch]["best"] == pytest.approx(best)
    assert rows["uniform"]["shape"].startswith("stock") and rows["global"]["shape"].startswith("moeprune")
    header = "| result | served as | tok/s b=1: median (best) | tok/s b=2: median (best) | x base (best) | x uniform (best) |"
    assert header in printed
    assert sum(line.startswith("| ") for line in printed.splitlines()) == 2 * (1 + len(rows))


def test_vllm_holds_the_predicted_parameters(measured):
    table, _ = measured
    rows = {row["result"]: row for row in table["rows"]}
    for name, row in rows.items():
        assert row["held"]["repacked_parameters"] > 0, "vLLM's CPU build repacks attention: counted"
        # the plugin allocates the prediction; vLLM's CPU kernel then pads widths to 32 neurons
        assert row["predicted_parameters"] <= row["held"]["parameters"] == row["predicted_cpu_parameters"], name
        assert row["held"]["bytes"] == 4 * row["held"]["parameters"] and row["held"]["dtype"] == "float32"
    for name in ("base", "uniform", "global"):  # nothing padded: what vLLM holds is what is stored
        assert rows[name]["held"]["parameters"] == rows[name]["stored"]["parameters"], name
    assert rows["uniform"]["held"]["parameters"] < rows["base"]["held"]["parameters"]
