"""The file-level jobs the command line runs, each a checkpoint folder in and a result out.

- `prepare` (prepare.py): every check of a prune request that needs no weights, in seconds: the
  config, the file headers, the model on the meta device, the data tokenized, the sizes planned
  (and a size target solved), what the result's format will be (a quantized input's kept);
- `prune_checkpoint` / `run_job` (run.py): `moeprune prune`: load, `moeprune.api.prune`, save the
  result with its evidence (written from the input's bytes when a quantization is kept);
- `prepare_score` / `score_loaded` (score.py): `moeprune score` on the loaded model;
- `prune_without_loading` (no_load.py): `moeprune prune --no-load`, the shards rewritten one by one;
- evidence.py: the files beside every result, one writer for both pipelines;
- pipelines.py: the pipelines by name (in-memory, no-load), how the command line runs a prune.
"""

from __future__ import annotations

from moeprune.job.prepare import PlannedSizes, PruneJob, check_resume, plan_sizes, prepare
from moeprune.job.run import prune_checkpoint, run_job
from moeprune.job.score import prepare_score, score_loaded

__all__ = [
    "PlannedSizes",
    "PruneJob",
    "check_resume",
    "plan_sizes",
    "prepare",
    "prepare_score",
    "prune_checkpoint",
    "run_job",
    "score_loaded",
]
