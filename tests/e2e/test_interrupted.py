"""kill -9 at any moment never corrupts a result or a search in progress.

Two real processes are killed with SIGKILL at random moments: one replacing an output folder
over and over (the save), one running an EvoESAP search through the command line. After every
kill the output is a complete result (old or new, never a mix, never missing) and the search
state is valid; the next run cleans what the dead one left and a resumed search ends exactly
where an uninterrupted one does.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # builds, prunes, saves or serves models end to end

# A writer that replaces OUT again and again with complete versions v0, v1, ...: each version is
# 12 files written slowly, the last one a manifest naming the version. EXCHANGE=0 forces the
# two-rename fallback (filesystems without renameat2).
_WRITER = r"""
import os, sys, time
from pathlib import Path
from moeprune.runtime import atomic

if os.environ.get("EXCHANGE") == "0":
    atomic._exchange = lambda a, b: False
out = Path(sys.argv[1])
version = int(sys.argv[2])
print("ready", flush=True)
while True:
    version += 1
    def write(tmp, v=version):
        for i in range(12):
            (tmp / f"part{i}").write_text(f"v{v}")
            time.sleep(0.01)
        (tmp / "manifest").write_text(f"v{v}")
    atomic.atomic_write_dir(out, write, overwrite=True)
"""


def _complete_version(folder: Path) -> str:
    """The version a folder holds, asserting it is complete and unmixed."""
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(["manifest", *(f"part{i}" for i in range(12))]), names
    versions = {p.read_text() for p in folder.iterdir()}
    assert len(versions) == 1, versions
    return versions.pop()


@pytest.mark.parametrize("exchange", ["1", "0"], ids=["renameat2-swap", "two-renames"])
def test_kill_during_replacement_leaves_a_complete_result(tmp_path, exchange):
    from moeprune.runtime.atomic import recover

    out = tmp_path / "out"
    out.mkdir()
    for i in range(12):
        (out / f"part{i}").write_text("v0")
    (out / "manifest").write_text("v0")
    rng = random.Random(0)
    env = {**os.environ, "EXCHANGE": exchange}
    seen = set()
    for round_ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(out), str(100 * (round_ + 1))],
                                stdout=subprocess.PIPE, env=env, text=True)  # fmt: skip
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))  # somewhere inside one of the replacements
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        recover(out)  # what the next write does first: a swap cut in half is put back
        seen.add(_complete_version(out))
        leftovers = [p.name for p in tmp_path.iterdir() if p.name != "out"]
        assert leftovers == [], leftovers
    assert len(seen) > 1  # the kills landed after some replacements finished


def _prune_evo(checkpoint: Path, data: Path, out: Path, *extra: str) -> subprocess.Popen:
    args = [str(Path(sys.executable).with_name("moeprune")), "prune", str(checkpoint), "--output", str(out),
            "--criterion", "frequency", "--sparsity", "0.25", "--allocation", "evo", "--data", str(data),
            "--search-data", str(data), "--search-samples", "8", "--population", "8", "--elites", "2",
            "--generations", "12", "--quiet", *extra]  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_kill_during_search_then_resume_matches_an_uninterrupted_run(tiny_checkpoint, data, tmp_path):
    straight = _prune_evo(tiny_checkpoint, data, tmp_path / "straight")
    assert straight.wait() == 0, straight.stdout.read()
    expected = json.loads((tmp_path / "straight" / "search.json").read_text())

    out = tmp_path / "killed"
    state = tmp_path / ".killed.search_state.json"
    proc = _prune_evo(tiny_checkpoint, data, out)
    deadline = time.time() + 120
    while not state.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the search finished before it could be interrupted"
    time.sleep(random.Random(1).uniform(0.0, 0.5))  # a few generations in, at a random moment
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()  # the result appears only once complete
    json.loads(state.read_text())  # the state on disk is whole, whatever the kill interrupted
    resumed = _prune_evo(tiny_checkpoint, data, out, "--resume")
    assert resumed.wait() == 0, resumed.stdout.read()
    got = json.loads((out / "search.json").read_text())
    assert got["allocation"] == expected["allocation"]
    assert got["fitness_value"] == expected["fitness_value"]
    assert [g["best"] for g in got["generations"]] == [g["best"] for g in expected["generations"]]
    assert not state.exists() and not list(tmp_path.glob(".killed.*"))  # state, lock and temporaries gone
