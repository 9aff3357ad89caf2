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
from kvcomp.ops import horizon


@dataclass
class TokenStore:
    """Kept tokens of one layer.

    keys, values: ``[B, H_kv, L, D]``; positions: ``[B, H_kv, L]`` int32 original positions, SENTINEL in
    slots a row does not use (rows of a batch may keep different counts). scores: optional ``[B, H_kv, L]``
    float32 running statistics (H2O's accumulated attention).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor | None = None

    @property
    def valid(self) -> torch.Tensor:
        return self.positions < SENTINEL

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.positions, self.scores) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def gather(self, index: torch.Tensor, keep: torch.Tensor) -> TokenStore:
        """Keep slots ``index`` (``[B, H_kv, L']``); ``keep`` (same shape, bool) marks which are real."""
        d = self.keys.shape[-1]
        idx = index.unsqueeze(-1).expand(-1, -1, -1, d)
        positions = torch.where(keep, self.positions.gather(2, index), SENTINEL)
        scores = None if self.scores is None else self.scores.gather(2, index).masked_fill(~keep, 0.0)
        return TokenStore(self.keys.gather(2, idx), self.values.gather(2, idx), positions, scores)

    def cat(self, other: TokenStore) -> TokenStore:
        scores = None
        if self.scores is not None:
            extra = other.scores if other.scores is not None else self.scores.new_zeros(other.positions.shape)
            scores = torch.cat([self.scores, extra], dim=2)
        return TokenStore(
            torch.cat([self.keys, other.keys], dim=2),
            torch.cat([self.values, other.values], dim=2),
            torch.cat([self.positions, other.positions], dim=2),
            scores,
        )


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


def forget_before(store: TokenStore, oldest: torch.Tensor) -> TokenStore:
    """Drop each row's tokens older than ``oldest[b]`` (``[B]``). The store's real slots are in position order
    (as every store here keeps them), so the dropped ones are a prefix of each row and KV head."""
    count = (store.positions < oldest.view(-1, 1, 1).to(store.positions.dtype)).sum(-1)  # [B, H_kv]
    low, high = (int(c) for c in count.aminmax())
    if high == 0:
        return store
    if low == high:
        return TokenStore(store.keys[:, :, high:], store.values[:, :, high:], store.positions[:, :, high:],
                          None if store.scores is None else store.scores[:, :, high:])
    length = store.positions.shape[-1]
    index = torch.arange(length - low, device=count.device).view(1, 1, -1) + count.unsqueeze(-1)
    return store.gather(index.clamp(max=length - 1), index < length)


def compact(store: TokenStore) -> TokenStore:
    """Drop padding slots (SENTINEL positions) that no row needs, keeping position order."""
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
    """

    compression_ratio: float = 0.0
    budget: int | None = None

    sliding_layers: ClassVar[str] = "compress"

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

    # -- what a method overrides ---------------------------------------------------------------------------
    def score(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """``[B, H_kv, n]`` importance of each prompt token; higher is kept."""
        raise NotImplementedError

    def decode_score(self, store: TokenStore, ctx: LayerContext) -> torch.Tensor:
        """``[B, H_kv, L]`` importance of each stored token while decoding (``decode_time`` methods)."""
        raise NotImplementedError

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
        n_real = store.valid[:, 0].sum(-1)
        budget = self.kept_tokens(n_real)
        if bool((budget >= n_real).all()):
            return compact(store)
        return select_top(store, self.score(q, k, v, ctx), budget)

    def append(self, layer, state, k, v, ctx):
        store = compact(state.cat(TokenStore(k, v, ctx.positions.to(torch.int32))))
        if not self.capabilities.decode_time:
            return store
        budget = self.kept_tokens(self.held_tokens(ctx))
        if bool((store.valid.sum(-1) <= budget.view(-1, 1)).all()):
            return store
        return select_top(store, self.decode_score(store, ctx), budget)

    def after_attend(self, layer, state, ctx):
        oldest = horizon(ctx.next_positions(), ctx.spec.window)
        return state if oldest is None else forget_before(state, oldest)

    def checkpoint(self, state: TokenStore) -> TokenStore:
        # append() builds new tensors (cat, gather) and never writes into the store it is given, so sharing
        # them is a snapshot; only H2O's scores are updated in place (observe), so they are copied.
        return dataclasses.replace(state, scores=None if state.scores is None else state.scores.clone())

    def materialize(self, state: TokenStore):
        return state.keys, state.values, state.positions

    def nbytes(self, state: TokenStore) -> dict[str, int]:
        return {"device": state.nbytes(), "host": 0, "disk": 0}

    def stored_tokens(self, state: TokenStore) -> torch.Tensor:
        return state.valid.sum(-1)


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
