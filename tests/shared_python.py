"""One warm process of another environment's Python in place of one per run.

moeprune hands llm-compressor (`--quant-python`, .venv-quant) and vLLM (`--vllm-python`,
.venv-vllm) a driver script: `PYTHON DRIVER SPEC OUT`, one fresh process each time. Importing
llm-compressor alone takes about 12 s on CI's two cores, so a dozen quantizing tests spent minutes
starting Pythons. `shared_python(real)` starts one server in the real environment and yields an
executable stand-in for its Python: the stand-in hands its three arguments, its working directory
and its environment to the server, which runs DRIVER as `__main__` with exactly that argv, cwd and
environment (its output written where the stand-in's goes, its exit code passed back), then waits
for the next one. Every other command line (`-c CODE`, `-m ...`) runs in the real Python itself.

What the runs share is the process and its imported libraries, nothing of the driver: the script is
executed afresh from its file each time (runpy), with its own directory first on sys.path and the
modules imported from that directory dropped afterwards, as a new process would see them. A test
that asserts something of a fresh process (what a driver imports, a library patched before its
import) keeps passing the real Python.

The server side runs in the other environment and uses the standard library only.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

STAND_IN = """#!{python}
import sys
sys.path.insert(0, {tests!r})
from shared_python import client
sys.exit(client({address!r}, {real!r}, sys.argv[1:]))
"""


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)  # as the interpreter does with `sys.exit("message")`
    return 1


def _run(request: dict, given: set[str]) -> int:
    """One driver run, as `python DRIVER SPEC OUT` would run it in a fresh process. Its environment
    is the stand-in's: what the server started with or an earlier stand-in gave (`given`) and this
    one lacks is removed; what the libraries and drivers set for themselves (vLLM does) stays."""
    for name in given - set(request["env"]):
        os.environ.pop(name, None)
    os.environ.update(request["env"])
    given |= set(request["env"])
    os.chdir(request["cwd"])
    argv, folder = request["argv"], os.path.dirname(os.path.abspath(request["argv"][0]))
    path, modules = list(sys.path), set(sys.modules)
    sys.argv, sys.path[0:0] = list(argv), [folder]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    try:
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # a driver's crash is its exit code 1, as in a process of its own
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        sys.path[:] = path
        for name in set(sys.modules) - modules:  # the driver's neighbours (oneshot_layout.py ...)
            if os.path.dirname(getattr(sys.modules[name], "__file__", None) or "") == folder:
                del sys.modules[name]
        gc.collect()
    return code


def serve(address: str, preload: list[str]) -> None:
    """The server's loop: listen first (requests queue while the libraries import), then one
    request at a time until a `stop`, or until the process that started it is gone."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    given, parent = set(os.environ), os.getppid()
    for name in preload:
        with contextlib.suppress(Exception):  # a failing import is the driver's to report
            importlib.import_module(name)
    listener.settimeout(5.0)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the tests that started it are gone (killed): so is it
                os._exit(0)
            continue
        conn.settimeout(None)
        with conn:
            request = json.loads(_read_line(conn) or b"{}")
            if not request or request.get("stop"):
                os._exit(0)  # nothing to flush: the runs' outputs are written; skip unloading the libraries
            conn.sendall(json.dumps({"code": _run(request, given)}).encode() + b"\n")


def _connect(address: str, wait_s: float = 120.0) -> socket.socket:
    """A connection to the server, waiting while it starts (it binds its socket first thing)."""
    deadline = time.monotonic() + wait_s
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(address)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def client(address: str, real: str, argv: list[str]) -> int:
    """The stand-in Python: `DRIVER SPEC OUT` to the server, anything else to the real Python."""
    if len(argv) != 3 or argv[0].startswith("-") or not argv[0].endswith(".py"):
        os.execv(real, [real, *argv])
    with tempfile.TemporaryDirectory(prefix="moeprune-shared-") as work:
        log = os.path.join(work, "log")
        request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "log": log}
        try:
            with _connect(address) as conn:
                conn.sendall(json.dumps(request).encode() + b"\n")
                answer = json.loads(_read_line(conn))
        except (OSError, ValueError) as exc:
            print(f"the shared {real} (tests/shared_python.py) is gone: {exc}", file=sys.stderr)
            return 1
        if os.path.exists(log):
            with open(log, "rb") as handle:
                sys.stdout.buffer.write(handle.read())
        return int(answer["code"])


@contextlib.contextmanager
def shared_python(real: Path, preload: tuple[str, ...] = ()) -> Iterator[Path]:
    """A stand-in for the Python `real`, backed by one server process of it (stopped on exit)."""
    work = Path(tempfile.mkdtemp(prefix="mp-shared-"))  # short: a socket path has 107 bytes at most
    address = str(work / "s")
    log = (work / "server.log").open("w")
    server = subprocess.Popen([str(real), __file__, address, *preload], stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)  # fmt: skip
    stand_in = work / "python"
    stand_in.write_text(STAND_IN.format(python=sys.executable, tests=str(Path(__file__).parent),
                                        address=address, real=str(real)))  # fmt: skip
    stand_in.chmod(0o755)
    try:
        yield stand_in
    finally:
        with contextlib.suppress(OSError), _connect(address, wait_s=5.0) as conn:
            conn.sendall(b'{"stop": true}\n')
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        for path in work.iterdir():
            path.unlink()
        work.rmdir()


if __name__ == "__main__":
    del sys.path[0]  # tests/ (this file's folder): a driver's run sees its own folder there instead
    serve(sys.argv[1], sys.argv[2:])
