"""A real Redis server for the tests: :class:`kvcomp.redis_store.LocalServer` (Debian's redis-server on 127.0.0.1
and a free port, no persistence, killed with the test process).

``make test`` (and ``.ci/run``) installs redis-server when it is missing (``make redis``); a machine without it
fails these tests with that instruction rather than skipping them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcomp.redis_store import LocalServer


def start(directory: Path, *extra: str) -> LocalServer:
    """Start a server (extra arguments are redis-server options, e.g. ``--maxmemory 2mb``) and wait for PING."""
    try:
        return LocalServer(directory, *extra)
    except FileNotFoundError as err:
        pytest.fail(f"{err.strerror} `make test` and .ci/run install it themselves.")
