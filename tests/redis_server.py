"""A real Redis server for the tests: Debian's ``redis-server`` on 127.0.0.1 and a free port, no persistence.

``make test`` (and ``.ci/run``) installs redis-server when it is missing (``make redis``); a machine without it
fails these tests with that instruction rather than skipping them. Each server dies with the test process
(``PR_SET_PDEATHSIG``), so a killed pytest leaves none behind; :meth:`RedisServer.stop` ends it otherwise.
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    proc: subprocess.Popen
    port: int
    dir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL, as a crashed or OOM-killed server."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start(directory: Path, *extra: str) -> RedisServer:
    """Start a server (extra arguments are redis-server options, e.g. ``--maxmemory 2mb``) and wait for PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run `make redis` (apt-get install -y redis-server); "
                    "`make test` and .ci/run do it themselves.")
    directory.mkdir(parents=True, exist_ok=True)
    for _ in range(5):
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "yes", "--save", "",
             "--appendonly", "no", "--dir", str(directory), "--daemonize", "no", "--loglevel", "warning", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        server = RedisServer(proc, port, directory)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if server.client().ping():
                    return server
            except Exception:
                time.sleep(0.05)
        server.stop()
    out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    pytest.fail(f"redis-server did not start: {out[-2000:]}")
