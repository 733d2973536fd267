"""moeprune's vLLM plugin: `vllm serve OUT` / `vllm.LLM(model=OUT)` on moeprune-format results.

vLLM calls `register()` in every process it starts (entry point group `vllm.general_plugins`,
declared in pyproject.toml). It tells vLLM three things:

1. the architectures `MoePrune<Family>ForCausalLM` live in moeprune.serve.vllm.models (lazy
   "module:Class" strings: nothing is imported until vLLM builds such a model);
2. the config types `moeprune_<family>` are the family's stock config class under that name
   (the `MoePrune<Config>` classes of modeling_moeprune.py), so vLLM reads them without
   trust_remote_code; every other model type of the installed transformers gets a config type
   that refuses with one sentence naming the alternatives, before anything is loaded;
3. vLLM decisions keyed on `model_type` that matter for the served families see through the
   prefix: DeepSeek-V2/V3 attention is MLA (`is_deepseek_mla`, via vLLM's
   MODEL_ARCH_CONFIG_CONVERTORS registry), and MTP speculative drafts (`speculative_config=
   {"method": "mtp"}`): vLLM picks the draft model by the target config's model type
   (`SpeculativeConfig.hf_config_override`, deepseek_v3 -> deepseek_mtp), so the plugin wraps
   that function: a moeprune-format config with MTP layers (its section's `mtp` entry) is turned
   back into its base family's config with the MTP layers' expert count, and vLLM's own draft
   model (DeepSeekMTP) is built from it and loads the MTP layers' tensors, which keep the
   release's names (shards/mtp.py). Families listed in MTP_DRAFTED only (the ones checked);
   any other moeprune result asked for MTP drafts is refused in one sentence. The other
   model_type checks in vLLM 0.32 (DeepSeek-V3.2/V4 indexers, GLM-5 router dtype) concern
   families a moeprune result does not have.

On a vLLM release outside the tested range (serve/vllm/version.py) it registers none of this:
every `moeprune_<family>` config type refuses with one sentence naming the range, and vLLM's log
says it once at start-up. It does not raise from `register()`, because vLLM loads every plugin
in every run: a raise would stop the user's stock models too, which the plugin does not touch.
`MOEPRUNE_ALLOW_UNTESTED_VLLM=1` registers everything anyway (logged as a warning).

Importing this module costs nothing beyond moeprune's package root and the layout table:
no torch, no vLLM, none of moeprune's pipeline (tested).
"""

from __future__ import annotations

import importlib
import logging
import os

from moeprune.serve.moeprune_format import parse_mtp
from moeprune.serve.vllm.layout import (
    ARCHITECTURE_PREFIX,
    MODEL_TYPE_PREFIX,
    MTP_DRAFTED,
    SERVED_FAMILIES,
    mtp_refusal,
    refusal,
    refused_families,
    route_like_transformers,
)
from moeprune.serve.vllm.version import ALLOW_UNTESTED_ENV, is_tested, untested_refusal

MODELS_MODULE = "moeprune.serve.vllm.models"
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
_registered = False
# a child of vLLM's own logger, so the line appears in vLLM's log with its format
logger = logging.getLogger("vllm.moeprune_plugin")


def register() -> None:
    """Entry point: register moeprune's architectures, config types and MLA convertors (idempotent);
    on an untested vLLM, only config types that refuse in one sentence."""
    global _registered
    if _registered:
        return
    import vllm
    from vllm import ModelRegistry

    version = str(vllm.__version__)
    if not is_tested(version):
        if os.environ.get(ALLOW_UNTESTED_ENV, "") in ("", "0"):
            message = untested_refusal(version)
            logger.warning(message)
            _register_refusals(message)
            _registered = True
            return
        logger.warning(
            "moeprune's vLLM plugin runs on untested vLLM %s because %s is set", version, ALLOW_UNTESTED_ENV
        )
    for arch in sorted(set(SERVED_FAMILIES.values())):  # families may share a vLLM class
        name = ARCHITECTURE_PREFIX + arch
        ModelRegistry.register_model(name, f"{MODELS_MODULE}:{name}")
    _register_configs()
    _register_mla()
    _register_mtp()
    _registered = True


def config_class(family: str) -> type:
    """The config class of `moeprune_<family>`: modeling_moeprune's, or the stock class renamed."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    stock = CONFIG_MAPPING[family]
    name = ARCHITECTURE_PREFIX + stock.__name__
    module = f"{__package__}.modeling_moeprune"
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ModuleNotFoundError as exc:  # the self-contained modeling file is not installed beside us
        if exc.name != module:
            raise
        found = None
    if found is not None:
        return found
    return type(name, (stock,), {"model_type": MODEL_TYPE_PREFIX + family, "__module__": __name__})


def _refusing_config(family: str, message: str | None = None) -> type:
    """A config type `moeprune_<family>` that raises `message` (default: why the family is not
    served) when vLLM reads such a config.json, before anything is loaded."""
    from transformers import PretrainedConfig

    sentence = message or refusal(family)

    def __init__(self, *args, **kwargs):
        raise ValueError(sentence)

    name = f"MoePruneUnservedConfig_{family}"
    return type(
        name,
        (PretrainedConfig,),
        {"model_type": MODEL_TYPE_PREFIX + family, "__init__": __init__, "__module__": __name__},
    )


def _register_configs() -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    for family in SERVED_FAMILIES:
        _CONFIG_REGISTRY[MODEL_TYPE_PREFIX + family] = config_class(family)
    for family in refused_families(CONFIG_MAPPING_NAMES):
        _CONFIG_REGISTRY[MODEL_TYPE_PREFIX + family] = _refusing_config(family)


def _register_refusals(message: str) -> None:
    """Every `moeprune_<family>` of the installed transformers refuses with `message`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    for family in CONFIG_MAPPING_NAMES:
        if not family.startswith(MODEL_TYPE_PREFIX):
            _CONFIG_REGISTRY[MODEL_TYPE_PREFIX + family] = _refusing_config(family, message)


def _register_mla() -> None:
    from vllm.transformers_utils import model_arch_config_convertor as convertors

    class MoePruneMLAConvertor(convertors.ModelArchConfigConvertorBase):
        """DeepSeek-V2/V3 results keep MLA attention whenever the config has a KV LoRA rank, as
        vLLM decides for the stock model types."""

        def is_deepseek_mla(self) -> bool:
            return getattr(self.hf_text_config, "kv_lora_rank", None) is not None

    for family in MLA_FAMILIES:
        convertors.MODEL_ARCH_CONFIG_CONVERTORS[MODEL_TYPE_PREFIX + family] = MoePruneMLAConvertor


def draft_config(hf_config):
    """A moeprune-format target config as the config of its base family's MTP draft: model type,
    architecture and routed-expert count (the MTP layers' own, from the section's `mtp` entry)
    put back, the section removed (the draft model is vLLM's stock class). Any other config is
    returned unchanged; a moeprune config vLLM cannot draft from is refused in one sentence."""
    section = getattr(hf_config, "moeprune", None)
    if not isinstance(section, dict) or not str(getattr(hf_config, "model_type", "")).startswith(
        MODEL_TYPE_PREFIX
    ):
        return hf_config
    family = str(section.get("base_model_type", ""))
    where = f"{getattr(hf_config, 'name_or_path', '') or 'the checkpoint'}/config.json"
    mtp = parse_mtp(section.get("mtp"), f"{where} ('moeprune' section)")
    if family not in MTP_DRAFTED or mtp is None or mtp.num_experts == 0:
        raise ValueError(mtp_refusal(family, where, mtp is not None))
    count_field = (section.get("family") or {}).get("count_field")
    if not isinstance(count_field, str):
        raise ValueError(
            f"{where}: the moeprune section names no expert-count field; re-create it with moeprune"
        )
    text = hf_config.get_text_config()
    setattr(text, count_field, mtp.num_experts)
    route_like_transformers(family, hf_config)  # the draft routes as the target does
    hf_config.model_type = family
    hf_config.architectures = [str(section.get("base_architecture") or SERVED_FAMILIES[family])]
    delattr(hf_config, "moeprune")
    return hf_config


def _register_mtp() -> None:
    from vllm.config.speculative import SpeculativeConfig

    stock = SpeculativeConfig.hf_config_override
    if getattr(stock, "_moeprune", False):
        return

    def hf_config_override(hf_config):
        return stock(draft_config(hf_config))

    hf_config_override._moeprune = True  # type: ignore[attr-defined]
    SpeculativeConfig.hf_config_override = staticmethod(hf_config_override)
