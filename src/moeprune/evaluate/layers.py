"""Per decoder layer, how far a model's hidden states are from the reference's.

Why: the final metrics say how much quality was lost, this says where the error enters and how
it grows with depth. Both models read the same tokens; padding is excluded. transformers returns
the last decoder layer's output after the final norm, so the last entry is post-norm.
"""

from __future__ import annotations

import torch
from torch import nn

from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.runtime.device import input_device
from moeprune.runtime.finite import NonFiniteError, all_finite, kind

F64 = torch.float64


def _hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple:
    """Decoder layer outputs (embeddings left out)."""
    device = input_device(model)
    with torch.no_grad():
        out = model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            output_hidden_states=True,
            use_cache=False,
        )
    return out.hidden_states[1:]


def _batch_sums(
    ours: tuple, theirs: tuple, valid: torch.Tensor, labels: tuple[str, str] = ("the model", "the reference")
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, sums over real tokens of the distance and of the relative distance (fp64, on the
    layers' device; only the [B, L] norms go to the CPU). A NaN/inf hidden state raises
    NonFiniteError naming the model and the first decoder layer whose output holds it."""
    if len(ours) != len(theirs):
        raise MoePruneError(f"model has {len(ours)} decoder layers, reference {len(theirs)}")
    dist = torch.stack(
        [(a.to(F64) - b.to(a.device, F64)).norm(dim=-1).cpu()[valid] for a, b in zip(ours, theirs)]
    )
    norm = torch.stack([b.to(F64).norm(dim=-1).cpu()[valid] for b in theirs])
    _check_layers(norm, labels[1])
    _check_layers(dist, labels[0])  # with a finite reference, only the model can make it non-finite
    return dist.sum(1), (dist / norm.clamp_min(1e-30)).sum(1)


def _check_layers(norms: torch.Tensor, label: str) -> None:
    """norms [layers, tokens]: the first decoder layer with a NaN/inf output, if any, stops the metric."""
    if all_finite(norms):
        return
    layer = int((~torch.isfinite(norms)).any(1).nonzero()[0])
    raise NonFiniteError(f"the output of decoder layer {layer} of {label} holds {kind(norms[layer])}")


def layer_error(
    model: nn.Module,
    reference: nn.Module,
    data: CalibrationData,
    *,
    batch_size: int = 8,
    pad_token_id: int | None = None,
    labels: tuple[str, str] = ("the model", "the reference"),
) -> dict[str, object]:
    """Per layer: mean over tokens of ||h - h_ref||_2 (``l2``) and of that over ||h_ref||_2 (``relative``).

    `labels` name the two models when a hidden state is NaN or infinite (NonFiniteError)."""
    l2: torch.Tensor | float = 0.0
    rel: torch.Tensor | float = 0.0
    tokens = 0
    for batch in data.batches(batch_size, pad_token_id):
        ours = _hidden_states(model, batch.input_ids, batch.attention_mask)
        theirs = _hidden_states(reference, batch.input_ids, batch.attention_mask)
        dist, ratio = _batch_sums(ours, theirs, batch.attention_mask.bool(), labels)
        l2, rel, tokens = l2 + dist, rel + ratio, tokens + int(batch.attention_mask.sum())
    if not tokens or not isinstance(l2, torch.Tensor) or not isinstance(rel, torch.Tensor):
        raise MoePruneError("layer-error needs at least one token of data")
    return {
        "tokens": tokens,
        "note": "the last layer's hidden state is after the final norm (as transformers returns it)",
        "layers": [
            {"layer": i, "l2": a / tokens, "relative": r / tokens}
            for i, (a, r) in enumerate(zip(l2.tolist(), rel.tolist()))
        ],
    }
