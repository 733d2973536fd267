"""Can vLLM run a quantized checkpoint's MoE experts on this machine? Asked before vLLM starts.

vLLM's CPU build (0.32) has quantized fused-MoE kernels only for some CPUs: int4 weight-only
(compressed-tensors w4a16), int8, fp8 and MXFP4 experts run on x86 only with AMX (Intel Sapphire
Rapids and later: `fused_moe/experts/cpu_moe.py`'s `CPUExpertsInt4` and its siblings check
`torch.cpu._is_amx_tile_supported()`), int4 and int8 ones on Arm too (`cpu_int4_moe.py`,
`ArmCPUExpertsInt8`), and int4 on AMD Zen only through zentorch when that is installed. On any
other x86 CPU vLLM loads the model for a minute and then stops with a kernel-selection traceback
(on this project's test machine, which has no AMX, its WNA16 linear kernels already refuse a tiny
w8a16 or w4a16 result). So `serve-check` and `eval --engine vllm` refuse a quantized MoE folder
there in one sentence, saying what does run it; where a kernel family exists (AMX, Arm) a
scheme it lacks is still vLLM's to refuse.

The decision is a pure function of the facts (`quantized_moe_blocker`), read from /proc/cpuinfo,
`platform.machine()` and the GPU device nodes by `host_facts`, so it is tested with fake inputs.
A GPU (an NVIDIA or AMD device node) lets it through: vLLM's GPU builds run these kernels.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeprune.errors import MoePruneError

CPUINFO = Path("/proc/cpuinfo")
GPU_NODES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's driver, AMD's ROCm driver
ARM = ("aarch64", "arm64")
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


@dataclass(frozen=True)
class HostFacts:
    """What decides whether vLLM runs quantized MoE kernels here."""

    machine: str  # platform.machine(): x86_64, aarch64, ...
    cpu_flags: frozenset[str]  # the first processor's `flags` line of /proc/cpuinfo
    gpu: bool  # a GPU device node is present


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The `flags` (x86) or `Features` (Arm) of the first processor in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def host_facts() -> HostFacts:
    """This machine's facts (no /proc/cpuinfo: no flags)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        text = ""
    return HostFacts(platform.machine().lower(), cpu_flags(text), any(Path(p).exists() for p in GPU_NODES))


def quantized_moe_blocker(facts: HostFacts) -> str | None:
    """Why vLLM cannot run quantized fused-MoE experts on a machine with `facts` (a clause), or
    None where it can: a GPU, an Arm CPU, or an x86 CPU with AMX (the `amx_tile` flag)."""
    if facts.gpu or facts.machine in ARM or "amx_tile" in facts.cpu_flags:
        return None
    if facts.machine in ("x86_64", "amd64", "i686"):
        return "its CPU build runs quantized fused-MoE experts only on x86 CPUs with AMX, and this one has no amx_tile flag"
    return f"its CPU build has no quantized fused-MoE experts for {facts.machine or 'this'} CPUs"


def quantization_method(config: dict[str, Any]) -> str | None:
    """The quant_method of a MoE config's quantization (a wrapper's text config included), or None
    for a full-precision or dense config."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    quant = config.get("quantization_config") or (text or {}).get("quantization_config")
    if not quant:
        return None
    moe = config.get("moeprune") is not None or any(
        (config.get(k) or (text or {}).get(k)) for k in EXPERT_COUNT_KEYS
    )
    if not moe:
        return None
    return str(quant.get("quant_method", "quantized")) if isinstance(quant, dict) else "quantized"


def refuse_quantized_moe(
    folder: str | Path, config: dict[str, Any], action: str, facts: HostFacts | None = None
) -> None:
    """Refuse, in one sentence, to start vLLM on the quantized MoE checkpoint `folder` where vLLM
    has no kernel for its experts; `action` says what to run elsewhere ("serve-check it")."""
    method = quantization_method(config)
    if method is None:
        return
    blocker = quantized_moe_blocker(facts or host_facts())
    if blocker is None:
        return
    raise MoePruneError(
        f"vLLM cannot serve {folder}'s {method} MoE experts on this machine: {blocker}; {action} on a GPU, "
        "an x86 CPU with AMX or an Arm CPU, or evaluate it here with `moeprune eval --engine hf` "
        "(moeprune decodes the quantized weights itself)"
    )
