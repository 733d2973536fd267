"""Runs in the quantization environment's Python (.venv-quant), started by `moeprune prune
--quantize` as a script: `python driver.py SPEC OUT`.

Why a script and not an import: llm-compressor pins transformers (5.15-5.17) and compressed-tensors
(0.19), which moeprune's own environment does not share, so prune saves the pruned model and this
file quantizes it there. It imports llm-compressor, transformers and the standard library only,
never moeprune.

SPEC (JSON): {"model": folder of the pruned, full-precision model, "output": folder to save the
quantized model in, "scheme": w4a16 | w8a16 | fp8-dynamic | nvfp4a16, "method": gptq | rtn,
"group_size": N, "samples": [[token ids], ...] (none: round-to-nearest without data),
"ignore": [module names or "re:" patterns], "max_shard_size": as save_pretrained takes it,
optionally "layer_schemes": {decoder layer index: scheme of its routed experts} (per-layer precision),
"moeprune": whether the folder is in moeprune's format (layout.py quantizes that one)}.

Calibration reaches every expert: llm-compressor linearizes each fused experts module into one
Linear per projection and expert, and with `moe_calibrate_all_experts` every expert computes on
every token of the calibration batch (its output still weighted by the router, so the model's
activations downstream are the routed ones). A forward pre-hook on each expert counts the tokens
it saw; OUT (JSON) records them per MoE layer, with the library versions:
{"versions": {...}, "tokens": N, "tokens_per_expert": {layer module name: [count per expert]}}.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# run as a script, its folder (moeprune/quantize/) comes first on sys.path: its modules (tables.py,
# grid.py, ...) must not shadow the libraries' top-level names, so it is taken off and layout.py
# (beside this file, no moeprune import either) is loaded by its path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
_spec = importlib.util.spec_from_file_location("moeprune_oneshot_layout", _HERE / "layout.py")
assert _spec is not None and _spec.loader is not None
_layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_layout)
count_own_tokens, per_layer_experts, write_compressed = (
    _layout.count_own_tokens,
    _layout.per_layer_experts,
    _layout.write_compressed,
)


def _scheme(spec: dict):
    """llm-compressor's modifier keywords for the scheme: explicit config groups for the integer
    schemes (their group size is the user's), the library's presets for the float ones."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    name = spec["scheme"]
    if name in ("w4a16", "w8a16"):
        weights = QuantizationArgs(
            num_bits=4 if name == "w4a16" else 8,
            type="int",
            symmetric=True,
            strategy="group",
            group_size=spec["group_size"],
        )
        return {"config_groups": {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}}
    return {"targets": ["Linear"], "scheme": {"fp8-dynamic": "FP8_DYNAMIC", "nvfp4a16": "NVFP4A16"}[name]}


def _layer_schemes(spec: dict):
    """Per-layer precision (`--quantize auto:...`): spec["layer_schemes"] maps a decoder layer's
    index to the scheme of its routed experts; every other Linear takes spec["scheme"]. One config
    group per scheme; the experts' groups target their linearized projections by name, and
    compressed-tensors gives a name pattern precedence over the class target "Linear"."""
    from compressed_tensors.quantization import preset_name_to_scheme

    def scheme(name: str, targets: list[str]):
        one = _scheme({**spec, "scheme": name})
        if "config_groups" in one:
            group = one["config_groups"]["group_0"]
            return group.model_copy(update={"targets": targets})
        return preset_name_to_scheme(one["scheme"], targets)

    by_scheme: dict[str, list[str]] = defaultdict(list)
    for layer, name in sorted(spec["layer_schemes"].items(), key=lambda item: int(item[0])):
        if name != spec["scheme"]:
            by_scheme[name].append(str(layer))
    groups = {"group_0": scheme(spec["scheme"], ["Linear"])}
    for i, (name, layers) in enumerate(sorted(by_scheme.items()), start=1):
        pattern = rf"re:.*layers\.({'|'.join(layers)})\.mlp\.experts\.\d+\.(gate|up|down)_proj$"
        groups[f"group_{i}"] = scheme(name, [pattern])
    return {"config_groups": groups}


def _count_expert_tokens(model) -> dict:
    """Forward pre-hooks on every linearized expert: tokens each one computed on, per layer."""
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    counts: dict[str, list[int]] = defaultdict(list)
    for name, module in model.named_modules():
        if not isinstance(module, LinearExperts2D):
            continue
        counts[name] = [0] * module.num_experts
        for index in range(module.num_experts):

            def hook(_module, args, _name=name, _index=index):
                counts[_name][_index] += args[0].shape[:-1].numel()

            module[index].register_forward_pre_hook(hook)
    return counts


def main() -> None:
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    torch.manual_seed(0)
    moeprune = bool(spec.get("moeprune"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["model"],
        dtype="auto",
        trust_remote_code=moeprune,  # moeprune's format: its modeling files
    )
    own = per_layer_experts(model) if moeprune else {}
    linearize_moe(model)  # done here (not inside oneshot) so that the experts can be hooked
    counts = _count_expert_tokens(model) | count_own_tokens(own)
    modifier = GPTQModifier if spec["method"] == "gptq" else QuantizationModifier
    recipe = modifier(
        ignore=spec["ignore"], **(_layer_schemes(spec) if spec.get("layer_schemes") else _scheme(spec))
    )
    samples = spec["samples"]
    data: dict = {}
    if samples:  # round-to-nearest of weights needs none
        data = {
            "dataset": Dataset.from_dict(
                {"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]}
            ),
            "num_calibration_samples": len(samples),
            "max_seq_length": max(len(s) for s in samples),
            "shuffle_calibration_samples": False,
        }
    oneshot(
        model=model,
        recipe=recipe,
        moe_calibrate_all_experts=True,
        trust_remote_code_model=moeprune,
        pipeline="datafree" if not samples else "basic" if spec["method"] == "rtn" else "sequential",
        **data,
    )
    if moeprune:
        write_compressed(model, spec["model"], spec["output"])
    else:
        model.save_pretrained(spec["output"], save_compressed=True, max_shard_size=spec["max_shard_size"])
    out = {
        "versions": {
            "llmcompressor": llmcompressor.__version__,
            "compressed_tensors": compressed_tensors.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "tokens": sum(len(s) for s in samples),
        "tokens_per_expert": dict(counts),
    }
    with open(sys.argv[2], "w") as handle:
        json.dump(out, handle)


if __name__ == "__main__":
    main()
