"""`moeprune serve-check OUT`: does vLLM serve the model moeprune made?

vLLM builds its own model from the files (for moeprune's format through moeprune's plugin) with
its own kernels, and reads config fields its own way; nothing else checks that the result is the
model `moeprune.load_pretrained` gives. Here both engines run the same prompts (token ids, so no
tokenizer can differ) in float32:

- vLLM, in a subprocess of the Python that has it (vllm_driver.py), generates `new_tokens` greedy
  tokens per prompt with its top-k logprobs at each step, and is timed;
- moeprune's model, in this process, is run once per prompt on the prompt plus vLLM's tokens
  (teacher-forced), which gives its log-softmax at every generated position given the same prefix.

Then at every position: each of vLLM's top-k logprobs must be within `atol` of moeprune's for the
same token, and vLLM's token must be moeprune's argmax (then, position by position, the greedy
sequences are the same), unless it is a tie: moeprune prefers its own token by at most 2 * atol,
where float rounding may pick either (the sequences may then part, and the comparison of that
prompt's tokens stops; its logprobs are still compared, on vLLM's prefix).

LOGPROB_ATOL is 2e-4. The two engines sum in different orders (vLLM's fused-MoE, attention and
MLA kernels against transformers' loops), so their float32 logprobs differ by rounding: measured
on the tiny models of tests/serve (qwen3_moe, olmoe, mixtral, deepseek_v3 and four more families,
every output kind), the worst difference is 1.9e-5, so 2e-4 is a tenfold margin; a model built
wrongly moves logprobs by 1e-1 or more (a missing novice term, a wrong routing scale, a config
field read differently). Larger models accumulate more rounding over more layers: `--atol`
raises the bound, and the report records the one used.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moeprune.checkpoint.load import check_model_path, load_pretrained, load_tokenizer, require_tokenizer
from moeprune.checkpoint.structure import read_config_dict
from moeprune.config import RECIPE_FILE, Recipe
from moeprune.data.files import parse_source
from moeprune.data.loading import load_data
from moeprune.errors import MoePruneError
from moeprune.evaluate.driver import find_vllm_python, run_driver
from moeprune.evaluate.vllm_host import refuse_quantized_moe
from moeprune.serve.vllm.layout import quantized_refusal

LOGPROB_ATOL = 2e-4
DRIVER = Path(__file__).with_name("vllm_driver.py")


@dataclass
class ServeCheckOptions:
    """How serve-check runs: prompts, lengths, the tolerance, where vLLM is."""

    prompts: Sequence[str] = ()  # data files; empty: the calibration data recorded in recipe.json
    tokenizer_path: str | None = None  # None: the output's tokenizer, else its base model's
    samples: int = 8  # prompts taken from the files
    prompt_length: int = 32  # tokens per prompt, at most
    new_tokens: int = 16  # generated per prompt (fixed: EOS ignored)
    top_k: int = 5  # logprobs compared per position
    atol: float = LOGPROB_ATOL
    reference: str | None = None  # base model, timed in vLLM too
    vllm_python: str | None = None  # None: this interpreter, if it has vLLM
    vllm_options: dict[str, Any] = field(default_factory=dict)  # extra vllm.LLM keywords
    timeout_s: float = 3600.0


def prompt_sources(folder: Path, given: Sequence[str]) -> list[str]:
    """The data files to take prompts from: those given, else the calibration data the prune read."""
    if given:
        return list(given)
    try:
        sources = list(Recipe.load(folder).data.sources)
    except MoePruneError:  # none, or not one moeprune wrote
        sources = []
    if not sources:
        raise MoePruneError(
            f"{folder} records no calibration data (no {RECIPE_FILE} naming data files); give prompt files",
            options=("prompts",),
        )
    missing = [s for s in sources if not Path(parse_source(s)[0]).exists()]
    if missing:
        raise MoePruneError(
            f"the calibration data {RECIPE_FILE} names is not here ({', '.join(missing)}); give prompt files",
            options=("prompts",),
        )
    return list(sources)


def tokenizer_folder(folder: Path, given: str | None) -> Path:
    """Where the tokenizer is: the one given, else the output's, else its base model's (an output
    pruned by a weight-only criterion has none: the prune never read text), from report.json."""
    if given:
        return Path(given)
    if load_tokenizer(folder) is not None:
        return folder
    try:
        base = json.loads((folder / "report.json").read_text()).get("model")
    except (OSError, ValueError, AttributeError):
        base = None
    return Path(base) if base and Path(base).is_dir() else folder


def prompts(folder: Path, options: ServeCheckOptions) -> tuple[list[list[int]], list[str]]:
    """Token ids of the prompts (the model's tokenizer, cut to prompt_length), and their files."""
    sources = prompt_sources(folder, options.prompts)
    tokenizer = require_tokenizer(tokenizer_folder(folder, options.tokenizer_path))
    data = load_data(sources, tokenizer, num_samples=options.samples, max_length=options.prompt_length)
    return [list(s.input_ids) for s in data.samples if len(s.input_ids)], data.sources


def _check_options(options: ServeCheckOptions) -> None:
    for name in ("samples", "prompt_length", "new_tokens", "top_k"):
        if getattr(options, name) < 1:
            raise MoePruneError(f"{name} must be at least 1, got {getattr(options, name)}", options=(name,))
    if not options.atol > 0:
        raise MoePruneError(f"atol must be positive, got {options.atol}", options=("atol",))


def run_vllm(
    python: str, models: Sequence[str], token_ids: list[list[int]], options: ServeCheckOptions
) -> dict:
    """vLLM's tokens, logprobs and timing for each model, from one subprocess."""
    spec = {
        "models": list(models),
        "prompts": token_ids,
        "new_tokens": options.new_tokens,
        "logprobs": options.top_k,
        "llm": options.vllm_options,
    }
    return run_driver(python, DRIVER, spec, options.timeout_s, "vLLM")


@torch.no_grad()
def teacher_forced_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """moeprune's log-softmax at each generated position, given the prompt and vLLM's tokens before it."""
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


@dataclass
class _Tally:
    tokens_compared: int = 0
    ties: int = 0
    max_difference: float = 0.0
    first: dict[str, Any] | None = None  # the first difference, in prompt then position order

    def differ(self, found: dict[str, Any]) -> None:
        key = (found["prompt"], found["position"])
        if self.first is None or key < (self.first["prompt"], self.first["position"]):
            self.first = found


def compare(served: dict, token_ids: list[list[int]], model, atol: float) -> _Tally:
    """vLLM's tokens and top-k logprobs against moeprune's model, position by position."""
    tally = _Tally()
    for index, (prompt, tokens, steps) in enumerate(zip(token_ids, served["tokens"], served["logprobs"])):
        reference = teacher_forced_logprobs(model, prompt, tokens)
        comparing_tokens = True
        for position, (token, top) in enumerate(zip(tokens, steps)):
            row = reference[position]
            for candidate, logprob in top.items():
                difference = abs(logprob - float(row[int(candidate)]))
                tally.max_difference = max(tally.max_difference, difference)
                if difference > atol:
                    tally.differ(
                        {
                            "prompt": index,
                            "position": position,
                            "kind": "logprob",
                            "token": int(candidate),
                            "vllm_logprob": logprob,
                            "moeprune_logprob": float(row[int(candidate)]),
                        }
                    )
            if not comparing_tokens:
                continue
            best = int(row.argmax())
            if best == token:
                tally.tokens_compared += 1
                continue
            gap = float(row[best] - row[token])
            if gap <= 2 * atol:  # a tie within rounding: either token is greedy's
                tally.ties += 1
                comparing_tokens = False
                continue
            tally.tokens_compared += 1
            tally.differ(
                {
                    "prompt": index,
                    "position": position,
                    "kind": "token",
                    "vllm_token": token,
                    "moeprune_token": best,
                    "gap": gap,
                }
            )
            comparing_tokens = False  # past a different token the sequences are different texts
    return tally


def describe_difference(first: dict[str, Any], atol: float) -> str:
    """The first difference, in words: which prompt, which generated token, what differs."""
    where = f"prompt {first['prompt']}, generated token {first['position']}"
    if first["kind"] == "token":
        return (
            f"{where}: vLLM generated token {first['vllm_token']}, moeprune {first['moeprune_token']} "
            f"(preferred by {first['gap']:.3g} in logprob, not a tie)"
        )
    return (
        f"{where}: vLLM's logprob of token {first['token']} is {first['vllm_logprob']:.6f}, moeprune's "
        f"{first['moeprune_logprob']:.6f} (tolerance {atol:g})"
    )


def _refuse_unservable(folder: Path) -> None:
    """A folder the plugin refuses by its config alone (a moeprune-format result that kept quantized
    weights) is refused here, in the plugin's sentence, before vLLM takes its 20 s to start; so is
    a quantized MoE folder on a CPU vLLM has no quantized fused-MoE kernel for (vllm_host.py)."""
    config = read_config_dict(folder)
    quant = config.get("quantization_config")
    if quant and config.get("moeprune"):  # the section moeprune-format configs carry
        method = quant.get("quant_method", "quantized") if isinstance(quant, dict) else "quantized"
        raise MoePruneError(quantized_refusal(str(method)))
    refuse_quantized_moe(folder, config, "serve-check it")


def serve_check(folder: str | Path, options: ServeCheckOptions) -> dict[str, Any]:
    """Serve `folder` in vLLM and compare with `moeprune.load_pretrained(folder)`; the document that
    report.json keeps under `serve_check` (moeprune.report.parts.ServeCheck)."""
    _check_options(options)
    folder = check_model_path(folder)
    _refuse_unservable(folder)
    reference = str(check_model_path(options.reference)) if options.reference else None
    if reference:
        _refuse_unservable(Path(reference))
    python = find_vllm_python(options.vllm_python)
    token_ids, sources = prompts(folder, options)
    if not token_ids:
        raise MoePruneError("the prompt files gave no tokens", options=("prompts",))
    model = load_pretrained(folder)  # fails here, before vLLM starts, on a checkpoint moeprune cannot read
    served = run_vllm(python, [str(folder), *([reference] if reference else [])], token_ids, options)
    result = served["models"][str(folder)]
    if "error" in result:
        raise MoePruneError(f"vLLM refused {folder}: {result['error']}")
    tally = compare(result, token_ids, model, options.atol)
    speed = result["generated_tokens"] / result["seconds"]
    document: dict[str, Any] = {
        "verdict": "match" if tally.first is None else "mismatch",
        "vllm_version": served["vllm_version"],
        "dtype": "float32",
        "prompt_sources": sources,
        "prompts": len(token_ids),
        "new_tokens": options.new_tokens,
        "top_k": options.top_k,
        "tokens_compared": tally.tokens_compared,
        "ties": tally.ties,
        "max_logprob_difference": tally.max_difference,
        "logprob_atol": options.atol,
        "first_difference": None if tally.first is None else describe_difference(tally.first, options.atol),
        "first_difference_at": None
        if tally.first is None
        else [tally.first["prompt"], tally.first["position"]],
        "vllm_tokens_per_s": speed,
    }
    if reference:
        base = served["models"][reference]
        if "error" in base:
            raise MoePruneError(
                f"vLLM refused the reference {reference}: {base['error']}", options=("reference",)
            )
        base_speed = base["generated_tokens"] / base["seconds"]
        document.update(
            reference=reference, reference_tokens_per_s=base_speed, throughput_ratio=speed / base_speed
        )
    return document
