"""Before loading: do the joint precision search's fake-quantized copies fit in memory?

`prune --quantize auto:A,B --target-size T --allocation evo` without `--sparsity`
(quantize/evo.py) moves any layer to any scheme from one candidate to the next, so its
`LayerSwap` (quantize/choice.py) keeps every routed expert's round-to-nearest copy once per scheme,
in the model's dtype, beside the model for the whole search. With two schemes that is twice the
model's routed-expert bytes: on a model that fills the RAM the OS would kill the run after the
load and the teacher pass, so it is refused in one line before anything is loaded. The per-layer
choice at a given `--sparsity` (`measure_losses`) quantizes one layer at a time and drops its
copies, so it is the way out beside fewer schemes or more memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import moeprune.search.forms  # noqa: F401 - the searches register (search/registry.py)
import moeprune.search.gradient  # noqa: F401
from moeprune.config import PruneConfig
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.quantize.choice import expert_weights
from moeprune.quantize.options import QuantizeOptions
from moeprune.runtime.device import Placement
from moeprune.search.registry import searches_schemes
from moeprune.surgery import lowrank
from moeprune.surgery.registry import ResolvedConfig


@dataclass(frozen=True)
class JointMemory:
    """What the joint search holds: the copies (bytes), the model (bytes), and the memory they are
    checked against (None: on an accelerator, not checked here)."""

    copies: int
    schemes: int
    model: int
    memory: int | None

    def describe(self) -> dict[str, int | None]:
        return {
            "joint_copies_bytes": self.copies,
            "joint_copies_schemes": self.schemes,
            "joint_model_bytes": self.model,
            "joint_memory_bytes": self.memory,
        }


def joint_copies_bytes(meta: MoEModel, schemes: int, dtype: torch.dtype) -> int:
    """Bytes of every routed expert's fake-quantized copy, once per scheme, in `dtype` (`meta` may
    be the meta skeleton: its shapes only)."""
    element = torch.empty((), dtype=dtype).element_size()
    weights = (p for i in range(len(meta.layers)) for p in expert_weights(meta, i).values())
    return schemes * element * sum(p.numel() for p in weights)


def model_bytes(meta: MoEModel, dtype: torch.dtype) -> int:
    """Bytes of the model loaded in `dtype` (floating tensors cast, others as they are)."""
    element = torch.empty((), dtype=dtype).element_size()
    tensors = [*meta.model.parameters(), *meta.model.buffers()]
    return sum(t.numel() * (element if t.is_floating_point() else t.element_size()) for t in tensors)


def check_joint_memory(
    meta: MoEModel,
    config: PruneConfig,
    quantize: QuantizeOptions | None,
    placement: Placement,
    memory: int | None = None,
) -> JointMemory | None:
    """The joint evo search's memory (None when the job runs no such search), refused in one line
    when the copies and the model exceed `memory` (default: this machine's RAM, as the novice
    moments' check reads it). On an accelerator the copies live in its memory: not checked here."""
    if (
        quantize is None
        or not quantize.joint
        or not quantize.candidates
        or not searches_schemes(ResolvedConfig.of(config))
    ):
        return None
    schemes = len(quantize.candidates)
    copies = joint_copies_bytes(meta, schemes, placement.dtype)
    model = model_bytes(meta, placement.dtype)
    if placement.device.type != "cpu" or placement.device_map is not None:
        return JointMemory(copies, schemes, model, None)
    memory = lowrank.physical_memory() if memory is None else memory
    if memory is not None and copies + model > memory:
        raise MoePruneError(
            f"the joint precision search (--allocation evo without --sparsity) holds every routed "
            f"expert's fake-quantized copy once per scheme: {copies / 2**30:,.2f} GiB for {schemes} "
            f"schemes ({copies:,} bytes) beside the {model / 2**30:,.2f} GiB model, more than this "
            f"machine's {memory / 2**30:,.2f} GiB; name fewer schemes, give --sparsity (the per-layer "
            "choice quantizes one layer at a time), or run with more memory",
            options=("quantize", "allocation", "sparsity"),
        )
    return JointMemory(copies, schemes, model, memory)
