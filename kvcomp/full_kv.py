"""The full KV that lossless decoding verifies with, and the uncompressed baseline decodes from.

Every holder has the same interface: ``cache`` (the transformers cache the model runs on), ``tee`` (the prefill's
K/V, taken from the compressed cache's forward), ``prefetch`` (start bringing the KV in for the next forward),
``new_kv`` / ``commit`` (the K/V of the last forward's tokens; keep the first ``kept``), ``nbytes``, ``close`` and
the transfer counters ``bytes_in``, ``transfer_seconds``, ``read_seconds``.

* :class:`ResidentFullKV`: a ``DynamicCache`` next to the model (nothing is transferred);
* :class:`TieredFullKV`: a slower tier of :mod:`kvcomp.tiers` (host, disk, ram, or a store), streamed in layer by
  layer for each verification through :class:`kvcomp.cache.TierLayer`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import DynamicCache

from kvcomp.cache import tier_cache
from kvcomp.tiers import Tier


class ResidentFullKV:
    """The full KV in a plain ``transformers.DynamicCache`` next to the model (nothing is transferred).

    The interface every full-KV holder has: ``cache`` (what the model runs on), ``tee`` (prefill K/V from the
    compressed cache's forward), ``prefetch`` (start bringing the KV in for the next forward), ``new_kv`` /
    ``commit`` (the K/V of the last forward's tokens; keep the first ``kept`` of them), ``nbytes``, ``close``
    and the transfer counters."""

    def __init__(self, model):
        self.cache = DynamicCache()
        self.bytes_in = 0
        self.transfer_seconds = 0.0
        self.read_seconds = 0.0

    def tee(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.update(k, v, layer)

    def prefetch(self) -> None:
        pass

    def new_kv(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K/V ``[B, H_kv, n, D]`` per layer of the ``n`` tokens of the last forward (copies: a view would keep
        the whole old cache tensor alive after the next forward grows it)."""
        layers = self.cache.layers
        return [lay.keys[:, :, -n:].clone() for lay in layers], [
            lay.values[:, :, -n:].clone() for lay in layers
        ]

    def commit(self, n: int, kept: int) -> None:
        if n > kept:
            for lay in self.cache.layers:
                lay.crop(kept - n)

    def nbytes(self) -> dict[str, int]:
        total = sum(lay.keys.nbytes + lay.values.nbytes for lay in self.cache.layers if lay.is_initialized)
        return {"device": total, "host": 0, "disk": 0}

    def close(self) -> None:
        pass


class TieredFullKV:
    """The full KV in a slower tier of :mod:`kvcomp.tiers` (``"host"``, ``"disk"``, or ``"ram"``), streamed in
    layer by layer for each verification.

    ``prefetch()`` (called when a round starts drafting) queues reads of the first ``window`` layers on the
    tiers' background worker; each layer the verification forward consumes queues the read of the layer
    ``window`` further, so at most ``window`` layers of full KV are in memory at once (``window=0``: all).
    ``transfer_seconds`` is the time the verification waited for reads (not hidden); ``read_seconds`` the time
    the reads took; the difference ran while the draft model or earlier layers computed.
    This adapter uses only ``Tier.append/read/length/nbytes/close`` and ``tiers.shared_worker``: whole-layer
    reads are contiguous (``read``), which the Prefetcher's index ``gather`` would do slower, and a sliding
    window of reads needs more than its one outstanding request.
    """

    def __init__(self, model, tier: str | Tier = "disk", window: int = 0, overlap: bool = True, **tier_options):
        from kvcomp.tiers import make_tier

        n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        # A Tier object (a kvcomp.store.StoreTier over a stored context's full KV) is used as it is.
        self.tier = tier if isinstance(tier, Tier) else make_tier(tier, device=model.device, **tier_options)
        self.cache = tier_cache(self, n_layers)
        self.n_layers = n_layers
        self.window = window if window > 0 else n_layers
        self.overlap = (
            overlap  # False: read each layer when the forward needs it (measures what overlap buys)
        )
        self._reads: dict[int, Any] = {}
        # On CUDA the copies run on a side stream, so they overlap the model's kernels (the default stream
        # would serialise them); the consumer waits on each read's event.
        cuda = self.tier.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.tier.device) if cuda else None
        self.bytes_in = 0
        self.transfer_seconds = 0.0
        self.read_seconds = 0.0

    def tee(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.tier.append(layer, k, v)

    def length(self, layer: int) -> int:
        return self.tier.length(layer)

    def _read(self, layer: int, ready=None):
        t0 = time.perf_counter()
        if self._stream is None:
            k, v = self.tier.read(layer)
            return k, v, None, time.perf_counter() - t0
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)  # what the model stream wrote into a device tier comes first
            k, v = self.tier.read(layer, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return k, v, event, time.perf_counter() - t0

    def _submit(self, layer: int) -> None:
        from kvcomp.tiers import shared_worker

        if layer < self.n_layers and layer not in self._reads and self.tier.length(layer) > 0:
            ready = None
            if self._stream is not None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.tier.device))
            self._reads[layer] = shared_worker().submit(self._read, layer, ready)

    def prefetch(self) -> None:
        if self.overlap:
            for layer in range(self.window):
                self._submit(layer)

    def fetch(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        self._submit(layer)  # a miss (no prefetch): read now
        future = self._reads.pop(layer, None)
        if future is None:
            return None
        t0 = time.perf_counter()
        k, v, event, read_s = future.result()
        if event is not None:
            current = torch.cuda.current_stream(self.tier.device)
            current.wait_event(event)
            k.record_stream(current)
            v.record_stream(current)
        self.transfer_seconds += time.perf_counter() - t0
        self.read_seconds += read_s
        self.bytes_in += k.numel() * k.element_size() + v.numel() * v.element_size()
        if self.overlap:
            self._submit(layer + self.window)
        return k, v

    def new_kv(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [lay.new[0] for lay in self.cache.layers], [lay.new[1] for lay in self.cache.layers]

    def commit(self, n: int, kept: int) -> None:
        for lay in self.cache.layers:
            k, v = lay.new
            self.tier.append(lay.layer_idx, k[:, :, :kept], v[:, :, :kept])
            lay.new = None

    def nbytes(self) -> dict[str, int]:
        total = {"device": 0, "host": 0, "disk": 0}
        for kind, n in self.tier.nbytes_by_kind().items():
            total[kind] = total.get(kind, 0) + n
        return total

    def close(self) -> None:
        for future in self._reads.values():
            future.result()
        self._reads.clear()
        self.tier.close()


def make_full_kv(model, tier: str = "resident", tier_options: dict[str, Any] | None = None, context=None):
    """Where verification's full KV lives: ``"resident"`` (a DynamicCache) or a :mod:`kvcomp.tiers` tier
    (``"store"``: a :mod:`kvcomp.store`). With a stored ``context`` (:class:`kvcomp.contexts.LoadedContext`), its
    stored full KV: read from the store at every verification for ``"store"``, else copied into the tier."""
    tier_options = tier_options or {}
    if context is None:
        if tier == "resident":
            return ResidentFullKV(model)
        return TieredFullKV(model, tier, **tier_options)
    stored = context.full_kv_tier(model.device)
    if tier == "store":
        options = {k: v for k, v in tier_options.items() if k in ("window", "overlap")}
        return TieredFullKV(model, stored, **options)
    full = make_full_kv(model, tier, tier_options)
    try:
        for layer in stored.layers:
            full.tee(layer, *stored.read(layer))
    finally:
        stored.close()
    return full
