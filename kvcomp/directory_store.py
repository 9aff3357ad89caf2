"""The local-directory backend of :mod:`kvcomp.store` (the default store): a path or ``file:///path``.

Layout: ``<root>/entries/<sha256(key)>/`` holds ``manifest.json`` and the parts ``<gen>-<i>``; a put writes a
private ``<root>/.tmp/<pid>-<random>/`` (locked by its process for as long as it lives) and renames it into
place under ``<root>/.commit.lock``: one atomic step. Directories are 0700 and files 0600 (plaintext K/V),
written with ``O_NOFOLLOW``/``O_EXCL``; a store whose ``entries`` or ``.tmp`` is a symbolic link is refused.
The temporary directories of writers that died (SIGKILL, a crash) and expired entries are removed when a process
first opens the store; SIGTERM removes a writer's own. Free space is checked before anything is written, and
``ENOSPC`` while writing is a :class:`~kvcomp.store.StoreFull` with the partial entry removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import threading
import uuid

from kvcomp import tiers
from kvcomp.store import Manifest, Store, StoreError, StoreFull, StoreMismatch, _err

_OWNER = "owner.lock"
_swept: set[str] = set()
_sweep_lock = threading.Lock()


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _stale(path: str) -> bool:
    """Whether the temporary directory ``path`` (named ``<pid>-...``) belongs to a process that is gone."""
    return tiers.is_stale_dir(path, prefix="", lock_name=_OWNER)


def _write_file(path: str, data) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        view = memoryview(data).cast("B")
        while view.nbytes:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


class DirectoryStore(Store):
    """Entries under a local directory: ``<root>/entries/<sha256(key)>/`` holds ``manifest.json`` and the
    parts ``<gen>-<i>``. A put writes a private ``<root>/.tmp/<pid>-<random>/`` (locked by its process) and
    renames it into place: one atomic step. Temporary directories of dead writers and expired entries are
    removed when a process first opens the store. Space is checked before writing; a full filesystem is a
    :class:`StoreFull` with nothing left behind."""

    scheme = "file"

    def __init__(self, url: str | os.PathLike):
        text = os.fspath(url)
        path = text[len("file://"):] if text.startswith("file://") else text
        self.root = os.path.abspath(os.path.expanduser(path))
        self.url = f"file://{self.root}"
        for sub in ("", "entries", ".tmp"):
            d = os.path.join(self.root, sub) if sub else self.root
            if sub and os.path.islink(d):
                raise _err(StoreError, f"{d} is a symbolic link; kvcomp does not write a store through links.",
                           errno.ELOOP)
            os.makedirs(d, mode=0o700, exist_ok=True)
        with _sweep_lock:
            if self.root not in _swept:
                _swept.add(self.root)
                self.sweep()

    def _entry_dir(self, key: str) -> str:
        return os.path.join(self.root, "entries", hashlib.sha256(key.encode()).hexdigest()[:40])

    def sweep(self) -> list[str]:
        """Remove temporary directories of dead writers and expired entries; returns what was removed."""
        removed = []
        tmp = os.path.join(self.root, ".tmp")
        for name in os.listdir(tmp):
            path = os.path.join(tmp, name)
            if not os.path.islink(path) and os.path.isdir(path) and _stale(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        entries = os.path.join(self.root, "entries")
        for name in os.listdir(entries):
            data = self._read_file(os.path.join(entries, name, "manifest.json"))
            try:
                expired = data is not None and Manifest.from_bytes(data, name).expired
            except StoreMismatch:
                expired = False
            if expired:
                shutil.rmtree(os.path.join(entries, name), ignore_errors=True)
                removed.append(os.path.join(entries, name))
        return removed

    @staticmethod
    def _read_file(path: str, start: int = 0, stop: int | None = None) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            if stop is None:
                stop = os.fstat(fd).st_size
            out = bytearray(max(0, stop - start))
            view, at = memoryview(out), 0
            while at < len(out):
                n = os.preadv(fd, [view[at:]], start + at)
                if n == 0:
                    return bytes(out[:at])
                at += n
            return bytes(out)
        finally:
            os.close(fd)

    # -- primitives ------------------------------------------------------------------------------------
    def _tmp_dir(self, gen: str) -> str:
        return os.path.join(self.root, ".tmp", f"{os.getpid()}-{gen}")

    def _write_parts(self, gen, parts, ttl):
        total = sum(d.nbytes for _, d in parts)
        free = _free_bytes(self.root)
        if total > free:
            raise StoreFull(f"store full: {self.url} needs {total:,} bytes for this entry and its filesystem has "
                            f"{free:,} free. Free space there, delete entries (kvcomp store rm), or use another "
                            "store.", self.url, total)
        path = self._tmp_dir(gen)
        os.mkdir(path, 0o700)
        tiers.on_sigterm_cleanup(("store-tmp", path), lambda: shutil.rmtree(path, ignore_errors=True))
        lock = os.open(os.path.join(path, _OWNER), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        self._locks = getattr(self, "_locks", {})
        self._locks[gen] = lock
        try:
            for i, data in parts:
                _write_file(os.path.join(path, f"{gen}-{i}"), data)
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"store full: {self.url} ran out of space writing an entry of {total:,} bytes; "
                                "nothing of it was kept. Free space there or use another store.",
                                self.url, total) from None
            raise

    def _commit(self, manifest, ttl):
        path = self._tmp_dir(manifest.gen)
        for part in manifest.parts.values():
            if not os.path.isfile(os.path.join(path, f"{manifest.gen}-{part.index}")):
                raise _err(StoreError, f"store {self.url}: a part of the entry being written is missing.")
        _write_file(os.path.join(path, "manifest.json"), manifest.to_bytes())
        target = self._entry_dir(manifest.key)
        os.remove(os.path.join(path, _OWNER))
        with self._commit_lock():  # writers of one store publish one at a time (readers never wait)
            try:
                os.rename(path, target)
            except OSError as err:
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                trash = self._tmp_dir(uuid.uuid4().hex)
                os.rename(target, trash)  # readers of the old generation now find nothing, never a mix
                os.rename(path, target)
                shutil.rmtree(trash, ignore_errors=True)
        self._release(manifest.gen)
        return None  # the old generation's parts left with its directory

    @contextlib.contextmanager
    def _commit_lock(self):
        fd = os.open(os.path.join(self.root, ".commit.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _release(self, gen: str) -> None:
        lock = getattr(self, "_locks", {}).pop(gen, None)
        if lock is not None:
            os.close(lock)
        tiers.drop_cleanup(("store-tmp", self._tmp_dir(gen)))

    def _abort(self, gen, n_parts):
        shutil.rmtree(self._tmp_dir(gen), ignore_errors=True)
        self._release(gen)

    def _read_manifest(self, key):
        return self._read_file(os.path.join(self._entry_dir(key), "manifest.json"))

    def _read_part(self, manifest, part, start=0, stop=None):
        return self._read_file(os.path.join(self._entry_dir(manifest.key), f"{manifest.gen}-{part.index}"),
                               start, stop)

    def _delete(self, key, manifest):
        target = self._entry_dir(key)
        if not os.path.isdir(target):
            return False
        trash = self._tmp_dir(uuid.uuid4().hex)
        try:
            with self._commit_lock():
                os.rename(target, trash)
        except FileNotFoundError:
            return False
        shutil.rmtree(trash, ignore_errors=True)
        return manifest is not None and not manifest.expired

    def _drop_generation(self, manifest):
        pass  # the old generation's files left with its directory in _commit

    def _keys(self, prefix):
        keys = []
        entries = os.path.join(self.root, "entries")
        for name in os.listdir(entries):
            data = self._read_file(os.path.join(entries, name, "manifest.json"))
            manifest = None if data is None else _maybe_manifest(data)
            if manifest is not None and not manifest.expired and manifest.key.startswith(prefix):
                keys.append(manifest.key)
        return keys


def _maybe_manifest(data: bytes) -> Manifest | None:
    try:
        return Manifest.from_bytes(data, "")
    except StoreMismatch:
        return None
