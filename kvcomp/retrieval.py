"""Retrieval with offload: the full KV in a slower tier, a small resident summary, per-step retrieval.

The shared machinery of :class:`compressors.freekv.FreeKV` and :class:`compressors.specache.SpeCache`.
Nothing is thrown away: every token's K/V is written to a :class:`kvcomp.tiers.Tier` (``tier``: disk, host
memory or RAM) at prefill and appended while decoding. Resident on the fast tier, per layer:

* the first ``n_sink`` tokens and the recent tokens (``window`` to ``window + chunk - 1`` of them), at full
  precision;
* a method-specific *summary* of the tokens in between, built a whole ``chunk`` at a time (FreeKV: a page's
  per-channel key min/max; SpeCache: a low-bit KIVI copy, a quantization group at a time) — tokens leave the
  recent window a chunk at a time, when ``window + chunk`` have accumulated;
* the fetch buffer: the full-precision K/V of the units (pages or tokens) selected for the current step.

Each decode step a method scores the summary with the step's queries (``score``: ``[B, H_kv, U]`` per unit,
aggregated over each KV head's query group by the maximum) and the top units per KV head are fetched.
Speculative retrieval (``speculative=True``): the units for step t+1 are chosen with step t's queries right after
step t's attention and fetched in the background (:class:`kvcomp.tiers.Prefetcher`); at step t+1 the KV heads whose
query moved (cosine similarity to step t's query below ``tau``, averaged over the KV head's query group) are
corrected: they attend the units their new query selects, the ones the prefetch holds taken from it and the others
fetched synchronously. The prompt's last query drives the prefetch for the first decode step. ``overlap=False``
keeps the same selections but performs each fetch only when it is needed (no overlap: the baseline to measure what
overlap buys); ``overlap=None``, the default, fetches in a background thread only where a fetch is a transfer that
can run beside the step (a CUDA device's tiers, a store), and when needed where it is a gather from this CPU's own
memory or page cache: there the thread only contends with the step for the same cores and the interpreter lock
(FreeKV at 8K on SmolLM2, 2 threads: 116.5 ms/token overlapped, 102.5 not;
experiments/results/bench-freekv-overlap-embedded); ``speculative=False`` selects with the step's own query and
fetches synchronously (exact retrieval). ``correction="missed"`` replaces the cosine rule: every step the units the
step's own query selects are compared with the prefetched ones, the prefetched units it wants are kept and only the
ones the prefetch missed are fetched synchronously, so the output is identical to exact retrieval and the prefetch
hides the share of the transfer it guessed right (``recall``). The selection is computed every step in both modes.

A forward of several tokens (a question block appended to a compressed context, a verified draft) attends
over the full KV read back from the tier: that is prefill-like work, as in FreeKV and SpeCache.

Budget: ``top_k`` units per KV head when set; otherwise ``budget_fraction`` of the layer's full-KV bytes is
the fast-tier budget, and what summary, sinks and window leave of it is spent on fetched tokens (at least
none), so ``memory_factor`` is about ``1 / budget_fraction`` once the context is long enough.

``checkpoint`` / ``rollback`` undo the tokens appended since the checkpoint (lossless decoding): the tier is cropped and the state
becomes the one the shorter history would have built. Scope: batch size 1 (``supports_batch=False``) and
contiguous positions (it cannot follow an eviction stage in ``Compose``). Per-step transfer statistics are on each layer state (``state.stats`` and the prefetcher's
``state.prefetcher.stats``); :func:`retrieval_stats` sums them over a cache.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kvcomp import kernels, validation
from kvcomp.compressor import SENTINEL, Capabilities, Compressor, CompressorError, LayerContext
from kvcomp.kernels.retrieval_ref import members
from kvcomp.ops import dense_attention, take_slots
from kvcomp.tiers import TIER_KINDS, FetchRequest, Prefetcher, Tier, make_tier

CORRECTIONS = ("cosine", "missed")


@dataclass
class RetrievalStats:
    """Counters of one layer; ``head_steps`` counts (decode step, KV head) pairs."""

    decode_steps: int = 0
    head_steps: int = 0
    speculated: int = 0  # head-steps that had a prefetched selection
    corrected: int = 0  # ... of which a synchronous fetch corrected the prefetch (see ``correction``)
    recall_sum: float = 0.0  # sum over speculated head-steps of |prefetched ∩ needed| / |needed| (units)
    served_sum: float = 0.0  # sum over speculated head-steps of the share of attended units the prefetch gave
    decode_bytes: int = 0  # bytes moved from the slow tier for decode steps (prefetches and corrections)
    block_bytes: int = 0  # bytes read back for multi-token forwards (full KV)
    fetched_tokens: int = 0  # full-precision tokens attended from fetch buffers, summed over head-steps


@dataclass(frozen=True)
class RetrievalSnapshot:
    """What :meth:`Retrieval.rollback` needs to restore a state: how many tokens it held."""

    length: int


@dataclass
class RetrievalState:
    """One layer. Token ``i`` of the tier has position ``start_pos + i``; ``[n_sink, boundary)`` is summarized,
    ``[boundary, length)`` is the recent window. ``sink_*`` ``[B, H, n_sink, D]``, ``recent_*``
    ``[B, H, R, D]``, ``prev_q`` ``[B, H, G, D]`` (the last query, for the correction)."""

    tier: Tier
    layer: int
    start_pos: int
    length: int
    n_sink: int
    boundary: int
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    recent_k: torch.Tensor
    recent_v: torch.Tensor
    summary: Any
    prefetcher: Prefetcher
    prev_q: torch.Tensor | None = None
    pending_units: torch.Tensor | None = None  # [B, H, k] units of the outstanding prefetch
    step: int = 0
    fetch_bytes: int = 0  # the fetch buffer now: the outstanding prefetch, else the last step's fetch
    scratch: Any = None  # a method's per-step intermediate (SpeCache: the low-bit logits of this step's query)
    stats: RetrievalStats = field(default_factory=RetrievalStats)

    def resident_tensors(self) -> list[torch.Tensor]:
        tensors = [self.sink_k, self.sink_v, self.recent_k, self.recent_v, self.prev_q, self.pending_units, self.scratch]
        return [t for t in tensors if isinstance(t, torch.Tensor)]


@dataclass
class Retrieval(Compressor):
    """Base of offloading retrieval methods; a method sets ``chunk``/``unit`` and overrides the summary hooks.

    budget_fraction: fast-tier bytes / full-KV bytes (None: use ``top_k``). top_k: units fetched per KV
    head and step (overrides ``budget_fraction``). tier: "auto" (host memory on CUDA, disk otherwise),
    "disk", "host" or "ram". offload_dir: where the disk tier writes (None: $KVCOMP_OFFLOAD_DIR or /tmp).
    correction: how a speculative prefetch is corrected, "cosine" (heads whose query moved below ``tau``
    attend their own selection, fetching what the prefetch missed) or "missed" (every head does: output
    identical to exact retrieval).
    speculative: True, False, or None (prefetch only where it can change the output or hide a transfer).
    overlap: True (fetch in a background thread), False (each fetch when needed), or None (a thread only where
    a fetch is a transfer: a CUDA device's tiers or a store). Neither changes what is fetched.
    """

    budget_fraction: float | None = 0.125
    top_k: int | None = None
    n_sink: int = 4
    window: int = 32
    tier: str = "auto"
    speculative: bool | None = True  # None: where it can pay (_speculates); SpeCache's default
    overlap: bool | None = None  # None: a background thread only where a fetch is a transfer (_overlaps)
    tau: float = 0.8
    correction: str = "cosine"
    offload_dir: str | None = None

    capabilities: ClassVar[Capabilities] = Capabilities(lossy=True, decode_time=True, supports_batch=False)

    def __post_init__(self) -> None:
        if self.budget_fraction is None and self.top_k is None:
            raise CompressorError("Set budget_fraction (fast-tier bytes / full KV bytes) or top_k (units per head).")
        # Above 1 the fast tier would hold more than the full KV (memory_factor below 1, silently).
        validation.fraction("budget_fraction", self.budget_fraction, low_open=True, none=True, owner=self,
                            hint=" (fast-tier bytes / full-KV bytes)")
        validation.non_negative_int("top_k", self.top_k, none=True, owner=self, hint=" (units per KV head)")
        validation.non_negative_int("n_sink", self.n_sink, owner=self)
        validation.non_negative_int("window", self.window, owner=self)
        validation.choice("tier", self.tier, ("auto", *TIER_KINDS), owner=self)
        validation.boolean("speculative", self.speculative, none=True, owner=self,
                           hint=" (None: prefetch only where it can change the output or hide a transfer)")
        validation.boolean("overlap", self.overlap, none=True, owner=self,
                           hint=" (None: a background fetch only where a fetch is a transfer)")
        validation.finite_float("tau", self.tau, -1.0, 1.0, owner=self, hint=" (a cosine similarity)")
        validation.choice("correction", self.correction, CORRECTIONS, owner=self)
        validation.path_or_none("offload_dir", self.offload_dir, owner=self)

    # -- what a method defines -----------------------------------------------------------------------------
    chunk: ClassVar[int] = 32  # tokens summarized at a time (overridden by a property where it is a field)
    unit: ClassVar[int] = 1  # tokens per selectable unit

    def summarize(self, k: torch.Tensor, v: torch.Tensor, previous: Any) -> Any:
        """Summary of ``previous`` extended by whole chunks ``k``, ``v`` ``[B, H, n * chunk, D]`` (``previous``
        is None at prefill)."""
        raise NotImplementedError

    def summary_tensors(self, summary: Any) -> list[torch.Tensor]:
        raise NotImplementedError

    def score(self, state: RetrievalState, qg: torch.Tensor, scaling: float) -> torch.Tensor:
        """``[B, H_kv, U]`` score of each unit of the summary for queries ``qg`` ``[B, H_kv, G, D]``."""
        raise NotImplementedError

    def attend_decode(self, state: RetrievalState, q: torch.Tensor, ctx: LayerContext, keys: torch.Tensor,
                      values: torch.Tensor, positions: torch.Tensor, units: torch.Tensor,
                      complete: bool = False) -> torch.Tensor:
        """Attention of ``q`` given the fetched tokens (``[B, H, k, D]``, positions ``[B, H, k]``, SENTINEL
        where nothing was fetched) and the selected ``units`` ``[B, H, k_units]`` (-1: none); ``complete``:
        every fetched slot holds a token (known on the host, from the fetch)."""
        keys = torch.cat([state.sink_k, keys, state.recent_k], dim=2)
        values = torch.cat([state.sink_v, values, state.recent_v], dim=2)
        if complete and ctx.spec.window is None:
            # Every slot holds a token at or before this query on a full-attention layer: no positions to build.
            out, _ = dense_attention(q, keys, values, ctx.query_positions, None, ctx.spec, all_visible=True)
            return out
        positions = torch.cat([self._positions(state, 0, state.n_sink, q), positions,
                               self._positions(state, state.boundary, state.length, q)], dim=2)
        out, _ = dense_attention(q, keys, values, ctx.query_positions, positions, ctx.spec)
        return out

    # -- hooks ---------------------------------------------------------------------------------------------
    def prefill(self, layer, q, k, v, ctx):
        b, h, n, _ = k.shape
        positions = ctx.positions
        start = int(positions[0, 0, 0])
        if bool((positions >= SENTINEL).any()) or not torch.equal(
            positions, start + torch.arange(n, device=positions.device).expand_as(positions)
        ):
            raise CompressorError(
                f"{type(self).__name__} needs contiguous positions without padding (batch size 1, not after an "
                "eviction stage in Compose)."
            )
        kind = self.tier if self.tier != "auto" else ("host" if k.device.type == "cuda" else "disk")
        kwargs = {"directory": self.offload_dir} if kind == "disk" and self.offload_dir else {}
        tier = make_tier(kind, device=k.device, **kwargs)
        tier.write(layer, k, v)
        sinks = min(self.n_sink, n)
        # The recent part starts as a view of the prompt's K/V: summarising copies only what it keeps, and the
        # window is cloned once, so the prefill holds no second copy of the layer's full K/V.
        state = RetrievalState(
            tier, layer, start, n, sinks, sinks, k[:, :, :sinks].clone(), v[:, :, :sinks].clone(),
            k[:, :, sinks:], v[:, :, sinks:], None,
            Prefetcher(overlap=self._overlaps(k.device, tier), device=k.device),
        )
        if not self._advance(state):
            state.recent_k, state.recent_v = state.recent_k.clone(), state.recent_v.clone()
        if self._speculates(state):
            self._prefetch_next(state, q, ctx.scaling)
        return state

    def append(self, layer, state: RetrievalState, k, v, ctx):
        state.tier.append(layer, k, v)
        state.recent_k = torch.cat([state.recent_k, k], dim=2)
        state.recent_v = torch.cat([state.recent_v, v], dim=2)
        state.length += k.shape[2]
        return state

    def attend(self, layer, state: RetrievalState, q, ctx):
        state.step += 1
        if q.shape[2] > 1:
            return self._attend_block(state, q, ctx)
        b, hq, _, d = q.shape
        h = state.sink_k.shape[1]
        qg = q.reshape(b, h, hq // h, d)
        units = self._select(state, qg, ctx.scaling)  # what this step's own query selects
        fresh = units
        st = state.stats
        st.decode_steps += 1
        st.head_steps += b * h
        speculates = self._speculates(state)
        result = state.prefetcher.wait(state.step) if speculates else None
        if result is None:
            result = state.prefetcher.fetch(state.step, self._request(state, units, skips=False))
        else:
            spec = state.pending_units
            st.speculated += b * h
            # This step's units the prefetch holds, their share per KV head, and how far each head's query moved.
            held, recall_heads, cos = kernels.speculation_check(qg, state.prev_q, units, spec, self._n_units(state))
            if self.correction == "missed":
                recall = float(recall_heads.sum())
                st.recall_sum += recall
                result = self._fetch_missed(state, result, spec, units, held)
                st.served_sum += recall  # the kept prefetched units; the missed ones were fetched
            else:
                result, units = self._correct_moved(state, result, spec, units, held, recall_heads, cos)
        keys, values, index = result.keys, result.values, result.request.index
        state.fetch_bytes = _buffer_bytes(keys, values)
        tokens = int((index >= 0).sum()) if result.tokens is None else result.tokens
        st.fetched_tokens += tokens
        complete = tokens == index.numel()  # every slot holds a token (a synchronous fetch, mostly)
        if complete:
            positions = index + state.start_pos
        else:
            positions = torch.where(index >= 0, state.start_pos + index, SENTINEL)
        out = self.attend_decode(state, q, ctx, keys, values, positions, units, complete)
        st.decode_bytes += result.nbytes
        advanced = self._advance(state)
        if speculates:
            # The selection this step's query made is the next step's speculation, unless the summary grew.
            self._prefetch_next(state, q, ctx.scaling, None if advanced else fresh)
        return out

    def _correct_moved(self, state: RetrievalState, result, spec: torch.Tensor, units: torch.Tensor,
                       held: torch.Tensor, recall_heads: torch.Tensor, cos: torch.Tensor):
        """``correction="cosine"`` (FreeKV): KV heads whose query moved (``cos``, the cosine to the last step's,
        below ``tau``) attend this step's own selection instead of the prefetch (its units the prefetch holds are
        kept, only the missed ones fetched synchronously); the others attend the prefetch."""
        stale = cos < self.tau
        # One read back for the decision and the statistics: per KV head, whether it moved, and its recall.
        moved, recalls = torch.stack([stale.to(recall_heads.dtype), recall_heads]).view(2, -1).tolist()
        st = state.stats
        st.recall_sum += sum(recalls)
        st.corrected += int(sum(moved))
        # Uncorrected heads attend the whole prefetch; corrected ones the part of it their selection kept.
        st.served_sum += sum(r if m else 1.0 for m, r in zip(moved, recalls))
        if not any(moved):
            return result, spec
        width = max(spec.shape[-1], units.shape[-1])
        result = self._refetch(state, result, spec, units, held, stale, width * self.unit)
        units = torch.where(stale.unsqueeze(-1), _pad_units(units, width), _pad_units(spec, width))
        return result, units

    def _fetch_missed(self, state: RetrievalState, result, spec: torch.Tensor, units: torch.Tensor,
                      held: torch.Tensor):
        """``correction="missed"``: every KV head attends exactly what ``speculative=False`` would (this step's
        own selection), from the prefetched units it wants plus a synchronous fetch of the missed ones."""
        everyone = torch.ones(held.shape[:2], dtype=torch.bool, device=held.device)
        state.stats.corrected += int((units.masked_fill(held, -1) >= 0).any(-1).sum())
        return self._refetch(state, result, spec, units, held, everyone, units.shape[-1] * self.unit)

    def _refetch(self, state: RetrievalState, result, spec: torch.Tensor, units: torch.Tensor, held: torch.Tensor,
                 heads: torch.Tensor, width: int):
        """The KV heads in ``heads`` ``[B, H]`` attend their own ``units`` (``held``: which of them the prefetch
        holds): the prefetched units they want are kept and the missed ones fetched synchronously; the other
        heads attend the prefetch ``spec`` unchanged. ``width`` tokens wide, in ascending token order."""
        own = heads.unsqueeze(-1)
        wanted = members(spec, units, self._n_units(state)) | ~own
        missed = units.masked_fill(held | ~own, -1)
        fixed = state.prefetcher.fetch(state.step, self._request(state, missed)) if bool((missed >= 0).any()) else None
        return _complete(result, wanted, fixed, self.unit, width)

    def checkpoint(self, state: RetrievalState) -> RetrievalSnapshot:
        # Only the length: every token is in the tier, so rollback rebuilds what it removes from there.
        return RetrievalSnapshot(state.length)

    def rollback(self, state: RetrievalState, snapshot: RetrievalSnapshot) -> RetrievalState:
        """Undo the tokens appended since ``snapshot``: crop the tier (which invalidates an outstanding prefetch)
        and, when the window would hold fewer than ``window`` tokens, drop summary chunks and read their tokens
        back from the tier into the window — the state a history without those tokens would have built."""
        n = state.length - snapshot.length
        if n <= 0:
            return state
        length = snapshot.length
        if length < state.n_sink:
            raise CompressorError(f"rollback({n}) would remove prompt sink tokens ({state.length} stored).")
        state.prefetcher.cancel()
        state.pending_units = None
        state.tier.crop(state.layer, length)
        state.length = length
        if length - self.window < state.boundary:  # the window would fall short: un-summarize whole chunks
            chunks = max(0, length - state.n_sink - self.window) // self.chunk
            state.boundary = state.n_sink + chunks * self.chunk
            tensors = self.summary_tensors(state.summary)
            state.summary = type(state.summary)(*(t[:, :, :chunks] for t in tensors)) if chunks else None
            state.recent_k, state.recent_v = state.tier.read(state.layer, state.boundary, length)
        else:
            keep = length - state.boundary
            state.recent_k = state.recent_k[:, :, :keep].clone()
            state.recent_v = state.recent_v[:, :, :keep].clone()
        return state

    def materialize(self, state: RetrievalState):
        keys, values = state.tier.read(state.layer)
        return keys, values, self._positions(state, 0, state.length, keys)

    def nbytes(self, state: RetrievalState) -> dict[str, int]:
        resident = state.resident_tensors() + self.summary_tensors(state.summary)
        device = sum(t.numel() * t.element_size() for t in resident) + state.fetch_bytes
        slow = {"device": 0, "host": 0, "disk": 0}
        for kind, n in state.tier.nbytes_by_kind().items():  # "store": a kvcomp.store.StoreTier
            slow[kind] = slow.get(kind, 0) + n
        return {**slow, "device": device + slow["device"]}

    def restored(self, layer, state: RetrievalState, convert: bool = True) -> RetrievalState:
        """A state read back from a store (its tier now a :class:`kvcomp.store.StoreTier` over the stored full
        KV): restart the prefetch the prefill had submitted for the first decode step."""
        state.prefetcher.overlap = self._overlaps(state.sink_k.device, state.tier)
        if self._speculates(state) and state.pending_units is not None:
            state.prefetcher.submit(state.step + 1, self._request(state, state.pending_units))
        return state

    def stored_tokens(self, state: RetrievalState) -> torch.Tensor:
        b, h = state.sink_k.shape[:2]
        return torch.full((b, h), state.length, dtype=torch.long, device=state.sink_k.device)

    # -- machinery -----------------------------------------------------------------------------------------
    def _speculates(self, state: RetrievalState) -> bool:
        """``speculative``; None: prefetch where it can change the output (``correction="cosine"``) or hide a
        transfer (a CUDA device's tiers; a store over the network), not with ``correction="missed"`` over this
        CPU's own memory or page cache, where a fetch is a memory gather and prefetching adds one (the
        speculated units, then the missed ones, merged) on the cores the step computes on."""
        if self.speculative is not None:
            return self.speculative
        return self.correction != "missed" or not _gathers_locally(state.sink_k.device, state.tier)

    def _overlaps(self, device: torch.device, tier) -> bool:
        """``overlap``; None: fetch in a background thread only where a fetch is a transfer."""
        return self.overlap if self.overlap is not None else not _gathers_locally(device, tier)

    def _n_units(self, state: RetrievalState) -> int:
        return (state.boundary - state.n_sink) // self.unit

    def budget_units(self, state: RetrievalState) -> int:
        """Units fetched per KV head this step: ``top_k``, or what the fast-tier budget leaves."""
        n_units = self._n_units(state)
        if self.top_k is not None:
            return min(self.top_k, n_units)
        b, h, _, d = state.sink_k.shape
        token_bytes = b * h * 2 * d * state.sink_k.element_size()  # one token's K and V over the heads
        resident = state.resident_tensors() + self.summary_tensors(state.summary)
        fixed = sum(t.numel() * t.element_size() for t in resident)
        tokens = math.floor((self.budget_fraction * state.length * token_bytes - fixed) / token_bytes)
        return max(0, min(n_units, tokens // self.unit))

    def _select(self, state: RetrievalState, qg: torch.Tensor, scaling: float) -> torch.Tensor:
        """``[B, H, k]`` top units per KV head, ascending (so fetched tokens stay in position order)."""
        k = self.budget_units(state)
        b, h = qg.shape[:2]
        if k == 0:
            return torch.zeros(b, h, 0, dtype=torch.long, device=qg.device)
        scores = self.score(state, qg, scaling)
        return kernels.top_ascending(scores, k)

    def _request(self, state: RetrievalState, units: torch.Tensor, skips: bool = True) -> FetchRequest:
        """Token indices ``[B, H, k * unit]`` of ``units`` (-1 stays -1; ``skips=False``: the caller knows there
        is none, a selection)."""
        units = units.unsqueeze(-1)  # [B, H, k, 1]
        tokens = units * self.unit + _token_offsets(self.unit, state.n_sink, units.device)  # [B, H, k, unit]
        if skips:
            tokens.masked_fill_(units < 0, -1)
        return FetchRequest(state.tier, state.layer, tokens.flatten(2))

    def _positions(self, state: RetrievalState, start: int, stop: int, like: torch.Tensor) -> torch.Tensor:
        b, h = state.sink_k.shape[:2]
        pos = torch.arange(state.start_pos + start, state.start_pos + stop, device=like.device)
        return pos.view(1, 1, -1).expand(b, h, -1)

    def _advance(self, state: RetrievalState) -> bool:
        """Move whole chunks from the recent window into the summary once ``window + chunk`` have gathered."""
        recent = state.length - state.boundary
        n = max(0, recent - self.window) // self.chunk * self.chunk
        if n == 0:
            return False
        state.summary = self.summarize(state.recent_k[:, :, :n], state.recent_v[:, :, :n], state.summary)
        state.recent_k = state.recent_k[:, :, n:].clone()
        state.recent_v = state.recent_v[:, :, n:].clone()
        state.boundary += n
        return True

    def _prefetch_next(self, state: RetrievalState, q: torch.Tensor, scaling: float,
                       units: torch.Tensor | None = None) -> None:
        b, hq, _, d = q.shape
        h = state.sink_k.shape[1]
        qg = q[:, :, -1].reshape(b, h, hq // h, d)
        if units is None:
            units = self._select(state, qg, scaling)
        state.prev_q = qg.clone()
        state.pending_units = units
        state.scratch = None  # per-step intermediates do not outlive the step
        request = self._request(state, units, skips=False)
        state.prefetcher.submit(state.step + 1, request)
        # The step's own buffer is released after its attention; the prefetch buffer takes its place.
        state.fetch_bytes = 2 * request.index.numel() * d * state.sink_k.element_size()

    def _attend_block(self, state: RetrievalState, q: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        state.prefetcher.cancel()
        keys, values = state.tier.read(state.layer)
        state.stats.block_bytes += _buffer_bytes(keys, values)
        positions = self._positions(state, 0, state.length, q)
        out, _ = dense_attention(q, keys, values, ctx.query_positions, positions, ctx.spec)
        self._advance(state)
        if self._speculates(state):
            self._prefetch_next(state, q, ctx.scaling)
        return out


def _gathers_locally(device: torch.device, tier) -> bool:
    """Whether a fetch from ``tier`` is a gather from this CPU's own memory or page cache (nothing to hide
    behind compute: a prefetch or a background thread only adds work on the cores the step runs on), rather
    than a transfer (to a CUDA device, or from a store)."""
    return device.type == "cpu" and tier.kind != "store"


def _buffer_bytes(keys: torch.Tensor, values: torch.Tensor) -> int:
    return keys.numel() * keys.element_size() + values.numel() * values.element_size()


@functools.lru_cache(maxsize=16)
def _token_offsets(unit: int, first: int, device: torch.device) -> torch.Tensor:
    """``first + [0, unit)``: the tokens of unit 0 (a unit's tokens are these plus ``unit`` times its index)."""
    return torch.arange(first, first + unit, device=device)


def _pad_units(units: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(units, (0, max(0, width - units.shape[-1])), value=-1)


def _complete(spec, wanted: torch.Tensor, fixed, unit: int, width: int):
    """The prefetched result restricted to its ``wanted`` units (``[B, H, k_spec]``) plus the ``fixed`` fetch of
    the missed ones, in ascending token order and ``width`` tokens wide: what a synchronous fetch of the same
    units returns, so attention is bit-identical to fetching them all (``speculative=False`` for
    ``correction="missed"``)."""
    index = spec.request.index.masked_fill(~wanted.repeat_interleave(unit, -1), -1)
    keys, values, nbytes = spec.keys, spec.values, spec.nbytes
    if fixed is not None:
        index = torch.cat([index, fixed.request.index], dim=-1)
        keys = torch.cat([keys, fixed.keys], dim=2)
        values = torch.cat([values, fixed.values], dim=2)
        nbytes += fixed.nbytes
    order = torch.where(index >= 0, index, torch.iinfo(index.dtype).max).argsort(dim=-1, stable=True)[..., :width]
    index = index.gather(-1, order)
    keys, values = take_slots(keys, order), take_slots(values, order)
    return type(spec)(FetchRequest(spec.request.tier, spec.request.layer, index), keys, values, nbytes, spec.version)


def retrieval_stats(cache) -> dict[str, float]:
    """Transfer statistics summed over the layers of a ``CompressedCache`` using a retrieval compressor.

    bytes_per_token: bytes moved from the slow tier per decode step (all layers); hit_rate: share of the
    attended units, over (step, layer, KV head), that came from the prefetch (cosine correction: the heads
    used uncorrected; missed correction: the prefetched units kept); correction_rate: share of speculated
    head-steps that needed a synchronous fetch; recall: fraction of the units the step's own query selects
    that the prefetch held; wait_seconds: time the model thread waited on
    fetches (prefetch completions and synchronous fetches)."""
    states = [layer.state for layer in cache.layers if isinstance(getattr(layer, "state", None), RetrievalState)]
    if not states:
        return {}
    s = RetrievalStats()
    waited = 0.0
    for state in states:
        for name in vars(s):
            setattr(s, name, getattr(s, name) + getattr(state.stats, name))
        waited += state.prefetcher.stats.wait_seconds
    steps = max(1, states[0].stats.decode_steps)
    # With nothing fetched (the budget left no room for a unit) a hit or a recall means nothing.
    speculated = max(1, s.speculated) if s.fetched_tokens else 0
    return {
        "decode_steps": states[0].stats.decode_steps,
        "bytes_moved": s.decode_bytes,
        "bytes_per_token": s.decode_bytes / steps,
        "block_bytes": s.block_bytes,
        "hit_rate": s.served_sum / max(1, s.head_steps) if speculated else float("nan"),
        "correction_rate": s.corrected / speculated if speculated else float("nan"),
        "recall": s.recall_sum / speculated if speculated and s.speculated else float("nan"),
        "fetched_tokens_per_head_step": s.fetched_tokens / max(1, s.head_steps),
        "wait_seconds": waited,
        "wait_seconds_per_token": waited / steps,
    }
