"""`setting`: a config field that carries its command-line flag, help and bounds (every config
class of moeprune.config declares its fields with it), and `check_bounds`, which refuses a value
outside them where a config is made in Python (the command line's ranges come from the same
bounds)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field, fields
from typing import Any

from moeprune.errors import MoePruneError


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


def _rule(low: float | None, high: float | None, open_: bool) -> str:
    below, above = (">", "<") if open_ else (">=", "<=")
    if low is not None and high is not None:
        return f"{'strictly ' if open_ else ''}between {low:g} and {high:g}"
    return f"{below} {low:g}" if low is not None else f"{above} {high:g}"


def check_bounds(config: Any, what: str) -> None:
    """Every bounded `setting` of the dataclass `config` a number of its type within its bounds
    (None where the field allows it), else one line naming the parameter: '`what` steps must be
    an integer >= 1, got 0'."""
    for f in fields(config):
        low, high, open_ = f.metadata.get("min"), f.metadata.get("max"), bool(f.metadata.get("open"))
        if low is None and high is None:
            continue
        value, kind = getattr(config, f.name), str(f.type)
        if value is None and "None" in kind:
            continue
        integer = kind.split("|")[0].strip() == "int"
        number = not isinstance(value, bool) and isinstance(value, int if integer else int | float)
        inside = number and (
            (low is None or (value > low if open_ else value >= low))
            and (high is None or (value < high if open_ else value <= high))
        )
        if not inside:
            raise MoePruneError(
                f"{what} {f.name} must be {'an integer' if integer else 'a number'} "
                f"{_rule(low, high, open_)}, got {value!r}",
                options=(f.name,),
            )
