"""`moeprune eval --engine vllm`: lm-eval's vLLM backend, with moeprune's plugin, scores a stock
and a moeprune-format result like the HF backend does on the same local task.

vLLM's CPU build runs in `.venv-vllm` (./scripts/setup_vllm.sh), started by the bridge as
`--vllm-python`; this Python runs the HF backend on the same folders, in float32 both.

The tasks are local (a JSONL file through the harness's json builder; nothing is downloaded):
a loglikelihood task scored by perplexity, a continuous figure that moves with every logprob,
and a multiple-choice task scored by accuracy. The tolerance: each document's loglikelihood is a
sum over at most MAX_TARGET_TOKENS tokens whose logprobs the serving tests bound by 2e-4 between
vLLM and transformers (tests/serve/test_serve_vllm.py, worst measured 1.9e-5), so the log of the
perplexity (minus the mean of those sums) differs by at most 4 x 2e-4 = 8e-4; a served model that
is wrong moves logprobs by 0.1 or more (a missing novice term, a routing scale). Accuracy must be
equal: the choices' loglikelihoods of these models differ by far more than that bound (checked:
the smallest gap is printed).
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from moeprune.checkpoint import load_model, save_pretrained
from moeprune.cli.main import main
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.models.reshape import drop_experts

pytestmark = pytest.mark.vllm  # drives vLLM's CPU build in a subprocess (.venv-vllm)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PPL_TASK, MC_TASK = "moeprune_mini_ppl", "moeprune_mini_choice"
MAX_TARGET_TOKENS = 4  # bytes: the targets below are at most 4 characters
LOG_PPL_ATOL = MAX_TARGET_TOKENS * 2e-4


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tasks")
    ppl = [{"question": f"{a} + {a} =", "answer": f" {2 * a}"} for a in range(10)]
    choice = [{"question": f"x{a} * 2 =", "choices": [f" {2 * a}", f" {2 * a + 1}", f" {a}"], "label": 0}
              for a in range(10)]  # fmt: skip
    (folder / "ppl.jsonl").write_text("\n".join(json.dumps(r) for r in ppl) + "\n")
    (folder / "choice.jsonl").write_text("\n".join(json.dumps(r) for r in choice) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (folder / f"{PPL_TASK}.yaml").write_text(
        f"task: {PPL_TASK}\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'ppl.jsonl'}\n"
        'output_type: loglikelihood\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / f"{MC_TASK}.yaml").write_text(
        f"task: {MC_TASK}\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'choice.jsonl'}\n"
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen3-MoE reference (vLLM's CPU head size), a stock uniform drop of it and a
    moeprune-format result (per-layer counts)."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = tiny_model(
        "qwen3_moe", vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=4, max_position_embeddings=256,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, moe_intermediate_size=32, intermediate_size=64,
        mlp_only_layers=[],
    )  # fmt: skip
    model.save_pretrained(root / "reference")
    tokenizer.save_pretrained(root / "reference")
    made = {"reference": root / "reference"}
    for name, removed in (
        ("stock", {i: [0, 1] for i in range(4)}),
        ("uneven", {0: [0, 1, 2], 1: [5], 3: [7]}),
    ):
        pruned, _ = load_model(root / "reference")
        drop_experts(MoEModel(pruned), removed)
        kind = save_pretrained(pruned, root / name, tokenizer)
        assert kind == ("stock" if name == "stock" else "moeprune"), kind
        made[name] = root / name
    return made


def _eval(models, task_dir, out: Path, engine: str, vllm_python: Path | None = None) -> dict:
    extra = ["--engine", "vllm", "--vllm-python", str(vllm_python),
             "--vllm-option", f"kv_cache_memory_bytes={1 << 26}", "--vllm-option", "enforce_eager=true",
             ] if engine == "vllm" else []  # fmt: skip
    result = CliRunner().invoke(
        main,
        ["eval", str(models["stock"]), str(models["uneven"]), "--compare", "-r", str(models["reference"]),
         "--metrics", "size", "--lm-eval-tasks", f"{PPL_TASK},{MC_TASK}", "--lm-eval-include", str(task_dir),
         "--dtype", "fp32", "--output", str(out), "--quiet", *extra],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def both(models, task_dir, tmp_path_factory, shared_vllm_python) -> dict[str, dict]:
    """Both engines' documents. The three vLLM runs (one per model, as the bridge starts them) go to
    the warm shared .venv-vllm process (conftest.py): vLLM and lm-eval are imported once, not
    three times; each run still builds its own engine from the folder."""
    work = tmp_path_factory.mktemp("eval")
    return {
        engine: _eval(models, task_dir, work / f"{engine}.json", engine, shared_vllm_python)
        for engine in ("hf", "vllm")
    }


def _scores(doc: dict) -> dict[str, dict]:
    out = {"reference": doc["reference_lm_eval"]}
    out.update({m["label"]: m["lm_eval"]["results"] for m in doc["models"]})
    return out


def test_vllm_backend_scores_like_the_hf_backend(both):
    assert both["vllm"]["lm_eval_engine"] == "vllm" and both["hf"]["lm_eval_engine"] == "hf"
    hf, vllm = _scores(both["hf"]), _scores(both["vllm"])
    assert set(hf) == set(vllm) == {"reference", "stock", "uneven"}
    for name in hf:
        log_hf, log_vllm = (
            math.log(hf[name][PPL_TASK]["perplexity"]),
            math.log(vllm[name][PPL_TASK]["perplexity"]),
        )
        print(f"{name}: log perplexity hf {log_hf:.6f}, vllm {log_vllm:.6f}")
        assert abs(log_hf - log_vllm) <= LOG_PPL_ATOL, name
        assert vllm[name][PPL_TASK]["acc"] == hf[name][PPL_TASK]["acc"], name
        assert vllm[name][MC_TASK]["acc"] == hf[name][MC_TASK]["acc"], name
    # the pruned models are other models: the comparison above can tell models apart
    assert (
        abs(
            math.log(hf["uneven"][PPL_TASK]["perplexity"]) - math.log(hf["reference"][PPL_TASK]["perplexity"])
        )
        > 10 * LOG_PPL_ATOL
    )


def test_vllm_backend_recovery_and_report(both):
    doc = both["vllm"]
    for model in doc["models"]:
        ratio = model["lm_eval"]["recovery"][PPL_TASK]["perplexity"]
        assert ratio == pytest.approx(model["lm_eval"]["results"][PPL_TASK]["perplexity"]
                                      / doc["reference_lm_eval"][PPL_TASK]["perplexity"])  # fmt: skip


@pytest.mark.parametrize(
    "args,message",
    [
        (["--engine", "vllm"], "need --lm-eval-tasks"),
        (["--lm-eval-tasks", PPL_TASK, "--vllm-python", sys.executable], "need --engine vllm"),
        (
            ["--lm-eval-tasks", PPL_TASK, "--engine", "vllm", "--vllm-python", sys.executable],
            "which lacks vllm",
        ),
        (
            ["--lm-eval-tasks", PPL_TASK, "--engine", "vllm", "--vllm-python", "/no/such/python"],
            "not an executable",
        ),
    ],
    ids=["no-tasks", "hf-with-vllm-python", "python-without-vllm", "no-python"],
)
def test_engine_refusals_before_loading(models, task_dir, args, message):
    """One line, exit 2, before any model is loaded (sys.executable is this .venv: no vLLM)."""
    if message == "which lacks vllm" and importlib.util.find_spec("vllm") is not None:
        pytest.skip("this Python has vLLM: it is not a Python without it")
    result = CliRunner().invoke(
        main, ["eval", "/no/such/model", "-r", "/no/such/ref", "--lm-eval-include", str(task_dir), *args]
    )
    if "--lm-eval-tasks" not in args:  # --lm-eval-include alone is refused first: drop it
        result = CliRunner().invoke(main, ["eval", "/no/such/model", "-r", "/no/such/ref", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_a_model_in_memory_is_refused(models, task_dir):
    from moeprune.errors import MoePruneError
    from moeprune.evaluate import EvalOptions, Loaded, evaluate_loaded
    from moeprune.evaluate.lm_eval_bridge import LmEvalOptions

    reference, tokenizer = load_model(models["reference"])
    options = EvalOptions(
        metrics=("size",),
        lm_eval=LmEvalOptions(
            tasks=[PPL_TASK], include=str(task_dir), engine="vllm", vllm_python=str(VLLM_PYTHON)
        ),
    )
    with pytest.raises(MoePruneError, match="save it first"):
        evaluate_loaded(
            [Loaded("in memory", reference, tokenizer)],
            Loaded("in memory too", reference, tokenizer),
            options,
        )
