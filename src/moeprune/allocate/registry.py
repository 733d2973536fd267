"""What decides an allocation: how many routed experts each MoE layer loses (or keeps whole)."""

from __future__ import annotations

from dataclasses import dataclass

from moeprune.config import Registry


@dataclass(frozen=True)
class Allocator:
    name: str
    help: str
    needs: tuple[str, ...] = ()


ALLOCATIONS: Registry[Allocator] = Registry("allocation", "allocation")
