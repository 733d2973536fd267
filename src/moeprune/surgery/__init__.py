"""What happens to chosen experts: drop (virtual and physical), and later novices and neurons."""

from __future__ import annotations

from moeprune.surgery.drop import drop_experts, kept_experts, mask_experts

__all__ = ["drop_experts", "kept_experts", "mask_experts"]
