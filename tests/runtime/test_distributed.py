"""Data-parallel observation under torchrun (2 gloo processes on CPU) equals one process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_observe import calibration

from distributed_worker import BATCH_SIZE, FAMILIES, LENGTHS, SEQUENTIAL_FAMILY
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel
from moeprune.models.factory import save_tiny_model, tiny_model
from moeprune.observe.distributed import _flatten, _unflatten, observe_distributed
from moeprune.observe.observer import observe
from moeprune.observe.stats import GATED_FIELDS, MOMENT_FIELDS, NEURON_FIELDS, SUM_FIELDS, ExpertStats
from moeprune.runtime import device
from moeprune.runtime.device import Placement
from moeprune.runtime.distributed import shard_data
from moeprune.shards.sequential import observe_sequential

pytestmark = pytest.mark.distributed  # starts torchrun process groups


def assert_same_stats(a: ExpertStats, b: ExpertStats, rtol: float = 1e-12) -> None:
    assert a.tokens == b.tokens
    for x, y in zip(a.layers, b.layers, strict=True):
        assert x.layer == y.layer
        assert torch.equal(x.count, y.count)
        for name in SUM_FIELDS[1:] + MOMENT_FIELDS + NEURON_FIELDS + GATED_FIELDS:
            torch.testing.assert_close(getattr(x, name), getattr(y, name), rtol=rtol, atol=1e-14)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shards_partition_the_batches():
    data = calibration(LENGTHS)
    full = [b.input_ids for b in data.batches(BATCH_SIZE, 0)]
    shards = [list(shard_data(data, BATCH_SIZE, r, 2).batches(BATCH_SIZE, 0)) for r in range(2)]
    assert [len(s) for s in shards] == [2, 2]
    for r, shard in enumerate(shards):
        for j, batch in enumerate(shard):
            assert torch.equal(batch.input_ids, full[r + 2 * j])


def test_merging_shards_in_rank_order_equals_one_pass():
    """The reduction's arithmetic, without processes: flatten, unflatten and merge per rank."""
    moe = MoEModel(tiny_model("qwen2_moe"))
    data = calibration(LENGTHS)
    whole = observe(moe, data, batch_size=BATCH_SIZE, neurons=True, progress=False)
    parts = [
        observe(moe, shard_data(data, BATCH_SIZE, r, 3), batch_size=BATCH_SIZE, neurons=True, progress=False)
        for r in range(3)
    ]
    layers, tokens = _unflatten(_flatten(parts[0]), parts[0])
    for part in parts[1:]:
        other, n = _unflatten(_flatten(part), part)
        for mine, theirs in zip(layers, other):
            mine.merge(theirs)
        tokens += n
    assert_same_stats(whole, ExpertStats(layers=layers, tokens=tokens))


def test_not_distributed_is_plain_observe():
    moe = MoEModel(tiny_model("olmoe"))
    data = calibration(LENGTHS)
    a = observe_distributed(moe, data, batch_size=BATCH_SIZE, progress=False)
    b = observe(moe, data, batch_size=BATCH_SIZE, progress=False)
    assert_same_stats(a, b, rtol=0)


def test_torchrun_two_gloo_ranks_equal_one_process(tmp_path: Path):
    out, checkpoint = tmp_path / "out", save_tiny_model(SEQUENTIAL_FAMILY, tmp_path / "checkpoint")
    out.mkdir()
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "CUDA_VISIBLE_DEVICES": "",  # gloo on CPU even on a GPU machine
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(Path(__file__).parents[1] / "distributed_worker.py"), str(out), str(checkpoint),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    data = calibration(LENGTHS)
    for family in FAMILIES:
        reference = observe(
            MoEModel(tiny_model(family)), data, batch_size=BATCH_SIZE, neurons=True, progress=False
        )
        check_ranks(reference, [out / f"{family}-rank{r}.pt" for r in range(2)])
    reference = observe_sequential(checkpoint, data, batch_size=BATCH_SIZE, neurons=True, progress=False)
    check_ranks(reference, [out / f"sequential-rank{r}.pt" for r in range(2)])


def check_ranks(reference: ExpertStats, files: list[Path]) -> None:
    ranks = [ExpertStats.load(str(f)) for f in files]
    assert_same_stats(ranks[0], ranks[1], rtol=0)  # every rank holds the same result
    for x, y in zip(ranks[0].layers, ranks[1].layers, strict=True):  # rank 0's probe tokens (merge)
        assert x.probe is not None and x.probe.shape[0] > 0 and torch.equal(x.probe, y.probe)
    assert_same_stats(reference, ranks[0])
    assert (ranks[0].samples, ranks[0].data_fingerprint) == (reference.samples, reference.data_fingerprint)


def test_placement_defaults(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Placement.choose(None, None) == Placement(torch.device("cpu"), torch.float32, None)
    assert Placement.choose("cpu", "bf16") == Placement(torch.device("cpu"), torch.bfloat16, None)
    with pytest.raises(MoePruneError, match="0 visible CUDA GPU.*use the cpu") as caught:
        Placement.choose("cuda", None)  # a clear line, not torch's "not compiled with CUDA" traceback
    assert caught.value.options == ("device",)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert Placement.choose("cuda:1", None).device == torch.device("cuda", 1)
    with pytest.raises(MoePruneError, match="2 visible CUDA GPU"):
        Placement.choose("cuda:2", None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert Placement.choose(None, None) == Placement(torch.device("cuda", 1), torch.bfloat16, None)
    assert Placement.choose(None, "fp32").dtype == torch.float32


def test_device_map_auto_needs_accelerate(monkeypatch):
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MoePruneError, match="accelerate"):
        Placement.choose("auto", None)


def test_more_ranks_than_gpus_is_one_clear_line(monkeypatch):
    """NCCL runs one rank per GPU; two ranks on one GPU would fail deep inside CUDA or NCCL instead.
    Both ways in are checked: choosing the rank's device, and joining the process group."""
    from moeprune.runtime import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *a, **k: pytest.fail("joined a group"))
    expected = r"than the 1 visible CUDA GPU\(s\) \(local rank 1\): use --nproc_per_node 1"
    with pytest.raises(MoePruneError, match=expected):
        Placement.choose(None, None)
    with pytest.raises(MoePruneError, match=expected):
        distributed.init_distributed()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert Placement.choose(None, None).device == torch.device("cuda", 1)
