"""Per-expert calibration statistics, accumulated in fp64.

The observer fills these; every data-driven criterion, novice surgery and neuron pruning read
them. Means and variances use Chan's parallel form of Welford's update, so merging batches (or
ranks, or domains) is exact rather than approximate.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moeprune.errors import MoePruneError
from moeprune.observe.kinds import DEFAULT, Statistic

F64 = torch.float64
SUM_FIELDS = ("count", "weight_sum", "norm_sum", "weighted_norm_sum", "tenp_sum")  # plain fp64 sums, [E]
RECORDED_FIELDS = SUM_FIELDS[:4]  # always recorded; tenp_sum only when asked for (observe/kinds.py)
MOMENT_FIELDS = ("mean", "m2")  # Welford moments, [E, d]; only when asked for
NEURON_FIELDS = ("neuron_proj_sum", "neuron_l2_sum")  # optional, [E, I]
GATED_FIELDS = ("gated_sum",)  # optional plain sums, [E, d]: absent from statistics saved before them
PROBE_TOKENS = 128  # block inputs kept per layer for the merge method's shared-token features
MAX_FIELDS = ("output_absmax",)  # running maxima, [E]: merged with max, not summed


@dataclass
class LayerStats:
    """Statistics of one MoE layer; every tensor is indexed by the original expert id.

    A field the observation was not asked for (observe/kinds.py) is None; `need` names it."""

    layer: int  # decoder layer index
    num_experts: int
    hidden_size: int
    intermediate_size: int
    count: torch.Tensor  # [E] n_i, routed (non-padding) tokens
    weight_sum: torch.Tensor  # [E] sum g_i(t)
    norm_sum: torch.Tensor  # [E] sum ||E_i(h_t)||
    weighted_norm_sum: torch.Tensor  # [E] sum g_i(t) ||E_i(h_t)||
    tenp_sum: torch.Tensor | None = None  # [E] sum g_i(t) ||E_i(h_t)|| (1 - cos(h_t, E_i(h_t))) (TENP)
    mean: torch.Tensor | None = None  # [E, d] running mean of E_i(h_t) (MOMENTS)
    m2: torch.Tensor | None = None  # [E, d] running sum of squared deviations, Welford (MOMENTS)
    neuron_proj_sum: torch.Tensor | None = None  # [E, I] sum <y_k, y> / (||y|| + 1e-8)
    neuron_l2_sum: torch.Tensor | None = None  # [E, I] sum ||y_k||
    # [E] max over routed tokens of max_j |E_i(h_t)_j| (before the routing weight): the super-expert
    # statistic (criteria/super_experts.py). None only in statistics saved before it was recorded.
    output_absmax: torch.Tensor | None = None
    # [E, d] sum g_i(t) E_i(h_t): the mean gated output's direction (the merge method's distance)
    gated_sum: torch.Tensor | None = None
    # [P, d] the first P <= PROBE_TOKENS distinct block inputs h_t the layer saw: tokens every expert
    # can be run on afterwards, so neurons and router columns of different experts are compared on
    # the same tokens (merge method). Not a sum: a merge keeps these rows and fills up to P.
    probe: torch.Tensor | None = None

    @classmethod
    def zeros(
        cls,
        layer: int,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        neurons: bool = False,
        statistics: Collection[Statistic] = DEFAULT,
    ) -> LayerStats:
        """Empty accumulators of the asked kinds (`neurons` adds Statistic.NEURONS)."""
        e, d, i = num_experts, hidden_size, intermediate_size
        asked = set(statistics) | ({Statistic.NEURONS} if neurons else set())
        neurons, moments = Statistic.NEURONS in asked, Statistic.MOMENTS in asked

        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=F64)

        def given(kind: Statistic, *shape: int) -> torch.Tensor | None:
            return z(*shape) if kind in asked else None

        return cls(
            layer=layer,
            num_experts=e,
            hidden_size=d,
            intermediate_size=i,
            count=z(e),
            weight_sum=z(e),
            norm_sum=z(e),
            weighted_norm_sum=z(e),
            tenp_sum=given(Statistic.TENP, e),
            mean=z(e, d) if moments else None,
            m2=z(e, d) if moments else None,
            neuron_proj_sum=z(e, i) if neurons else None,
            neuron_l2_sum=z(e, i) if neurons else None,
            output_absmax=given(Statistic.MAXIMA, e),
            gated_sum=given(Statistic.GATED_OUTPUTS, e, d),
            probe=given(Statistic.PROBE, 0, d),
        )

    def need(self, name: str) -> torch.Tensor:
        """Field `name`, or one line saying the observation was not asked for it (a reader whose
        entry did not declare the statistic it reads: observe/kinds.py)."""
        value = getattr(self, name)
        if value is None:
            raise MoePruneError(
                f"decoder layer {self.layer}: the calibration statistics hold no {name} (the "
                "observation was not asked for it: the entry reading it must declare it in `statistics`)"
            )
        return value

    @property
    def variance(self) -> torch.Tensor:
        """Unbiased per-dimension variance [E, d]; zero where fewer than two tokens were seen."""
        denom = (self.count - 1).clamp(min=1).unsqueeze(1)
        var = self.need("m2") / denom
        return torch.where((self.count > 1).unsqueeze(1), var, torch.zeros_like(var))

    @property
    def sq_norm_sum(self) -> torch.Tensor:
        """[E] sum ||E_i(h_t)||^2 over the routed tokens (MSAN), from the moments already kept:
        sum_t ||y_t||^2 = n ||mean||^2 + sum_d M2_d. Both terms are >= 0, so nothing cancels and the
        fp64 result matches a dedicated accumulator to rounding; 0 where no token was seen."""
        return self.count * self.need("mean").square().sum(1) + self.need("m2").sum(1)

    def to(self, device: torch.device | str) -> LayerStats:
        """Move every accumulator to `device` in place (the observer accumulates where rows are)."""
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    def add_moments(self, expert: int, n: float, batch_mean: torch.Tensor, batch_m2: torch.Tensor) -> None:
        """Merge a batch's mean and M2 (Chan et al.); call before updating `count`."""
        mean, m2 = self.need("mean"), self.need("m2")
        n_a = self.count[expert]
        n_ab = n_a + n
        delta = batch_mean - mean[expert]
        mean[expert] += delta * (n / n_ab)
        m2[expert] += batch_m2 + delta.square() * (n_a * n / n_ab)

    def merge(self, other: LayerStats) -> None:
        """Add another accumulation of the same layer (another batch set, rank or domain)."""
        if (other.layer, other.num_experts, other.hidden_size) != (
            self.layer,
            self.num_experts,
            self.hidden_size,
        ):
            raise ValueError(f"cannot merge statistics of different layers ({other.layer} vs {self.layer})")
        if self.mean is not None and other.mean is not None and other.m2 is not None:
            for e in torch.nonzero(other.count > 0).flatten().tolist():
                self.add_moments(e, float(other.count[e]), other.mean[e], other.m2[e])
        for name in RECORDED_FIELDS:
            getattr(self, name).add_(getattr(other, name))
        for name in NEURON_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None and theirs is not None:
                mine.add_(theirs)
        for name in ("tenp_sum", *GATED_FIELDS):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None and theirs is not None:
                mine.add_(theirs)
            elif theirs is not None:
                setattr(self, name, theirs.clone())
        self.add_probe(other.probe)
        for name in MAX_FIELDS:  # a maximum over both accumulations: exact, order-independent
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None and theirs is not None:
                torch.maximum(mine, theirs, out=mine)
            elif theirs is not None:
                setattr(self, name, theirs.clone())

    def add_probe(self, rows: torch.Tensor | None) -> None:
        """Append block inputs to the probe until it holds PROBE_TOKENS rows."""
        if rows is None:
            return
        have = 0 if self.probe is None else self.probe.shape[0]
        take = rows[: max(0, PROBE_TOKENS - have)].to(F64)
        if take.shape[0]:
            self.probe = (
                take.clone() if self.probe is None else torch.cat((self.probe, take.to(self.probe.device)))
            )

    def to_dict(self) -> dict[str, object]:
        """Tensors as plain tensors (for torch.save); keys mirror the field names."""
        return {k: v for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> LayerStats:
        return cls(**data)  # type: ignore[arg-type]


@dataclass
class ExpertStats:
    """Statistics of every MoE layer of a model over one calibration set."""

    layers: list[LayerStats]
    tokens: int = 0  # non-padding tokens seen
    samples: int = 0
    truncated: int = 0  # samples cut at max length
    data_fingerprint: str = ""
    domain: str = ""
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_pass(cls, layers: list[LayerStats], tokens: int, data, domain: str, note: str) -> ExpertStats:
        """The result of one observation pass over `data` (a CalibrationData)."""
        stats = cls(
            layers=layers,
            tokens=tokens,
            samples=len(data.samples),
            truncated=data.truncated,
            data_fingerprint=data.fingerprint,
            domain=domain,
        )
        stats.notes.append(note)
        return stats

    def layer(self, layer_index: int) -> LayerStats:
        for stats in self.layers:
            if stats.layer == layer_index:
                return stats
        raise KeyError(f"no statistics for decoder layer {layer_index}")

    def merge(self, other: ExpertStats) -> None:
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.merge(theirs)
        self.tokens += other.tokens
        self.samples += other.samples
        self.truncated += other.truncated

    def unseen_experts(self) -> dict[int, list[int]]:
        """Experts that no calibration token reached, per decoder layer (reports mention them)."""
        out = {}
        for stats in self.layers:
            ids = torch.nonzero(stats.count == 0).flatten().tolist()
            if ids:
                out[stats.layer] = ids
        return out

    def save(self, path: str) -> None:
        torch.save(
            {
                "layers": [s.to_dict() for s in self.layers],
                "tokens": self.tokens,
                "samples": self.samples,
                "truncated": self.truncated,
                "data_fingerprint": self.data_fingerprint,
                "domain": self.domain,
                "notes": self.notes,
            },
            path,
        )

    @classmethod
    def load(cls, path: str) -> ExpertStats:
        raw = torch.load(path, weights_only=True)
        raw["layers"] = [LayerStats.from_dict(d) for d in raw["layers"]]
        return cls(**raw)


def as_domains(stats: ExpertStats | Sequence[ExpertStats]) -> list[ExpertStats]:
    """Statistics of one or several calibration domains, checked to describe the same model."""
    domains = [stats] if isinstance(stats, ExpertStats) else list(stats)
    if not domains:
        raise MoePruneError("no calibration statistics were given (an empty list of domains)")
    ref = [(s.layer, s.num_experts) for s in domains[0].layers]
    for d in domains[1:]:
        got = [(s.layer, s.num_experts) for s in d.layers]
        if got != ref:
            raise MoePruneError(
                f"calibration domains disagree on MoE layers / expert counts: {ref} vs {got} "
                "(were they observed on different models?)"
            )
    return domains


def merged_layer(domains: Sequence[ExpertStats], layer: int) -> LayerStats:
    """One layer's statistics summed over domains (Chan merge for moments); inputs stay untouched."""
    first = domains[0].layer(layer)
    # field name -> value of every field: ints and tensors mixed, so only Any fits each keyword
    values: dict[str, Any] = {
        k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in first.__dict__.items()
    }
    out = LayerStats(**values)
    for d in domains[1:]:
        out.merge(d.layer(layer))
    return out
