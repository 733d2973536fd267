"""The CUDA paths: statistics on a GPU, bf16 surgery on a GPU, the CLI's `--device cuda|auto`.

CI has no GPU, so these are skipped there; they run wherever `torch.cuda.is_available()` (a lent
GPU machine: `pytest -m cuda`). Tolerances, because a GPU runs other kernels than the CPU:

- fp32 on both: cuBLAS and the CPU's BLAS sum a dot product in different orders, a few ulps per
  term; TF32 is off (PyTorch's default for matmul), so statistics agree to ~1e-6 relative.
  `STATS_RTOL` leaves an order of magnitude above that and two below any real change.
- bf16 on the GPU: the removed experts change the shapes of the expert products, so bf16 outputs
  can round differently. What must hold is that surgery adds no error beyond bf16's own: the
  physically pruned model differs from the masked one by at most `BF16_SLACK` times what bf16
  rounding does to the unpruned model (its distance to fp32), in ‖a - b‖ / ‖b‖ over all logits.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from test_observe import calibration

from moeprune.config import PruneConfig
from moeprune.criteria import compute_scores, get_criterion
from moeprune.models import MoEModel, supported_families
from moeprune.models.factory import tiny_model
from moeprune.observe.observer import observe
from moeprune.surgery.planning import build_plan
from moeprune.surgery.plans import apply_plan_physical, virtual_plan

pytestmark = [
    pytest.mark.integration,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FAMILIES = [f for f in ("qwen3_moe", "deepseek_v3", "mixtral", "olmoe", "gpt_oss") if f in supported_families()]
STATS_RTOL = 1e-4
BF16_SLACK = 2.0
TOKENS = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(5))
LENGTHS = (20, 17, 15, 12)


def logits(model, device="cuda") -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS.to(device)).logits.float().cpu()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a - b‖ / ‖b‖ over every logit: one number per comparison, robust to a single rounding."""
    return float((a - b).norm() / b.norm())


def drop_plan_of(moe: MoEModel, stats):
    crit = get_criterion("reap")
    return build_plan(moe, crit, compute_scores("reap", stats=stats), config=PruneConfig("reap", 0.25))


@pytest.mark.parametrize("family", FAMILIES)
def test_statistics_on_cuda_equal_cpu(family):
    model = tiny_model(family)
    on_cpu = observe(MoEModel(model), calibration(LENGTHS), batch_size=2, neurons=True, progress=False)
    on_gpu = observe(
        MoEModel(copy.deepcopy(model).cuda()), calibration(LENGTHS), batch_size=2, neurons=True, progress=False
    )
    assert on_gpu.tokens == on_cpu.tokens
    for a, b in zip(on_gpu.layers, on_cpu.layers, strict=True):
        assert torch.equal(a.count.cpu(), b.count), "a routing choice differs between CPU and GPU"
        for name in ("weight_sum", "norm_sum", "reap_sum"):
            if hasattr(b, name):
                torch.testing.assert_close(getattr(a, name).cpu(), getattr(b, name), rtol=STATS_RTOL, atol=1e-8)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_surgery_on_cuda_adds_no_error(family):
    reference = tiny_model(family).cuda()
    moe = MoEModel(reference)
    stats = observe(moe, calibration(LENGTHS), batch_size=2, progress=False)
    plan = drop_plan_of(moe, stats)
    half = copy.deepcopy(reference).to(torch.bfloat16)
    full32, full16 = logits(reference), logits(half)
    half_moe = MoEModel(half)
    with virtual_plan(half_moe, plan, stats):
        virtual16 = logits(half)
    assert torch.equal(logits(half), full16), "the bf16 masks were not undone"
    apply_plan_physical(half_moe, plan, stats)
    physical16 = logits(half)
    noise = relative(full16, full32)  # what bf16 rounding alone does to this model's logits
    assert noise > 0, "bf16 gave fp32's logits: the model did not run in bf16"
    assert relative(virtual16, full16) > 5 * noise, "the plan is lost in bf16 noise"
    assert relative(physical16, virtual16) <= BF16_SLACK * noise


def run_cli(*args: str) -> None:
    from click.testing import CliRunner

    from moeprune.cli import main

    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output


def test_cli_on_cuda_keeps_the_cpu_plan_and_auto_runs_bf16(tmp_path: Path, tiny_checkpoint: Path, data: Path):
    common = ("--criterion", "reap", "--sparsity", "0.25", "--data", str(data), "--samples", "12")
    reports, plans = {}, {}
    for name, device, dtype in (("cpu", "cpu", "fp32"), ("cuda", "cuda", "fp32"), ("auto", "auto", None)):
        out = tmp_path / name
        run_cli("prune", str(tiny_checkpoint), "--output", str(out), "--device", device,
                *(("--dtype", dtype) if dtype else ()), *common)  # fmt: skip
        reports[name] = json.loads((out / "report.json").read_text())
        plans[name] = json.loads((out / "plan.json").read_text())["layers"]
    assert plans["cuda"] == plans["cpu"], "the same fp32 statistics on a GPU chose other experts"
    assert reports["cuda"]["save_dtype"] == "float32"
    assert reports["auto"]["save_dtype"] == "float32"  # computed in bf16 (the GPU default), saved as stored


def test_gradient_allocation_on_cuda_trains_like_the_cpu(tmp_path: Path, tiny_checkpoint: Path, data: Path):
    """`--allocation gradient` trains its logits on the GPU that holds the model (the noise comes
    from a CPU generator, so both devices draw the same samples): the budget is met exactly there
    too, and the fp32 run follows the CPU's losses to STATS_RTOL (a lost gradient or a mask that
    stayed on the CPU would change them by far more)."""
    common = ("--criterion", "frequency", "--sparsity", "0.25", "--allocation", "gradient", "--data", str(data),
              "--search-data", str(data), "--search-samples", "6", "--samples", "8", "--gradient-steps", "4",
              "--dtype", "fp32", "--quiet")  # fmt: skip
    searches = {}
    for device in ("cpu", "cuda"):
        run_cli("prune", str(tiny_checkpoint), "--output", str(tmp_path / device), "--device", device, *common)
        searches[device] = json.loads((tmp_path / device / "search.json").read_text())
    for search in searches.values():
        assert sum(search["allocation"]) == search["budget"] == 8  # 25 % of 4 layers x 8 experts
    cpu_loss = torch.tensor([step["loss"] for step in searches["cpu"]["training"]])
    cuda_loss = torch.tensor([step["loss"] for step in searches["cuda"]["training"]])
    assert torch.allclose(cuda_loss, cpu_loss, rtol=STATS_RTOL), (cuda_loss, cpu_loss)


def test_repair_on_cuda_follows_the_cpu_in_fp32_and_never_lowers_in_bf16(
    tmp_path: Path, tiny_checkpoint: Path, data: Path
):
    """`--repair` on the GPU: in fp32 the same uniform drop's repair reaches the CPU's held-out
    fitness before and after (to 1e-3: a few hundred Adam steps on other kernels) and its first loss
    to STATS_RTOL; in bf16 (fp32 masters, bf16 model) it never lowers the held-out fitness and the
    result keeps its dtype."""
    common = ("--criterion", "reap", "--sparsity", "0.5", "--data", str(data), "--search-data", str(data),
              "--search-samples", "6", "--samples", "12", "--repair", "--repair-steps", "20",
              "--repair-eval-every", "5", "--allow-super-experts", "--quiet")  # fmt: skip
    repairs = {}
    for name, device, dtype in (("cpu", "cpu", "fp32"), ("cuda", "cuda", "fp32"), ("bf16", "cuda", "bf16")):
        out = tmp_path / name
        run_cli("prune", str(tiny_checkpoint), "--output", str(out), "--device", device, "--dtype", dtype, *common)
        repairs[name] = json.loads((out / "report.json").read_text())["repair"]
    cpu, cuda, bf16 = repairs["cpu"], repairs["cuda"], repairs["bf16"]
    assert cuda["before"] == pytest.approx(cpu["before"], abs=1e-5)
    assert cuda["after"] == pytest.approx(cpu["after"], abs=1e-3)
    assert cuda["loss_first"] == pytest.approx(cpu["loss_first"], rel=STATS_RTOL)
    assert bf16["after"] >= bf16["before"] and bf16["steps_run"] >= 5
