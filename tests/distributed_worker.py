"""Launched by test_distributed.py under torchrun: each rank saves its reduced statistics.

Arguments: output folder, a tiny checkpoint of SEQUENTIAL_FAMILY (for the layer-by-layer observer).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from helpers import calibration  # tests/helpers.py, beside this file (no test module: see there)
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.observe.distributed import observe_distributed
from moeprune.runtime.distributed import init_distributed
from moeprune.shards.sequential import observe_sequential_distributed

FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss")
SEQUENTIAL_FAMILY = "qwen3_next"
LENGTHS = (9, 6, 4, 12, 3, 7, 5)  # batch size 2: four batches, the last one partial
BATCH_SIZE = 2


def main(out: Path, checkpoint: Path) -> None:
    torch.set_num_threads(1)
    rank, world = init_distributed()
    assert world == 2, world
    for family in FAMILIES:
        moe = MoEModel(tiny_model(family))
        stats = observe_distributed(
            moe, calibration(LENGTHS), batch_size=BATCH_SIZE, neurons=True, progress=False
        )
        stats.save(str(out / f"{family}-rank{rank}.pt"))
    data = calibration(LENGTHS)  # the layer-by-layer observer, split over ranks the same way
    stats = observe_sequential_distributed(
        checkpoint, data, batch_size=BATCH_SIZE, neurons=True, progress=False
    )
    stats.save(str(out / f"sequential-rank{rank}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
