"""Former module paths, kept for users' scripts: importing one warns and gives the module it became.

Each former module is a two-line file calling `moved`; the new module replaces it in sys.modules,
so `from moeprune.allocate.search.run import run_evo_search` keeps working (with a warning).
"""

from __future__ import annotations

import importlib
import sys
import warnings


def moved(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}; import it from there (the old path will be removed)",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
