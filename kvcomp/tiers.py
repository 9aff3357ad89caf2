"""Where KV bytes live: the fast tier and slower tiers, and a background prefetcher with double buffering.

A :class:`Tier` holds, per layer, an appendable K/V of shape ``[B, H_kv, L, D]``:

=================================  ==========================================================================
``write(layer, k, v)``             replace the layer's K/V (prefill)
``append(layer, k, v)``            add tokens at the end (decoding, verified blocks)
``read(layer, start, stop)``       ``(k, v)`` of tokens ``[start, stop)``, ``[B, H, stop - start, D]``
``gather(layer, index)``           ``(k, v)`` of tokens ``index`` ``[B, H, k]`` (``-1``: not fetched, zeros)
``crop(layer, length)``            keep the first ``length`` tokens (lossless decoding drops rejected drafts)
``length(layer)``                  tokens stored
``free(layer)`` / ``close()``      release one layer / everything (the disk tier deletes its files)
``nbytes()``                       bytes allocated in this tier (capacity, not only the used part)
=================================  ==========================================================================

Tiers: :class:`RamTier` (a tensor on any torch device: GPU memory, or RAM on a CPU-only machine),
:class:`HostTier` (host memory, pinned when CUDA is present so copies to the GPU are asynchronous) and
:class:`DiskTier` (one memory-mapped file per layer under a private temporary directory, extended as tokens are
appended and deleted by ``free``/``close``, when the tier is garbage-collected, or at interpreter exit; it is
also a context manager), and :class:`kvcomp.store.StoreTier`, the kind ``"store"`` (a layer's K/V in a
:mod:`kvcomp.store`: a directory or a Redis server). ``make_tier(kind, ...)`` builds one from a registry of kinds
(:func:`register_tier`), so another place for KV bytes (LMCache, Mooncake, S3) is one class in one file, or one
:class:`kvcomp.store.Store` backend behind the ``"store"`` kind. Returned tensors are fresh copies on
the tier's ``device`` (the compute device), never views of the storage, so a later write cannot change them.

Where the disk tier's bytes go, and what they are: ``<root>/kvcomp-tier-<pid>-<random>/layer<i>.kv`` with
``<root>`` the ``directory`` given (``offload_dir=`` of FreeKV/SpeCache, ``tier_options`` of lossless decoding),
else ``$KVCOMP_OFFLOAD_DIR``, else the system temporary directory. The files hold the full K/V **in plaintext**
(unencrypted, at full precision: enough to recover much of the prompt), readable by the owner only (directory
0700, files 0600). They are removed on ``close``/``free``, garbage collection, interpreter exit and SIGTERM
(:func:`install_sigterm_cleanup` chains any earlier handler, then ends the process as SIGTERM would). What
SIGKILL, a power loss or a kernel crash leaves behind is removed the next time a kvcomp process opens a disk
tier in the same root (:func:`sweep_stale`: each directory holds ``owner.lock``, locked by its process as long
as it lives, so a directory whose lock is free belongs to a dead process). For prompts that must not touch a
disk, use ``tier="host"`` or point the root at an encrypted volume or a tmpfs.

Space: a layer's file is reserved (``posix_fallocate``) before it is mapped or grown, after a check of the free
space (``os.statvfs``), so a full filesystem raises :class:`TierFull` (naming the directory and the bytes needed;
the tier's files are removed) instead of a SIGBUS when a page of a sparse file finds no room.

Layout: storage is blocks of ``BLOCK`` tokens, ``[blocks, B, H, BLOCK, 2, D]``: a token's key and value for one
head are one contiguous run of ``2 * D * itemsize`` bytes, a head's tokens of one block are ``BLOCK`` consecutive
runs (a retrieved page of one KV head is one or two reads, not ``B * H`` times its bytes spread over the file),
and appending writes in the last block, growing the storage a whole block at a time. A disk tier is written
through a mapping of its file and gathered from with ``pread`` (the bytes copied out of the OS page cache; a
range read goes through the mapping): a recently written file may still be in RAM; that is what a real
offloading system on this machine would see too.

:class:`Prefetcher` moves reads off the critical path (a :class:`FetchRequest` is a gather of token indices
or a token range of one layer): ``submit(step, request)`` starts fetching in the
background (a worker thread on CPU; on CUDA the thread issues the copy on a side stream that first waits
for the submitting stream — the index is computed there — and the consumer waits on the copy's event; the
CUDA path is written but has not run on a GPU yet), ``wait(step)`` returns the :class:`FetchResult` submitted for exactly that ``step`` (or
``None``), and ``fetch(step, request)`` fetches synchronously. At most one submission is outstanding (double
buffering: one buffer in use, one filling); a submission for another step, or one whose layer was rewritten
or cropped since it was read (the tier's per-layer ``version``), is dropped and never returned. Bytes moved,
time waited, prefetches used and dropped are counted per step in :class:`TransferStats`.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import math
import mmap
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from kvcomp.kernels import cpu_native
from kvcomp.validation import ResourceError

TIER_KINDS = ("ram", "host", "disk")
BLOCK = 32  # tokens of one head stored one after the other (the storage's second-innermost token dimension)
_MIN_GROWTH = 256  # tokens added at least when a layer's storage grows
WRITE_CHUNK = 512  # tokens interleaved into the storage layout at a time (bounds the write's temporary copy)


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def _place(data: torch.Tensor, start: int, kv: torch.Tensor) -> None:
    """Write ``kv`` ``[B, H, n, 2, D]`` as tokens ``[start, start + n)`` of the blocked storage ``data``: whole
    blocks in one copy, the partial ones at either end apart."""
    n, at = kv.shape[2], 0
    while at < n:
        block, offset = divmod(start + at, BLOCK)
        if offset == 0 and n - at >= BLOCK:
            whole = (n - at) // BLOCK
            part = kv[:, :, at : at + whole * BLOCK].unflatten(2, (whole, BLOCK))  # [B, H, whole, BLOCK, 2, D]
            data[block : block + whole] = part.permute(2, 0, 1, 3, 4, 5)
            at += whole * BLOCK
        else:
            take = min(BLOCK - offset, n - at)
            data[block, :, :, offset : offset + take] = kv[:, :, at : at + take]
            at += take


@dataclass
class _Slot:
    data: torch.Tensor  # [blocks, B, H, BLOCK, 2, D]
    length: int = 0
    version: int = 0  # new (unique within the tier) on write and crop: whatever changes tokens already stored


class Tier:
    """Appendable per-layer K/V storage (see the module docstring). Subclasses own the allocation."""

    kind: ClassVar[str] = "device"  # the nbytes() key this tier's bytes are reported under

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._slots: dict[int, _Slot] = {}
        self._lock = threading.RLock()  # the prefetch worker reads while the model thread appends
        self._versions = itertools.count()  # never reused, so a request made before free + write is stale
        self.bytes_read = 0
        self.bytes_written = 0

    # -- storage (overridden by subclasses) ------------------------------------------------------------
    def _allocate(self, layer: int, blocks: int, tail: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Storage of ``blocks`` blocks, ``[blocks, *tail]``."""
        raise NotImplementedError

    def _grow(self, layer: int, slot: _Slot, blocks: int) -> torch.Tensor:
        data = self._allocate(layer, blocks, tuple(slot.data.shape[1:]), slot.data.dtype)
        used = _blocks(slot.length)
        data[:used] = slot.data[:used]
        return data

    def _release(self, layer: int) -> None:
        pass

    def _drop_pages(self, layer: int) -> None:
        """After an access: give back whatever of the layer's storage the access made resident in this process
        (a mapped file's pages). Default: nothing (the storage is the process's memory by design)."""

    def _gather_native(self, layer: int, slot: _Slot, index: torch.Tensor, out: torch.Tensor) -> int | None:
        """``out`` = the tokens ``index`` (``[B, H, k]``, on the storage's device) with the C kernel: the rows read,
        or None where it does not run (the gather then goes through torch). Default: a copy from the storage
        when it is CPU memory."""
        return cpu_native.gather_tokens(-1, slot.data, index, slot.length, BLOCK, out)

    def _write_native(self, layer: int, slot: _Slot, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Write ``k``, ``v`` ``[B, H, n, D]`` after the stored tokens with the C kernel; False where it does not
        (the write then goes through torch into the storage). Default: False."""
        return False

    # -- API -------------------------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return sorted(self._slots)

    def length(self, layer: int) -> int:
        slot = self._slots.get(layer)
        return 0 if slot is None else slot.length

    def version(self, layer: int) -> int:
        slot = self._slots.get(layer)
        return -1 if slot is None else slot.version

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the layer's K/V with ``k``, ``v`` ``[B, H, L, D]``."""
        with self._lock:
            old = self._slots.pop(layer, None)
            if old is not None:
                self._release(layer)
            b, h, n, d = k.shape
            data = self._allocate(layer, _blocks(max(n, 1)), (b, h, BLOCK, 2, d), k.dtype)
            self._slots[layer] = _Slot(data, 0, next(self._versions))
            self._put(layer, k, v)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add ``k``, ``v`` ``[B, H, n, D]`` after the stored tokens (``write`` if the layer is empty)."""
        with self._lock:
            if layer not in self._slots:
                self.write(layer, k, v)
                return
            slot = self._slots[layer]
            if tuple(k.shape[:2]) != tuple(slot.data.shape[1:3]) or k.shape[-1] != slot.data.shape[-1]:
                raise ValueError(f"append: K/V {tuple(k.shape)} do not match layer {layer}'s {tuple(slot.data.shape)}.")
            need, have = _blocks(slot.length + k.shape[2]), slot.data.shape[0]
            if need > have:
                slot.data = self._grow(layer, slot, max(need, have + max(have // 4, _MIN_GROWTH // BLOCK)))
            self._put(layer, k, v)

    def _put(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        slot = self._slots[layer]
        n = k.shape[2]
        if not self._write_native(layer, slot, k, v):
            # In bounded chunks: interleaving K and V into the storage layout never copies the whole layer.
            for a in range(0, n, WRITE_CHUNK):
                b = min(n, a + WRITE_CHUNK)
                kv = torch.stack([k[:, :, a:b], v[:, :, a:b]], dim=3)  # [B, H, b - a, 2, D]
                _place(slot.data, slot.length + a, kv.to(slot.data.device, slot.data.dtype))
            self._drop_pages(layer)
        slot.length += n
        self.bytes_written += 2 * k.numel() * slot.data.element_size()

    def _slot(self, layer: int) -> _Slot:
        if layer not in self._slots:
            raise KeyError(f"{type(self).__name__} holds no K/V for layer {layer} (layers: {self.layers}).")
        return self._slots[layer]

    def read(self, layer: int, start: int = 0, stop: int | None = None, device=None,
             non_blocking: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of tokens ``[start, stop)``, each ``[B, H, n, D]``, fresh tensors on ``device``."""
        with self._lock:
            slot = self._slot(layer)
            stop = slot.length if stop is None else min(stop, slot.length)
            start = max(0, min(start, stop))
            first, last = start // BLOCK, _blocks(stop)
            kv = slot.data[first:last].permute(1, 2, 0, 3, 4, 5)  # [B, H, blocks, BLOCK, 2, D], a view
            out = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device, pin_memory=self._pin_out(kv))
            out.copy_(kv)
            out = out.flatten(2, 3)[:, :, start - first * BLOCK : stop - first * BLOCK]  # [B, H, n, 2, D]
            self.bytes_read += out.numel() * out.element_size()
            self._drop_pages(layer)
        out = self._to(out, device, non_blocking)
        return out[..., 0, :], out[..., 1, :]

    def gather(self, layer: int, index: torch.Tensor, device=None,
               non_blocking: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` ``[B, H, k, D]`` of the tokens ``index`` ``[B, H, k]`` (long, per row and head).

        Entries ``< 0`` are not read: their K/V are zeros and they cost no bytes."""
        out, _ = self.gather_rows(layer, index, device, non_blocking)
        return out[..., 0, :], out[..., 1, :]

    def gather_rows(self, layer: int, index: torch.Tensor, device=None,
                    non_blocking: bool = False) -> tuple[torch.Tensor, int]:
        """:meth:`gather`'s K/V as rows ``[B, H, k, 2, D]``, and how many of them were read (entries ``>= 0``).

        A token's K and V of one head are one row of the storage: the C kernel copies the rows
        (:meth:`_gather_native`), else one ``index_select`` over the storage's ``[blocks * B * H * BLOCK, 2, D]``
        rows."""
        with self._lock:
            slot = self._slot(layer)
            b, h = slot.data.shape[1:3]
            if tuple(index.shape[:2]) != (b, h):
                raise ValueError(f"gather: index {tuple(index.shape)} does not match [B={b}, H={h}, k].")
            index = index.to(slot.data.device)
            shape = (*index.shape, *slot.data.shape[4:])
            out = torch.empty(shape, dtype=slot.data.dtype, device=slot.data.device,
                              pin_memory=self._pin_out(slot.data))
            try:
                wanted = self._gather_native(layer, slot, index, out) if index.numel() else 0
            except IndexError:
                raise IndexError(f"gather: token index beyond the {slot.length} stored in layer {layer}.") from None
            if wanted is None:
                wanted = self._gather_torch(layer, slot, index, out)
            self.bytes_read += wanted * math.prod(shape[3:]) * out.element_size()
        return self._to(out, device, non_blocking), wanted

    def _gather_torch(self, layer: int, slot: _Slot, index: torch.Tensor, out: torch.Tensor) -> int:
        """:meth:`gather`'s rows through torch (a device's storage, or no C kernel); returns the rows read."""
        b, h = slot.data.shape[1:3]
        rows = slot.data.view(-1, *slot.data.shape[4:])
        low, high = (int(x) for x in index.aminmax())
        if high >= slot.length:
            raise IndexError(f"gather: token index beyond the {slot.length} stored in layer {layer}.")
        heads = torch.arange(b * h, device=index.device).view(b, h, 1)
        flat = ((torch.div(index, BLOCK, rounding_mode="floor") * (b * h) + heads) * BLOCK + index % BLOCK).flatten()
        if low >= 0:  # everything wanted: the common case, one gather
            torch.index_select(rows, 0, flat, out=out.view(-1, *out.shape[3:]))
            wanted = index.numel()
        else:
            keep = (index >= 0).flatten().nonzero().squeeze(1)
            out.zero_()
            out.view(-1, *out.shape[3:])[keep] = rows.index_select(0, flat[keep])
            wanted = keep.numel()
        if wanted:
            self._drop_pages(layer)  # read through the storage (a mapped file's pages)
        return wanted

    def crop(self, layer: int, length: int) -> None:
        """Keep the first ``length`` tokens of the layer (``length < 0`` removes ``-length`` from the end)."""
        with self._lock:
            slot = self._slot(layer)
            if length < 0:
                length = max(0, slot.length + length)
            if length < slot.length:
                slot.length = length
                slot.version = next(self._versions)

    def free(self, layer: int) -> None:
        with self._lock:
            if self._slots.pop(layer, None) is not None:
                self._release(layer)

    def close(self) -> None:
        with self._lock:
            for layer in list(self._slots):
                self.free(layer)

    def nbytes(self) -> int:
        """Bytes allocated in this tier (all layers, whole capacity)."""
        return sum(s.data.numel() * s.data.element_size() for s in self._slots.values())

    def nbytes_by_kind(self) -> dict[str, int]:
        """:meth:`nbytes` under the key this tier's bytes are reported under (a tier whose bytes live in two
        places, :class:`kvcomp.store.StoreTier`, splits them)."""
        return {self.kind: self.nbytes()}

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------------------
    def _pin_out(self, like: torch.Tensor) -> bool:
        return False

    def _to(self, t: torch.Tensor, device, non_blocking: bool) -> torch.Tensor:
        device = self.device if device is None else torch.device(device)
        return t if t.device == device else t.to(device, non_blocking=non_blocking)


class RamTier(Tier):
    """The fast tier: a plain tensor on ``storage_device`` (GPU memory, or RAM on a CPU-only machine)."""

    kind = "device"

    def __init__(self, device=None, storage_device=None):
        super().__init__(device)
        self.storage_device = torch.device(storage_device) if storage_device is not None else self.device

    def _allocate(self, layer, blocks, tail, dtype):
        return torch.empty(blocks, *tail, dtype=dtype, device=self.storage_device)


class HostTier(Tier):
    """Host memory, pinned when CUDA is present (so host-to-GPU copies can overlap compute)."""

    kind = "host"

    def __init__(self, device=None, pin_memory: bool | None = None):
        super().__init__(device)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory

    def _allocate(self, layer, blocks, tail, dtype):
        return torch.empty(blocks, *tail, dtype=dtype, pin_memory=self.pin_memory)

    def _pin_out(self, like):
        return self.pin_memory and self.device.type == "cuda"


class TierFull(ResourceError):
    """The disk tier's filesystem has no room for the bytes a layer needs (``errno.ENOSPC``)."""

    def __init__(self, message: str, directory: str, needed: int, free: int):
        super().__init__(errno.ENOSPC, message)
        self.directory, self.needed, self.free = directory, needed, free


TIER_PREFIX = "kvcomp-tier-"
OWNER_LOCK = "owner.lock"
# Directories of live disk tiers of this process (insertion-ordered), for the SIGTERM cleanup.
_live_dirs: dict[str, None] = {}
_swept_roots: set[str] = set()
_sweep_lock = threading.Lock()
_sigterm_state: dict[str, Any] = {}
_live_cleanups: dict[Any, Any] = {}  # key -> callable, run on SIGTERM (on_sigterm_cleanup)


def _free_bytes(path: str) -> int:
    """Bytes an unprivileged process may still write on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _remove_dir(path: str, owner_pid: int | None = None, lock_fd: int | None = None) -> None:
    if owner_pid is not None and os.getpid() != owner_pid:
        return  # a forked child exiting must not delete its parent's tier
    _live_dirs.pop(path, None)
    shutil.rmtree(path, ignore_errors=True)
    if lock_fd is not None:
        os.close(lock_fd)


def _close_and_remove(fds: dict[int, int], path: str, owner_pid: int, lock_fd: int) -> None:
    """A disk tier's end: its layers' descriptors closed (a removed file open somewhere keeps its disk space),
    then :func:`_remove_dir`."""
    while fds:
        os.close(fds.popitem()[1])
    _remove_dir(path, owner_pid, lock_fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def is_stale_dir(path: str, prefix: str = TIER_PREFIX, lock_name: str = OWNER_LOCK) -> bool:
    """Whether the private directory ``path`` (named ``<prefix><pid>-...``, holding ``lock_name`` flock-ed by
    its owner as long as it lives) belongs to a process that is gone (see the module docstring). The one rule
    for the tiers' directories and the directory store's temporary ones."""
    lock = os.path.join(path, lock_name)
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        # Being created (the lock comes right after the directory), or left by a kvcomp without locks: the
        # pid in the name decides; a name without one cannot be judged and is left alone.
        pid = os.path.basename(path)[len(prefix):].split("-", 1)[0]
        return pid.isdigit() and not _pid_alive(int(pid))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its owner holds the lock: alive
    finally:
        os.close(fd)  # also releases a lock taken just now
    return True


def sweep_stale(root: str | os.PathLike) -> list[str]:
    """Remove the tier directories under ``root`` whose processes are dead (killed by SIGKILL, a crash);
    returns what was removed. Runs once per root and process, when the first disk tier opens there."""
    root = os.path.abspath(root)
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if not name.startswith(TIER_PREFIX) or path in _live_dirs or os.path.islink(path) or not os.path.isdir(path):
            continue
        if is_stale_dir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        warnings.warn(f"kvcomp: removed {len(removed)} offload director{'y' if len(removed) == 1 else 'ies'} left in "
                      f"{root} by processes that died without cleaning up (plaintext KV): "
                      f"{', '.join(os.path.basename(p) for p in removed)}.", stacklevel=3)
    return removed


def on_sigterm_cleanup(key: Any, cleanup) -> None:
    """Run ``cleanup()`` on SIGTERM too (as disk tiers' directories are removed), until :func:`drop_cleanup`;
    for other places plaintext KV goes (a store tier's scratch entries, :mod:`kvcomp.store`)."""
    install_sigterm_cleanup()
    _live_cleanups[key] = cleanup


def drop_cleanup(key: Any) -> None:
    _live_cleanups.pop(key, None)


def _on_sigterm(signum, frame) -> None:
    previous = _sigterm_state.get("previous")
    if os.getpid() == _sigterm_state.get("pid"):
        for path in list(_live_dirs):
            _remove_dir(path)
        for key, cleanup in list(_live_cleanups.items()):
            _live_cleanups.pop(key, None)
            try:
                cleanup()
            except Exception:  # a store that cannot be reached now: its entries expire on their own
                pass
    if callable(previous):
        previous(signum, frame)
        return
    # The default action: end the process as SIGTERM does (exit status 128 + 15 in a shell).
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install_sigterm_cleanup() -> bool:
    """Make SIGTERM remove this process's disk tiers first (once per process; from the main thread only, as
    Python requires). An earlier Python handler is called afterwards; with none, the process then ends as
    SIGTERM's default action would. A process that ignores SIGTERM keeps ignoring it. Returns whether the
    handler is installed."""
    if _sigterm_state.get("pid") == os.getpid():
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        return False
    _sigterm_state.update(pid=os.getpid(), previous=previous if callable(previous) else None)
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


class DiskTier(Tier):
    """One memory-mapped file per layer (``layer<i>.kv``) in a private directory under ``directory``
    (default: ``$KVCOMP_OFFLOAD_DIR`` or the system temporary directory). The files hold plaintext K/V: see
    the module docstring for where they go and when they are removed.

    The directory is removed by :meth:`close`, by ``with DiskTier() as tier:``, when the tier is
    garbage-collected (``weakref.finalize``, so also after an exception drops the last reference), at
    interpreter exit and on SIGTERM; the first tier of a process in a root sweeps what dead processes left."""

    kind = "disk"

    def __init__(self, device=None, directory: str | os.PathLike | None = None):
        super().__init__(device)
        root = os.path.abspath(directory or os.environ.get("KVCOMP_OFFLOAD_DIR") or tempfile.gettempdir())
        os.makedirs(root, exist_ok=True)
        install_sigterm_cleanup()
        with _sweep_lock:
            if root not in _swept_roots:
                _swept_roots.add(root)
                sweep_stale(root)
        self.path = tempfile.mkdtemp(prefix=f"{TIER_PREFIX}{os.getpid()}-", dir=root)
        _live_dirs[self.path] = None
        try:
            # Held as long as this tier lives; the kernel drops it when the process dies, however it dies.
            lock_fd = os.open(os.path.join(self.path, OWNER_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except BaseException:
            _remove_dir(self.path)
            raise
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        os.write(lock_fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fds: dict[int, int] = {}  # layer -> its file, open read-write
        self._finalizer = weakref.finalize(self, _close_and_remove, self._fds, self.path, os.getpid(), lock_fd)
        self._maps: dict[int, np.memmap] = {}
        self._meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}

    def file(self, layer: int) -> str:
        return os.path.join(self.path, f"layer{layer}.kv")

    def _map(self, layer: int, blocks: int, tail: tuple[int, ...], dtype: torch.dtype, create: bool) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        shape = (blocks, *tail[:-1], tail[-1] * itemsize)
        if create:  # the layer's descriptor, open as long as its file: the gathers read and the appends write it
            self._close_fd(layer)
            self._fds[layer] = os.open(self.file(layer), os.O_RDWR | os.O_NOFOLLOW | os.O_CREAT | os.O_TRUNC, 0o600)
        self._reserve(self._fds[layer], layer, math.prod(shape))
        mm = np.memmap(self.file(layer), dtype=np.uint8, mode="r+", shape=shape)
        self._maps[layer] = mm
        return torch.from_numpy(mm).view(dtype)

    def _reserve(self, fd: int, layer: int, size: int) -> None:
        """Make the file ``size`` bytes with its blocks allocated: writing a page of a sparse file on a full
        filesystem is a SIGBUS, not an error Python can catch."""
        have = os.fstat(fd).st_size
        need = size - have
        if need <= 0:
            return
        free = _free_bytes(self.path)
        if need > free:
            self._full(layer, need, free)
        try:
            os.posix_fallocate(fd, have, need)
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                self._full(layer, need, _free_bytes(self.path))
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(fd, size)  # a filesystem without fallocate: the free-space check is all there is

    def _full(self, layer: int, need: int, free: int) -> None:
        path = self.path
        self.close()
        raise TierFull(
            f"Offload disk full: layer {layer} of the disk tier needs {need:,} more bytes in {path}, and that "
            f"filesystem has {free:,} free. The tier's files were removed. Free space there, point the offload at "
            "a larger disk (offload_dir=... for FreeKV/SpeCache, Lossless(tier_options={'directory': ...}), or "
            "$KVCOMP_OFFLOAD_DIR), or keep the full KV in memory (tier='host').", path, need, free)

    def _allocate(self, layer, blocks, tail, dtype):
        if not self._finalizer.alive:
            raise RuntimeError("DiskTier is closed.")
        self._meta[layer] = (tail, dtype)
        return self._map(layer, blocks, tail, dtype, create=True)

    def _grow(self, layer, slot, blocks):
        # Extend the file and map it again: the stored tokens are not copied.
        tail, dtype = self._meta[layer]
        return self._map(layer, blocks, tail, dtype, create=False)

    def _gather_native(self, layer, slot, index, out):
        # pread copies the page cache's bytes without mapping them. Faulting the mapping's pages in and dropping
        # them again at every fetch took about 1.5x as long on this layout (FreeKV's fetches over 30 layers of
        # SmolLM2 at 2K, KVCOMP_NATIVE=0 against 1); KVCOMP_NATIVE=0 or no compiler still reads that way.
        try:
            return cpu_native.gather_tokens(self._fds[layer], None, index, slot.length, BLOCK, out)
        except OSError as err:
            raise OSError(err.errno, f"Reading layer {layer} of the disk tier {self.file(layer)} failed: "
                          f"{err.strerror}.") from None

    def _write_native(self, layer, slot, k, v):
        # pwritev, like the gather's pread: an append through the mapping faulted its page in, and giving it back
        # (madvise) took longer than the write (~30 us of a ~80 us append per layer, SmolLM2's decode steps).
        try:
            return cpu_native.pwrite_tokens(self._fds[layer], k.to(slot.data.dtype), v.to(slot.data.dtype),
                                            slot.length, BLOCK)
        except OSError as err:
            raise OSError(err.errno, f"Writing layer {layer} of the disk tier {self.file(layer)} failed: "
                          f"{err.strerror}.") from None

    def _drop_pages(self, layer):
        # The file's pages stay in the OS page cache (written back when the kernel decides); unmapping them here
        # keeps them out of this process's resident memory, so the offloaded KV does not count against it.
        mm = getattr(self._maps.get(layer), "_mmap", None)
        if mm is not None and hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_DONTNEED)

    def _close_fd(self, layer: int) -> None:
        fd = self._fds.pop(layer, None)
        if fd is not None:
            os.close(fd)

    def _release(self, layer):
        self._close_fd(layer)
        self._maps.pop(layer, None)
        self._meta.pop(layer, None)
        try:
            os.remove(self.file(layer))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        super().close()
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


# -- the registry of tier kinds ---------------------------------------------------------------------------------
# kind -> a Tier class, or "module:attribute" imported on first use (a store backend lives in a module that
# imports this one). A new place for KV bytes is one class registered here: register_tier("s3", S3Tier).
_TIERS: dict[str, type[Tier] | str] = {"ram": RamTier, "host": HostTier, "disk": DiskTier,
                                       "store": "kvcomp.store:StoreTier"}


def register_tier(kind: str, cls: type[Tier] | str) -> None:
    """Make ``make_tier(kind, ...)`` build ``cls`` (a :class:`Tier` subclass, or ``"module:attribute"``)."""
    _TIERS[kind] = cls


def tier_kinds() -> tuple[str, ...]:
    """Every registered kind: the local ones (:data:`TIER_KINDS`) and ``"store"`` (:mod:`kvcomp.store`)."""
    return tuple(_TIERS)


def tier_class(kind: str) -> type[Tier]:
    if kind not in _TIERS:
        raise ValueError(f"Unknown tier {kind!r}; choose one of {', '.join(_TIERS)}.")
    cls = _TIERS[kind]
    if isinstance(cls, str):
        import importlib

        module, _, attr = cls.partition(":")
        cls = _TIERS[kind] = getattr(importlib.import_module(module), attr)
    return cls


def make_tier(kind: str, device=None, **kwargs: Any) -> Tier:
    """``"ram"`` (fast tier), ``"host"``, ``"disk"`` or ``"store"`` (``store=`` a URL or
    :class:`kvcomp.store.Store`), or any kind registered with :func:`register_tier`; ``device`` is where fetched
    tensors land."""
    return tier_class(kind)(device, **kwargs)


# -- prefetch --------------------------------------------------------------------------------------------
@dataclass
class FetchRequest:
    """Tokens ``index`` ``[B, H, k]`` of ``layer`` in ``tier`` (``-1``: not wanted), or, with ``index=None``,
    the range ``[start, stop)`` (``stop=None``: to the end), e.g. a whole layer streamed in for verification."""

    tier: Tier
    layer: int
    index: torch.Tensor | None = None
    start: int = 0
    stop: int | None = None
    version: int | None = None  # the layer's version when the request was made (set by submit/fetch)

    def _read(self, **kwargs) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(k, v, tokens read per row and head summed)`` (called with the tier's lock held)."""
        if self.index is None:
            k, v = self.tier.read(self.layer, self.start, self.stop, **kwargs)
            return k, v, k.shape[0] * k.shape[1] * k.shape[2]
        rows, wanted = self.tier.gather_rows(self.layer, self.index, **kwargs)
        return rows[..., 0, :], rows[..., 1, :], wanted


@dataclass
class FetchResult:
    request: FetchRequest
    keys: torch.Tensor | None  # [B, H, k, D] on the compute device (None: not read, the request was stale)
    values: torch.Tensor | None
    nbytes: int  # bytes moved from the tier
    version: int  # the layer's version when it was read
    event: Any = None  # CUDA event the consumer waits on
    tokens: int | None = None  # entries of request.index >= 0, when known without reading it


@dataclass
class TransferStats:
    """Totals plus ``per_step[step] = [bytes moved, seconds waited]``."""

    bytes_moved: int = 0
    wait_seconds: float = 0.0
    sync_fetches: int = 0
    prefetches: int = 0  # submitted
    prefetches_used: int = 0  # returned by wait()
    prefetches_dropped: int = 0  # superseded, for another step, or read before the layer changed
    per_step: dict[Any, list[float]] = field(default_factory=dict)

    def record(self, step: Any, nbytes: int, waited: float) -> None:
        self.bytes_moved += nbytes
        self.wait_seconds += waited
        entry = self.per_step.setdefault(step, [0, 0.0])
        entry[0] += nbytes
        entry[1] += waited

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("bytes_moved", "wait_seconds", "sync_fetches", "prefetches",
                                               "prefetches_used", "prefetches_dropped")}


_worker_lock = threading.Lock()
_shared_worker: ThreadPoolExecutor | None = None


def _one_intraop_thread() -> None:
    torch.get_num_threads()  # ATen sets a thread's count from the process default on its first use: do it now
    torch.set_num_threads(1)


def shared_worker() -> ThreadPoolExecutor:
    """One background thread shared by every Prefetcher of the process (fetches run in submission order).

    The thread runs its torch operations on one intra-op thread. With more, it would start a second OpenMP
    team; libgomp then sees more threads than cores and shortens every team's spin-wait, so each small
    operation of the compute thread pays to wake its sleeping helpers (on 2 cores, at 4K, a ragged
    allocator's per-head attention went from about 45 to 330 us a call in ``kvcomp bench``, where FreeKV and
    SpeCache had run before it). ``torch.set_num_threads`` also sets the default for threads started later, so
    the caller's count is put back once the worker has taken its own."""
    global _shared_worker
    with _worker_lock:
        if _shared_worker is None:
            threads = torch.get_num_threads()
            _shared_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcomp-prefetch")
            _shared_worker.submit(_one_intraop_thread).result()
            torch.set_num_threads(threads)
        return _shared_worker


def _run_fetch(request: FetchRequest, stream, ready=None) -> FetchResult:
    tier = request.tier
    cuda = stream is not None
    with tier._lock:
        version = tier.version(request.layer)
        if version != request.version:  # rewritten or cropped since the request: its indices are stale
            return FetchResult(request, None, None, 0, version)
        if cuda:
            with torch.cuda.stream(stream):
                if ready is not None:  # the index was computed on the submitting stream
                    stream.wait_event(ready)
                k, v, wanted = request._read(non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        else:
            k, v, wanted = request._read()
            event = None
    nbytes = 2 * wanted * k.shape[-1] * k.element_size()
    return FetchResult(request, k, v, nbytes, version, event, tokens=wanted)


class Prefetcher:
    """Background fetches with double buffering (see the module docstring).

    overlap: False runs a submitted fetch only when it is waited for (same data and statistics, no overlap;
    the baseline for measuring what overlap buys)."""

    def __init__(self, overlap: bool = True, device=None, executor: ThreadPoolExecutor | None = None):
        self.overlap = overlap
        self.device = torch.device(device) if device is not None else None
        self.executor = executor
        self.stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self.stats = TransferStats()
        self._pending: tuple[Any, FetchRequest, Future | None, Any] | None = None

    @property
    def _cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda" and torch.cuda.is_available()

    def submit(self, step: Any, request: FetchRequest) -> None:
        """Start fetching ``request`` for ``step``; an unconsumed earlier submission is dropped."""
        self.cancel()
        if request.version is None:
            request.version = request.tier.version(request.layer)
        future, ready = None, None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        if self.overlap:
            future = (self.executor or shared_worker()).submit(_run_fetch, request, self.stream, ready)
        self._pending = (step, request, future, ready)
        self.stats.prefetches += 1

    def pending_request(self) -> FetchRequest | None:
        return None if self._pending is None else self._pending[1]

    def cancel(self) -> None:
        if self._pending is not None:
            future = self._pending[2]
            if future is not None and not future.cancel():
                future.exception()  # let it finish: its buffers must not be freed while being written
            self._pending = None
            self.stats.prefetches_dropped += 1

    def wait(self, step: Any) -> FetchResult | None:
        """The fetch submitted for exactly ``step``, once complete; ``None`` when there is none (nothing
        submitted, submitted for another step, or the layer was rewritten or cropped since)."""
        if self._pending is None:
            return None
        if self._pending[0] != step:
            self.cancel()
            return None
        _, request, future, ready = self._pending
        self._pending = None
        t0 = time.perf_counter()
        result = future.result() if future is not None else _run_fetch(request, self.stream, ready)
        if result.event is not None and result.keys is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(result.event)
            result.keys.record_stream(current)
            result.values.record_stream(current)
        waited = time.perf_counter() - t0
        if not request.version == result.version == request.tier.version(request.layer):
            self.stats.prefetches_dropped += 1
            self.stats.record(step, result.nbytes, waited)
            return None
        self.stats.prefetches_used += 1
        self.stats.record(step, result.nbytes, waited)
        return result

    def fetch(self, step: Any, request: FetchRequest) -> FetchResult:
        """Fetch synchronously (a miss or a correction); counted as waited time."""
        t0 = time.perf_counter()
        if request.version is None:
            request.version = request.tier.version(request.layer)
        result = _run_fetch(request, None)
        self.stats.sync_fetches += 1
        self.stats.record(step, result.nbytes, time.perf_counter() - t0)
        return result

    def close(self) -> None:
        self.cancel()
