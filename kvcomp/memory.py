"""Measuring the process's memory: its resident set now, its peak while a block runs, and a fixed malloc
threshold so that peaks compare across runs (set only for a measuring pass: it slows what it measures).

These are the figures a user who runs out of memory cares about, beside ``memory_factor`` (the bytes a cache
holds at rest): ``kvcomp bench`` reports the peak rise of a prefill and of a decode step, and ``kvcomp grid``
records per sample the rise of the shared prefill and of each configuration's cache build and decoding.
"""

from __future__ import annotations

import gc
import os
import platform
import threading

import torch


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; falls back to the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Samples the process RSS (and CUDA's peak allocation) every few ms while the ``with`` block runs;
    ``peak - start`` is the block's rise (on CUDA: peak allocated over what was allocated at the start).
    ``collect``: run the garbage collector first (off for a decode step: it would cost more than the step)."""

    def __init__(self, device: str, interval: float = 0.01, collect: bool = True):
        self.device, self.interval, self.collect = device, interval, collect
        self.start = self.peak = 0
        self._stop = threading.Event()

    @property
    def rise_mb(self) -> float:
        """The block's rise in MiB (``peak - start``)."""
        return (self.peak - self.start) / 2**20

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakMemory:
        if self.collect:
            gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            self._cuda_start = torch.cuda.memory_allocated()
        self.start = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        if self.device.startswith("cuda"):
            self.start, self.peak = self._cuda_start, torch.cuda.max_memory_allocated()


def fixed_malloc_threshold(nbytes: int = 1 << 16) -> bool:
    """Make glibc serve every allocation of ``nbytes`` or more by its own mapping, returned when freed
    (``mallopt(M_MMAP_THRESHOLD)``, which also turns off its dynamic threshold). With glibc's default the
    threshold grows to 32 MiB after the first large free, the prefill's transients then come from the heap and
    fragmentation keeps them resident, so a process's peak depends on allocation order more than on what the
    cache holds (measured: FreeKV at 4K rose 583 MiB with the default, 122 MiB with this, none 282 MiB). The
    benchmark sets it for its memory pass so that the peaks compare what each method allocates; returns whether
    it could. It stays for the rest of the process, and it costs time: every large allocation becomes a fresh
    mapping whose pages fault in (measured at 4K: DynamicCache 145 against 106 ms/token, StreamingLLM 98
    against 81), so time nothing after it."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or platform.system() != "Linux":
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(-3, nbytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def trim_heap() -> bool:
    """Return the heap's free memory to the system (glibc's ``malloc_trim(0)``), so that a measured block
    starts without pages that earlier work left resident; returns whether it could."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or platform.system() != "Linux":
        return False
    try:
        ctypes.CDLL(name).malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


