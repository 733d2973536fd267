"""Which transformers class holds a model: the causal LM, or the multimodal wrapper around it.

A checkpoint names its class in config.json's `architectures` (Qwen3-VL-MoE: the
`...ForConditionalGeneration` that holds the vision tower and the MoE language model); moeprune
builds and saves that same class, so towers it does not prune are kept as they are. A config
without architectures (a model built in memory) maps to its causal-LM class, or, for a wrapper
with sub-model configs (vision, audio), to its image-text-to-text class.
"""

from __future__ import annotations

import transformers
from transformers import PreTrainedModel

from moeprune.errors import UnsupportedModelError


def model_class(config) -> type[PreTrainedModel]:
    """The transformers class that builds `config`'s whole model (see the module docstring)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name.removeprefix("MoePrune"), None)
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls
    model_type = config.model_type
    order = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES]
    if is_wrapper(config):
        order.reverse()
    for mapping in order:
        cls = getattr(transformers, mapping.get(model_type, ""), None)
        if cls is not None:
            return cls
    raise UnsupportedModelError(
        f"model type {model_type!r} has no causal-LM or image-text-to-text class in this transformers; "
        "moeprune prunes language models with routed experts"
    )


def is_wrapper(config) -> bool:
    """Whether the config wraps sub-models (vision or audio towers beside the language model)."""
    return any(
        isinstance(value, transformers.PretrainedConfig) and name != "text_config" or name == "vision_config"
        for name, value in vars(config).items()
    )


def text_config_key(config) -> str | None:
    """Where a wrapper's config.json keeps the language model's config ("text_config"); None
    when the config is the language model's own."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is config:
        return None
    return next((name for name, value in vars(config).items() if value is text), None)
