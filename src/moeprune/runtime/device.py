"""Where a model lives, where its inputs go and in which dtype: one object for every stage.

Loading, observation, the search and evaluation all ask the same `Placement`, so a model that
accelerate split over several GPUs, a model on one GPU and a model on the CPU are handled in one
place: inputs go to the embedding's device (the first GPU of a split model; each decoder layer's
hook moves its inputs on), and caches that may not fit the GPU (the search's teacher
distributions) ask `cache_device`. Nothing here knows about pruning.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from moeprune.errors import MoePruneError

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_LOG = logging.getLogger(__name__)
SPREAD = "auto"  # the device that spreads one model over every GPU (accelerate's device_map)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A torch dtype from its name ("bf16", "float32", ...); None is fp32."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype or torch.float32
    if dtype not in DTYPES:
        raise MoePruneError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}", options=("dtype",))
    return DTYPES[dtype]


def input_device(model: nn.Module) -> torch.device:
    """Where input ids go: the embedding's device (the first GPU when accelerate splits a model)."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    weight = getattr(embeddings, "weight", None)
    return weight.device if weight is not None else next(model.parameters()).device


def precision_lost(compute: torch.dtype, save: torch.dtype) -> str | None:
    """Why weights computed in `compute` and saved as `save` lose bits, or None when they keep them.

    Surgery writes the loaded tensors, so a model loaded in bf16 (the GPU default) and saved as its
    stored fp32 holds bf16-rounded values in fp32 bytes: twice the size for bf16's precision.
    """
    if compute == save or torch.finfo(compute).bits > torch.finfo(save).bits:
        return None
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return (
        f"the model runs in {name.get(compute, compute)} and is saved as {name.get(save, save)}: "
        f"the saved weights hold {name.get(compute, compute)}-rounded values; pass "
        f"--dtype {name.get(save, save)} to keep every bit, or --save-dtype {name.get(compute, compute)} "
        "to write the bytes they hold"
    )


def local_rank_gpu() -> int:
    """This process's GPU: torchrun's LOCAL_RANK (0 outside torchrun), checked against the GPUs.

    NCCL runs one rank per GPU; more ranks on a node than GPUs would fail later, deep inside CUDA
    or NCCL, with a traceback per rank.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank and local_rank >= visible:
        raise MoePruneError(
            f"torchrun started more ranks on this node than the {visible} visible CUDA GPU(s) "
            f"(local rank {local_rank}): use --nproc_per_node {max(visible, 1)}, or "
            "CUDA_VISIBLE_DEVICES= to run the ranks on the CPU (gloo)"
        )  # torchrun's option, not moeprune's: no `options`
    return local_rank


@dataclass(frozen=True)
class Placement:
    """A model's devices and dtype.

    `device` is where inputs go; `device_map` is "auto" when accelerate splits the model over
    every visible GPU (then `device` is the first GPU).
    """

    device: torch.device
    dtype: torch.dtype
    device_map: str | None = None

    @classmethod
    def choose(cls, device: str | None = None, dtype: str | torch.dtype | None = None) -> Placement:
        """The placement a user asked for, checked before anything is loaded.

        `device`: None picks the GPU (this rank's under torchrun) when there is one, else the CPU;
        "auto" spreads the model over every visible GPU (accelerate's device_map="auto"). `dtype`:
        None gives bf16 on GPUs and fp32 on the CPU.
        """
        device_map = None
        if device == SPREAD and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise MoePruneError(
                "device 'auto' splits one model over every GPU, but under torchrun each rank holds its own copy: "
                "leave the device unset (each rank then takes its own GPU, cuda:LOCAL_RANK)",
                options=("device",),
            )
        if device == SPREAD:
            if importlib.util.find_spec("accelerate") is None:
                raise MoePruneError(
                    "device 'auto' uses accelerate's device_map='auto': pip install accelerate",
                    options=("device",),
                )
            if torch.cuda.is_available():
                device_map, device = "auto", "cuda:0"
            else:
                _LOG.warning("device 'auto': no GPU is visible, so the model stays on the CPU")
                device = "cpu"
        elif device == "cuda" or (device is None and torch.cuda.is_available()):
            device = f"cuda:{local_rank_gpu()}"  # under torchrun: this rank's GPU
        elif device is None:
            device = "cpu"
        try:
            resolved = torch.device(device)
        except RuntimeError:
            raise MoePruneError(
                f"unknown device {device!r}; use cpu, cuda, cuda:N or auto", options=("device",)
            ) from None
        if resolved.type == "cuda" and not device_map:
            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if (resolved.index or 0) >= visible:
                raise MoePruneError(
                    f"device {device}: this machine has {visible} visible CUDA GPU(s)"
                    + (" (or this torch build has no CUDA)" if visible == 0 else "")
                    + "; use the cpu, or a GPU index below the count",
                    options=("device",),
                )
        chosen = (
            (torch.bfloat16 if resolved.type == "cuda" else torch.float32)
            if dtype is None
            else resolve_dtype(dtype)
        )
        return cls(resolved, chosen, device_map)

    @classmethod
    def of(cls, model: nn.Module) -> Placement:
        """The placement of a loaded model."""
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        split = len({p.device for p in model.parameters()}) > 1
        return cls(input_device(model), dtype, "auto" if split else None)

    def cache_device(self, nbytes: int, share: float = 0.25, what: str = "a cache") -> torch.device:
        """Where `nbytes` of reusable data should live: the GPU when it fits in `share` of the free
        memory there, else the CPU (rows then cross to the GPU when used)."""
        if self.device.type != "cuda":
            return self.device
        free, _ = torch.cuda.mem_get_info(self.device)
        if nbytes <= share * free:
            return self.device
        _LOG.warning(
            "%s needs %.1f GiB, more than %d%% of the free GPU memory: keeping it on the CPU",
            what,
            nbytes / 2**30,
            int(share * 100),
        )
        return torch.device("cpu")


def room_for_a_copy(model: nn.Module, share: float = 0.5) -> bool:
    """Whether a second copy of `model` fits in `share` of the memory free where it lives (one
    device; a model split over several, or on a device that does not say, has no room)."""
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        return False
    (device,) = devices
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return need <= share * free
    if device.type != "cpu":
        return False
    try:
        with open("/proc/meminfo") as info:
            free = next(int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return False
    return need <= share * free
