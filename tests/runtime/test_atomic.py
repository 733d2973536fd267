"""The one atomic writer: replace only on success, no leftovers, the user's umask, strict JSON."""

from __future__ import annotations

import json
import math
import os
import stat

import pytest

from moeprune.errors import MoePruneError
from moeprune.runtime.atomic import atomic_write_dir, check_not_inside, recover, write_json

pytestmark = pytest.mark.unit  # fast, small inputs: `pytest -m unit` runs them all in about a minute


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_failed_write_keeps_the_old_result_and_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")

    def fail(tmp):
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write_dir(out, fail, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in out.iterdir()] == ["old.txt"]


def test_replacement_is_complete_and_swapped(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    atomic_write_dir(out, lambda tmp: (tmp / "new.txt").write_text("new"), overwrite=True)
    assert [p.name for p in out.iterdir()] == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_new_folders_and_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        out = atomic_write_dir(tmp_path / "out", lambda tmp: write_json(tmp / "r.json", {"a": 1}))
    finally:
        os.umask(old)
    assert _mode(out) == 0o777 & ~umask
    assert _mode(out / "r.json") == 0o666 & ~umask


def test_recover_puts_back_a_result_set_aside_by_a_dead_writer(tmp_path):
    """A two-rename swap killed between its renames leaves OUT missing and the old one aside."""
    aside = tmp_path / ".out.old-999999-1"
    aside.mkdir()
    (aside / "old.txt").write_text("old")
    (tmp_path / ".out.tmp-999999-abc").mkdir()  # the new one, half written
    recover(tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (tmp_path / "out" / "old.txt").read_text() == "old"


def test_json_refuses_non_finite_numbers(tmp_path):
    with pytest.raises(MoePruneError, match="non-finite"):
        write_json(tmp_path / "r.json", {"kl": math.nan})
    assert list(tmp_path.iterdir()) == []
    write_json(tmp_path / "r.json", {"kl": None})
    assert json.loads((tmp_path / "r.json").read_text()) == {"kl": None}


def test_inputs_are_protected_through_symlinks(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    os.symlink(model, tmp_path / "link")
    for bad in (model, tmp_path / "link", model / "sub", tmp_path):
        with pytest.raises(MoePruneError):
            check_not_inside(bad, [tmp_path / "link"])
    check_not_inside(tmp_path / "elsewhere", [model])
