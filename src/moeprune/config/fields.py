"""`setting`: a config field that carries its command-line flag, help and bounds (every config
class of moeprune.config declares its fields with it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Any


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    open_bounds: bool = False,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
) -> Any:
    """A config field that carries its command-line help, flag, bounds (`open_bounds`: both
    excluded), choices and metavar, so the CLI's options, their --help and the docs' CLI reference
    are made from the field (cli/options.py). `default=MISSING`: a required field and option."""
    metadata = {"help": help, "flag": flag, "min": minimum, "max": maximum, "open": open_bounds}
    return field(default=default, metadata=metadata | {"choices": choices, "metavar": metavar})
