"""`moeprune serve-check OUT` passes where vLLM serves what moeprune loads, and fails, naming
the first differing prompt and token, where it does not.

The command runs here (.venv) as a user runs it, in a subprocess, with `--vllm-python` pointing at
.venv-vllm (vLLM's CPU build with moeprune beside it), once per output: four serve-checks, whose
vLLM drivers run in turn in one warm .venv-vllm process (conftest.py's shared_vllm_python), and a
process of its own that loads two models in vLLM posing as an untested release. Tiny OLMoE models as in test_serve_vllm.py: a stock result (drop, timed against its base
with --reference), per-layer expert counts (global) and per-expert widths (TENP), both in
moeprune's format through the plugin.

The altered checkpoint: a copy of the stock result whose config.json sets `norm_topk_prob: true`.
transformers' OLMoE (moeprune's loader) then renormalises the top-k router weights, vLLM 0.32's
OlmoeForCausalLM never does (`renormalize=False`, whatever the config says): the files are the
same, the served model is not, which is the kind of difference serve-check exists to find (a
weight altered in the safetensors would be read alike by both engines, so it is no test of
serving). The unaltered copy passing on the same prompts shows the alteration is what fails it.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_serve_vllm import KINDS, _reference

from helpers import run_cli
from moeprune.config import DataOptions, PruneConfig, RunOptions
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.evaluate.serve_check import LOGPROB_ATOL
from moeprune.job import PruneRequest, prune_checkpoint
from moeprune.serve.vllm.version import untested_refusal

pytestmark = pytest.mark.vllm  # drives vLLM's CPU build in a subprocess (.venv-vllm)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
FAMILY = "olmoe"
SMALL_KV_CACHE = "kv_cache_memory_bytes=67108864"  # the CPU build's default reserves gigabytes


@pytest.fixture(scope="module")
def vllm_python(shared_vllm_python) -> Path:
    """.venv-vllm's Python as serve-check is given it: the shared one (conftest.py)."""
    return shared_vllm_python


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """The base model, a stock result (drop) and the two per-layer structures of moeprune's format
    (expert counts, TENP widths), the calibration and a prompt file. Novices and neuron widths are
    served by test_serve_vllm.py against the same loader; serve-check's own path is the same for them."""
    root = tmp_path_factory.mktemp("serve_check")
    out = base_model(root)
    for kind in ("drop", "global", "tenp"):
        out[kind] = root / kind
        prune_with(out, out[kind], PruneConfig(**KINDS[kind][0]))
    return out


def base_model(root: Path) -> dict[str, Path]:
    """A tiny OLMoE with a byte tokenizer (`base`), its calibration text (`data`) and three prompts."""
    tokenizer = byte_tokenizer()
    data = root / "calib.jsonl"
    rows = [{"text": f"def f{i}(a, b):\n    return a * {i} + b  # {'xyz' * i}\n"} for i in range(16)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"text": t}) for t in ("The cat", "x = [i * i for i in", "1 + 2 ="))
    )
    base = root / "base"
    _reference(FAMILY, base, len(tokenizer))
    tokenizer.save_pretrained(base)
    return {"base": base, "data": data, "prompts": prompts}


def prune_with(made: dict[str, Path], out: Path, config: PruneConfig) -> None:
    """`made["base"]` pruned to `out` by `config`, calibrated on `made["data"]`."""
    prune_checkpoint(PruneRequest(made["base"], out, config,
                     data=DataOptions(sources=[str(made["data"])], samples=16, max_length=64),
                     run=RunOptions(progress=False)))  # fmt: skip


def serve_check(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeprune", "serve-check", *map(str, args)],
                          capture_output=True, text=True, timeout=1200, check=False)  # fmt: skip


def _check(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())["serve_check"]


@pytest.fixture(scope="module")
def stock_run(made, vllm_python) -> subprocess.CompletedProcess:
    """The stock result against its base, prompts from the calibration data recipe.json names."""
    return serve_check(made["drop"], "--vllm-python", vllm_python, "--vllm-option", SMALL_KV_CACHE,
                       "--reference", made["base"])  # fmt: skip


def test_the_installed_vllm_is_in_the_tested_range(vllm_python, tmp_path):
    # a driver (DRIVER SPEC OUT) runs in the shared warm process, where vLLM is already imported
    driver = tmp_path / "version.py"
    driver.write_text(
        "import json, sys, vllm\n"
        "from moeprune.serve.vllm.version import is_tested\n"
        "json.dump([vllm.__version__, is_tested(vllm.__version__)], open(sys.argv[2], 'w'))\n"
    )
    subprocess.run([str(vllm_python), str(driver), "-", str(tmp_path / "out.json")], check=True)
    version, tested = json.loads((tmp_path / "out.json").read_text())
    assert tested is True, f"vLLM {version} in .venv-vllm is outside the range the plugin accepts"


def test_a_stock_result_matches_and_is_timed_against_its_base(made, stock_run):
    assert stock_run.returncode == 0, stock_run.stdout + stock_run.stderr[-3000:]
    check = _check(made["drop"])
    assert check["verdict"] == "match" and check["vllm_version"].startswith("0.32")
    assert check["prompt_sources"] == [str(made["data"])] and check["prompts"] == 8
    assert check["ties"] == 0 and check["tokens_compared"] == 8 * 16  # no tie within rounding on this model
    assert 0 <= check["max_logprob_difference"] <= LOGPROB_ATOL
    ratio = check["vllm_tokens_per_s"] / check["reference_tokens_per_s"]
    assert check["throughput_ratio"] == pytest.approx(ratio) and check["reference"] == str(made["base"])
    card = (made["drop"] / "README.md").read_text()
    assert "Served by vLLM as moeprune loads it" in card and "the base model's" in card
    assert card.startswith("---\n") and "# " in card  # the redrawn card keeps its front matter
    assert stock_run.stdout.splitlines()[0] == f"serve-check {made['drop']}: match"
    print(f"stock: worst |logprob difference| {check['max_logprob_difference']:.2e}, "
          f"{check['vllm_tokens_per_s']:.0f} tokens/s, ratio to base {check['throughput_ratio']:.2f}")  # fmt: skip


@pytest.mark.parametrize("kind", ["global", "tenp"])
def test_every_other_output_kind_matches(made, vllm_python, kind):
    """Per-layer expert counts and per-expert widths (served through the plugin); prompts from a
    file, the tokenizer from the base when the output has none."""
    config = json.loads((made[kind] / "config.json").read_text())
    section = config.get("moeprune", {}).get("layers", [])
    if kind == "global":
        assert len({layer["num_experts"] for layer in section}) > 1
    else:
        assert any(len({w for w in layer["widths"] if w}) > 1 for layer in section)
    done = serve_check(made[kind], "--vllm-python", vllm_python, "--vllm-option", SMALL_KV_CACHE,
                       "--prompts", made["prompts"], "--new-tokens", 12)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    check = _check(made[kind])
    assert check["verdict"] == "match" and check["prompts"] == 3 and check["new_tokens"] == 12
    assert check["prompt_sources"] == [str(made["prompts"])]
    assert check["max_logprob_difference"] <= LOGPROB_ATOL and "reference" not in check
    print(f"{kind}: worst |logprob difference| {check['max_logprob_difference']:.2e}")


def test_an_altered_checkpoint_fails_naming_the_position(made, vllm_python, stock_run, tmp_path):
    altered = tmp_path / "altered"
    shutil.copytree(made["drop"], altered)
    config = json.loads((altered / "config.json").read_text())
    assert config.get("norm_topk_prob") is False
    config["norm_topk_prob"] = True
    (altered / "config.json").write_text(json.dumps(config))
    done = serve_check(altered, "--vllm-python", vllm_python, "--vllm-option", SMALL_KV_CACHE)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    check = _check(altered)
    prompt, position = check["first_difference_at"]
    first = done.stdout.splitlines()[0]
    assert first.startswith(
        f"serve-check {altered}: MISMATCH at prompt {prompt}, generated token {position}: "
    )
    assert check["verdict"] == "mismatch" and check["max_logprob_difference"] > 100 * LOGPROB_ATOL
    assert "does NOT serve it" in (altered / "README.md").read_text()
    assert _check(made["drop"])["verdict"] == "match"  # the same prompts, unaltered


def test_bad_input_is_one_line_and_exit_2(made, tmp_path):
    """Refused before vLLM starts, nothing written."""
    cases = {
        "missing folder": ([tmp_path / "nope"], "does not exist"),
        **({"no vLLM here": ([made["tenp"]], "--vllm-python")} if importlib.util.find_spec("vllm") is None else {}),
        "not a python": ([made["tenp"], "--vllm-python", tmp_path / "none"], "--vllm-python"),
        "no prompts": ([made["base"], "--vllm-python", sys.executable], "--prompts"),
        "bad option": ([made["tenp"], "--vllm-option", "novalue"], "--vllm-option"),
    }
    before = (made["tenp"] / "report.json").read_text()
    for name, (args, needle) in cases.items():  # in this process: each is refused before vLLM starts
        done = run_cli("serve-check", *args, ok=False)
        lines = done.output.strip().splitlines()
        assert done.exit_code == 2 and len(lines) == 1 and lines[0].startswith("moeprune: error:"), (
            name,
            done.output,
        )
        assert needle in lines[0], (name, lines[0])
    assert (made["tenp"] / "report.json").read_text() == before


UNTESTED = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import vllm
vllm.__version__ = "0.34.0"  # what the plugin reads: an untested release, as far as it can tell
from vllm import LLM

def llm(path):
    return LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=64,
               kv_cache_memory_bytes=1 << 26, distributed_executor_backend="uni")

if __name__ == "__main__":
    out = {"stock": llm(sys.argv[1]).llm_engine.model_config.architectures[0]}
    try:
        llm(sys.argv[2])
        out["refused"] = None
    except Exception as exc:
        out["refused"] = f"{type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps(out))
"""


def test_an_untested_vllm_refuses_moeprune_models_and_serves_stock_ones(made, vllm_python, tmp_path):
    """In real vLLM, told it is 0.34.0: the stock result still loads (vLLM loads the plugin in every
    run), the moeprune-format one is refused with the one sentence, also logged at start-up."""
    (tmp_path / "untested.py").write_text(UNTESTED)  # a fresh process: vLLM told its version before the plugin loads
    done = subprocess.run([str(VLLM_PYTHON), str(tmp_path / "untested.py"), str(made["drop"]), str(made["global"])],
                          capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    log = "\n".join(
        line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("RESULT ")
    )
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    sentence = untested_refusal("0.34.0")
    assert result["stock"] == "OlmoeForCausalLM"
    assert result["refused"] is not None and sentence in result["refused"], result["refused"]
    assert sentence in log  # the warning at start-up, in vLLM's log
