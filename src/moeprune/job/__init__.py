"""The file-level jobs the command line runs, each a checkpoint folder in and a result out.

- `prune_checkpoint(request, pipeline=...)` (pipelines.py): the one file verb, `moeprune prune`;
  the pipelines by name (in-memory, no-load), each declaring what it supports;
- `prepare` (prepare.py): every check of a `PruneRequest` that needs no weights, in seconds: the
  config, the file headers, the model on the meta device, the data tokenized, the sizes planned
  (and a size target solved), what the result's format will be (a quantized input's kept), and
  the quantize stage's checks and plans before loading (quantize/stage.py);
- `prune_in_memory` / `run_job` (run.py): the in-memory pipeline: load, the quantize stage's
  before-prune step, `moeprune.api.prune`, its after-prune step, save the result (quantized by
  llm-compressor when asked; written from the input's bytes when a quantization is kept);
- `prune_without_loading` (no_load.py): the no-load pipeline, the shards rewritten one by one (it
  quantizes nothing: a quantize request is refused before anything is read);
- `prune_auto` (auto.py): `--method auto`: the recipes checked and sized before loading, raced on the
  loaded model, the winner saved as its recipe;
- evidence.py: the files beside every result, one writer for both pipelines;
- `prepare_score` / `score_loaded` (score.py): `moeprune score` on the loaded model.
"""

from __future__ import annotations

from moeprune.job.pipelines import PIPELINES, prune_checkpoint
from moeprune.job.prepare import PlannedSizes, PruneJob, PruneRequest, check_resume, plan_sizes, prepare
from moeprune.job.run import prune_in_memory, run_job
from moeprune.job.score import prepare_score, score_loaded

__all__ = [
    "PIPELINES",
    "PlannedSizes",
    "PruneJob",
    "PruneRequest",
    "check_resume",
    "plan_sizes",
    "prepare",
    "prepare_score",
    "prune_checkpoint",
    "prune_in_memory",
    "run_job",
    "score_loaded",
]
