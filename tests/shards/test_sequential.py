"""Layer-by-layer observation equals the all-in-memory observer, holding about one layer at a time."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_observe import calibration

from moeprune.checkpoint import load_model, load_pretrained, save_pretrained
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel, supported_families
from moeprune.models.factory import save_tiny_model, tiny_model
from moeprune.models.reshape import drop_experts
from moeprune.observe.observer import observe
from moeprune.observe.stats import MOMENT_FIELDS, NEURON_FIELDS, SUM_FIELDS, ExpertStats
from moeprune.runtime.device import Placement
from moeprune.shards.sequential import SequentialOptions, observe_sequential

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

# longer than the tiny models' sliding window and attention chunk (16); batch size 2 pads two batches
LENGTHS = (40, 23, 7, 33, 12)


def assert_close_stats(expected: ExpertStats, actual: ExpertStats) -> None:
    """Identical counts; every other statistic within 1e-5 of its layer's largest magnitude."""
    assert (expected.tokens, expected.samples) == (actual.tokens, actual.samples)
    for a, b in zip(expected.layers, actual.layers, strict=True):
        assert a.layer == b.layer
        assert torch.equal(a.count, b.count)
        for name in SUM_FIELDS[1:] + MOMENT_FIELDS + NEURON_FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            if x is None:
                assert y is None
                continue
            scale = float(x.abs().max().clamp_min(1e-30))
            assert float((x - y).abs().max()) <= 1e-5 * scale, (a.layer, name)


@pytest.mark.parametrize("family", supported_families())
def test_sequential_equals_in_memory(family, tmp_path):
    save_tiny_model(family, tmp_path)
    data = calibration(LENGTHS)
    expected = observe(MoEModel(load_pretrained(tmp_path)), data, batch_size=2, neurons=True, progress=False)
    try:
        actual = observe_sequential(tmp_path, data, batch_size=2, neurons=True, progress=False)
    except MoePruneError as exc:  # layers that hand state to the next one are refused, in one line
        assert "cannot be run one at a time" in str(exc) and "\n" not in str(exc)
        pytest.skip(f"{family}: --sequential refused: {exc}")
    assert_close_stats(expected, actual)


@pytest.mark.parametrize("family", supported_families())
def test_the_outer_modules_never_hold_the_decoder_layers(family):
    """What is loaded before the layers (embedding, norm, rotary) holds none of them, also where
    the layers sit deeper than the base model's children (nemotron_h_omni: the wrapper's decoder
    is a causal LM around the backbone). Holding them, their buffers were materialised early and
    checked before their weights loaded: a NaN from uninitialised memory, now and then."""
    from moeprune.models.adapter import decoder_layers
    from moeprune.shards.sequential import _outer_modules

    model = tiny_model(family)
    container = decoder_layers(model)
    outer = _outer_modules(model)
    assert outer and not any(m is container for module in outer for m in module.modules())
    assert model.get_input_embeddings() in [m for module in outer for m in module.modules()]


def test_bf16_keeps_the_fp32_modules(tmp_path):
    """bf16 loads like from_pretrained: ERNIE's router and selection bias stay fp32."""
    save_tiny_model("ernie4_5_moe", tmp_path)
    data = calibration(LENGTHS)
    model, _ = load_model(tmp_path, dtype="bf16")
    expected = observe(MoEModel(model), data, batch_size=2, progress=False)
    bf16 = SequentialOptions(placement=Placement(torch.device("cpu"), torch.bfloat16))
    actual = observe_sequential(tmp_path, data, batch_size=2, options=bf16, progress=False)
    assert_close_stats(expected, actual)


def test_sharded_checkpoint_with_activations_on_disk(tmp_path):
    """A multi-shard checkpoint (index.json) of a hybrid family, activations offloaded to disk."""
    model_dir, scratch = tmp_path / "model", tmp_path / "scratch"
    scratch.mkdir()
    model = tiny_model("qwen3_next")
    model.save_pretrained(model_dir, max_shard_size="40KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    data = calibration(LENGTHS)
    expected = observe(MoEModel(model), data, batch_size=2, progress=False)
    options = SequentialOptions(offload_dir=scratch)
    actual = observe_sequential(model_dir, data, batch_size=2, progress=False, options=options)
    assert_close_stats(expected, actual)
    assert not any(scratch.iterdir())  # the temporary activations are removed


def test_moeprune_format_checkpoint(tmp_path):
    """Per-layer expert counts (moeprune's own checkpoint format) load layer by layer too."""
    model = tiny_model("deepseek_v3")
    moe = MoEModel(model)
    first, second = (m.index for m in moe.layers)
    drop_experts(moe, {first: [1, 5], second: [2, 3, 6, 7]})
    assert save_pretrained(model, tmp_path) == "moeprune"
    data = calibration(LENGTHS)
    expected = observe(MoEModel(load_pretrained(tmp_path)), data, batch_size=2, progress=False)
    actual = observe_sequential(tmp_path, data, batch_size=2, progress=False)
    assert [s.num_experts for s in actual.layers] == [6, 4]
    assert_close_stats(expected, actual)


_MEASURE = textwrap.dedent(
    """
    import sys
    import torch
    torch.set_num_threads(1)
    from moeprune.shards.sequential import observe_sequential
    from helpers import calibration

    def status(field):  # VmHWM is this process's own peak (ru_maxrss would include the parent's at fork)
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))

    data = calibration((48, 30, 17, 48))
    observe_sequential(sys.argv[2], data, batch_size=2, progress=False)  # warm-up: lazy imports, kernels
    try:
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak to the current size
    except OSError:
        pass
    base = status("VmRSS")
    observe_sequential(sys.argv[1], data, batch_size=2, progress=False)
    print(status("VmHWM") - base)
    """
)


def test_peak_memory_is_about_one_layer(tmp_path):
    """Peak RSS growth during observe_sequential stays far below the model's weights (16 layers).

    Measured in a fresh process: its peak RSS minus the resident size before the run (a warm-up
    run on a tiny model first loads what is loaded lazily; where the peak cannot be reset, the
    warm-up's peak counts too, which only overestimates the growth).
    """
    shape = dict(hidden_size=256, num_experts=16, moe_intermediate_size=256, head_dim=64, mlp_only_layers=[])
    big = save_tiny_model("qwen3_moe", tmp_path / "big", num_hidden_layers=16, **shape)
    small = save_tiny_model("qwen3_moe", tmp_path / "small", num_hidden_layers=2, **shape)
    weights = sum(f.stat().st_size for f in big.glob("*.safetensors"))
    layer = weights / 16
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(big), str(small)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[1],  # tests/, where helpers.py (calibration) lives
    )
    assert done.returncode == 0, done.stderr[-3000:]
    growth = int(done.stdout.split()[-1])
    print(
        f"weights {weights / 2**20:.0f} MiB, layer {layer / 2**20:.1f} MiB, peak growth {growth / 2**20:.0f} MiB"
    )
    assert growth < 0.35 * weights, (growth, weights)  # measured: ~3 layers (conversion copies)
