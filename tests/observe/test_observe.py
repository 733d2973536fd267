"""The observer's fp64 statistics equal a brute-force recomputation from captured tensors."""

from __future__ import annotations

import pytest
import torch

from helpers import calibration  # noqa: F401 - other test modules import it from here
from moeprune.criteria import get_criterion
from moeprune.criteria.data import UNIFIED_FORM
from moeprune.data.loading import CalibrationData
from moeprune.errors import MoePruneError
from moeprune.models import MoEModel, supported_families
from moeprune.models.factory import tiny_model
from moeprune.observe.observer import observe

pytestmark = pytest.mark.unit  # fast, small inputs: `pytest -m unit` runs them all in about a minute

F64 = torch.float64


def capture_routing(moe: MoEModel, data: CalibrationData):
    """Run the stock model and capture, per MoE layer, what its experts receive: their input
    (Gemma-4 normalises it apart from the router's), the selected experts and applied weights."""
    captured = {m.index: [] for m in moe.layers}
    handles = []
    for layer in moe.layers:
        if layer.spec.weight_on_input:  # Llama-4: the block weights the input itself

            def hook(mod, args, out, layer=layer):
                h = args[0].reshape(-1, args[0].shape[-1]).detach()
                scores, logits = out
                idx = torch.topk(logits, layer.top_k, dim=1).indices
                captured[layer.index].append((h, idx, scores.gather(1, idx)))

            handles.append(layer.router.register_forward_hook(hook))
            continue

        def experts_hook(mod, args, kwargs, layer=layer):
            values = list(args) + [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            h, idx, w = values[:3]
            captured[layer.index].append((h.reshape(-1, h.shape[-1]).detach(), idx, w))

        handles.append(layer.experts.register_forward_pre_hook(experts_hook, with_kwargs=True))
    valid = []
    with torch.no_grad():
        for batch in data.batches(2, 0):
            moe.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            valid.append(batch.attention_mask.reshape(-1).bool())
    for h in handles:
        h.remove()
    return captured, valid


def stock_expert_output(layer, expert: int, x: torch.Tensor) -> torch.Tensor:
    """E_i(x) through the model's own experts module (not moeprune's computation)."""
    n = x.shape[0]
    if layer.spec.weight_on_input:  # Llama-4 experts take [E * n, d] with each expert's rows in its slot
        routed_in = torch.zeros(layer.num_experts, n, x.shape[1])
        routed_in[expert] = x
        return layer.experts(routed_in.reshape(-1, x.shape[1])).reshape(layer.num_experts, n, -1)[expert]
    # two selections, the second weighted 0: LongCat's experts squeeze a one-column mask
    index = torch.full((n, 2), expert, dtype=torch.long)
    return layer.experts(x, index, torch.tensor([[1.0, 0.0]]).expand(n, 2))


@pytest.mark.parametrize("family", supported_families())
def test_observer_matches_brute_force(family):
    model = tiny_model(family)
    moe = MoEModel(model)
    data = calibration()
    stats = observe(moe, data, batch_size=2, neurons=True, progress=False)
    captured, valid = capture_routing(moe, data)
    assert stats.tokens == sum(len(s.input_ids) for s in data.samples)
    for layer in moe.layers:
        outputs = {e: [] for e in range(layer.num_experts)}  # (g, h, y, m)
        with torch.no_grad():
            for (h, idx, w), ok in zip(captured[layer.index], valid):
                for t in torch.nonzero(ok).flatten().tolist():  # padding never counts
                    for j in range(layer.top_k):
                        e, g = int(idx[t, j]), float(w[t, j])
                        if e >= layer.num_experts:  # a zero expert (LongCat): no weighted expert's token
                            continue
                        x = h[t : t + 1] * g if layer.spec.weight_on_input else h[t : t + 1]
                        y = stock_expert_output(layer, e, x)[0]
                        gate, up, _ = layer.expert_weights(e)
                        gb, ub, _ = layer.expert_biases(e)
                        gp, upp = (None if gate is None else x[0] @ gate.T), x[0] @ up.T
                        if gb is not None:
                            gp, upp = gp + gb, upp + ub
                        outputs[e].append((g, h[t].to(F64), y.to(F64), layer.activate(gp, upp).to(F64)))
        s = stats.layer(layer.index)
        unified = {name: get_criterion(name).fn(s) for name in UNIFIED_FORM}
        for e, rows in outputs.items():
            assert int(s.count[e]) == len(rows)
            if not rows:
                assert s.weight_sum[e] == 0 and s.norm_sum[e] == 0
                assert all(scores[e] == 0 for scores in unified.values())  # unseen: 0, pruned first
                continue
            g = torch.tensor([r[0] for r in rows], dtype=F64)
            h = torch.stack([r[1] for r in rows])
            y = torch.stack([r[2] for r in rows])
            m = torch.stack([r[3] for r in rows])
            norms = y.norm(dim=1)
            cos = torch.nn.functional.cosine_similarity(h, y, dim=1)
            # fp32 kernels against fp64 sums: the absolute error grows with the reduction length
            # (the expert width; the hand-made fixtures have 16 neurons, other families up to 48)
            close = dict(rtol=1e-5, atol=1e-6 * max(1, layer.intermediate_size / 16))
            torch.testing.assert_close(s.weight_sum[e], g.sum(), **close)
            torch.testing.assert_close(s.norm_sum[e], norms.sum(), **close)
            torch.testing.assert_close(s.weighted_norm_sum[e], (g * norms).sum(), **close)
            torch.testing.assert_close(s.tenp_sum[e], (g * norms * (1 - cos)).sum(), **close)
            torch.testing.assert_close(s.mean[e], y.mean(0), **close)
            # frequency, seer, ean, reap, man and msan against S(b, alpha, beta) on the fp64 tensors
            for name, (b, alpha, beta) in UNIFIED_FORM.items():
                reference = len(rows) ** -b * (g**alpha * norms**beta).sum()
                torch.testing.assert_close(unified[name][e], reference, **close)
            if len(rows) > 1:
                torch.testing.assert_close(s.variance[e], y.var(0, unbiased=True), **close)
            down = layer.expert_weights(e)[2].to(F64)  # y_k = W_down[:, k] m_k
            shares = down.unsqueeze(0) * m.unsqueeze(1)  # [n, d, I]
            proj = (shares * y.unsqueeze(2)).sum(1) / (norms.unsqueeze(1) + 1e-8)
            torch.testing.assert_close(s.neuron_proj_sum[e], proj.sum(0), **close)
            torch.testing.assert_close(s.neuron_l2_sum[e], shares.norm(dim=1).sum(0), **close)


def test_padding_is_excluded_and_batching_does_not_matter():
    moe = MoEModel(tiny_model("qwen3_moe"))
    data = calibration((9, 3, 7, 2))
    one = observe(moe, data, batch_size=1, progress=False)
    four = observe(moe, data, batch_size=4, progress=False)
    for a, b in zip(one.layers, four.layers):
        assert int(a.count.sum()) == sum(len(s.input_ids) for s in data.samples) * 2
        torch.testing.assert_close(a.count, b.count)
        torch.testing.assert_close(a.weight_sum, b.weight_sum, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a.variance, b.variance, rtol=1e-5, atol=1e-7)


def test_non_finite_activations_stop_with_the_layer_named():
    model = tiny_model("olmoe")
    moe = MoEModel(model)
    with torch.no_grad():
        moe.layers[1].experts.down_proj[:, 0, 0] = float("nan")  # every expert of decoder layer 1
    with pytest.raises(MoePruneError, match="decoder layer 1"):
        observe(moe, calibration(), batch_size=2, progress=False)
