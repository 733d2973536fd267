"""User-facing errors: the CLI prints their message on one line and exits with code 2."""

from __future__ import annotations


class MoePruneError(Exception):
    """Bad input or an impossible request; the message says what is wrong and what to do."""


class UnsupportedModelError(MoePruneError):
    """The checkpoint is not an MoE model of a supported family."""


class InfeasibleBudgetError(MoePruneError):
    """The requested pruning budget cannot be met under the per-layer constraints."""


class DataError(MoePruneError):
    """Calibration or search data is missing, empty or malformed."""
