"""What a pruned model costs: parameters (total, routed, active per token), disk bytes, load memory.

Why measure loading: non-uniform results load through moeprune's skeleton-then-narrow path,
whose transient peak a parameter count does not show. The peak is the growth of this process's
resident set while loading, read from ``/proc/self/status`` (Linux): the high-water mark is reset
first when the kernel allows it, else a thread samples the resident size. Elsewhere it is None. A tiny model of the same family is loaded once first, so
library start-up costs are not charged to the first model.
"""

from __future__ import annotations

import functools
import re
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from moeprune.checkpoint import load_model
from moeprune.checkpoint.structure import read_config_dict
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.models import MoEModel
from moeprune.models.factory import moe_families, save_tiny_model
from moeprune.quant.support import quantization_of
from moeprune.surgery.parameters import routed_parameters

T = TypeVar("T")
_STATUS = Path("/proc/self/status")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _status_kib(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _reset_high_water_mark() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class _Sampler(threading.Thread):
    """Polls the resident size when the high-water mark cannot be reset."""

    def __init__(self, interval: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak, self.stop = interval, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _status_kib("VmRSS") or 0)
            time.sleep(self.interval)


def measure_peak(load: Callable[[], T]) -> tuple[T, dict[str, object]]:
    """Run `load()`; return its result and the peak resident-set growth in bytes while it ran
    (plus, with GPUs, the peak GPU memory allocated by torch on each of them)."""
    gpus = range(torch.cuda.device_count()) if torch.cuda.is_available() else range(0)
    gpu_before = {}
    for i in gpus:
        torch.cuda.reset_peak_memory_stats(i)
        gpu_before[i] = torch.cuda.memory_allocated(i)
    result, info = _host_peak(load)
    if gpu_before:
        info["gpu_load_peak_bytes"] = {
            f"cuda:{i}": torch.cuda.max_memory_allocated(i) - start for i, start in gpu_before.items()
        }
    return result, info


def _host_peak(load: Callable[[], T]) -> tuple[T, dict[str, object]]:
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    if before is None:
        result = load()
        return result, {"load_peak_bytes": None, "load_s": time.perf_counter() - start, "peak_method": "n/a"}
    sampler = None if _reset_high_water_mark() else _Sampler()
    if sampler:
        sampler.start()
    try:
        result = load()
    finally:
        if sampler:
            sampler.stop.set()
            sampler.join()
    peak = sampler.peak if sampler else _status_kib("VmHWM") or 0
    info: dict[str, object] = {
        "load_peak_bytes": max(0, peak - before) * 1024,
        "load_s": round(time.perf_counter() - start, 3),
        "peak_method": "sampled VmRSS" if sampler else "VmHWM after reset",
    }
    return result, info


@functools.cache
def warm_up_loading(model_type: str) -> None:
    """Load a tiny model of the family once, with a tokenizer, so that one-time library setup
    (lazy imports, allocator arenas) is not charged to the first real model measured."""
    if model_type not in moe_families():
        return
    with tempfile.TemporaryDirectory() as folder:
        save_tiny_model(model_type, folder)
        byte_tokenizer().save_pretrained(folder)
        load_model(folder)


def disk_bytes(path: str | Path) -> dict[str, int]:
    """Bytes of the checkpoint's files (subfolders, e.g. a demo corpus, are not part of it) and of its weights."""
    files = [p for p in Path(path).iterdir() if p.is_file()]
    return {
        "disk_bytes": sum(p.stat().st_size for p in files),
        "weight_bytes": sum(p.stat().st_size for p in files if p.name.endswith(_WEIGHT_SUFFIXES)),
    }


def model_size(moe: MoEModel, path: str | Path | None, load_info: dict[str, object] | None = None) -> dict:
    """Parameter counts, bytes on disk (when loaded from a folder) and the measured load peak."""
    dtype = next(moe.model.parameters()).dtype
    size: dict[str, object] = {
        "parameters": routed_parameters(moe),  # packed layers (novices, per-expert widths) included
        "dtype": str(dtype).removeprefix("torch."),
    }
    size["experts_per_layer"] = {str(m.index): m.num_experts for m in moe.layers}
    if path is not None:
        size.update(disk_bytes(path))
        stored_as = quantization_of(read_config_dict(Path(path)))
        if stored_as is not None:  # "dtype" is the model's in memory; on disk it is quantized
            size["quantization"] = stored_as
    size.update(load_info or {})
    return size
