"""vLLM on a quantized MoE checkpoint where its CPU build has no quantized fused-MoE kernel (an x86
CPU without AMX, this project's test machine): `serve-check` and `eval --engine vllm` refuse in
one sentence before vLLM starts (evaluate/vllm_host.py). The detector is a function of the facts,
tested here with fake /proc/cpuinfo texts; the CLI refusal is tested on this machine's own facts
when it has no AMX and no GPU (else with the facts of one that has neither)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_cli
from moeprune.errors import MoePruneError
from moeprune.evaluate import vllm_host
from moeprune.evaluate.lm_eval_bridge import LmEvalOptions, check_vllm_folders
from moeprune.evaluate.vllm_host import HostFacts, cpu_flags, host_facts, quantized_moe_blocker

pytestmark = pytest.mark.unit

SKYLAKE = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n\nprocessor\t: 1\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n"
GRAVITON = "processor\t: 0\nFeatures\t: fp asimd sve bf16\n"
NO_AMX = HostFacts("x86_64", cpu_flags(SKYLAKE), gpu=False)
QUANT = {"quant_method": "compressed-tensors", "format": "pack-quantized"}


def test_cpu_flags_read_from_the_first_processor():
    assert cpu_flags(SKYLAKE) == {"fpu", "sse2", "avx2", "avx512f", "avx512bw"}
    assert "amx_tile" in cpu_flags(SAPPHIRE) and "sve" in cpu_flags(GRAVITON)
    assert cpu_flags("") == frozenset()


@pytest.mark.parametrize(
    ("machine", "cpuinfo", "gpu", "refused"),
    [
        ("x86_64", SKYLAKE, False, True),  # no AMX: no quantized fused-MoE kernel
        ("x86_64", SAPPHIRE, False, False),  # AMX
        ("aarch64", GRAVITON, False, False),  # Arm
        ("x86_64", SKYLAKE, True, False),  # a GPU: vLLM's GPU build
        ("riscv64", "", False, True),
    ],
)
def test_blocker_needs_a_gpu_amx_or_arm(machine, cpuinfo, gpu, refused):
    blocker = quantized_moe_blocker(HostFacts(machine, cpu_flags(cpuinfo), gpu))
    assert (blocker is not None) == refused
    if refused and machine == "x86_64":
        assert "no amx_tile flag" in blocker


def test_this_machines_facts_match_proc_cpuinfo():
    facts = host_facts()
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    assert ("amx_tile" in facts.cpu_flags) == ("amx_tile" in text.split("\n\n")[0])


def _quantized_moe(folder: Path, **config) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **config}))
    return folder


def test_only_quantized_moe_configs_are_refused(tmp_path):
    options = LmEvalOptions(tasks=("arc_easy",), engine="vllm")
    quantized = _quantized_moe(tmp_path / "q", num_experts=8, quantization_config=QUANT)
    plain = _quantized_moe(tmp_path / "p", num_experts=8)
    dense = _quantized_moe(tmp_path / "d", quantization_config=QUANT)  # no experts: not ours to judge
    check_vllm_folders(options, [str(plain), str(dense)])
    check_vllm_folders(LmEvalOptions(tasks=("arc_easy",), engine="hf"), [str(quantized)])
    with pytest.raises(MoePruneError, match=r"compressed-tensors MoE experts on this machine: .*no amx_tile"):
        vllm_host.refuse_quantized_moe(quantized, json.loads((quantized / "config.json").read_text()), "x", NO_AMX)


def test_serve_check_refuses_before_vllm_starts(tmp_path, monkeypatch):
    """On this machine (no AMX, no GPU) its own facts refuse; elsewhere those of one like it."""
    if quantized_moe_blocker(host_facts()) is None:
        monkeypatch.setattr(vllm_host, "host_facts", lambda: NO_AMX)
    folder = _quantized_moe(tmp_path / "q", n_routed_experts=8, quantization_config=QUANT)
    # no vLLM Python is looked for: the refusal comes first
    result = run_cli("serve-check", folder, "--vllm-python", "/nonexistent/python", ok=False)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "vLLM cannot serve" in lines[0], result.output
    assert "serve-check it on a GPU, an x86 CPU with AMX or an Arm CPU" in lines[0]
    assert "moeprune eval --engine hf" in lines[0]
