"""Which MoE families can moeprune's vLLM plugin serve? Try them, on this vLLM.

    .venv/bin/python scripts/vllm_family_probe.py exaone_moe minimax_m2 ...   # families to try
    .venv/bin/python scripts/vllm_family_probe.py --candidates                # vLLM classes built like the served ones

For each family: a tiny random model (vLLM's CPU head size), its novice and TENP results in
moeprune's format, then one vLLM subprocess (.venv-vllm) serving the unpruned model and both
results, each compared with moeprune.load_pretrained as tests/serve/test_serve_vllm.py does (greedy
tokens, worst top-5 logprob difference). A family is served when the unpruned model already
matches (otherwise vLLM's class and transformers' disagree before moeprune touches anything) and
both results match too; the plugin's UNSERVED_REASONS records why the others are not. Try a
family by adding it to SERVED_FAMILIES (serve/vllm/layout.py) first: the plugin refuses others.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "serve"))

import test_serve_vllm as serving  # noqa: E402  (the driver, prompts and comparison of the tests)

import moeprune  # noqa: E402
from moeprune.config import DataOptions, PruneConfig, RunOptions  # noqa: E402
from moeprune.data.tokenizer import byte_tokenizer  # noqa: E402
from moeprune.job import PruneRequest, prune_checkpoint  # noqa: E402
from moeprune.models.factory import tiny_model  # noqa: E402

VLLM_SIZES = dict(
    hidden_size=64, head_dim=64, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256
)
KINDS = ("novice", "tenp")


def candidates() -> list[str]:
    """Working families whose vLLM class builds its MoE blocks from GateLinear and FusedMoEFactory
    (what the plugin resizes). Run with .venv-vllm's python (it imports vLLM)."""
    from vllm import ModelRegistry

    from moeprune.models.classes import model_class
    from moeprune.models.factory import tiny_config
    from moeprune.models.families import supported_families

    found = []
    for family in supported_families():
        arch = model_class(tiny_config(family)).__name__
        if arch not in ModelRegistry.models:
            continue
        try:
            module = importlib.import_module(ModelRegistry.models[arch].module_name)
        except ImportError:
            continue
        source = inspect.getsource(module)
        if "FusedMoEFactory" in source and "GateLinear" in source:
            found.append(family)
    return found


def compare(path: Path, result: dict) -> tuple[float, int]:
    """(worst |logprob difference|, prompts whose greedy tokens differ) against moeprune's loader."""
    model = moeprune.load_pretrained(path)
    worst, differing = 0.0, 0
    for prompt, tokens, steps in zip(serving.PROMPTS, result["tokens"], result["logprobs"]):
        greedy, reference = serving._greedy_and_logprobs(model, prompt, tokens)
        for t, top in enumerate(steps):
            worst = max([worst] + [abs(lp - float(reference[t, int(c)])) for c, lp in top.items()])
        differing += greedy != tokens
    return worst, differing


def probe(family: str, root: Path, options: DataOptions) -> None:
    tokenizer = byte_tokenizer()
    reference = root / family / "reference"
    tiny_model(family, vocab_size=len(tokenizer), **VLLM_SIZES).save_pretrained(reference)
    tokenizer.save_pretrained(reference)
    made = [reference]
    for kind in KINDS:
        made.append(root / family / kind)
        prune_checkpoint(PruneRequest(
            reference, made[-1], PruneConfig(**serving.KINDS[kind][0]), data=options, run=RunOptions(progress=False)
        ))
    work = root / family / "vllm"
    work.mkdir()
    spec = {"prompts": serving.PROMPTS, "new_tokens": serving.NEW_TOKENS, "logprobs": serving.TOP_LOGPROBS,
            "models": [[str(p), {}] for p in made], "refuse": []}  # fmt: skip
    (work / "spec.json").write_text(json.dumps(spec))
    (work / "driver.py").write_text(serving.DRIVER)
    args = [work / "driver.py", work / "spec.json", work / "out.json"]
    if serving._run_vllm(serving.VLLM_PYTHON, args, work / "log.txt").returncode:
        print(f"{family}: vLLM failed: {serving._tail(work / 'log.txt', 3)}")
        return
    served = json.loads((work / "out.json").read_text())["models"]
    for path in made:
        worst, differing = compare(path, served[str(path)])
        print(
            f"{family} {path.name}: worst |logprob difference| {worst:.2e}, prompts with other tokens {differing}"
        )


def main() -> int:
    if "--candidates" in sys.argv:
        print(" ".join(candidates()))
        return 0
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        data = root / "calib.jsonl"
        rows = [{"text": f"def f{i}(a, b):\n    return a * {i} + b  # {'xyz' * i}\n"} for i in range(16)]
        data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        options = DataOptions(sources=[str(data)], samples=16, max_length=64)
        for family in sys.argv[1:]:
            try:
                probe(family, root, options)
            except Exception as exc:  # one family's failure is a finding, not the end of the probe
                print(f"{family}: {type(exc).__name__}: {str(exc)[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
