"""Sizes as people write them ("40GiB", "500MB", bytes): `--target-size`, `--max-shard-size`."""

from __future__ import annotations

import re
from decimal import Decimal

from moeprune.errors import MoePruneError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(B|[KMGT]I?B)?\s*")  # a number, then B, kB..TB or KiB..TiB


def parse_bytes(size: int | str, what: str) -> int | None:
    """Bytes in "5GB", "500mb", "2GiB", "1.5 TB" or a plain number of bytes, or None when `size`
    is not written like that. Decimal units are powers of 10 (GB = 10^9, save_pretrained's and
    the disk makers'), binary ones powers of 2 (GiB = 2^30); case does not matter; a fraction of
    a byte is dropped. `what` only names the value in the error for a size that is not positive."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str) and (match := _SIZE.fullmatch(size.upper())):
        value = int(Decimal(match.group(1)) * _UNITS[match.group(2) or ""])
    else:
        return None
    if value <= 0:
        raise MoePruneError(f"{what} must be positive, got {size!r}")
    return value


def parse_target_size(size: int | str) -> int:
    """The bytes a `target_size` asks for (see `parse_bytes`), or a one-line refusal."""
    value = parse_bytes(size, "the target size")
    if value is None:
        raise MoePruneError(
            f"target size {size!r} is not a size; write bytes (123456) or a number with a unit: "
            "B, kB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2), e.g. 40GiB or 500MB",
            options=("target_size",),
        )
    return value
