"""User-facing errors: the CLI prints their message on one line and exits with code 2.

Messages speak the library's language (what is wrong, what to do, in terms of the Python API);
`options` names the API parameters that would fix the problem, and only the command line
translates those into its flags (cli/), so the library never mentions a flag.
"""

from __future__ import annotations

from collections.abc import Sequence


class MoePruneError(ValueError):
    """Bad input or an impossible request; the message says what is wrong and what to do.

    A ValueError, so code that guards a call with `except ValueError` also sees moeprune's refusals."""

    def __init__(self, message: str = "", *, options: Sequence[str] = ()):
        super().__init__(message)
        self.options = tuple(options)  # API parameter names the user can change to fix it


class UnsupportedModelError(MoePruneError):
    """The checkpoint is not an MoE model of a supported family."""


class InfeasibleBudgetError(MoePruneError):
    """The requested pruning budget cannot be met under the per-layer constraints."""


class DataError(MoePruneError):
    """Calibration or search data is missing, empty or malformed."""
