"""The `moeprune` command: one module per command, nothing but argument parsing, a call into the
library, and turning its errors into one line with the flags that fix them.

- main.py   the command group, shared options and error translation; inspect, score, prune
- eval.py   eval and report
- demo.py   demo
"""

from __future__ import annotations

from moeprune.cli.demo import demo
from moeprune.cli.eval import eval_command, report_command
from moeprune.cli.main import main

for _command in (eval_command, report_command, demo):
    main.add_command(_command)

__all__ = ["main"]
