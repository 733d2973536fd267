"""NaN and infinity never pass silently: one row per case, each naming the tensor, model or layer.

The corruptions: NaN in an expert's weights, NaN in an attention weight, inf in a router row, and
finite weights large enough that a layer's activations overflow (what bf16/fp16 runs hit). Each is
run through calibration (in memory and layer by layer), evaluation (every metric that runs the
models) and the pieces under them (weight scan, fitness, speculative decoding, JSON).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_observe import calibration

from moeprune.allocate.fitness import FitnessAccumulator, TeacherCache
from moeprune.cli.main import main
from moeprune.config import DataOptions
from moeprune.data.tokenizer import byte_tokenizer
from moeprune.errors import MoePruneError
from moeprune.evaluate import EvalOptions, evaluate_models, parse_metrics
from moeprune.evaluate.divergence import _exp
from moeprune.evaluate.speculative import SpecOptions, SpecStats, acceptance
from moeprune.models import MoEModel
from moeprune.models.factory import tiny_model
from moeprune.observe.observer import observe
from moeprune.report.eval_report import write_report
from moeprune.runtime.finite import NonFiniteError, check_finite_logits, check_finite_weights
from moeprune.shards.sequential import observe_sequential

pytestmark = pytest.mark.unit  # fast, small inputs: `pytest -m unit` runs them all in about a minute

Edit = Callable[[torch.nn.Module], None]


def _nan_expert(model) -> None:  # every expert of decoder layer 2, so any routed token meets it
    model.model.layers[2].mlp.experts.down_proj[:, 4, 5] = float("nan")


def _nan_attention(model) -> None:
    model.model.layers[1].self_attn.o_proj.weight[1, 2] = float("nan")


def _inf_router(model) -> None:
    model.model.layers[2].mlp.gate.weight[5, 1] = float("inf")


def _overflow(model) -> None:  # finite weights whose products overflow fp32
    model.model.layers[1].self_attn.v_proj.weight.fill_(3e38)


@dataclass
class Corruption:
    name: str
    edit: Edit
    in_memory: tuple[str, ...]  # message fragments from observe()
    layer_by_layer: tuple[str, ...]  # from observe_sequential()


CORRUPTIONS = [
    Corruption(
        "NaN weight in an expert", _nan_expert,
        ("of decoder layer 2 produced NaN outputs",),
        ("parameter model.layers.2.mlp.experts.down_proj (decoder layer 2) holds NaN at index [0, 4, 5]",),
    ),
    Corruption(
        "NaN weight in attention", _nan_attention,
        ("hidden states entering the MoE block of decoder layer 1 hold NaN", "model.layers.1.self_attn.o_proj"),
        ("parameter model.layers.1.self_attn.o_proj.weight (decoder layer 1) holds NaN at index [1, 2]",),
    ),
    Corruption(
        "inf in the router", _inf_router,
        ("the router of decoder layer 2 returned NaN routing weights", "model.layers.2.mlp.gate"),
        ("parameter model.layers.2.mlp.gate.weight (decoder layer 2) holds inf at index [5, 1]",),
    ),
    Corruption(
        "activations overflow", _overflow,
        ("hidden states entering the MoE block of decoder layer 1", "decoder layer 1 (model.layers.1.self_attn.v_proj)"),
        ("hidden states entering the MoE block of decoder layer 1", "decoder layer 1 (model.layers.1.self_attn.v_proj)"),
    ),
]  # fmt: skip
BY_NAME = {c.name: c for c in CORRUPTIONS}


def _model(edit: Edit | None = None, vocab_size: int = 259) -> torch.nn.Module:
    model = tiny_model("qwen3_moe", vocab_size=vocab_size, num_hidden_layers=4, mlp_only_layers=[]).eval()
    if edit is not None:
        with torch.no_grad():
            edit(model)
    return model


def _raises(fragments: tuple[str, ...], call: Callable[[], object]) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    return info.value


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A healthy tiny Qwen3-MoE and one corrupted copy per row, each with its tokenizer."""
    root, tokenizer = tmp_path_factory.mktemp("nonfinite"), byte_tokenizer()
    out = {}
    for name, edit in [("healthy", None), *((c.name, c.edit) for c in CORRUPTIONS)]:
        path = root / name.replace(" ", "-")
        _model(edit).save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "pairs.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": f" {2 * i}."}) for i in range(6))
    )
    return path


# ------------------------------------------------------------------------------------- calibration


@pytest.mark.parametrize("case", CORRUPTIONS, ids=lambda c: c.name)
def test_calibration_in_memory_stops_naming_the_layer(case):
    moe = MoEModel(_model(case.edit, vocab_size=96))
    _raises(case.in_memory, lambda: observe(moe, calibration((9, 6, 4)), batch_size=2, progress=False))


@pytest.mark.parametrize("case", CORRUPTIONS, ids=lambda c: c.name)
def test_calibration_layer_by_layer_stops_naming_the_tensor_or_layer(case, checkpoints):
    data = calibration((9, 6, 4))
    _raises(
        case.layer_by_layer,
        lambda: observe_sequential(checkpoints[case.name], data, batch_size=2, progress=False),
    )


def test_healthy_model_calibrates():
    stats = observe(MoEModel(_model(vocab_size=96)), calibration((9, 6, 4)), batch_size=2, progress=False)
    assert all(bool(torch.isfinite(layer.weight_sum).all()) for layer in stats.layers)


# ------------------------------------------------------------------------------------------ weights


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (
            _nan_expert,
            "parameter model.layers.2.mlp.experts.down_proj (decoder layer 2) holds NaN at index [0, 4, 5]",
        ),
        (
            _nan_attention,
            "parameter model.layers.1.self_attn.o_proj.weight (decoder layer 1) holds NaN at index [1, 2]",
        ),
        (_inf_router, "parameter model.layers.2.mlp.gate.weight (decoder layer 2) holds inf at index [5, 1]"),
        (
            lambda m: m.model.rotary_emb.inv_freq.__setitem__(3, float("nan")),
            "buffer model.rotary_emb.inv_freq holds NaN",
        ),
    ],
    ids=["expert", "attention", "router", "buffer"],
)
def test_check_finite_weights_names_the_first_bad_tensor(edit, fragment):
    check_finite_weights(_model())  # healthy: silent
    error = _raises((fragment, "my model:"), lambda: check_finite_weights(_model(edit), "my model"))
    assert error.options == ()  # no flag fixes corrupt weights


def test_weight_scan_reads_chunks_of_strided_and_bf16_tensors(monkeypatch):
    """Small chunks, a transposed (non-contiguous) bf16 weight: the index is still the logical one."""
    from moeprune.runtime import finite

    monkeypatch.setattr(finite, "_CHUNK", 7)
    layer = torch.nn.Linear(12, 10).to(torch.bfloat16)
    layer.weight = torch.nn.Parameter(layer.weight.detach().t().contiguous().t())  # [10, 12], strided
    assert not layer.weight.is_contiguous()
    check_finite_weights(layer)
    with torch.no_grad():
        layer.weight[8, 11] = float("-inf")
    _raises(("parameter weight holds inf at index [8, 11]",), lambda: check_finite_weights(layer))


def test_meta_tensors_are_skipped():
    with torch.device("meta"):
        check_finite_weights(torch.nn.Linear(4, 4))


# ------------------------------------------------------------------------------------- evaluation

EVAL_ROWS = [  # (corrupted side, corruption, metrics, fragments)
    ("reference", "NaN weight in an expert", "all",
     ("the reference ", "parameter model.layers.2.mlp.experts.down_proj (decoder layer 2) holds NaN")),
    ("model", "NaN weight in attention", "all",
     ("the model ", "parameter model.layers.1.self_attn.o_proj.weight (decoder layer 1) holds NaN")),
    ("model", "inf in the router", "all", ("the model ", "parameter model.layers.2.mlp.gate.weight", "holds inf")),
    ("reference", "activations overflow", "esap,kl",
     ("on data file", "the reference activations-overflow produced NaN logits",
      "decoder layer 1 (model.layers.1.self_attn.v_proj)")),
    ("model", "activations overflow", "nll", ("on data file", "the model activations-overflow produced NaN logits")),
    ("model", "activations overflow", "accept",
     ("speculative decoding on data file", "the model activations-overflow produced NaN logits while decoding",
      "decoder layer 1 (model.layers.1.self_attn.v_proj)")),
    ("reference", "activations overflow", "accept",
     ("speculative decoding on data file", "the reference activations-overflow produced NaN logits")),
    ("reference", "activations overflow", "routing",
     ("routing of the reference activations-overflow on data file", "MoE block of decoder layer 1")),
    ("model", "activations overflow", "layer-error",
     ("layer-error on data file", "decoder layer 1 of the model activations-overflow holds NaN")),
]  # fmt: skip


def _eval_options(pairs: Path, metrics: str, **kwargs) -> EvalOptions:
    data = DataOptions(sources=[str(pairs)], samples=None, max_length=64, batch_size=4)
    return EvalOptions(data=data, metrics=parse_metrics(metrics), spec_prompts=2, spec_tokens=6, **kwargs)


@pytest.mark.parametrize(("side", "corruption", "metrics", "fragments"), EVAL_ROWS, ids=lambda v: str(v)[:24])
def test_eval_stops_naming_model_data_and_layer(side, corruption, metrics, fragments, checkpoints, pairs):
    bad, good = str(checkpoints[corruption]), str(checkpoints["healthy"])
    model, reference = (good, bad) if side == "reference" else (bad, good)
    _raises(fragments, lambda: evaluate_models([model], reference, _eval_options(pairs, metrics)))


def test_eval_command_exits_with_the_error_and_writes_no_json(checkpoints, pairs, tmp_path):
    out = tmp_path / "report.json"
    args = ["eval", checkpoints["healthy"], "-r", checkpoints["activations overflow"], "--data", pairs,
            "--metrics", "kl", "--output", out, "--quiet"]  # fmt: skip
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    assert "the reference activations-overflow produced NaN logits" in result.output
    assert "(--dtype)" in result.output
    assert not out.exists()


def test_nan_reference_never_scores_kl_zero_or_esap_one():
    """Without the check a NaN teacher reads as p = 0 everywhere: KL 0 (and ESAP from NaN)."""
    logits = torch.randn(1, 4, 11)
    answer = torch.tensor([[False, True, True, True]])
    teacher = TeacherCache()
    _raises(("the full model produced NaN logits for sample 0",),
            lambda: teacher.add([0], torch.full_like(logits, math.nan), torch.zeros(1, 4, dtype=torch.long), answer))  # fmt: skip


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_candidate_logits_stop_the_fitness(bad):
    logits = torch.randn(1, 4, 11)
    answer = torch.tensor([[False, True, True, True]])
    teacher = TeacherCache()
    teacher.add([0], logits, torch.zeros(1, 4, dtype=torch.long), answer)
    candidate = logits.clone()
    candidate[0, 2, 3] = bad
    accumulator = FitnessAccumulator(teacher, "kl", label="candidate [2, 3]")
    kind = "NaN" if math.isnan(bad) else "inf"
    _raises(
        (f"candidate [2, 3] produced {kind} logits for sample 0",), lambda: accumulator.add([0], candidate)
    )


def test_padding_positions_are_not_checked():
    """Padding is never scored: a non-finite logit there is no error, one position earlier is."""
    logits = torch.zeros(1, 3, 5)
    logits[0, 2] = math.nan
    check_finite_logits(logits, "x", attention_mask=torch.tensor([[1, 1, 0]]))
    _raises(("x produced NaN logits (sample 0, position 2)",),
            lambda: check_finite_logits(logits, "x", attention_mask=torch.tensor([[1, 1, 1]])))  # fmt: skip


# ------------------------------------------------------------------------------------------- JSON


def _strict(text: str) -> dict:
    def refuse(constant: str):
        raise AssertionError(f"{constant} in the JSON")

    return json.loads(text, parse_constant=refuse)


def test_undefined_acceptance_is_null_with_a_note(checkpoints, pairs, tmp_path):
    """One new token per prompt leaves no room for a draft: accept_rate is null, never NaN."""
    out = tmp_path / "report.json"
    args = ["eval", checkpoints["healthy"], "-r", checkpoints["healthy"], "--data", pairs,
            "--metrics", "accept,esap", "--spec-tokens", "1", "--spec-prompts", "2", "--output", out, "--quiet"]  # fmt: skip
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = _strict(out.read_text())
    per_file = doc["models"][0]["per_data"][str(pairs)]
    assert per_file["accept_rate"] is None and per_file["esap"] == pytest.approx(1.0)
    assert any("accept_rate is null" in note for note in doc["notes"])
    assert SpecStats(gamma=2).to_dict()["accept_rate"] is None


def test_report_writer_refuses_non_finite_numbers(tmp_path):
    with pytest.raises(MoePruneError, match="non-finite"):
        write_report(
            {"command": "eval", "models": [{"per_data": {"f": {"kl": math.nan}}}]}, tmp_path / "r.json"
        )
    assert not (tmp_path / "r.json").exists()


def test_perplexity_past_the_largest_float_is_none():
    assert _exp(2.0) == pytest.approx(math.e**2)
    assert _exp(1e4) is None


# --------------------------------------------------------------------------------- accept metric


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("side", ["draft", "target"])
def test_speculative_decoding_stops_on_non_finite_logits(side, mode):
    """Sampling from NaN probabilities crashed inside torch.multinomial; now the model is named."""
    healthy, broken = _model(vocab_size=96), _model(_overflow, vocab_size=96)
    draft, target = (broken, healthy) if side == "draft" else (healthy, broken)
    _raises((f"the {side} produced NaN logits while decoding", "decoder layer 1 (model.layers.1.self_attn.v_proj)"),
            lambda: acceptance(draft, target, [[5, 6, 7, 8]], SpecOptions(gamma=2, max_new_tokens=4), modes=[mode]))  # fmt: skip
