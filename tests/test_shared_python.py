"""shared_python.py: a stand-in Python whose driver runs share one process, each run seeing what a
fresh `python DRIVER SPEC OUT` would (argv, working directory, environment, its own neighbour
modules), its output and exit code passed back; other command lines go to the real Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shared_python import shared_python

pytestmark = pytest.mark.unit

DRIVER = """
import json, os, sys
import neighbour
print("out", os.environ.get("RUN"), flush=True)
print("err", file=sys.stderr)
if neighbour.FAIL:
    sys.exit("the spec said fail")
json.dump({"pid": os.getpid(), "cwd": os.getcwd(), "argv": sys.argv, "value": neighbour.VALUE,
           "spec": json.load(open(sys.argv[1]))}, open(sys.argv[2], "w"))
"""


def test_driver_runs_share_one_process_and_see_a_fresh_one(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "driver.py").write_text(DRIVER)
        (tmp_path / name / "neighbour.py").write_text(f"VALUE, FAIL = {name!r}, {name == 'b'}\n")
    (tmp_path / "spec.json").write_text('{"n": 1}')
    base = os.path.realpath(
        sys.executable
    )  # the interpreter itself: the server needs the standard library only
    with shared_python(base) as python:
        runs = []
        for run in ("1", "2"):
            done = subprocess.run([str(python), "a/driver.py", "spec.json", f"out{run}.json"], cwd=tmp_path,
                                  env={**os.environ, "RUN": run}, capture_output=True, text=True, check=False)  # fmt: skip
            assert (done.returncode, done.stdout) == (0, f"out {run}\nerr\n")
            runs.append(json.loads((tmp_path / f"out{run}.json").read_text()))
        failed = subprocess.run([str(python), "b/driver.py", "spec.json", "out3.json"], cwd=tmp_path,
                                capture_output=True, text=True, check=False)  # fmt: skip
        real = subprocess.run([str(python), "-c", "import os, sys; print(sys.executable, os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert runs[0]["pid"] == runs[1]["pid"] != os.getpid()
    assert runs[0]["cwd"] == str(tmp_path) and runs[0]["argv"] == ["a/driver.py", "spec.json", "out1.json"]
    assert runs[0]["value"] == "a" and runs[0]["spec"] == {"n": 1}
    # b's neighbour.py, not a's cached one: the driver's folder is its own first, as in a new process
    assert failed.returncode == 1 and failed.stdout == "out None\nerr\nthe spec said fail\n"
    assert not (tmp_path / "out3.json").exists()
    assert real[0] == base and int(real[1]) != runs[0]["pid"]
