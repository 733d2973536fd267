"""Former module paths keep working for users' scripts: each import warns and gives the module it
became (the very same object, so registries are not filled twice)."""

from __future__ import annotations

import importlib
import sys

import pytest

pytestmark = pytest.mark.unit  # imports only

MOVED = {
    **{f"moeprune.allocate.search.{m}": f"moeprune.search.{m}"
       for m in ("auto", "candidates", "evo", "options", "population", "prefix", "run")},
    "moeprune.allocate.search.fitness": "moeprune.allocate.fitness",
    "moeprune.observe.sequential": "moeprune.shards.sequential",
}  # fmt: skip


@pytest.mark.parametrize("old", sorted(MOVED))
def test_former_path_warns_and_is_the_new_module(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}; import it from there"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_names_users_import_from_former_paths_still_resolve(monkeypatch):
    monkeypatch.delitem(sys.modules, "moeprune.allocate.search.run", raising=False)
    with pytest.warns(DeprecationWarning):
        from moeprune.allocate.search.run import run_evo_search
    from moeprune.search.run import run_evo_search as moved

    assert run_evo_search is moved


JOB_NAMES = ("prepare", "PruneJob", "plan_sizes", "PlannedSizes", "check_resume", "prune_checkpoint", "run_job",
             "RECIPE", "prepare_score", "score_loaded")  # fmt: skip


@pytest.mark.parametrize("name", JOB_NAMES)
def test_file_jobs_still_import_from_the_api_module(name):
    """The file-level jobs moved from moeprune.api to moeprune.job: the former names warn and are
    the very same objects; the one verb stays where it was, without a warning."""
    import warnings

    import moeprune.api as api
    import moeprune.job as job

    with pytest.warns(DeprecationWarning, match=f"moeprune.api.{name} moved to moeprune.job"):
        old = getattr(api, name)
    assert old is getattr(job, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from moeprune import prune_checkpoint  # noqa: F401  (the package's lazy name, no warning)
        from moeprune.api import prune  # noqa: F401
    with pytest.raises(AttributeError):
        api.no_such_name  # noqa: B018
