"""Token selection: the shared machinery of methods that decide which tokens to keep.

A method overrides :meth:`TokenSelection.score` (prefill) and, if it evicts while decoding,
:meth:`TokenSelection.decode_score`; this base class owns budgets, per-KV-head top-k, the gather into
smaller tensors, and appends. Evicted tokens are gone: the store holds ``[B, H_kv, L, D]`` tensors with
``L`` the largest kept count of the batch, not a mask over the full cache.

Sliding-window layers: token selection compresses them too (``sliding_layers = "compress"``), within what the
layer can still use: tokens no later query can see (older than :func:`kvcomp.ops.horizon`) are dropped at
prefill and after every forward, the budget is taken of what the layer's queries can see
(``min(seen, window)`` while a decode step attends), and scores see the window (through :mod:`kvcomp.ops`). :class:`WindowStore`, the
selection that keeps every such token, is what the framework stores for the sliding layers of compressors
that do not compress them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcomp import host, validation
from kvcomp.compressor import SENTINEL, Capabilities, Compressor, CompressorError, LayerContext, clone_state
from kvcomp.kernels import cpu_native
from kvcomp.ops import dense_attention, horizon, take_slots
from kvcomp.ragged import RaggedStore, ragged_attention

SLOT_FIELDS = ("keys", "values", "positions", "scores", "aux")  # TokenStore's per-slot tensors, in order


def _spare(length: int) -> int:
    """Spare slots a growable TokenStore of ``length`` tokens allocates when it must copy (decode appends then
    write in place): 1/128 of the store, up to 64 (under 1% more memory, counted by nbytes), so a long store is
    copied once every 8 to 64 steps instead of every step; a store under 128 tokens (cheap to copy) has none."""
    return min(64, length // 128)


@dataclass
class TokenStore:
    """Kept tokens of one layer.

    keys, values: ``[B, H_kv, L, D]``; positions: ``[B, H_kv, L]`` int32 original positions, SENTINEL in
    slots a row does not use (rows of a batch may keep different counts). scores: optional ``[B, H_kv, L]``
    float32 running statistics (H2O's accumulated attention); aux: a second such channel (InertiaKV's moving
    average; NaN for a token not scored yet). extra: per-layer tensors a method keeps with the layer (Expected
    Attention's query statistics). Everything here is resident and counted by :meth:`nbytes`.
    all_real (host): every slot holds a real token (no SENTINEL), as far as the host knows without reading the
    positions back; False means "not known". :func:`compact` sets it once it has checked, so a decode step over
    an unpadded store reads nothing back (no host synchronisation per layer).

    Growable storage: a store returned by :meth:`extend` holds its per-slot tensors (:data:`SLOT_FIELDS`) as
    views of buffers with spare slots (:func:`_spare`); the buffers (``_buffers``) are not a dataclass field, so
    they are never stored and a copy made with ``dataclasses.replace`` does not inherit them. The next
    :meth:`extend` writes the new tokens into the spare slots instead of copying the whole store, and a
    decode-time eviction of one token per head moves the last slot into the evicted one (:func:`drop_lowest`),
    so a method that evicts at every step copies nothing either. :meth:`replace` hands the buffers on (to a copy
    that takes the store's place, or a rollback snapshot): of two stores sharing buffers only one may be
    extended, the other being discarded. :meth:`nbytes` counts the buffers, spare slots included (the memory
    they take).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] | None = None
    all_real: bool = False

    @property
    def valid(self) -> torch.Tensor:
        return self.positions < SENTINEL

    def slot_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The per-slot tensors, in :data:`SLOT_FIELDS` order (None where absent)."""
        return self.keys, self.values, self.positions, self.scores, self.aux

    def live_buffers(self) -> tuple[torch.Tensor | None, ...] | None:
        """The growable buffers (:meth:`extend`), one per :data:`SLOT_FIELDS` entry, or None when the keys,
        values and positions are no longer their views; an entry is None where its tensor is absent or is not
        its buffer's view (a statistic replaced since)."""
        buffers = getattr(self, "_buffers", None)
        if buffers is None:
            return None
        out = []
        for i, (t, buf) in enumerate(zip(self.slot_tensors(), buffers)):
            # A view of the buffer from slot _start on: the same strides, the data at that slot (pointer arithmetic
            # instead of slicing the buffer: this runs several times per layer and decode step).
            view = t is not None and buf is not None and t.stride() == buf.stride() and (
                t.data_ptr() == buf.data_ptr() + self._start * buf.stride(2) * buf.element_size())
            if i < 3 and not view:
                return None
            out.append(buf if view else None)
        return tuple(out)

    def tensors(self) -> list[torch.Tensor]:
        buffers = self.live_buffers() or (None,) * len(SLOT_FIELDS)
        held = [t if buf is None else buf for t, buf in zip(self.slot_tensors(), buffers)]
        return [t for t in held if t is not None] + list((self.extra or {}).values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def stored_tokens(self) -> torch.Tensor:
        """``[B, H_kv]`` real tokens per row and KV head (known on the host when no slot is empty)."""
        if not self.all_real:
            return self.valid.sum(-1)
        b, h, length = self.positions.shape
        return host.known(host.tensor([length] * (b * h), self.positions.device).view(b, h), [length] * (b * h))

    def gather(self, index: torch.Tensor, keep: torch.Tensor | None = None) -> TokenStore:
        """Keep slots ``index`` (``[B, H_kv, L']``); ``keep`` (same shape, bool) marks which are real, ``None``
        that every kept slot is (an all-real store stays all-real)."""
        positions = self.positions.gather(2, index)
        scores = None if self.scores is None else self.scores.gather(2, index)
        aux = None if self.aux is None else self.aux.gather(2, index)
        if keep is not None:
            positions = torch.where(keep, positions, SENTINEL)
            scores = None if scores is None else scores.masked_fill(~keep, 0.0)
            aux = None if aux is None else aux.masked_fill(~keep, float("nan"))
        return TokenStore(take_slots(self.keys, index), take_slots(self.values, index), positions, scores, aux,
                          self.extra, all_real=keep is None and self.all_real)

    def cat(self, other: TokenStore) -> TokenStore:
        scores = aux = None
        if self.scores is not None:
            extra = other.scores if other.scores is not None else self.scores.new_zeros(other.positions.shape)
            scores = torch.cat([self.scores, extra], dim=2)
        if self.aux is not None:
            extra = other.aux if other.aux is not None else self.aux.new_full(other.positions.shape, float("nan"))
            aux = torch.cat([self.aux, extra], dim=2)
        return TokenStore(
            torch.cat([self.keys, other.keys], dim=2),
            torch.cat([self.values, other.values], dim=2),
            torch.cat([self.positions, other.positions], dim=2),
            scores, aux, self.extra, self.all_real and other.all_real,
        )

    def extend(self, other: TokenStore) -> TokenStore:
        """This store followed by ``other``'s tokens: written into this store's spare slots when it has enough
        (and its tensors are still the views of its buffers), else copied once into new buffers with spare slots
        (:func:`_spare`). Per-token statistics extend alike (a new token's score 0, its aux NaN, as in
        :meth:`cat`); a store without them given tokens with them is concatenated instead."""
        if (other.scores is not None and self.scores is None) or (other.aux is not None and self.aux is None):
            return self.cat(other)
        mine = self.slot_tensors()
        new = (other.keys, other.values, other.positions,
               None if self.scores is None else 0.0 if other.scores is None else other.scores,
               None if self.aux is None else float("nan") if other.aux is None else other.aux)
        length, n = self.keys.shape[2], other.keys.shape[2]
        buffers, start = self.live_buffers(), getattr(self, "_start", 0)
        if buffers is None or start + length + n > buffers[0].shape[2] or any(
                (t is None) != (buf is None) for t, buf in zip(mine, buffers)):
            size = length + n + _spare(length + n)
            buffers = tuple(None if t is None else t.new_empty(*t.shape[:2], size, *t.shape[3:]) for t in mine)
            for buf, t in zip(buffers, mine):
                if buf is not None:
                    buf[:, :, :length] = t
            start = 0
        end = start + length
        for buf, t in zip(buffers, new):
            if buf is not None:
                buf[:, :, end:end + n] = t
        out = TokenStore(*(None if buf is None else buf[:, :, start:end + n] for buf in buffers), extra=self.extra,
                         all_real=self.all_real and other.all_real)
        out._buffers, out._start = buffers, start
        return out

    def slice(self, start: int) -> TokenStore:
        def cut(t):
            return None if t is None else t[:, :, start:]

        out = TokenStore(cut(self.keys), cut(self.values), cut(self.positions), cut(self.scores), cut(self.aux),
                         self.extra, self.all_real)
        if getattr(self, "_buffers", None) is not None:  # still views of the same buffers, further in
            out._buffers, out._start = self._buffers, self._start + min(start, self.keys.shape[2])
        return out

    def clone(self) -> TokenStore:
        """A copy sharing no tensor with this store (growable buffers copied with their spare slots)."""
        extra = clone_state(self.extra)
        buffers = self.live_buffers()
        if buffers is None:
            return dataclasses.replace(self, **{f: None if t is None else t.clone()
                                                for f, t in zip(SLOT_FIELDS, self.slot_tensors())}, extra=extra)
        buffers = tuple(None if b is None else b.clone() for b in buffers)
        start, end = self._start, self._start + self.keys.shape[2]
        out = dataclasses.replace(self, **{f: (None if t is None else t.clone()) if b is None else b[:, :, start:end]
                                           for f, t, b in zip(SLOT_FIELDS, self.slot_tensors(), buffers)},
                                  extra=extra)
        out._buffers, out._start = buffers, start
        return out

    def replace(self, **changes) -> TokenStore:
        """A copy with ``changes``; it takes over the growable buffers of the per-slot tensors it keeps when
        they are still their views (the store it replaces is not extended afterwards)."""
        out = dataclasses.replace(self, **changes)
        buffers = self.live_buffers()
        if buffers is not None and not {"keys", "values", "positions"} & set(changes):
            out._buffers = tuple(None if f in changes else b for f, b in zip(SLOT_FIELDS, buffers))
            out._start = self._start
        return out

    # The per-token layout of this store is the padded one already (RaggedStore converts between the two).
    def pad(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        return x

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def padded(self) -> TokenStore:
        return self


def select_top(store: TokenStore, scores: torch.Tensor, budget: torch.Tensor) -> TokenStore:
    """Keep the ``budget[b]`` highest-scoring real slots of each row and KV head, in position order.

    scores: ``[B, H_kv, L]``; budget: ``[B]`` long. Rows keep different counts; the result has
    ``L' = max(budget)`` slots and fills a row's unused ones with SENTINEL positions.
    """
    n_slots = scores.shape[-1]
    budgets = host.values(budget)
    width = min(max(budgets), n_slots)
    if store.all_real and width == n_slots - 1 and min(budgets) == width:
        return drop_lowest(store, scores)
    scores = scores.float().masked_fill(~store.valid, float("-inf"))
    top = scores.topk(width, dim=-1).indices  # [B, H, width]
    rank = torch.arange(width, device=scores.device)
    keep = rank.view(1, 1, -1) < budget.view(-1, 1, 1)
    keep = keep & store.valid.gather(2, top)
    # Order kept slots by position (unused slots last) so the store stays readable and recent-first logic is simple.
    order_key = torch.where(keep, store.positions.gather(2, top).long(), SENTINEL + n_slots)
    order = order_key.argsort(dim=-1)
    return store.gather(top.gather(2, order), keep.gather(2, order))


def drop_lowest(store: TokenStore, scores: torch.Tensor) -> TokenStore:
    """Evict the lowest-scoring slot of each row and KV head of an unpadded store (``scores`` ``[B, H_kv, L]``):
    what :func:`select_top` does when one token per head must go (a decode step of an evicting method), with an
    argmin instead of a top-k and a sort. Ties: the oldest goes; a NaN score (a token not scored yet) ranks
    above every number, as in top-k.

    A store that :meth:`TokenSelection.append` just built (``_owned``: no snapshot or other store shows its
    tensors) is evicted in place: the last slot's token moves into the evicted slot and the store ends one
    slot earlier, a view of the same tensors (no copy; its slots are then no longer in position order, which
    nothing reads on a full-attention layer: attention, scores and budgets go by positions). Any other store
    is copied without the evicted slot, in position order."""
    if getattr(store, "_owned", False) and (moved := _evict_in_place_native(store, scores)) is not None:
        return moved
    ranked = scores.float().nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    lowest = ranked == ranked.amin(-1, keepdim=True)
    drop = torch.where(lowest, store.positions, SENTINEL).argmin(-1, keepdim=True)  # [B, H_kv, 1]: the oldest
    return (_evict_in_place if getattr(store, "_owned", False) else _evict_by_copy)(store, drop)


def _evict_in_place_native(store: TokenStore, scores: torch.Tensor) -> TokenStore | None:
    """:func:`_evict_in_place` of the lowest slots in one native call (the argmin and the moves), for a store
    whose per-slot tensors are all its own or its buffers' (no statistic to copy); None when it cannot."""
    live = store.live_buffers()
    buffers = live if live is not None else (store.keys, store.values, store.positions, None, None)  # its own
    held = [(t, buf) for t, buf in zip(store.slot_tensors(), buffers) if t is not None]
    if any(buf is None for _, buf in held):  # a statistic that is neither (_evict_in_place copies it)
        return None
    if cpu_native.evict_lowest(scores.float(), store.positions, [t for t, _ in held]) is None:
        return None
    last = store.positions.shape[-1] - 1
    out = TokenStore(*(None if t is None else t.narrow(2, 0, last) for t in store.slot_tensors()), store.extra,
                     all_real=True)
    out._buffers, out._start = buffers, store._start if live is not None else 0
    return out


def _evict_by_copy(store: TokenStore, drop: torch.Tensor) -> TokenStore:
    """``store`` without slot ``drop[b, h]`` (``[B, H_kv, 1]``) of each row and KV head, copied in order."""
    slots = torch.arange(store.positions.shape[-1] - 1, device=drop.device)
    return store.gather(slots + (slots >= drop))  # every slot but the dropped one


def _evict_in_place(store: TokenStore, drop: torch.Tensor) -> TokenStore:
    """``store`` without slot ``drop[b, h]`` (``[B, H_kv, 1]``) of each row and KV head: the last slot's token
    is written there and the result is a view one slot shorter (the freed slot becomes a spare one). Its
    tensors are growable buffers' views (:meth:`TokenStore.extend`) or its own (concatenated); a statistic that
    is neither (set by a method's ``observe``, maybe an expanded view) is copied without the slot."""
    last = store.positions.shape[-1] - 1
    buffers = store.live_buffers()
    start = 0 if buffers is None else store._start
    if buffers is None:  # concatenated: its keys, values and positions are its own, now buffers
        buffers = (store.keys, store.values, store.positions, None, None)
    b, h = drop.shape[:2]
    index = (torch.arange(b, device=drop.device).view(b, 1), torch.arange(h, device=drop.device).view(1, h),
             drop.view(b, h))  # slot drop[b, h] of row b and KV head h
    moved, kept_buffers = [], []
    for t, buf in zip(store.slot_tensors(), buffers):
        if t is None:
            moved.append(None)
        elif buf is not None:  # the last slot's token (copied first: it is part of t) into the evicted slot
            moved.append(t.index_put_(index, t.select(2, last).clone()).narrow(2, 0, last))
        else:
            moved.append(t.index_put(index, t.select(2, last)).narrow(2, 0, last).contiguous())
        kept_buffers.append(None if t is None else buf)
    out = TokenStore(*moved, store.extra, all_real=True)
    out._buffers, out._start = tuple(kept_buffers), start
    return out


def store_from_block(k: torch.Tensor, v: torch.Tensor, ctx: LayerContext) -> TokenStore:
    """The block as a store; on a sliding-window layer, tokens no later query sees are marked empty."""
    positions = ctx.positions.to(torch.int32)
    oldest = horizon(ctx.next_positions(), ctx.spec.window)
    if oldest is not None:
        positions = positions.masked_fill(positions < oldest.view(-1, 1, 1), SENTINEL)
    return TokenStore(k, v, positions, all_real=ctx.all_real and oldest is None)


def store_of_new(k: torch.Tensor, v: torch.Tensor, ctx: LayerContext) -> TokenStore:
    """The tokens of a decode block as a store (to append; padding slots SENTINEL)."""
    return TokenStore(k, v, ctx.positions.to(torch.int32), all_real=ctx.all_real)


def forget_before(store, oldest: torch.Tensor):
    """Drop each row's tokens older than ``oldest[b]`` (``[B]``) on a sliding-window layer. Its store's real
    slots are in position order (only full-attention stores are evicted in place, out of order: drop_lowest),
    so the dropped ones are a prefix of each row and KV head."""
    if isinstance(store, RaggedStore):
        return store.forget_before(oldest)
    count = (store.positions < oldest.view(-1, 1, 1).to(store.positions.dtype)).sum(-1)  # [B, H_kv]
    low, high = (int(c) for c in count.aminmax())
    if high == 0:
        return store
    if low == high:
        return store.slice(high)
    length = store.positions.shape[-1]
    index = torch.arange(length - low, device=count.device).view(1, 1, -1) + count.unsqueeze(-1)
    return store.gather(index.clamp(max=length - 1), index < length)


def compact(store):
    """Drop padding slots (SENTINEL positions) that no row needs, keeping position order."""
    if isinstance(store, RaggedStore) or store.all_real:
        return store  # holds no padding
    if store.positions.numel() == 0 or int(store.positions.max()) < SENTINEL:
        return store.replace(all_real=True)  # checked once; later steps append real tokens without reading back
    valid = store.valid
    counts = valid.sum(-1)
    if bool((counts == valid.shape[-1]).all()):
        return store
    return select_top(store, torch.zeros_like(store.positions, dtype=torch.float32), counts.amax(dim=1))


@dataclass
class TokenSelection(Compressor):
    """Base of selection methods: keep ``kept_tokens(n)`` tokens per row and KV head.

    compression_ratio: fraction of tokens removed (kvpress convention; 0.75 keeps a quarter).
    budget: absolute number of tokens to keep per KV head; overrides ``compression_ratio`` when set.

    What a method overrides (each has a default):

    * :meth:`score` (prefill importance ``[B, H_kv, n]``) and, for decode-time methods, :meth:`decode_score`;
    * :meth:`prefill_stats`: per-token statistics kept with the store (``store.scores``: H2O's accumulated
      attention), and :meth:`prefill_score` when the prefill selection is made from them;
    * :meth:`layer_budget` (PyramidKV: budgets that fall with depth) and :meth:`select` (AdaKV: one top-k over
      every KV head of the layer, stored ragged, :class:`kvcomp.ragged.RaggedStore`);
    * ``evict_after_attention`` (TOVA): decode-time eviction runs in :meth:`after_attend`, once this step's own
      attention has been observed, instead of in :meth:`append` before it.
    """

    compression_ratio: float = 0.0
    budget: int | None = None

    sliding_layers: ClassVar[str] = "compress"
    evict_after_attention: ClassVar[bool] = False
    # The per-token scores a step computes (TOVA's) are dropped once the step has evicted: not kept at rest.
    transient_scores: ClassVar[bool] = False
    # Keep the prefill scores of the kept tokens (``store.aux``) for decode-time eviction by a scorer without
    # a decode-time score (``decode_evict`` over SnapKV).
    keeps_prefill_scores: ClassVar[bool] = False

    def __post_init__(self) -> None:
        validation.fraction("compression_ratio", self.compression_ratio, high_open=True, owner=self,
                            hint=" (the fraction of tokens removed; 0.75 keeps a quarter)")
        validation.positive_int("budget", self.budget, none=True, owner=self, hint=" (tokens kept per KV head)")

    # -- budgets -------------------------------------------------------------------------------------------
    def kept_tokens(self, seen: torch.Tensor) -> torch.Tensor:
        """``[B]`` tokens to keep per KV head after ``seen[b]`` real tokens."""
        if self.budget is not None:
            return host.clamp(seen, high=self.budget)
        keep_fraction = 1.0 - float(self.compression_ratio)
        return host.tensor((min(n, max(1, math.floor(n * keep_fraction + 1e-6))) for n in host.values(seen)),
                           seen.device)

    def layer_budget(self, seen: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """``[B]`` tokens per KV head this layer keeps (on average over its heads) after ``seen[b]`` tokens."""
        return self.kept_tokens(seen)

    # -- what a method overrides ---------------------------------------------------------------------------
    def score(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """``[B, H_kv, n]`` importance of each prompt token; higher is kept."""
        raise NotImplementedError

    def decode_score(self, store: TokenStore, ctx: LayerContext) -> torch.Tensor:
        """``[B, H_kv, L]`` importance of each stored token while decoding (``decode_time`` methods)."""
        raise NotImplementedError

    def prefill_stats(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext
                      ) -> torch.Tensor | None:
        """``[B, H_kv, n]`` per-token statistics the store keeps (``store.scores``), or None (the default)."""
        return None

    def prefill_extra(self, q: torch.Tensor, ctx: LayerContext) -> dict[str, torch.Tensor] | None:
        """Per-layer tensors the store keeps (``store.extra``) for decode-time scoring, or None (the default)."""
        return None

    def enable_decode_scoring(self) -> None:
        """Called by decode-time wrappers (``decode_evict``, ``inertiakv``): keep what :meth:`decode_score`
        needs (Expected Attention's query statistics). Default: nothing to keep."""

    def prefill_score(self, store: TokenStore, q, k, v, ctx: LayerContext, budget: torch.Tensor) -> torch.Tensor:
        """The scores the prefill selection uses (default :meth:`score`); ``store`` holds :meth:`prefill_stats`."""
        return self.score(q, k, v, ctx)

    def select(self, store: TokenStore, scores: torch.Tensor, budget: torch.Tensor, ctx: LayerContext):
        """Keep ``budget[b]`` tokens per KV head (the default; head-wise allocators keep ``H_kv * budget[b]`` per
        row, spread over heads, in a :class:`~kvcomp.ragged.RaggedStore`)."""
        return select_top(store, scores, budget)

    def over_budget(self, stored: torch.Tensor, budget: torch.Tensor) -> bool:
        """Whether ``stored`` (``[B, H_kv]``) exceeds what :meth:`select` keeps for ``budget`` (decided on the
        host when both are known there: :mod:`kvcomp.host`)."""
        counts, budgets = host.known_values(stored), host.known_values(budget)
        if counts is None or budgets is None:
            return bool((stored > budget.view(-1, 1)).any())
        heads = len(counts) // len(budgets)
        return any(n > budgets[i // heads] for i, n in enumerate(counts))

    def held_tokens(self, ctx: LayerContext) -> torch.Tensor:
        """``[B]`` tokens an uncompressed cache holds for this layer while this block attends: all seen, or on a
        sliding layer the ``window - 1`` before the block plus its own tokens (what its queries can see; the
        ones no later query sees are dropped after the block). Decode-time budgets are fractions of this."""
        window = ctx.spec.window
        if window is None:
            return ctx.seen
        held = torch.minimum(ctx.seen, window - 1 + ctx.query_valid.sum(1))
        seen = host.known_values(ctx.seen)
        if seen is None or not ctx.all_real:
            return held
        return host.known(held, (min(n, window - 1 + ctx.query_valid.shape[1]) for n in seen))

    # -- hooks ---------------------------------------------------------------------------------------------
    def prefill(self, layer, q, k, v, ctx):
        store = store_from_block(k, v, ctx)
        stats = self.prefill_stats(q, k, v, ctx)
        if stats is not None:
            store.scores = stats.masked_fill(~store.valid, 0.0)
        store.extra = self.prefill_extra(q, ctx)
        n_real = store.valid[:, 0].sum(-1)
        budget = self.layer_budget(n_real, ctx)
        nothing_evicted = bool((budget >= n_real).all())
        if nothing_evicted and not self.keeps_prefill_scores:
            return compact(store)
        scores = self.prefill_score(store, q, k, v, ctx, budget)
        if self.keeps_prefill_scores:
            store.aux = scores.float().masked_fill(~store.valid, float("nan"))
        return compact(store) if nothing_evicted else self.select(store, scores, budget, ctx)

    def append(self, layer, state, k, v, ctx):
        # On a full-attention layer the store extends in place (into spare slots), and a decode-time method
        # evicts from it in place (drop_lowest); a sliding layer's store is bounded (it holds exactly what
        # transformers' own sliding layer holds) and kept in position order (forget_before).
        growable = isinstance(state, TokenStore) and ctx.spec.window is None
        store = compact((state.extend if growable else state.cat)(store_of_new(k, v, ctx)))
        if growable and self.capabilities.decode_time and isinstance(store, TokenStore) and store is not state:
            store._owned = True  # see checkpoint(): no snapshot shows this store's tensors
        if not self.capabilities.decode_time or self.evict_after_attention:
            return store
        return self.evict(store, ctx)

    def evict(self, store, ctx: LayerContext):
        """The store brought back to this step's budget with :meth:`decode_score` (a ragged store is scored in a
        padded view built for this step)."""
        budget = self.layer_budget(self.held_tokens(ctx), ctx)
        if not self.over_budget(store.stored_tokens(), budget):
            return store
        view = store.padded()
        scores = self.decode_score(view, ctx)
        if self.transient_scores and view is store:
            # This step's scores (TOVA's attention) are dropped after it anyway (after_attend): not moved with the
            # evicted slot. The store object stays the same (its in-place eviction mark, _owned, with it).
            store.scores = None
        return self.select(view, scores, budget, ctx)

    def attend(self, layer, state, q, ctx):
        need = self.capabilities.needs_attention_weights
        if isinstance(state, RaggedStore):
            out, weights = ragged_attention(q, state, ctx.query_positions, ctx.spec, need)
        else:
            # A decode query sees every real slot of a full-attention layer (all stored positions precede it).
            all_visible = state.all_real and ctx.spec.window is None and q.shape[2] == 1
            out, weights = dense_attention(q, state.keys, state.values, ctx.query_positions, state.positions,
                                           ctx.spec, need, all_visible=all_visible)
        if need:
            self.observe(layer, state, weights, ctx)
        return out

    def after_attend(self, layer, state, ctx):
        if self.capabilities.decode_time and self.evict_after_attention:
            state = self.evict(state, ctx)
        if self.transient_scores and state.scores is not None:
            if isinstance(state, TokenStore):  # the layer's own store (a snapshot is another object): no copy
                state.scores = None
            else:
                state = state.replace(scores=None)
        oldest = horizon(ctx.next_positions(), ctx.spec.window)
        return state if oldest is None else forget_before(state, oldest)

    def checkpoint(self, state):
        # append() never writes into the tensors the store it is given shows (it builds new ones, or writes a
        # growable store's spare slots), so sharing them is a snapshot; only H2O's scores are updated in place
        # (observe), so they are copied. The snapshot shares the growable buffers: after a rollback only its own
        # lineage goes on (the store it was taken from is discarded), so their spare slots have one writer.
        # A decode-time method evicts in place (drop_lowest), over any slot: its snapshot is a copy.
        # A ragged store's select moves tokens in place when the store owns its tensors: the snapshot shows them
        # now, so the live store no longer does.
        if self.capabilities.decode_time:
            return state.clone() if isinstance(state, TokenStore) else clone_state(state)
        if isinstance(state, RaggedStore):
            state._owned = False
        scores = None if state.scores is None else state.scores.clone()
        return state.replace(scores=scores) if isinstance(state, TokenStore) else dataclasses.replace(state, scores=scores)

    def materialize(self, state):
        if isinstance(state, RaggedStore):
            state = state.padded()
        return state.keys, state.values, state.positions

    def nbytes(self, state) -> dict[str, int]:
        return {"device": state.nbytes(), "host": 0, "disk": 0}

    def stored_tokens(self, state) -> torch.Tensor:
        return state.stored_tokens()


@dataclass
class WindowStore(TokenSelection):
    """Every token a later query can still see, exactly: on a sliding-window layer its last ``window - 1``
    tokens at rest (what transformers' ``DynamicSlidingWindowLayer`` holds), on a full layer everything. The
    framework stores sliding layers with it for compressors that do not compress them."""

    capabilities: ClassVar[Capabilities] = Capabilities(lossy=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compression_ratio or self.budget is not None:
            raise CompressorError("WindowStore keeps every visible token: it takes no compression_ratio or budget.")


def recent_mask(positions: torch.Tensor, seen: torch.Tensor, window: torch.Tensor | int) -> torch.Tensor:
    """``[B, H, L]`` bool: slots among the last ``window`` (int or ``[B]``) real positions of each row."""
    return (positions >= (seen - window).view(-1, 1, 1)) & (positions < SENTINEL)
