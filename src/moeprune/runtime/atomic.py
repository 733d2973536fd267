"""The one way moeprune writes results: complete or not at all, and never over the input.

- A folder is written into a temporary sibling (`.NAME.tmp-PID-...`) and moved into place with
  one rename. Replacing an existing folder swaps the two atomically (Linux `renameat2` with
  RENAME_EXCHANGE), so at every instant OUTPUT is either the complete old result or the complete
  new one; where the filesystem cannot swap, the old folder is renamed aside first and put back
  if anything fails, and a later run restores it if the process died in between.
- Temporary folders of processes that died (kill -9) are removed by the next write to the same
  output; new folders and files get the user's umask (mkdtemp alone would make them 0700).
- A lock file beside the output (`.NAME.lock`, held with flock) makes a second writer of the
  same output refuse, naming the first; a lock whose process is gone is taken over.
- JSON is written through a temporary file and a rename, and refuses NaN and infinity (strict
  JSON parsers reject them; a NaN in a report is a bug to surface, not to write).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from moeprune.errors import MoePruneError

_RENAME_EXCHANGE = 2  # linux/fs.h


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def check_not_inside(output: str | Path, inputs: list[str | Path], what: str = "output") -> None:
    """Refuse an output that is, contains or lies inside an input (symlinks resolved): writing or
    replacing it would modify or delete the input."""
    out = Path(output).resolve()
    for source in inputs:
        src = Path(source).resolve()
        if out == src:
            raise MoePruneError(
                f"the {what} {str(output)!r} is the input {str(source)!r}; write somewhere else"
            )
        if src in out.parents:
            raise MoePruneError(
                f"the {what} {str(output)!r} lies inside the input {str(source)!r}; write somewhere else"
            )
        if out in src.parents:
            raise MoePruneError(
                f"the {what} {str(output)!r} contains the input {str(source)!r} (replacing it would delete the "
                "input); write somewhere else"
            )


def check_output_dir(path: str | Path, overwrite: bool) -> Path:
    """Refuse an output folder that exists (unless overwriting) or that cannot be created, before
    any expensive work; nothing is written."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise MoePruneError(f"output path {str(path)!r} exists and is not a folder; choose another path")
        if not overwrite:
            raise MoePruneError(
                f"output folder {str(path)!r} already exists; choose another or allow overwriting it",
                options=("overwrite",),
            )
    check_creatable(path)
    return path


def check_creatable(path: Path) -> None:
    """The nearest existing ancestor of `path` must be a writable folder."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise MoePruneError(f"cannot create {str(path)!r}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MoePruneError(f"cannot create {str(path)!r}: no write permission in {parent}")


def _siblings(out_dir: Path, kind: str) -> Iterator[tuple[Path, int]]:
    """Temporary siblings `.NAME.<kind>-PID-...` of an output, with their writer's pid."""
    prefix = f".{out_dir.name}.{kind}-"
    if not out_dir.parent.is_dir():
        return
    for entry in out_dir.parent.iterdir():
        if entry.name.startswith(prefix):
            pid = entry.name[len(prefix) :].split("-", 1)[0]
            if pid.isdigit():
                yield entry, int(pid)


def recover(out_dir: Path) -> None:
    """Finish what a killed writer left: put a set-aside old result back, remove dead temporaries."""
    for old, pid in _siblings(out_dir, "old"):
        if _alive(pid) and pid != os.getpid():
            continue
        if not out_dir.exists():
            os.replace(old, out_dir)  # the swap was cut between its two renames: the old one returns
        else:
            shutil.rmtree(old, ignore_errors=True)
    for tmp, pid in _siblings(out_dir, "tmp"):
        if not _alive(pid) or pid == os.getpid():
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(a))


def make_temp_dir(out_dir: Path) -> Path:
    """A temporary sibling folder with the permissions a plain mkdir would give."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-", dir=out_dir.parent))
    tmp.chmod(0o777 & ~_umask())
    return tmp


def atomic_write_dir(out_dir: str | Path, write: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Run `write(tmp_dir)`, then put tmp_dir at out_dir in one step (replacing only on success)."""
    out_dir = Path(out_dir)
    recover(out_dir)
    out_dir = check_output_dir(out_dir, overwrite)
    tmp = make_temp_dir(out_dir)
    try:
        write(tmp)
        if not out_dir.exists():
            os.replace(tmp, out_dir)
        elif _exchange(tmp, out_dir):
            shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old result
        else:
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}-{time.monotonic_ns()}")
            os.replace(out_dir, old)
            try:
                os.replace(tmp, out_dir)
            except BaseException:
                os.replace(old, out_dir)
                raise
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def write_json(path: str | Path, data: object) -> None:
    """Atomic, strict JSON (temporary file + rename; NaN and infinity are refused)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    except ValueError as exc:
        raise MoePruneError(f"refusing to write {path}: it would hold a non-finite number ({exc})") from exc
    write_text(path, text)


def write_text(path: str | Path, text: str) -> None:
    """Atomic text file: the old file or the new one is there, never a half-written one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    try:
        with tmp.open("w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())  # on disk before the rename: even a power cut leaves a whole file
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------- lock
def lock_path(output: Path) -> Path:
    return output.parent / f".{output.name}.lock"


@contextmanager
def output_lock(output: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on OUTPUT for the whole run; a second writer refuses, naming the first.

    flock is released by the kernel when the holder dies, so a stale lock file (kill -9) never
    blocks anyone; the pid inside is only there to name the holder in the message.
    """
    output = Path(output).absolute()
    output.parent.mkdir(parents=True, exist_ok=True)
    path = lock_path(output)
    handle = _acquire(path, output)
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(
            f"moeprune pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}\n"
        )
        handle.flush()
        yield
    finally:
        path.unlink(missing_ok=True)
        handle.close()


def _acquire(path: Path, output: Path):
    """Open and flock the lock file; retry when the file was replaced between open and flock."""
    while True:
        handle = path.open("a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise MoePruneError(
                f"{str(output)!r} is being written by {holder}; wait for it to finish or choose another output"
            ) from None
        try:
            same = os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return handle
        handle.close()  # the holder removed it as we opened it: take the new one
