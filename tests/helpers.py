"""Assertions shared by tests that compare two models' logits.

Two fp32 models holding bit-identical weights need not give bit-identical logits: BLAS and
oneDNN pick their vectorised code path (and so the order of a dot product's partial sums)
by CPU feature set and by the alignment of each buffer, and a reloaded or re-sliced model
holds its weights in other allocations than the model it came from. Measured differences
reached 2.9e-6 on logits of order 1 (qwen3_next, one CPU model of the CI pool), i.e. a few
ulps of every term summed over the hidden width. The tolerance below is 1e-5 relative to the
logits' scale: above any reordering noise, and an order of magnitude under what the smallest
real change measured in these tests produces (pruning one neuron moves logits by > 1e-4).

Bit-exact comparisons remain where the very same tensors run the very same code (a mask
undone on the same model, two calls of one function): there, any difference is a bug.
"""

from __future__ import annotations

import torch

REORDER_RTOL = 1e-5  # see the module docstring


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = REORDER_RTOL) -> None:
    """Equal up to fp32 summation order: |a - b| <= rtol * max(1, max |b|)."""
    assert actual.shape == expected.shape, f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}"
    scale = max(1.0, float(expected.detach().abs().max()))
    diff = float((actual.detach().float() - expected.detach().float()).abs().max())
    assert diff <= rtol * scale, f"logits differ by {diff:.3g} (allowed {rtol * scale:.3g})"


def stock_from_pretrained(path, **kwargs):
    """Stock transformers' own class for a saved folder (a causal LM, or the multimodal wrapper its
    config.json names), loaded by transformers alone, as a user of the family would."""
    from transformers import AutoConfig

    from moeprune.models.classes import model_class

    return model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, **kwargs).eval()


def run_cli(*args, ok: bool = True):
    """`moeprune ARGS` in-process; with `ok`, exit code 0 is asserted (the output shown if not)."""
    from click.testing import CliRunner

    from moeprune.cli.main import main

    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def stored_tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's safetensors, as stored (dtype and all)."""
    from pathlib import Path

    from safetensors import safe_open

    out = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - not a dict
    return out


def header_entries(folder, prefix: str, skip: tuple[str, ...] = ()) -> tuple[int, int]:
    """(count, bytes) of the safetensors header entries whose names start with `prefix` (and end
    with none of `skip`), each as written (`,"name":{...}` with the comma before it)."""
    import json
    import struct
    from pathlib import Path

    count = size = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name.startswith(prefix) and not name.endswith(skip or ("\0",)):
                count += 1
                size += len(f',"{name}":' + json.dumps(entry, separators=(",", ":")))
    return count, size


def assert_expert_header_bound(
    predicted: int, stored: int, folder, prefix: str, digits: int = 6, skip: tuple[str, ...] = ()
) -> None:
    """The byte model's bytes of a layer's experts (quantize/pricing.py) are their tensors'
    plus a bound on their header entries: at least the entries written, and over them by at most
    the offsets' digits (each of the two offsets an entry has `digits` digits at most, 1 at least)."""
    count, written = header_entries(folder, prefix, skip)
    gap = predicted - stored - written
    assert 0 <= gap <= count * 2 * (digits - 1), (prefix, predicted, stored, written, count)


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes as stored: compares fp8 and packed codes byte for byte (-0 differs from +0)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def fixed_logits(model) -> torch.Tensor:
    """The model's float32 logits on a fixed batch of token ids (2 x 12, seed 0, ids >= 3)."""
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits.float()


def kept_expert_sources(plan: dict, after: dict[str, torch.Tensor]) -> dict[str, str]:
    """For every per-expert tensor of a pruned checkpoint (`after`, on-disk names
    `model.layers.L.<block>.experts.E.<...>`), the input key it must be a copy of: expert E of
    layer L is the E-th expert that `plan` (plan.json) keeps there."""
    import re

    expert, layer_of = re.compile(r"\.experts\.(\d+)\."), re.compile(r"^model\.layers\.(\d+)\.")
    index = {lp["layer"]: lp for lp in plan["layers"]}
    sources = {}
    for key in after:
        match, layer = expert.search(key), layer_of.match(key)
        if match is None or layer is None or int(layer.group(1)) not in index:
            continue
        lp = index[int(layer.group(1))]
        kept = [e for e in range(lp["num_experts"]) if e not in lp["dropped"]]
        sources[key] = expert.sub(f".experts.{kept[int(match.group(1))]}.", key, count=1)
    return sources


def assert_streamed_scores_and_no_load_drop(quantized, reference, tmp_path) -> None:
    """Weight-only scores streamed from a quantized checkpoint's shards decode each expert's codes
    with their companions: they equal the dequantized `reference`'s streamed scores (the same
    values summed in the same order: to the last bit); the no-load drop they drive keeps the
    quantization and writes the loaded pipeline's files byte for byte."""
    import json

    run_cli("score", quantized, "--criterion", "aimer", "--streaming", "--quiet", "--output", tmp_path / "q.json")
    run_cli("score", reference, "--criterion", "aimer", "--streaming", "--quiet", "--output", tmp_path / "r.json")
    got, expected = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("q", "r"))
    assert got["layers"] == expected["layers"]
    common = ["--criterion", "aimer", "--sparsity", "0.25", "--quiet"]
    run_cli("prune", quantized, *common, "--no-load", "--output", tmp_path / "no_load")
    run_cli("prune", quantized, *common, "--output", tmp_path / "loaded")
    assert json.loads((tmp_path / "no_load" / "config.json").read_text())["quantization_config"]
    for file in (tmp_path / "loaded").glob("*.safetensors"):
        assert file.read_bytes() == (tmp_path / "no_load" / file.name).read_bytes()


def save_tiny_qwen(folder, num_hidden_layers: int = 3, **overrides):
    """A tiny qwen3_moe (every layer MoE; `overrides` change its config) with the byte tokenizer,
    saved to `folder`: the input checkpoint of the quantize tests. Returns (model, tokenizer)."""
    from moeprune.data.tokenizer import byte_tokenizer
    from moeprune.models.factory import tiny_model

    tokenizer = byte_tokenizer()
    model = tiny_model("qwen3_moe", vocab_size=len(tokenizer), num_hidden_layers=num_hidden_layers, mlp_only_layers=[], **overrides)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def write_arithmetic(path, count: int = 6):
    """`count` calibration lines of arithmetic (jsonl, a `text` field each); returns `path`."""
    import json

    path.write_text("".join(json.dumps({"text": f"Question {i}: {i} plus {i} is {2 * i}. " * 2}) + "\n" for i in range(count)))
    return path


def save_tiny_release(folder, family: str, **overrides):
    """A tiny 3-layer `family` model with the byte tokenizer saved to `folder`; deepseek_v3 in its
    release layout, with the MTP layer stored beside the stack (model.layers.3.*)."""
    from tests.release_layouts import write_mtp_release

    from moeprune.data.tokenizer import byte_tokenizer
    from moeprune.models.factory import tiny_model

    tokenizer = byte_tokenizer()
    if family == "deepseek_v3":
        write_mtp_release(family, folder, vocab_size=len(tokenizer), num_hidden_layers=3, **overrides)
    else:
        tiny_model(family, vocab_size=len(tokenizer), num_hidden_layers=3, **overrides).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def prune_auto_halfway(common: list, out) -> tuple[int, dict[str, int]]:
    """`moeprune prune *common --output out` (a `--quantize auto:w4a16,w8a16` run) with the target
    halfway between its dry run's bytes with every layer's experts at w4a16 and at w8a16: the
    choice then has bytes to spend but cannot buy w8a16 everywhere. Returns (target, those bytes)."""
    import re

    dry = run_cli("prune", *common, "--output", out, "--target-size", "10MB", "--dry-run").output
    every = {s: int(n.replace(",", "")) for s, n in re.findall(r"(w\d+a16) [\d.]+ kB \(([\d,]+) bytes\)", dry)}
    target = (every["w4a16"] + every["w8a16"]) // 2
    run_cli("prune", *common, "--output", out, "--target-size", str(target), "--quiet")
    return target, every


def oneshot_stand_in(python, folder, options, samples, max_shard_size, moeprune_format=False):
    """In place of quantize/stage.py's `quantize_folder` (llm-compressor's oneshot in .venv-quant):
    what report.json's `quantization` needs from its run, nothing quantized. The tests that
    monkeypatch it check the search and choice; the quant_env tests check the bytes written."""
    return {
        "scheme": options.scheme,
        "method": options.method,
        "calibration_tokens": 1,
        "least_tokens_per_expert": 1,
        "versions": {"llmcompressor": "stand-in"},
        "layer_schemes": {str(k): v for k, v in (options.layer_schemes or {}).items()},
    }


def brute_force_choice(precision: dict, target: int) -> dict[str, str]:
    """The per-layer schemes of least summed loss within `target`, by trying every combination of
    report.json's `quantization.precision` tables (losses, expert bytes, fixed bytes)."""
    import itertools

    losses, sizes = precision["losses"], precision["expert_bytes"]
    layers = sorted(losses, key=int)
    schemes = sorted(losses[layers[0]])
    fits = [
        c for c in itertools.product(schemes, repeat=len(layers))
        if precision["fixed_bytes"] + sum(sizes[lay][s] for lay, s in zip(layers, c)) <= target
    ]  # fmt: skip
    best = min(fits, key=lambda c: sum(losses[lay][s] for lay, s in zip(layers, c)))
    return dict(zip(layers, best))


def kept_quantization(quantization_config: dict) -> dict:
    """A result's quantization_config without the `moe_sparsity_config` moeprune adds to it (the
    metadata standard, checkpoint/sparsity_metadata.py): what the input's must equal, key for key."""
    return {k: v for k, v in quantization_config.items() if k != "moe_sparsity_config"}


# Random data for tiny models, here rather than in the test modules that use it most: the torchrun
# workers (distributed_worker.py, distributed_search_worker.py) import them, and importing a test
# module that parametrizes over supported_families() built every family's tiny model in each rank
# (about 30 s of a rank's 40 on CI's two cores).
TINY_VOCAB = 96  # the tiny models' vocabulary the random ids stay under


def calibration(lengths=(9, 6, 4)):
    """Random answer-only samples of the given lengths (seeded): CalibrationData."""
    from moeprune.data.loading import CalibrationData, Sample

    gen = torch.Generator().manual_seed(1)
    samples = [
        Sample(
            input_ids=torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist(),
            answer_mask=[True] * n,
            source="t",
            truncated=False,
        )
        for n in lengths
    ]
    return CalibrationData(samples=samples, fingerprint="test", truncated=0, text_only=True, sources=["t"])


def random_data(n: int = 10, text_only: bool = False, seed: int = 0):
    """Random prompt/answer samples of different lengths (so batches are padded): CalibrationData."""
    from moeprune.data.loading import CalibrationData, Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        length = int(torch.randint(8, 20, (1,), generator=g))
        ids = torch.randint(3, TINY_VOCAB, (length,), generator=g).tolist()
        cut = 0 if text_only else length // 2
        samples.append(Sample(ids, [False] * cut + [True] * (length - cut), "mem", False))
    return CalibrationData(samples, f"fp{seed}", 0, text_only, ["mem"])


def random_orders(moe, seed: int = 0) -> list[list[int]]:
    """A random expert order per MoE layer (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randperm(m.num_experts, generator=g).tolist() for m in moe.layers]
