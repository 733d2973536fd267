"""Progress for every stage a person waits on: bars on a terminal, plain lines elsewhere.

A bar redrawn with carriage returns is noise in a CI log or a redirected file, so without a
terminal each stage prints one line when it starts and one when it ends (with its count, time
and last status, e.g. the best fitness so far); stages that report each step (an EvoESAP
generation) print one line per step. Every finished stage's wall time goes to the active run
log (`moeprune.log`). This module only reports: it never changes what a stage computes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Sized
from contextlib import contextmanager
from typing import Any, cast

from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from moeprune.runtime.runlog import RunLog


def on_terminal() -> bool:
    """Whether progress goes to an interactive terminal (bars) rather than a log (lines)."""
    stream = sys.stderr
    return bool(getattr(stream, "isatty", None) and stream.isatty())


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 120 else f"{value / 60:.1f} min"


class PlainBar:
    """tqdm's interface as plain lines: one at the start, one at the end (and, with
    `each_step`, one per step). Used when stderr is not a terminal."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        initial: int = 0,
        each_step: bool = False,
    ) -> None:
        self.iterable, self.desc, self.unit, self.each_step = iterable, desc, unit, each_step
        self.total = (
            total
            if total is not None
            else (len(cast(Sized, iterable)) if hasattr(iterable, "__len__") else None)
        )
        self.n, self.postfix, self.closed = initial, "", False
        self.start = time.perf_counter()
        of = f" ({self.total} {unit})" if self.total is not None else ""
        self._print(f"{desc}: started{of}" + (f", resuming after {initial}" if initial else ""))

    def _print(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def __iter__(self) -> Iterator:
        try:
            for item in self.iterable or ():
                yield item
                self.update(1)
        finally:
            self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.each_step:
            of = f"/{self.total}" if self.total is not None else ""
            self._print(f"{self.desc}: {self.n}{of} {self.unit}{self._status()}")

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def _status(self) -> str:
        return f", {self.postfix}" if self.postfix else ""

    def write(self, line: str) -> None:
        self._print(line)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        took = time.perf_counter() - self.start
        self._print(f"{self.desc}: done, {self.n} {self.unit} in {_seconds(took)}{self._status()}")

    def __enter__(self) -> PlainBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Timed:
    """Wraps a bar so that its stage's wall time reaches the run log when it closes."""

    def __init__(self, bar: Any, desc: str) -> None:
        self.bar, self.desc, self.start, self.logged = bar, desc, time.perf_counter(), False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bar, name)

    def __iter__(self) -> Iterator:
        try:
            yield from self.bar
        finally:
            self.close()

    def close(self) -> None:
        self.bar.close()
        if not self.logged:
            self.logged = True
            RunLog.record_stage(self.desc, time.perf_counter() - self.start, self.bar.n)

    def __enter__(self) -> _Timed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Silent:
    """A disabled bar that still counts, so the stage's time reaches the run log."""

    def __init__(self, iterable: Iterable | None, initial: int) -> None:
        self.iterable, self.n = iterable, initial

    def __iter__(self) -> Iterator:
        for item in self.iterable or ():
            yield item
            self.n += 1

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None  # set_postfix, write, ...: nothing to show


def progress_bar(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str,
    unit: str = "it",
    enabled: bool = True,
    initial: int = 0,
    each_step: bool = False,
) -> Any:
    """A progress bar for one stage: tqdm on a terminal, `PlainBar` lines elsewhere, nothing shown
    when not `enabled`; in every case the stage's time reaches the run log. `each_step`: without a
    terminal, print a line per step (for steps that take long, like a search generation)."""
    if not enabled:
        bar: Any = _Silent(iterable, initial)
    elif on_terminal():
        bar = tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial)
    else:
        bar = PlainBar(iterable, total=total, desc=desc, unit=unit, initial=initial, each_step=each_step)
    return _Timed(bar, desc)


def say(line: str, enabled: bool = True) -> None:
    """One line of what a long stage is doing between its bars (a contest's recipe scored, a
    recipe let through), on stderr beside the bars when `enabled`."""
    if enabled:
        print(line, file=sys.stderr, flush=True)


@contextmanager
def stage(desc: str, enabled: bool = True) -> Iterator[None]:
    """A stage with no steps to count (loading, saving): a line at its start and end when
    `enabled`; its time always reaches the run log."""
    start = time.perf_counter()
    if enabled:
        print(f"{desc} ...", file=sys.stderr, flush=True)
    yield
    took = time.perf_counter() - start
    RunLog.record_stage(desc, took)
    if enabled:
        print(f"{desc}: done in {_seconds(took)}", file=sys.stderr, flush=True)


@contextmanager
def transformers_bars_off() -> Iterator[None]:
    """No transformers progress bars ("Loading weights" per shard) inside one of our stages:
    the stage's own line says what happens; transformers' warnings still reach the log."""
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
