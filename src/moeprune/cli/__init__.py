"""The `moeprune` command: one module per command, nothing but argument parsing, a call into the
library, and turning its errors into one line with the flags that fix them.

- main.py     the command group and error translation (MoePruneError -> one line, exit code 2)
- options.py  options several commands share, choices and help read from the registries
- inspect.py, score.py, prune.py, eval.py (eval and report), serve_check.py, demo.py, setup.py
  (`setup quantize`): one command each

- reference.py  The command-line reference (docs/cli.md), rendered from the commands themselves
"""

from __future__ import annotations

# Importing a command module registers it on `main`; this order is --help's.
# isort: off
from moeprune.cli import inspect  # noqa: F401
from moeprune.cli import score  # noqa: F401
from moeprune.cli import prune  # noqa: F401
from moeprune.cli import eval  # noqa: F401
from moeprune.cli import serve_check  # noqa: F401
from moeprune.cli import demo  # noqa: F401
from moeprune.cli import setup  # noqa: F401

# isort: on
from moeprune.cli.main import main

__all__ = ["main"]
