"""Files kvcomp writes into output directories: never through a symbolic link, one process per run directory.

* :func:`open_output` / :func:`write_text` / :func:`truncate` open with ``O_NOFOLLOW``: a results file, summary
  or report that is a symbolic link is refused (:class:`UnsafeOutput`) instead of writing, appending to or
  truncating whatever it points at, possibly outside the output directory. :func:`make_dirs` creates an output
  directory's subdirectories and refuses one that is a link (the files under it would escape too).
* :func:`lock_run_dir` takes an exclusive ``flock`` on ``<dir>/.kvcomp-run.lock`` and writes the holder (pid,
  host, command, start time) into it. A second process asking for the same directory is refused with
  :class:`RunDirBusy`, naming the holder: two processes appending to one run directory would duplicate every
  record. The kernel drops the lock when its process ends, however it ends, so a stale lock cannot exist.
  Within one process the lock is re-entrant (``experiments.run`` holds its run directory and calls
  :func:`eval.runner.run`, which asks for it again).
* :func:`cache_dir` is kvcomp's own cache (converted models, calibration artifacts, the compiled CPU kernel, the
  default store): ``$KVCOMP_CACHE``, else ``$XDG_CACHE_HOME/kvcomp``, else ``~/.cache/kvcomp``.
"""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import weakref
from pathlib import Path
from typing import IO

from kvcomp.validation import ResourceError


def cache_dir() -> Path:
    """kvcomp's cache directory (not created here)."""
    root = os.environ.get("KVCOMP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvcomp"
    )
    return Path(root)


LOCK_NAME = ".kvcomp-run.lock"


class UnsafeOutput(ResourceError):
    """An output path kvcomp would write is a symbolic link (or lies under one)."""


class RunDirBusy(ResourceError):
    """Another process is writing this run directory."""


def _refuse_link(path: Path) -> None:
    raise UnsafeOutput(
        errno.ELOOP,
        f"{path} is a symbolic link; kvcomp does not write through links (it could overwrite or truncate a file "
        "outside the output directory). Remove the link, or choose another output directory.",
    )


_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "r+": os.O_RDWR, "r": os.O_RDONLY}


def open_output(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8", newline: str | None = None
                ) -> IO:
    """``open(path, mode)`` for ``mode`` in w, a, r+, r (plus ``b``), refusing a symbolic link."""
    path = Path(path)
    binary = "b" in mode
    try:
        fd = os.open(path, _FLAGS[mode.replace("b", "")] | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            _refuse_link(path)
        raise
    if binary:
        return os.fdopen(fd, mode)
    return os.fdopen(fd, mode, encoding=encoding, newline=newline)


def write_text(path: str | os.PathLike, text: str) -> None:
    with open_output(path, "w") as f:
        f.write(text)


def append_text(path: str | os.PathLike, text: str) -> None:
    """One write in append mode (concurrent appenders of a sidecar file do not interleave lines)."""
    with open_output(path, "a") as f:
        f.write(text)
        f.flush()


def read_bytes(path: str | os.PathLike) -> bytes:
    with open_output(path, "rb") as f:
        return f.read()


def truncate(path: str | os.PathLike, size: int) -> None:
    with open_output(path, "r+b") as f:
        f.truncate(size)


def check_not_link(path: str | os.PathLike) -> None:
    if os.path.islink(path):
        _refuse_link(Path(path))


def make_dirs(path: str | os.PathLike, root: str | os.PathLike) -> Path:
    """``mkdir -p path`` for a ``path`` inside ``root`` (which may itself be a link: the user chose it), refusing
    any component below ``root`` that is a symbolic link."""
    path, root = Path(path), Path(root)
    rel = path.relative_to(root)
    current = root
    current.mkdir(parents=True, exist_ok=True)
    for part in rel.parts:
        current = current / part
        check_not_link(current)
        current.mkdir(exist_ok=True)
    return path


# -- run directory locks ---------------------------------------------------------------------------------------
_held: dict[str, list] = {}  # lock path -> [fd, count] for this process
_held_lock = threading.Lock()


class RunLock:
    """Holds a run directory's lock until :meth:`release` (or garbage collection, or process exit)."""

    def __init__(self, key: str, directory: Path):
        self.key, self.directory = key, directory
        self._finalizer = weakref.finalize(self, _release, key)

    def release(self) -> None:
        self._finalizer()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _release(key: str) -> None:
    with _held_lock:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            os.close(entry[0])  # drops the flock


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "a process that has just started"
    return (f"pid {info.get('pid')} on {info.get('host')}, since {info.get('started')}, "
            f"command: {info.get('command')}")


def lock_run_dir(directory: str | os.PathLike, what: str = "this run") -> RunLock:
    """Take the run directory's exclusive lock (creating the directory) or raise :class:`RunDirBusy`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    key = f"{os.getpid()}:{os.path.realpath(path)}"  # a forked child holds nothing of its parent's
    with _held_lock:
        if key in _held:
            _held[key][1] += 1
            return RunLock(key, directory)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:
                _refuse_link(path)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirBusy(
                errno.EBUSY,
                f"{directory} is being written by another kvcomp process ({holder}). Two processes writing one "
                f"run directory would duplicate every record of {what}: wait for that one to finish (a rerun "
                "then resumes), or write to another output directory.",
            ) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv) or sys.executable,
                "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        _held[key] = [fd, 1]
        return RunLock(key, directory)
