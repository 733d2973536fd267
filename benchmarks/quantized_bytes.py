"""How close is `--quantize`'s predicted size to the bytes llm-compressor writes? On the quick demo
model (trained once and cached), saved in bf16, quantized whole by prune --quantize's llm-compressor
driver (round-to-nearest: GPTQ writes the same tensors), against quantize/pricing.py's
prediction for the unpruned model (the one `--dry-run` and `--target-size` start from):

    python benchmarks/quantized_bytes.py w4a16 w8a16 fp8-dynamic nvfp4a16

Needs the quantization environment (scripts/setup_quant.sh). The figures are in
docs/quantization.md ("Predicted and written bytes").
"""

from __future__ import annotations

import argparse
import copy
import shutil
import tempfile
from pathlib import Path

import torch

from moeprune.quantize.oneshot import quantize_folder
from moeprune.quantize.pricing import quantized_weight_bytes
from moeprune.quantize.schemes import DEFAULT_PYTHON, SCHEMES, QuantizeOptions
from moeprune.shards.weight_bytes import cast_weight_bytes
from quality import load_demo


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("schemes", nargs="+", choices=sorted(SCHEMES))
    parser.add_argument("--group-size", type=int, default=32, help="for w4a16 and w8a16")
    parser.add_argument("--python", default=DEFAULT_PYTHON, help="the quantization environment's Python")
    args = parser.parse_args()
    demo = load_demo("qwen3_moe", quick=True)
    python = str(Path(args.python).absolute())
    with tempfile.TemporaryDirectory() as work:
        bf16 = Path(work) / "bf16"
        copy.deepcopy(demo.moe.model).to(torch.bfloat16).save_pretrained(bf16)
        demo.tokenizer.save_pretrained(bf16)
        size = cast_weight_bytes(demo.model_dir, demo.moe, torch.bfloat16)
        samples = [list(range(5, 21))] * 2  # RTN reads no statistics; the pipeline still runs a batch
        for scheme in args.schemes:
            spec = SCHEMES[scheme]
            group = args.group_size if spec.grouped and not spec.fixed_group else None
            options = QuantizeOptions(scheme, "rtn", group, python)
            out = Path(work) / scheme
            shutil.copytree(bf16, out)
            quantize_folder(python, out, options, samples, "5GB")
            written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
            predicted = quantized_weight_bytes(size, demo.moe, options, 2).total
            over = (predicted - written) / written
            print(
                f"{scheme}: predicted {predicted:,}, written {written:,}, over {predicted - written:,} ({over:.2%})"
            )


if __name__ == "__main__":
    main()
