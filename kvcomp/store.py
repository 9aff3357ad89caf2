"""Stores: KV bytes that outlive a process (compress once, ask many).

A :class:`Store` holds *entries*. An entry is a key, a manifest (JSON: the caller's metadata and every part's
name, size and sha256) and named binary *parts* (a layer's compressed state, a layer's full KV, ...):

======================================  =====================================================================
``put(key, parts, meta, ttl=None)``     write every part, then publish the manifest in one atomic step
``manifest(key)`` / ``metadata(key)``   the manifest / the caller's metadata (:class:`KeyMissing` if absent)
``get(key, names=None)``                ``(manifest, {name: bytes})``, each part checked against its sha256
``stream(key, names)``                  the parts one at a time, in the order asked: a streaming get by layer
``read(manifest, name, start, stop)``   a byte range of a part (full KV read per token range), size-checked
``read_ranges(manifest, name, spans)``  many ranges in one round trip (a retrieval step's scattered tokens)
``delete(key)`` / ``list(prefix)``      remove an entry / the keys
======================================  =====================================================================

Atomic writes: the parts of a ``put`` are written under a fresh generation id where no reader looks, and the
manifest naming them is published last, in one step (a directory rename; a Lua script on Redis). A reader
sees the whole entry or none of it; a writer killed mid-way leaves no entry (its half-written parts are
removed by the next process that opens the store, or expire on Redis). Replacing a key publishes the new
generation, then deletes the old one's parts, so a reader still streaming the old one gets
:class:`KeyEvicted`, never a mix of both.

Faults are errors that say what happened, never a partial or wrong result: :class:`StoreUnavailable` (server
down or unreachable, a timeout), :class:`KeyMissing` (no such key), :class:`KeyEvicted` (the manifest is there
but a part is gone, short or does not match its digest: evicted under memory pressure, deleted or replaced
while being read, corrupted), :class:`StoreFull` (the filesystem or Redis's ``maxmemory`` has no room; nothing
of the entry is left), and :class:`StoreMismatch` (raised by :mod:`kvcomp.contexts`: an entry of another model,
kvcomp version, format or compressor). All are :class:`~kvcomp.validation.ResourceError` s, which the
``kvcomp`` command prints as one line.

Backends, one file each, by URL (:func:`open_store`): :class:`kvcomp.directory_store.DirectoryStore` (a path
or ``file:///path``; the default, ``$KVCOMP_STORE`` or ``~/.cache/kvcomp/store``; no server) and
:class:`kvcomp.redis_store.RedisStore` (``redis://host:port/db``). A new backend (LMCache, Mooncake, S3) is one
more file: a :class:`Store` subclass implementing the primitives below (``_write_parts``, ``_commit``,
``_abort``, ``_read_manifest``, ``_read_part``, ``_delete``, ``_drop_generation``, ``_keys``; ``_read_ranges``
if it can batch), registered with :func:`register_store` or the entry-point group ``kvcomp.stores``.

The store as a tier: :class:`StoreTier` is the :mod:`kvcomp.tiers` kind ``"store"`` (``make_tier("store",
store=url)``, ``Lossless(tier="store", tier_options={"store": url})``): the full KV a prefill writes goes to
the store, one entry per layer, and every read (lossless verification, retrieval's fetches) comes back from
it, over the network for Redis; tokens appended later (a question, decoded tokens) stay in memory. Over a
saved context (:mod:`kvcomp.contexts`) it reads the context's stored full KV and writes nothing.

What the bytes are: K/V and compressed states **in plaintext**, as in the disk tier (``kvcomp/tiers.py``). A
directory store's files are readable by their owner only (directories 0700, files 0600), written without
following symbolic links; a Redis server must be trusted with the prompt (bind it to localhost or a private
network, set a password: ``redis://:password@host:port/db``). A store tier's own scratch entries (a fresh
run's full KV) are deleted on close, garbage collection, exit and SIGTERM, and carry a time to live for what a
SIGKILL leaves.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import time
import uuid
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from kvcomp import tiers
from kvcomp.tiers import RamTier, Tier
from kvcomp.validation import ResourceError

MANIFEST_FORMAT = "kvcomp-store-entry/1"
_KEY = re.compile(r"^[A-Za-z0-9._:@=+,/-]{1,512}$")


# -- errors -----------------------------------------------------------------------------------------------------
class StoreError(ResourceError):
    """A store could not give or take what was asked; the message says what happened and what to do."""


class StoreUnavailable(StoreError):
    """The store's server is down or unreachable (or stopped answering mid-way)."""


class KeyMissing(StoreError, KeyError):
    """No entry under this key (never written, deleted, or expired)."""


class KeyEvicted(StoreError):
    """The entry's manifest is there but one of its parts is gone, short or corrupt: evicted under memory
    pressure, deleted or replaced while it was being read."""


class StoreFull(StoreError):
    """The store has no room for an entry; nothing of it was kept."""

    def __init__(self, message: str, url: str = "", needed: int = 0):
        super().__init__(errno.ENOSPC, message)
        self.url, self.needed = url, needed


class StoreMismatch(StoreError):
    """An entry that does not belong to this model, kvcomp version, format or compressor."""


def _err(cls, message: str, code: int = errno.EIO):
    return cls(code, message)


# -- manifests --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    name: str
    index: int  # the part's address within its generation
    size: int
    sha256: str


@dataclass
class Manifest:
    """What a reader needs to find and check an entry's parts."""

    key: str
    gen: str  # generation id: the parts of this version of the entry
    meta: dict[str, Any]
    parts: dict[str, Part]
    created: float
    expires: float | None = None  # unix time after which the entry no longer exists (None: never)

    @property
    def nbytes(self) -> int:
        return sum(p.size for p in self.parts.values())

    def part(self, name: str) -> Part:
        if name not in self.parts:
            raise _err(KeyMissing, f"entry {self.key!r} has no part {name!r} (it has {len(self.parts)}: "
                                   f"{', '.join(list(self.parts)[:8])}...).", errno.ENOENT)
        return self.parts[name]

    def to_bytes(self) -> bytes:
        return json.dumps({"format": MANIFEST_FORMAT, "key": self.key, "gen": self.gen, "meta": self.meta,
                           "parts": [[p.name, p.index, p.size, p.sha256] for p in self.parts.values()],
                           "created": self.created, "expires": self.expires}).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        try:
            d = json.loads(data)
            if d.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format {d.get('format')!r}")
            parts = {name: Part(name, int(i), int(size), str(digest)) for name, i, size, digest in d["parts"]}
            return cls(str(d["key"]), str(d["gen"]), dict(d["meta"]), parts, float(d["created"]), d.get("expires"))
        except (ValueError, KeyError, TypeError) as err:
            raise _err(StoreMismatch, f"{where}: not a kvcomp store entry of format {MANIFEST_FORMAT} ({err}); "
                                      "written by another program or kvcomp version. Delete it or use another key.",
                       errno.EINVAL) from None

    @property
    def expired(self) -> bool:
        return self.expires is not None and time.time() >= self.expires


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key) or ".." in key.split("/"):
        raise _err(StoreError, f"bad store key {key!r}: use 1-512 characters of A-Z a-z 0-9 . _ : @ = + , / -",
                   errno.EINVAL)
    return key


# -- the protocol -----------------------------------------------------------------------------------------------
class Store:
    """Base of every backend (see the module docstring for the protocol and its guarantees)."""

    scheme: ClassVar[str] = ""
    url: str = ""

    # -- what a backend implements ---------------------------------------------------------------------
    def _write_parts(self, gen: str, parts: list[tuple[int, bytes]], ttl: float | None) -> None:
        """Write the parts of generation ``gen`` where no reader looks yet (and where they expire, or are swept,
        if the writer dies before :meth:`_commit`)."""
        raise NotImplementedError

    def _commit(self, manifest: Manifest, ttl: float | None) -> Manifest | None:
        """Publish ``manifest`` atomically, its parts becoming permanent (or expiring with ``ttl``); return the
        manifest it replaced, if any. Must fail (and publish nothing) if a part of the generation is missing."""
        raise NotImplementedError

    def _abort(self, gen: str, n_parts: int) -> None:
        """Remove what :meth:`_write_parts` wrote for ``gen`` (best effort)."""
        raise NotImplementedError

    def _read_manifest(self, key: str) -> bytes | None:
        raise NotImplementedError

    def _read_part(self, manifest: Manifest, part: Part, start: int = 0, stop: int | None = None) -> bytes | None:
        """Bytes ``[start, stop)`` of the part (None: the part does not exist)."""
        raise NotImplementedError

    def _read_ranges(self, manifest: Manifest, part: Part, spans: list[tuple[int, int]]) -> list[bytes | None]:
        return [self._read_part(manifest, part, a, b) for a, b in spans]

    def _delete(self, key: str, manifest: Manifest | None) -> bool:
        """Remove the entry (manifest first, then the parts of ``manifest``'s generation)."""
        raise NotImplementedError

    def _drop_generation(self, manifest: Manifest) -> None:
        """Remove the parts of a replaced generation (its manifest is no longer published)."""
        raise NotImplementedError

    def _keys(self, prefix: str) -> list[str]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the protocol ----------------------------------------------------------------------------------
    def put(self, key: str, parts: Mapping[str, bytes | bytearray | memoryview], meta: dict[str, Any] | None = None,
            ttl: float | None = None) -> Manifest:
        """Store ``parts`` (name -> bytes) and ``meta`` (JSON-able) under ``key``, replacing what was there;
        atomic. ``ttl``: seconds after which the entry is gone (None: kept until deleted)."""
        check_key(key)
        gen = uuid.uuid4().hex
        table, blobs = {}, []
        for i, (name, data) in enumerate(parts.items()):
            data = memoryview(data).cast("B")
            table[name] = Part(name, i, data.nbytes, hashlib.sha256(data).hexdigest())
            blobs.append((i, data))
        now = time.time()
        manifest = Manifest(key, gen, dict(meta or {}), table, now, None if ttl is None else now + ttl)
        try:
            self._write_parts(gen, blobs, ttl)
            old = self._commit(manifest, ttl)
        except BaseException:
            self._abort(gen, len(blobs))
            raise
        if old is not None and old.gen != gen:
            self._drop_generation(old)
        return manifest

    def manifest(self, key: str) -> Manifest:
        data = self._read_manifest(check_key(key))
        manifest = None if data is None else Manifest.from_bytes(data, f"{self.url} key {key!r}")
        if manifest is None or manifest.expired:
            raise _err(KeyMissing, f"no entry {key!r} in the store {self.url} (never written, deleted, or expired).",
                       errno.ENOENT)
        return manifest

    def metadata(self, key: str) -> dict[str, Any]:
        return self.manifest(key).meta

    def exists(self, key: str) -> bool:
        try:
            self.manifest(key)
            return True
        except KeyMissing:
            return False

    def read(self, manifest: Manifest, name: str, start: int = 0, stop: int | None = None,
             verify: bool | None = None) -> bytes:
        """Bytes ``[start, stop)`` of part ``name``. A whole part is checked against its sha256 (unless
        ``verify=False``); a range against its size only."""
        part = manifest.part(name)
        stop = part.size if stop is None else min(stop, part.size)
        start = max(0, min(start, stop))
        data = self._read_part(manifest, part, start, stop)
        self._check(manifest, part, data, stop - start)
        whole = start == 0 and stop == part.size
        if (verify if verify is not None else whole) and whole and hashlib.sha256(data).hexdigest() != part.sha256:
            raise _err(KeyEvicted, f"part {name!r} of {manifest.key!r} in {self.url} does not match its digest "
                                   "(corrupt, or replaced while being read); nothing of it was used.")
        return data

    def read_ranges(self, manifest: Manifest, name: str, spans: list[tuple[int, int]]) -> list[bytes]:
        """Byte ranges ``[(start, stop), ...]`` of part ``name``, in one round trip where the backend can."""
        part = manifest.part(name)
        if any(a < 0 or b > part.size or a > b for a, b in spans):
            raise ValueError(f"read_ranges: a span outside the {part.size} bytes of {name!r}.")
        out = self._read_ranges(manifest, part, spans)
        for data, (a, b) in zip(out, spans):
            self._check(manifest, part, data, b - a)
        return out

    def _check(self, manifest: Manifest, part: Part, data: bytes | None, expected: int) -> None:
        if data is None or len(data) != expected:
            got = "nothing" if data is None else f"{len(data)} bytes"
            raise _err(KeyEvicted, f"part {part.name!r} of {manifest.key!r} in {self.url} is gone or short ({got}, "
                                   f"expected {expected}): evicted, deleted or replaced while being read. Nothing "
                                   "of it was used; write the entry again (or recompute).")

    def get(self, key: str, names: Iterable[str] | None = None) -> tuple[Manifest, dict[str, bytes]]:
        manifest = self.manifest(key)
        names = list(manifest.parts) if names is None else list(names)
        return manifest, {name: self.read(manifest, name) for name in names}

    def stream(self, key: str | Manifest, names: Iterable[str] | None = None) -> Iterator[tuple[str, bytes]]:
        """The parts ``names`` (default: all) one at a time, each checked: a streaming get (by layer)."""
        manifest = key if isinstance(key, Manifest) else self.manifest(key)
        for name in (list(manifest.parts) if names is None else names):
            yield name, self.read(manifest, name)

    def delete(self, key: str) -> bool:
        """Remove the entry; False when there was none."""
        check_key(key)
        data = self._read_manifest(key)
        manifest = None if data is None else Manifest.from_bytes(data, f"{self.url} key {key!r}")
        return self._delete(key, manifest)

    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix`` (expired entries excluded), sorted."""
        return sorted(self._keys(prefix))

    def entries(self, prefix: str = "") -> list[Manifest]:
        out = []
        for key in self.list(prefix):
            try:
                out.append(self.manifest(key))
            except (KeyMissing, StoreMismatch):
                continue
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


# -- the registry -----------------------------------------------------------------------------------------------
_BACKENDS: dict[str, type[Store] | str] = {"file": "kvcomp.directory_store:DirectoryStore",
                                           "redis": "kvcomp.redis_store:RedisStore"}
_ENTRY_POINTS = "kvcomp.stores"


def register_store(scheme: str, cls: type[Store] | str) -> None:
    """``open_store("<scheme>://...")`` builds ``cls(url)`` (a :class:`Store` subclass or ``"module:attr"``)."""
    _BACKENDS[scheme] = cls


def store_schemes() -> list[str]:
    from importlib.metadata import entry_points

    return sorted({*_BACKENDS, *(ep.name for ep in entry_points(group=_ENTRY_POINTS))})


def default_store_url() -> str:
    from kvcomp.files import cache_dir

    return os.environ.get("KVCOMP_STORE") or str(cache_dir() / "store")


def open_store(spec: str | os.PathLike | Store | None = None) -> Store:
    """A store from a URL (``redis://host:port/db``, ``file:///path``), a directory path, or a Store (returned
    as is); None: the default directory store (``$KVCOMP_STORE`` or ``~/.cache/kvcomp/store``)."""
    if isinstance(spec, Store):
        return spec
    text = os.fspath(spec) if spec is not None else default_store_url()
    scheme, sep, _ = text.partition("://")
    if not sep:
        scheme = "file"
    if scheme not in _BACKENDS:
        from importlib.metadata import entry_points

        for ep in entry_points(group=_ENTRY_POINTS):
            if ep.name == scheme:
                _BACKENDS[scheme] = ep.load()
    cls = _BACKENDS.get(scheme)
    if cls is None:
        raise _err(StoreError, f"no store backend for {text!r}: known schemes are {', '.join(store_schemes())} "
                               "(a plain path is a directory store).", errno.EINVAL)
    if isinstance(cls, str):
        import importlib

        module, _, attr = cls.partition(":")
        cls = _BACKENDS[scheme] = getattr(importlib.import_module(module), attr)
    return cls(text)


# -- full KV as parts -------------------------------------------------------------------------------------------
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def kv_bytes(k: torch.Tensor, v: torch.Tensor) -> tuple[bytes, dict[str, Any]]:
    """A layer's K/V ``[B, H, L, D]`` as one part, head-major ``[B, H, L, 2, D]`` (a head's tokens are one
    contiguous run, so a token range or a page of one head is one ranged read), and its description."""
    kv = torch.stack([k, v], dim=3).contiguous().cpu()
    data = kv.view(torch.uint8).numpy().tobytes()
    return data, {"shape": list(k.shape), "dtype": str(k.dtype).removeprefix("torch.")}


def kv_from_bytes(data: bytes, info: dict[str, Any], device=None, spare: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of a part (:func:`kv_bytes`), each a contiguous ``[B, H, L + spare, D]`` tensor on ``device``
    whose first ``L`` tokens are the part's (the ``spare`` ones are left for the caller to fill): one pass over
    the bytes, which are only read (no copy of them is made first)."""
    b, h, n, d = info["shape"]
    dtype = _DTYPES[info["dtype"]]
    with warnings.catch_warnings():  # a read-only buffer, and this view of it is only read
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        kv = torch.frombuffer(data, dtype=dtype) if len(data) else torch.empty(0, dtype=dtype)
    kv = kv.view(b, h, n, 2, d)
    k, v = (torch.empty(b, h, n + spare, d, dtype=dtype, device=device) for _ in range(2))
    k[:, :, :n] = kv[..., 0, :]
    v[:, :, :n] = kv[..., 1, :]
    return k, v


@dataclass
class _Base:
    """A layer's stored K/V: part ``name`` of ``manifest``, ``[B, H, length, 2, D]``."""

    manifest: Manifest
    name: str
    shape: tuple[int, int, int, int]  # B, H, length, D
    dtype: torch.dtype
    limit: int  # tokens of it in use (a crop below the stored length lowers it)

    @property
    def token_bytes(self) -> int:
        return 2 * self.shape[3] * self.dtype.itemsize


def _delete_keys(store: Store, keys: list[str], pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child must not delete its parent's entries
    for key in list(keys):
        try:
            store.delete(key)
        except StoreError:
            pass  # unreachable now: the entry's time to live removes it
        keys.remove(key)


class StoreTier(Tier):
    """The tier kind ``"store"``: a layer's K/V in a :class:`Store`, read back on every ``read``/``gather``.

    ``StoreTier(device, store=url)``: a fresh run's tier; ``write`` (the prefill's K/V, lossless decoding's
    ``tee``) puts the layer into the store as its own scratch entry (deleted by ``free``/``close``, garbage
    collection, exit and SIGTERM; ``ttl`` seconds, default 6 hours, bound what a SIGKILL leaves).
    :meth:`over` opens the full KV of a saved context instead (read-only, nothing written to the store). Either
    way tokens added by ``append`` after the stored ones stay in memory on ``device`` (a question, decoded
    tokens: a few hundred, against the thousands in the store), so nothing but the stored prompt crosses the
    network. ``cache=True`` keeps each layer after its first read (then the store is read once per layer).
    """

    kind = "store"

    def __init__(self, device=None, store: str | Store | None = None, ttl: float | None = 6 * 3600.0,
                 cache: bool = False):
        super().__init__(device)
        if store is None:
            raise _err(StoreError, "the 'store' tier needs store=<URL or Store>, e.g. "
                                   "Lossless(tier='store', tier_options={'store': 'redis://127.0.0.1:6379/0'}).",
                       errno.EINVAL)
        self.store = open_store(store)
        self.ttl = ttl
        self.cache = cache
        self._base: dict[int, _Base] = {}
        self._tail = RamTier(self.device)
        self._version: dict[int, int] = {}
        self._cached: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._prefix = f"kvcomp-scratch/{os.getpid()}-{uuid.uuid4().hex[:12]}/"
        self._scratch: list[str] = []
        self._finalizer = weakref.finalize(self, _delete_keys, self.store, self._scratch, os.getpid())
        self._closed = False

    @classmethod
    def over(cls, store: Store, manifest: Manifest, layers: Mapping[int, str], device=None,
             cache: bool = False) -> StoreTier:
        """A tier reading layer ``i``'s K/V from part ``layers[i]`` of a stored entry (``manifest.meta["kv"]``
        describes each part, as :func:`kv_bytes` returns)."""
        tier = cls(device, store=store, cache=cache)
        for layer, name in layers.items():
            info = manifest.meta["kv"][name]
            tier._base[layer] = _Base(manifest, name, tuple(info["shape"]), _DTYPES[info["dtype"]],
                                      info["shape"][2])
            tier._version[layer] = next(tier._versions)
        return tier

    # -- API -------------------------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return sorted(set(self._base) | set(self._tail.layers))

    def length(self, layer: int) -> int:
        base = self._base.get(layer)
        return (0 if base is None else base.limit) + self._tail.length(layer)

    def version(self, layer: int) -> int:
        return self._version.get(layer, -1)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("StoreTier is closed.")
        with self._lock:
            self.free(layer)
            data, info = kv_bytes(k, v)
            key = f"{self._prefix}layer{layer}"
            if key not in self._scratch:
                self._scratch.append(key)
                tiers.on_sigterm_cleanup(("store-tier", id(self)), self._finalizer)
            manifest = self.store.put(key, {"kv": data}, {"kv": {"kv": info}, "scratch": True}, ttl=self.ttl)
            self._base[layer] = _Base(manifest, "kv", tuple(k.shape), k.dtype, k.shape[2])
            self._version[layer] = next(self._versions)
            self.bytes_written += len(data)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        with self._lock:
            if layer not in self._base:
                self.write(layer, k, v)
                return
            self._tail.append(layer, k, v)
            self.bytes_written += 2 * k.numel() * k.element_size()

    def _whole(self, layer: int, base: _Base, spare: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored part of ``layer`` (``[B, H, stored + spare, D]``: see :func:`kv_from_bytes`; ``spare`` is
        ignored for a cached layer)."""
        if layer in self._cached:
            return self._cached[layer]
        info = {"shape": list(base.shape), "dtype": str(base.dtype).removeprefix("torch.")}
        data = self.store.read(base.manifest, base.name, verify=False)
        self.bytes_read += len(data)
        k, v = kv_from_bytes(data, info, self.device, spare=0 if self.cache else spare)
        if self.cache:
            self._cached[layer] = (k, v)
        return k, v

    def read(self, layer: int, start: int = 0, stop: int | None = None, device=None,
             non_blocking: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            if layer not in self._base:
                raise KeyError(f"StoreTier holds no K/V for layer {layer} (layers: {self.layers}).")
            base = self._base[layer]
            total = self.length(layer)
            stop = total if stop is None else min(stop, total)
            start = max(0, min(start, stop))
            parts = []
            if start == 0 and base.limit == base.shape[2] and stop > base.limit and layer not in self._cached:
                # The whole layer (what verification reads every round): stored part and tail in one buffer.
                tail = stop - base.limit
                k, v = self._whole(layer, base, spare=tail)
                tk, tv = self._tail.read(layer, 0, tail)
                k[:, :, base.limit:], v[:, :, base.limit:] = tk, tv
                return self._to(k, device, non_blocking), self._to(v, device, non_blocking)
            if start < base.limit:
                upto = min(stop, base.limit)
                if start == 0 and upto == base.shape[2] or layer in self._cached:
                    k, v = self._whole(layer, base)
                    parts.append((k[:, :, start:upto], v[:, :, start:upto]))
                else:
                    parts.append(self._read_span(base, start, upto))
            if stop > base.limit:
                parts.append(self._tail.read(layer, max(0, start - base.limit), stop - base.limit))
        k = torch.cat([p[0] for p in parts], dim=2) if len(parts) > 1 else parts[0][0]
        v = torch.cat([p[1] for p in parts], dim=2) if len(parts) > 1 else parts[0][1]
        return self._to(k, device, non_blocking), self._to(v, device, non_blocking)

    def _read_span(self, base: _Base, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[start, stop)`` of every row and head: one ranged read per (row, head)."""
        b, h, n, d = base.shape
        tb = base.token_bytes
        spans = [((i * n + start) * tb, (i * n + stop) * tb) for i in range(b * h)]
        blobs = self.store.read_ranges(base.manifest, base.name, spans)
        self.bytes_read += sum(len(x) for x in blobs)
        kv = torch.frombuffer(bytearray(b"".join(blobs)), dtype=base.dtype).view(b, h, stop - start, 2, d)
        kv = kv.to(self.device)
        return kv[..., 0, :], kv[..., 1, :]

    def gather_rows(self, layer: int, index: torch.Tensor, device=None,
                    non_blocking: bool = False) -> tuple[torch.Tensor, int]:
        """:meth:`Tier.gather_rows`: stored tokens come back in one batch of ranged reads, consecutive tokens of a
        head coalesced into one range; tokens appended after them from memory."""
        with self._lock:
            if layer not in self._base:
                raise KeyError(f"StoreTier holds no K/V for layer {layer} (layers: {self.layers}).")
            base = self._base[layer]
            b, h, n, d = base.shape
            if tuple(index.shape[:2]) != (b, h):
                raise ValueError(f"gather: index {tuple(index.shape)} does not match [B={b}, H={h}, k].")
            if bool((index >= self.length(layer)).any()):
                raise IndexError(f"gather: token index beyond the {self.length(layer)} stored in layer {layer}.")
            out = torch.zeros(*index.shape, 2, d, dtype=base.dtype)
            idx = index.cpu().numpy()
            stored = (idx >= 0) & (idx < base.limit)
            if layer in self._cached and stored.any():
                k, v = self._cached[layer]
                kv = torch.stack([k, v], dim=3).cpu()
                sel = torch.from_numpy(stored)
                bi, hi, ji = sel.nonzero(as_tuple=True)
                out[bi, hi, ji] = kv[bi, hi, index.cpu()[bi, hi, ji]]
            elif stored.any():
                self._gather_stored(base, idx, stored, out)
            tail = idx >= base.limit
            if tail.any():
                local = torch.from_numpy(np.where(tail, idx - base.limit, -1)).to(index.device)
                rows, _ = self._tail.gather_rows(layer, local)
                mask = torch.from_numpy(tail)
                out[mask] = rows.cpu()[mask]
        return self._to(out, device, non_blocking), int(stored.sum() + tail.sum())

    def _gather_stored(self, base: _Base, idx: np.ndarray, stored: np.ndarray, out: torch.Tensor) -> None:
        b, h, n, d = base.shape
        tb = base.token_bytes
        spans, where = [], []
        for bi in range(b):
            for hi in range(h):
                cols = np.nonzero(stored[bi, hi])[0]
                if not len(cols):
                    continue
                order = cols[np.argsort(idx[bi, hi, cols], kind="stable")]
                tokens = idx[bi, hi, order]
                cuts = np.nonzero(np.diff(tokens) != 1)[0] + 1
                for run_cols, run_tokens in zip(np.split(order, cuts), np.split(tokens, cuts)):
                    row = (bi * h + hi) * n
                    spans.append(((row + int(run_tokens[0])) * tb, (row + int(run_tokens[-1]) + 1) * tb))
                    where.append((bi, hi, run_cols))
        blobs = self.store.read_ranges(base.manifest, base.name, spans)
        self.bytes_read += sum(len(x) for x in blobs)
        flat = torch.frombuffer(bytearray(b"".join(blobs)), dtype=base.dtype).view(-1, 2, d)
        at = 0
        for bi, hi, cols in where:
            out[bi, hi, torch.from_numpy(cols)] = flat[at:at + len(cols)]
            at += len(cols)

    def crop(self, layer: int, length: int) -> None:
        with self._lock:
            base = self._base.get(layer)
            if base is None:
                raise KeyError(f"StoreTier holds no K/V for layer {layer}.")
            if length < 0:
                length = max(0, self.length(layer) + length)
            if length >= self.length(layer):
                return
            if length >= base.limit:
                self._tail.crop(layer, length - base.limit)
            else:
                self._tail.free(layer)
                base.limit = length
            self._version[layer] = next(self._versions)

    def free(self, layer: int) -> None:
        with self._lock:
            base = self._base.pop(layer, None)
            self._tail.free(layer)
            self._cached.pop(layer, None)
            self._version.pop(layer, None)
            if base is not None and base.manifest.key in self._scratch:
                try:
                    self.store.delete(base.manifest.key)
                except StoreError:
                    pass
                self._scratch.remove(base.manifest.key)

    def close(self) -> None:
        with self._lock:
            for layer in list(self._base):
                self.free(layer)
            self._tail.close()
            self._finalizer()
            tiers.drop_cleanup(("store-tier", id(self)))
            self._closed = True

    def nbytes(self) -> int:
        """Bytes of this tier's layers in the store plus the appended tokens held in memory."""
        return sum(self.nbytes_by_kind().values())

    def nbytes_by_kind(self) -> dict[str, int]:
        """``{"store": bytes in the store, "device": appended tokens in memory}``."""
        stored = sum(b.shape[0] * b.shape[1] * b.limit * b.token_bytes for b in self._base.values())
        return {"store": stored, "device": self._tail.nbytes()}


__all__ = [
    "KeyEvicted", "KeyMissing", "Manifest", "Part", "Store", "StoreError", "StoreFull",
    "StoreMismatch", "StoreTier", "StoreUnavailable", "kv_bytes", "kv_from_bytes", "open_store", "register_store",
]
