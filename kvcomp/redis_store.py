"""The Redis backend of :mod:`kvcomp.store`: ``redis://[:password@]host:port/db[?prefix=kvcomp:&timeout=30]``.

Layout (``prefix`` default ``kvcomp:``): the manifest of key ``K`` is the string ``<prefix>m:K``; part ``i`` of
generation ``G`` is the string ``<prefix>p:G:i`` (a Redis string holds up to 512 MB: one layer's K/V of a
long context fits; a bigger part is refused before anything is written).

Atomic put: the parts are written first with a one-hour expiry (so a writer killed mid-way leaves nothing for
long), then one Lua script checks that every part exists, makes them permanent (or gives them the entry's
time to live) and sets the manifest, all at once: Redis runs a script without interleaving other commands,
and refuses a script that writes when ``maxmemory`` is reached before it starts, so a full server is a
:class:`~kvcomp.store.StoreFull` with the written parts removed, never a manifest without its parts. A
replaced generation's parts are deleted after the new manifest is set.

Faults: a server that is down, refuses, or stops answering mid-read (``timeout`` seconds, default 30) is a
:class:`~kvcomp.store.StoreUnavailable`; a part evicted (an ``allkeys-*`` eviction policy) or deleted under a
reader is a :class:`~kvcomp.store.KeyEvicted` (a missing key reads as nothing, a range as short). Use a
``noeviction`` policy for stores that must keep what they hold. Redis Cluster is not supported (an entry's
keys would live on different nodes; the script needs them on one).
"""

from __future__ import annotations

import contextlib
import errno
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvcomp.store import Manifest, Part, Store, StoreError, StoreFull, StoreUnavailable

PENDING_MS = 3600 * 1000  # parts of a put not yet committed expire after an hour
MAX_PART = 512 * 1024 * 1024
_BATCH_BYTES = 64 << 20  # bytes sent per pipeline round trip while writing
_BATCH_RANGES = 4096  # GETRANGEs per pipeline round trip

_COMMIT = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    return redis.error_reply('KVCOMP_MISSING ' .. KEYS[i])
  end
end
local ttl = tonumber(ARGV[2])
for i = 2, #KEYS do
  if ttl > 0 then redis.call('PEXPIRE', KEYS[i], ttl) else redis.call('PERSIST', KEYS[i]) end
end
local old = redis.call('GET', KEYS[1])
if ttl > 0 then redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl) else redis.call('SET', KEYS[1], ARGV[1]) end
return old
"""


class RedisStore(Store):
    scheme = "redis"

    def __init__(self, url: str):
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        self.prefix = query.pop("prefix", "kvcomp:")
        timeout = float(query.pop("timeout", 30))
        clean = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))
        shown = parts.netloc.rsplit("@", 1)[-1]
        self.url = urlunsplit((parts.scheme, shown, parts.path or "/0", "", ""))
        self._redis = redis
        self.client = redis.Redis.from_url(clean, socket_timeout=timeout, socket_connect_timeout=min(timeout, 5.0),
                                           retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2))
        self._script = self.client.register_script(_COMMIT)

    def close(self) -> None:
        self.client.close()

    @contextlib.contextmanager
    def _guard(self, what: str):
        r = self._redis.exceptions
        try:
            yield
        except (r.ConnectionError, r.TimeoutError) as err:
            raise StoreUnavailable(errno.ECONNREFUSED, (
                f"the Redis store {self.url} is unreachable while {what} ({type(err).__name__}: {err}). Start the "
                "server or check the URL; nothing half-read was used.")) from None
        except r.ResponseError as err:
            if str(err).startswith("OOM") or "maxmemory" in str(err):
                # Close the connections that carried the refused writes: the server keeps each one's query
                # buffer (hundreds of KB after a batch of parts) until it goes, and would count it against the
                # next write too, even after entries were deleted to make room.
                self.client.connection_pool.disconnect()
                raise StoreFull(f"store full: the Redis server {self.url} is at its maxmemory while {what} ({err}); "
                                "nothing of the entry was kept. Delete entries (kvcomp store rm), raise maxmemory, "
                                "or use another store.", self.url) from None
            raise StoreError(errno.EIO, f"the Redis store {self.url} refused {what}: {err}") from None

    def _m(self, key: str) -> str:
        return f"{self.prefix}m:{key}"

    def _p(self, gen: str, index: int) -> str:
        return f"{self.prefix}p:{gen}:{index}"

    # -- primitives ------------------------------------------------------------------------------------
    def _write_parts(self, gen, parts, ttl):
        for _, data in parts:
            if data.nbytes > MAX_PART:
                raise StoreError(errno.EFBIG, f"a part of {data.nbytes:,} bytes is over Redis's 512 MB per value "
                                              f"({self.url}); use a directory store for it.")
        with self._guard("writing an entry"):
            pipe, queued = self.client.pipeline(transaction=False), 0
            for i, data in parts:
                pipe.set(self._p(gen, i), data, px=PENDING_MS)
                queued += data.nbytes
                if queued >= _BATCH_BYTES:
                    pipe.execute()
                    pipe, queued = self.client.pipeline(transaction=False), 0
            pipe.execute()

    def _commit(self, manifest, ttl):
        keys = [self._m(manifest.key)] + [self._p(manifest.gen, p.index) for p in manifest.parts.values()]
        ttl_ms = 0 if ttl is None else max(1, int(ttl * 1000))
        with self._guard("publishing an entry"):
            try:
                old = self._script(keys=keys, args=[manifest.to_bytes(), ttl_ms])
            except self._redis.exceptions.ResponseError as err:
                if "KVCOMP_MISSING" in str(err):
                    raise StoreError(errno.EIO, f"the Redis store {self.url} lost a part of the entry being "
                                                f"written before it was published (evicted?): {err}") from None
                raise
        if old is None:
            return None
        try:
            return Manifest.from_bytes(old, self.url)
        except StoreError:
            return None

    def _abort(self, gen, n_parts):
        with contextlib.suppress(Exception):  # best effort: the parts expire anyway
            keys = [self._p(gen, i) for i in range(n_parts)]
            for start in range(0, len(keys), 1024):
                self.client.delete(*keys[start:start + 1024])

    def _read_manifest(self, key):
        with self._guard(f"reading the manifest of {key!r}"):
            return self.client.get(self._m(key))

    def _read_part(self, manifest: Manifest, part: Part, start=0, stop=None):
        stop = part.size if stop is None else stop
        key = self._p(manifest.gen, part.index)
        with self._guard(f"reading part {part.name!r} of {manifest.key!r}"):
            if start == 0 and stop == part.size:
                return self.client.get(key)
            if stop <= start:
                return b"" if self.client.exists(key) else None
            return self.client.getrange(key, start, stop - 1)

    def _read_ranges(self, manifest, part, spans):
        key = self._p(manifest.gen, part.index)
        out: list[bytes | None] = []
        with self._guard(f"reading part {part.name!r} of {manifest.key!r}"):
            for at in range(0, len(spans), _BATCH_RANGES):
                pipe = self.client.pipeline(transaction=False)
                for a, b in spans[at:at + _BATCH_RANGES]:
                    pipe.getrange(key, a, b - 1)
                out.extend(pipe.execute())
        return out

    def _delete(self, key, manifest):
        with self._guard(f"deleting {key!r}"):
            existed = bool(self.client.delete(self._m(key)))
        if manifest is not None:
            self._drop_generation(manifest)
        return existed

    def _drop_generation(self, manifest):
        keys = [self._p(manifest.gen, p.index) for p in manifest.parts.values()]
        with self._guard(f"deleting the parts of {manifest.key!r}"):
            for start in range(0, len(keys), 1024):
                self.client.delete(*keys[start:start + 1024])

    def _keys(self, prefix):
        pattern = self._m(_glob_escape(prefix)) + "*"
        skip = len(self._m(""))
        with self._guard("listing keys"):
            return [k.decode()[skip:] for k in self.client.scan_iter(match=pattern, count=1000)]


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


# -- a local server for tests and benchmarks ------------------------------------------------------------------
def _die_with_parent() -> None:
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalServer:
    """Debian's ``redis-server`` on 127.0.0.1 and a free port, for tests and benchmarks: no persistence (no RDB,
    no AOF), its working files in ``directory``, killed when this process dies (``PR_SET_PDEATHSIG``, so not even
    a SIGKILL of the parent leaves it running) and stopped by :meth:`stop` or ``with``. ``extra``: more
    redis-server options (``"--maxmemory", "2mb"``)."""

    def __init__(self, directory, *extra: str, binary: str | None = None):
        import shutil
        import socket
        import subprocess
        import time
        from pathlib import Path

        binary = binary or shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(errno.ENOENT, "redis-server is not installed: run `make redis` "
                                                  "(apt-get install -y redis-server).")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        last = ""
        for _ in range(5):  # a port found free can be taken before the server binds it: try another
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
            log = self.dir / "redis.log"  # a file, not a pipe: a pipe nobody reads would block the server
            with open(log, "ab") as out:
                self.proc = subprocess.Popen(
                    [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--protected-mode", "yes", "--save",
                     "", "--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no", "--loglevel", "warning",
                     *extra], stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if self.client().ping():
                        return
                except Exception:
                    time.sleep(0.05)
            self.stop()
            last = log.read_text(errors="replace")
        raise RuntimeError(f"redis-server did not start: {last[-2000:]}")

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
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
