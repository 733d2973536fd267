"""`moeprune.log`: what a run did, for the person who finds its output folder weeks later.

The log holds the command line, the versions that produced the result, the wall time of every
stage (reported by `runtime.progress`) and every warning raised while it ran (Python warnings
and the `moeprune`/`transformers` loggers), in the order they happened. One log is active at a
time; entering a second one while the first runs joins the first (an API call inside a command).
It records; it never filters, hides or changes a warning.
"""

from __future__ import annotations

import logging
import platform
import sys
import time
import warnings
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import ClassVar

LOG_NAME = "moeprune.log"
_WATCHED_LOGGERS = ("moeprune", "transformers", "torch")
_PACKAGES = ("moeprune", "torch", "transformers", "safetensors", "accelerate", "vllm", "lm_eval")


def versions() -> dict[str, str]:
    """Python's and every relevant installed package's version."""
    found = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            continue
    return found


class _Collector(logging.Handler):
    def __init__(self, log: RunLog) -> None:
        super().__init__(level=logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log.warning(f"{record.levelname.lower()} ({record.name}): {record.getMessage()}")


class RunLog:
    """The active run's log: enter it around the work, `write(folder)` before the folder is published."""

    _active: ClassVar[RunLog | None] = None

    def __init__(self, command_line: str | None = None) -> None:
        self.command_line = command_line or " ".join(["moeprune", *sys.argv[1:]])
        self.started = datetime.now(timezone.utc)
        self.stages: list[tuple[str, float, int | None]] = []
        self.warnings: list[str] = []
        self.notes: list[str] = []  # what the run did that the user should know (parts kept or left out)
        self._depth = 0
        self._clock = time.perf_counter()

    # --------------------------------------------------------------------------- activation
    @classmethod
    def join(cls, command_line: str | None = None) -> RunLog:
        """The active log, or a new one (enter it either way: only the outermost entry counts)."""
        return cls._active if cls._active is not None else cls(command_line)

    def __enter__(self) -> RunLog:
        self._depth += 1
        if self._depth == 1:
            RunLog._active = self
            self._handler = _Collector(self)
            for name in _WATCHED_LOGGERS:
                logging.getLogger(name).addHandler(self._handler)
            self._showwarning = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                self.warning(f"{category.__name__}: {message} ({Path(filename).name}:{lineno})")
                self._showwarning(message, category, filename, lineno, file, line)

            warnings.showwarning = show
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            for name in _WATCHED_LOGGERS:
                logging.getLogger(name).removeHandler(self._handler)
            warnings.showwarning = self._showwarning
            RunLog._active = None

    # --------------------------------------------------------------------------- recording
    @classmethod
    def record_stage(cls, name: str, seconds: float, steps: int | None = None) -> None:
        """A finished stage's wall time, into the active log (if any)."""
        if cls._active is not None:
            cls._active.stages.append((name, round(seconds, 3), steps))

    def warning(self, text: str) -> None:
        if text not in self.warnings:  # a warning repeated per layer or batch is listed once
            self.warnings.append(text)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def timings(self) -> dict[str, float]:
        """Seconds per stage (a stage run several times is summed) and the total so far."""
        out: dict[str, float] = {}
        for name, seconds, _ in self.stages:
            out[name] = round(out.get(name, 0.0) + seconds, 3)
        out["total"] = round(time.perf_counter() - self._clock, 3)
        return out

    def text(self) -> str:
        lines = [
            f"command   {self.command_line}",
            f"started   {self.started.isoformat(timespec='seconds')}",
            f"host      {platform.node()} ({platform.platform()})",
        ]
        lines += ["", "versions"] + [f"  {k:<13} {v}" for k, v in versions().items()]
        lines += ["", "stages (wall time)"]
        for name, seconds, steps in self.stages:
            lines.append(f"  {name:<40} {seconds:>9.2f} s" + (f"  ({steps} steps)" if steps else ""))
        lines.append(f"  {'total':<40} {time.perf_counter() - self._clock:>9.2f} s")
        if self.notes:
            lines += ["", "notes"] + [f"  {n}" for n in self.notes]
        lines += ["", f"warnings ({len(self.warnings)})"] + [f"  {w}" for w in self.warnings or ["none"]]
        return "\n".join(lines) + "\n"

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / LOG_NAME
        path.write_text(self.text())
        return path
