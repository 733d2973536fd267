"""The multi-token-prediction (MTP) layers a release stores beside the decoder stack, pruned with
the result rather than lost.

DeepSeek-V3/R1, GLM-4.5, Qwen3-Next, Qwen3.5-MoE, MiMo and DeepSeek-V4 ship one MoE decoder layer
more than transformers builds (it skips their weights on load); vLLM builds it for speculative
decoding, with the expert count of the config, the same as every other layer's. So a stock result
keeps each MTP layer with that count: its experts are chosen by a weight-only criterion on the MTP
layer's own weights (AIMER by default, the user's criterion when that is weight-only), read from
the input's shards, because calibrating it would take the MTP forward transformers does not have
(the last hidden state and the next token's embedding). Its kept experts, router rows and
selection biases are cut in step like any layer's (`shards/rewrite.py`), every other MTP tensor is
copied as stored, and the config keeps `num_nextn_predict_layers`.

A result in moeprune's format (different counts per layer, novices, narrowed experts) keeps them
too, dropped to one count: the kept count of the plan's last MoE layer (`mtp_count`), the layer
whose output the MTP layer reads. A drop is enough there whatever the main model's method: the MTP
layer is a draft, its quality only moves how many drafted tokens are accepted, never the
result's outputs. Its count and kept ids are recorded in config.json's `moeprune` section
(`mtp`: serve/moeprune_format.py `MtpStructure`), where the loaders find which stored keys are
the MTP layers' (kept on disk, not built) and vLLM's plugin builds the draft from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from moeprune.checkpoint import load_config
from moeprune.checkpoint.files import shard_names, stored_tensors
from moeprune.checkpoint.names import beside_stack_prefixes
from moeprune.criteria import compute_scores, get_criterion
from moeprune.plan import Plan
from moeprune.serve.moeprune_format import CONFIG, MtpLayer, MtpStructure
from moeprune.serve.vllm.layout import MTP_DRAFTED
from moeprune.shards.layout import CheckpointLayout
from moeprune.shards.reader import SafetensorsExperts, ShardReader

MTP_CRITERION = "aimer"  # weight-only, scale invariant: needs nothing but the MTP layer's weights
MTP_COUNT_FIELDS = ("num_nextn_predict_layers",)  # the config field vLLM reads (DeepSeek-V3, GLM-4.5)
MTP_NOT_REQUANTIZED = (
    "the input stores them quantized and this result is dequantized (moeprune does not quantize)"
)
MTP_SERVED = "vLLM drafts with them through moeprune's plugin (speculative method mtp)"
MTP_NOT_SERVED = (
    "vLLM does not draft with them from this {family} result: moeprune's plugin serves MTP drafts of "
    "{drafted} results only (the loaders load the main model, the MTP tensors stay on disk)"
)
NEURONS_SKIP_MTP = "narrowing experts (the neurons methods) does not reach MTP layers yet"
MTP_UNQUANTIZED = (
    "left unquantized by --quantize (llm-compressor quantizes the layers the model class builds; "
    "quantization_config's ignore names them)"
)


@dataclass
class MtpPlan:
    """What happens to a checkpoint's MTP layers: `kept` experts per layer (pruned and kept), or
    `left_out` with the reason (the result has none)."""

    prefixes: dict[int, str]  # layer number -> its stored key prefix
    roots: tuple[str, ...]  # every stored key of the MTP modules starts with one of them
    kept: dict[int, list[int]] = field(default_factory=dict)
    num_experts: int = 0
    criterion: str = ""
    left_out: str = ""
    served: str = ""  # moeprune's format: how vLLM drafts with them, or why it does not (the note says it)
    unquantized: bool = False  # kept in full precision beside a `--quantize`d model (the note says it)

    def to_json(self) -> dict:
        if self.left_out:
            return {"layers": sorted(self.prefixes), "left_out": self.left_out}
        return {
            "criterion": self.criterion,
            "layers": {
                str(i): {"prefix": self.prefixes[i], "num_experts": self.num_experts, "kept": kept}
                for i, kept in sorted(self.kept.items())
            },
        }

    def structure(self) -> MtpStructure:
        """The `mtp` entry of a moeprune-format config.json (kept ids renumbered 0..count-1 on disk)."""
        count = len(next(iter(self.kept.values()))) if self.kept else 0
        layers = tuple(MtpLayer(i, p, tuple(self.kept.get(i, ()))) for i, p in sorted(self.prefixes.items()))
        return MtpStructure(self.roots, count, layers)

    def note(self) -> str:
        """One line for the summary and the log."""
        names = ", ".join(f"{p}*" for p in self.prefixes.values())
        count = len(self.prefixes)
        what = f"{count} multi-token-prediction layer{'s' if count > 1 else ''} ({names})"
        if self.left_out:
            return f"{what} left out: {self.left_out}"
        if not self.kept:
            line = f"{what} kept as stored (no routed experts)"
        else:
            kept = len(next(iter(self.kept.values())))
            line = f"{what} kept, pruned to {kept} of {self.num_experts} experts by {self.criterion} on its own weights"
        return "; ".join(
            [line] + [x for x in (MTP_UNQUANTIZED if self.unquantized else "", self.served) if x]
        )


def mtp_count(plan: Plan, groups: int = 1) -> int:
    """The routed experts a result's MTP layers keep: as many as its last MoE layer (the layer
    whose output the MTP layer reads) holds weights for, its kept experts less its novices (a
    drop plan: its kept count; a uniform one: every layer's), at least its top-k, and a multiple
    of the config's routing `groups` (vLLM's grouped top-k views the experts as [groups, E /
    groups]). A draft needs no more experts than the layer it follows; experts narrowed by the
    neurons methods count whole (the MTP layer keeps them at full width)."""
    last = max(plan.layers, key=lambda lp: lp.layer)
    count = max(last.top_k, len(last.kept) - len(last.novice))
    if groups > 1 and count % groups:
        down = count - count % groups
        count = down if down >= last.top_k else min(last.num_experts, down + groups)
    return count


def mtp_serving(model_type: str) -> str:
    """What a moeprune-format result's summary says of vLLM's drafts with its MTP layers."""
    if model_type in MTP_DRAFTED:
        return MTP_SERVED
    return MTP_NOT_SERVED.format(family=model_type, drafted=", ".join(MTP_DRAFTED))


def record_mtp(folder: Path, mtp: MtpPlan | None) -> None:
    """Add the kept MTP layers to the `moeprune` section of `folder`'s config.json (moeprune's
    format; a stock config's count field already says theirs)."""
    if mtp is None or mtp.left_out:
        return
    data = json.loads((folder / CONFIG).read_text())
    if not isinstance(data.get("moeprune"), dict):
        return
    data["moeprune"]["mtp"] = mtp.structure().to_json()
    (folder / CONFIG).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def mtp_layers(layout: CheckpointLayout) -> dict[int, str]:
    """Layer number -> stored prefix of every MTP layer the checkpoint holds (with experts or not)."""
    return {extra.index: extra.prefix for extra in layout.extras}


def is_mtp_key(plan: MtpPlan, key: str) -> bool:
    return key.startswith(plan.roots)


def plan_mtp(
    layout: CheckpointLayout, count: int, criterion: str | None = None, left_out: str = ""
) -> MtpPlan | None:
    """The plan of `layout`'s MTP layers dropped to `count` experts (`mtp_count`), or None
    without MTP layers.
    `criterion` is used when it needs no data, `MTP_CRITERION` otherwise; `left_out` drops them
    for that reason (`--drop-mtp`)."""
    prefixes = mtp_layers(layout)
    if not prefixes:
        return None
    roots = tuple(sorted({extra.root for extra in layout.extras}))
    if left_out:
        return MtpPlan(prefixes, roots, left_out=left_out)
    name = criterion if criterion and not get_criterion(criterion).needs_data else MTP_CRITERION
    if not layout.extra_layers:  # dense MTP layers (MiMo-V2's): nothing to prune, copied as stored
        return MtpPlan(prefixes, roots)
    shards = ShardReader(layout.path, layout.tensors)
    sources = [SafetensorsExperts(lay, shards) for lay in layout.extra_layers]
    kept = {}
    for scores in compute_scores(name, weights=sources):
        n = len(scores.scores)
        kept[scores.layer] = sorted(scores.order[n - count :]) if count < n else list(range(n))
    n = layout.extra_layers[0].num_experts if layout.extra_layers else 0
    return MtpPlan(prefixes, roots, kept, n, name)


def ignored_note(keys: list[str], carried: bool) -> str:
    """One line for the tensors the model class skips on load: carried as stored, or not in the result."""
    groups = sorted({".".join(k.split(".")[:2]) + ".*" for k in keys})
    shown = ", ".join(groups[:3]) + (f" and {len(groups) - 3} more" if len(groups) > 3 else "")
    what = f"{len(keys)} stored tensor{'s' if len(keys) > 1 else ''} the model class skips on load ({shown})"
    if carried:
        return f"{what} carried into the result as stored"
    return f"{what} not in the result: moeprune's format holds what its loader builds"


def unmapped_mtp(src: str | Path, why: str) -> MtpPlan | None:
    """The MTP layers of a checkpoint whose shards moeprune cannot map onto its model, found from
    the stored names alone: left out for the reason `why` (None when it has none)."""
    folder = Path(src)
    if not shard_names(folder):
        return None
    config = load_config(folder)
    prefixes = beside_stack_prefixes(stored_tensors(folder), int(config.get_text_config().num_hidden_layers))
    if not prefixes:
        return None
    count = int(config.get_text_config().num_hidden_layers)
    numbered = {count + i: prefix for i, prefix in enumerate(prefixes)}
    return MtpPlan(numbered, tuple(prefixes), left_out=why)
