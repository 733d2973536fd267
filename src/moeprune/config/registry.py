"""The registries: every named choice (criterion, allocation, surgery method, fitness, metric) is one
entry of one `Registry`, declared beside its implementation with its help text and what it needs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Generic, TypeVar

from moeprune.errors import MoePruneError

# What an entry may need: the model's expert weights, calibration statistics (a pass over data),
# per-neuron statistics (a pass that also records neuron shares), or search data (prompt/answer).
WEIGHTS, CALIBRATION, NEURON_STATS, SEARCH_DATA = "weights", "calibration", "neuron statistics", "search data"

T = TypeVar("T")


class Registry(Generic[T]):
    """Named specs of one kind, in registration order.

    A spec is a frozen dataclass with at least `name`, `help` and `needs`; kinds whose entries are
    code (criteria, methods, metrics) give it an `fn` field, which `register` fills:

        @CRITERIA.register(Criterion("reap", ..., help="mean of g ||E(h)||", needs=(CALIBRATION,)))
        def reap(stats): ...
    """

    def __init__(self, kind: str, option: str):
        self.kind = kind  # "criterion", "allocation", ...
        self.option = option  # the API parameter that names one (the CLI turns it into its flag)
        self._specs: dict[str, T] = {}

    def add(self, spec: T) -> T:
        name = spec.name  # type: ignore[attr-defined]
        if name in self._specs:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._specs[name] = spec
        return spec

    def register(self, spec: T) -> Callable[[Callable], Callable]:
        """Decorator: register `spec` with the decorated function as its `fn`."""

        def decorate(fn: Callable) -> Callable:
            self.add(replace(spec, fn=fn))  # type: ignore[type-var]
            return fn

        return decorate

    def get(self, name: str) -> T:
        try:
            return self._specs[name]
        except KeyError:
            raise MoePruneError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(self._specs)}",
                options=(self.option,),
            ) from None

    def names(self) -> list[str]:
        return list(self._specs)

    def __iter__(self) -> Iterator[T]:
        return iter(self._specs.values())

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __len__(self) -> int:
        return len(self._specs)
