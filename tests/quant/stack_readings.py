"""The readings that test_read_as_compressed_tensors.py compares, in whichever environment runs
this: the main one (imported) or the quantization environment (.venv-quant, where llm-compressor
pins compressed-tensors 0.19 and transformers 5.17; run as `python stack_readings.py SPEC OUT`).

For one llm-compressor output `q` and a moeprune result `out` pruned from it, the logits of
- the compressed-tensors stack: stock transformers loading `q` (compressed-tensors decodes its
  Linears, quantizes their inputs where the config says so, transformers decodes the experts),
  with the plan's dropped experts masked (moeprune.models.reshape.mask_experts, which the
  unquantized tests check equals pruning);
- `moeprune.load_pretrained(out)`;
- the folder's modeling files (`trust_remote_code=True`), or the stock class for a stock result;
and the names of the Linears moeprune quantizes the inputs of.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

IDS = [[5, 17, 99, 3, 42, 7, 8, 200, 31, 64]]


def readings(q: str, out: str) -> dict:
    import compressed_tensors
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from moeprune.checkpoint import load_pretrained
    from moeprune.models import MoEModel
    from moeprune.models.reshape import mask_experts

    ids = torch.tensor(IDS)
    plan = json.loads((Path(out) / "plan.json").read_text())
    removed = {lp["layer"]: lp["dropped"] for lp in plan["layers"]}
    stack = AutoModelForCausalLM.from_pretrained(q, dtype=torch.float32).eval()
    ours = load_pretrained(out).eval()
    files = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, trust_remote_code=True).eval()
    with torch.no_grad():
        with mask_experts(MoEModel(stack), removed):
            masked = stack(ids).logits
        logits = {"stack": masked, "load_pretrained": ours(ids).logits, "modeling_files": files(ids).logits}
    hooked = sorted(
        n for n, m in ours.named_modules() if getattr(m, "moeprune_input_per_token", None) is not None
    )
    return {
        "versions": [compressed_tensors.__version__, transformers.__version__],
        "logits": {name: value.tolist() for name, value in logits.items()},
        "input_quantized": hooked,
    }


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, spec["src"])  # moeprune from the checkout under test
    result = {name: readings(q, out) for name, (q, out) in spec["cases"].items()}
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
