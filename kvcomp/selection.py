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

from kvcomp import validation
from kvcomp.compressor import SENTINEL, Capabilities, Compressor, CompressorError, LayerContext
from kvcomp.ops import dense_attention, horizon
from kvcomp.ragged import RaggedStore, ragged_attention


@dataclass
class TokenStore:
    """Kept tokens of one layer.

    keys, values: ``[B, H_kv, L, D]``; positions: ``[B, H_kv, L]`` int32 original positions, SENTINEL in
    slots a row does not use (rows of a batch may keep different counts). scores: optional ``[B, H_kv, L]``
    float32 running statistics (H2O's accumulated attention); aux: a second such channel (InertiaKV's moving
    average; NaN for a token not scored yet). extra: per-layer tensors a method keeps with the layer (Expected
    Attention's query statistics). Everything here is resident and counted by :meth:`nbytes`.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] | None = None

    @property
    def valid(self) -> torch.Tensor:
        return self.positions < SENTINEL

    def tensors(self) -> list[torch.Tensor]:
        fixed = [t for t in (self.keys, self.values, self.positions, self.scores, self.aux) if t is not None]
        return fixed + list((self.extra or {}).values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def stored_tokens(self) -> torch.Tensor:
        return self.valid.sum(-1)

    def gather(self, index: torch.Tensor, keep: torch.Tensor) -> TokenStore:
        """Keep slots ``index`` (``[B, H_kv, L']``); ``keep`` (same shape, bool) marks which are real."""
        d = self.keys.shape[-1]
        idx = index.unsqueeze(-1).expand(-1, -1, -1, d)
        positions = torch.where(keep, self.positions.gather(2, index), SENTINEL)
        scores = None if self.scores is None else self.scores.gather(2, index).masked_fill(~keep, 0.0)
        aux = None if self.aux is None else self.aux.gather(2, index).masked_fill(~keep, float("nan"))
        return TokenStore(self.keys.gather(2, idx), self.values.gather(2, idx), positions, scores, aux, self.extra)

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
            scores, aux, self.extra,
        )

    def slice(self, start: int) -> TokenStore:
        def cut(t):
            return None if t is None else t[:, :, start:]

        return TokenStore(cut(self.keys), cut(self.values), cut(self.positions), cut(self.scores), cut(self.aux),
                          self.extra)

    def replace(self, **changes) -> TokenStore:
        return dataclasses.replace(self, **changes)

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
    width = int(budget.max().clamp(max=n_slots))
    scores = scores.float().masked_fill(~store.valid, float("-inf"))
    top = scores.topk(width, dim=-1).indices  # [B, H, width]
    rank = torch.arange(width, device=scores.device)
    keep = rank.view(1, 1, -1) < budget.view(-1, 1, 1)
    keep = keep & store.valid.gather(2, top)
    # Order kept slots by position (unused slots last) so the store stays readable and recent-first logic is simple.
    order_key = torch.where(keep, store.positions.gather(2, top).long(), SENTINEL + n_slots)
    order = order_key.argsort(dim=-1)
    return store.gather(top.gather(2, order), keep.gather(2, order))


def store_from_block(k: torch.Tensor, v: torch.Tensor, ctx: LayerContext) -> TokenStore:
    """The block as a store; on a sliding-window layer, tokens no later query sees are marked empty."""
    positions = ctx.positions.to(torch.int32)
    oldest = horizon(ctx.next_positions(), ctx.spec.window)
    if oldest is not None:
        positions = positions.masked_fill(positions < oldest.view(-1, 1, 1), SENTINEL)
    return TokenStore(k, v, positions)


def forget_before(store, oldest: torch.Tensor):
    """Drop each row's tokens older than ``oldest[b]`` (``[B]``). The store's real slots are in position order
    (as every store here keeps them), so the dropped ones are a prefix of each row and KV head."""
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
    if isinstance(store, RaggedStore):
        return store  # holds no padding
    if store.positions.numel() == 0 or int(store.positions.max()) < SENTINEL:
        return store  # every slot is a real token (one reduction: the common decode case)
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
            return seen.clamp(max=self.budget)
        keep_fraction = 1.0 - float(self.compression_ratio)
        kept = [max(1, math.floor(int(n) * keep_fraction + 1e-6)) for n in seen.tolist()]
        return torch.tensor(kept, device=seen.device).clamp(max=seen)

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
        """Whether ``stored`` (``[B, H_kv]``) exceeds what :meth:`select` keeps for ``budget``."""
        return bool((stored > budget.view(-1, 1)).any())

    def held_tokens(self, ctx: LayerContext) -> torch.Tensor:
        """``[B]`` tokens an uncompressed cache holds for this layer while this block attends: all seen, or on a
        sliding layer the ``window - 1`` before the block plus its own tokens (what its queries can see; the
        ones no later query sees are dropped after the block). Decode-time budgets are fractions of this."""
        window = ctx.spec.window
        if window is None:
            return ctx.seen
        return torch.minimum(ctx.seen, window - 1 + ctx.query_valid.sum(1))

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
        store = compact(state.cat(TokenStore(k, v, ctx.positions.to(torch.int32))))
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
        return self.select(view, self.decode_score(view, ctx), budget, ctx)

    def attend(self, layer, state, q, ctx):
        need = self.capabilities.needs_attention_weights
        if isinstance(state, RaggedStore):
            out, weights = ragged_attention(q, state, ctx.query_positions, ctx.spec, need)
        else:
            out, weights = dense_attention(q, state.keys, state.values, ctx.query_positions, state.positions,
                                           ctx.spec, need)
        if need:
            self.observe(layer, state, weights, ctx)
        return out

    def after_attend(self, layer, state, ctx):
        if self.capabilities.decode_time and self.evict_after_attention:
            state = self.evict(state, ctx)
        if self.transient_scores and state.scores is not None:
            state = state.replace(scores=None)
        oldest = horizon(ctx.next_positions(), ctx.spec.window)
        return state if oldest is None else forget_before(state, oldest)

    def checkpoint(self, state):
        # append() builds new tensors (cat, gather) and never writes into the store it is given, so sharing
        # them is a snapshot; only H2O's scores are updated in place (observe), so they are copied.
        return dataclasses.replace(state, scores=None if state.scores is None else state.scores.clone())

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
