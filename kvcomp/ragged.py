"""Ragged per-head token stores: each KV head keeps its own number of tokens, with no padding.

Head-wise budgets (AdaKV, KVzip's global threshold, DuoAttention-style streaming heads) keep different counts
per KV head. A padded ``[B, H_kv, L_max, D]`` layout would store ``L_max`` slots for every head; this one
stores the kept tokens of all heads of a layer back to back, segment ``b * H_kv + h`` holding row ``b``'s KV
head ``h`` in position order::

    keys, values: [N, D]       N = kept tokens summed over rows and KV heads
    positions:    [N] int32    original positions
    lengths:      [B, H_kv] int64, the index (tokens per segment; offsets are its cumulative sum)

so ``nbytes()`` = ``N * (2 * D * itemsize + 4) + 8 * B * H_kv`` (plus any per-token statistics) against
``B * H_kv * L_max * (2 * D * itemsize + 4)`` for the padded layout.

Attention (:func:`ragged_attention`) runs each segment's contiguous slice against its query group through
:func:`kvcomp.ops.dense_attention` (the one visibility rule, softcap and sinks), so nothing is padded or copied
per step. Appending a decode step writes each segment's new tokens after it (one concatenation, as the dense
store's append does). Scoring at an eviction step may use :meth:`RaggedStore.padded`, a padded *view* built
for that step only (documented where used); the store itself never holds padding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvcomp.ops import SENTINEL, AttentionSpec, dense_attention


@dataclass
class RaggedStore:
    """Kept tokens of one layer, ragged over (row, KV head) segments; see the module docstring.

    scores / aux: optional ``[N]`` float32 per-token statistics (aligned with ``keys``); extra: per-layer
    tensors a method keeps with the layer (Expected Attention's query statistics), counted in ``nbytes``.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    scores: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] | None = None

    # -- layout -----------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.lengths.shape)  # (B, H_kv)

    def counts(self) -> list[int]:
        return self.lengths.reshape(-1).tolist()

    def segment_ids(self) -> torch.Tensor:
        """``[N]`` long: the segment ``b * H_kv + h`` of each token."""
        n_seg = self.lengths.numel()
        return torch.repeat_interleave(torch.arange(n_seg, device=self.keys.device), self.lengths.reshape(-1))

    def tensors(self) -> list[torch.Tensor]:
        fixed = [self.keys, self.values, self.positions, self.lengths, self.scores, self.aux]
        return [t for t in fixed if t is not None] + list((self.extra or {}).values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def stored_tokens(self) -> torch.Tensor:
        return self.lengths

    # -- conversions ------------------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, store, keep: torch.Tensor | None = None) -> RaggedStore:
        """The real slots of a padded ``TokenStore`` (``[B, H, L]`` slots; ``keep`` narrows them), in slot order."""
        mask = store.valid if keep is None else store.valid & keep
        index = mask.nonzero(as_tuple=True)  # found once for every per-slot tensor

        def take(t):
            return None if t is None else t[index]

        return cls(
            keys=take(store.keys), values=take(store.values), positions=take(store.positions),
            lengths=mask.sum(-1).to(torch.int64), scores=take(store.scores), aux=take(getattr(store, "aux", None)),
            extra=getattr(store, "extra", None),
        )

    def slot_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(segment, slot)`` of each token in the padded layout: ``[N]`` each."""
        seg = self.segment_ids()
        starts = torch.cumsum(self.lengths.reshape(-1), 0) - self.lengths.reshape(-1)
        return seg, torch.arange(seg.numel(), device=seg.device) - starts[seg]

    def padded(self):
        """A padded ``TokenStore`` ``[B, H, L_max]`` of the same tokens (SENTINEL in unused slots); built on
        demand for an eviction step's scoring, never kept."""
        from kvcomp.selection import TokenStore

        b, h = self.shape
        width = int(self.lengths.max()) if self.lengths.numel() else 0
        seg, slot = self.slot_index()
        d = self.keys.shape[-1]
        flat = seg * width + slot

        def spread(x, fill, shape):
            out = torch.full((b * h * width, *shape), fill, dtype=x.dtype, device=x.device)
            out[flat] = x
            return out.view(b, h, width, *shape)

        return TokenStore(
            spread(self.keys, 0, (d,)), spread(self.values, 0, (d,)), spread(self.positions, SENTINEL, ()),
            None if self.scores is None else spread(self.scores, 0.0, ()),
            aux=None if self.aux is None else spread(self.aux, float("nan"), ()),
            extra=self.extra,
        )

    def pad(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``[N]`` per-token values -> ``[B, H, L_max]`` (``fill`` in unused slots)."""
        b, h = self.shape
        width = int(self.lengths.max()) if self.lengths.numel() else 0
        seg, slot = self.slot_index()
        out = torch.full((b * h * width,), fill, dtype=x.dtype, device=x.device)
        out[seg * width + slot] = x
        return out.view(b, h, width)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, L_max]`` (the layout of :meth:`pad` and :meth:`padded`) -> ``[N]``."""
        seg, slot = self.slot_index()
        width = x.shape[-1]
        return x.reshape(-1)[seg * width + slot]

    # -- edits ------------------------------------------------------------------------------------------
    def select(self, keep: torch.Tensor) -> RaggedStore:
        """Keep the tokens where ``keep`` (``[N]`` bool) holds."""
        if bool(keep.all()):
            return self
        n_seg = self.lengths.numel()
        lengths = torch.zeros(n_seg, dtype=torch.int64, device=keep.device)
        lengths.index_add_(0, self.segment_ids(), keep.to(torch.int64))
        index = keep.nonzero().squeeze(1)  # found once for every per-token tensor

        def take(t):
            return None if t is None else t.index_select(0, index)

        return RaggedStore(take(self.keys), take(self.values), take(self.positions), lengths.view(self.shape),
                           take(self.scores), take(self.aux), self.extra)

    def cat(self, other) -> RaggedStore:
        """Append a dense block (``TokenStore`` ``[B, H, n]``; SENTINEL slots dropped) after each segment."""
        valid = other.valid
        added = valid.sum(-1).reshape(-1).tolist()
        counts = self.counts()
        n = other.keys.shape[2]
        h = self.shape[1]
        all_real = all(a == n for a in added)
        pieces: dict[str, list[torch.Tensor]] = {"keys": [], "values": [], "positions": [], "scores": [], "aux": []}
        new_scores = other.scores if other.scores is not None else None
        new_aux = getattr(other, "aux", None)
        start = 0
        for s, count in enumerate(counts):
            b, head = divmod(s, h)
            stop = start + count
            take = slice(None) if all_real else valid[b, head]
            pieces["keys"] += [self.keys[start:stop], other.keys[b, head][take]]
            pieces["values"] += [self.values[start:stop], other.values[b, head][take]]
            pieces["positions"] += [self.positions[start:stop], other.positions[b, head][take].to(self.positions.dtype)]
            if self.scores is not None:
                extra = (new_scores[b, head][take] if new_scores is not None
                         else self.scores.new_zeros(added[s]))
                pieces["scores"] += [self.scores[start:stop], extra]
            if self.aux is not None:
                extra = new_aux[b, head][take] if new_aux is not None else self.aux.new_full((added[s],), float("nan"))
                pieces["aux"] += [self.aux[start:stop], extra]
            start = stop
        lengths = self.lengths + valid.sum(-1).to(torch.int64)
        return RaggedStore(
            torch.cat(pieces["keys"]), torch.cat(pieces["values"]), torch.cat(pieces["positions"]), lengths,
            torch.cat(pieces["scores"]) if self.scores is not None else None,
            torch.cat(pieces["aux"]) if self.aux is not None else None,
            self.extra,
        )

    def forget_before(self, oldest: torch.Tensor) -> RaggedStore:
        """Drop each row's tokens older than ``oldest[b]`` (``[B]``)."""
        h = self.shape[1]
        row = self.segment_ids() // h
        keep = self.positions.to(torch.int64) >= oldest.to(torch.int64)[row]
        return self.select(keep)

    def replace(self, **changes) -> RaggedStore:
        return dataclasses.replace(self, **changes)


def segment_specs(spec: AttentionSpec, n_kv_heads: int) -> list[AttentionSpec]:
    """One spec per KV head: the same, with the sinks of that head's query group only."""
    if spec.sinks is None:
        return [spec] * n_kv_heads
    g = spec.sinks.numel() // n_kv_heads
    return [dataclasses.replace(spec, sinks=spec.sinks[h * g:(h + 1) * g]) for h in range(n_kv_heads)]


def ragged_attention(q: torch.Tensor, store: RaggedStore, q_pos: torch.Tensor, spec: AttentionSpec,
                     need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``q`` ``[B, H_q, n, D]`` over a ragged store, segment by segment (each a contiguous slice,
    no copy). Returns out ``[B, H_q, n, D]`` and, if asked, the weights in the padded layout
    ``[B, H_kv, G, n, L_max]`` (zeros in unused slots; the layout of :meth:`RaggedStore.pad`)."""
    b, hq, n, d = q.shape
    hkv = store.shape[1]
    g = hq // hkv
    specs = segment_specs(spec, hkv)
    counts = store.counts()
    width = max(counts) if counts else 0
    out = torch.empty_like(q)
    weights = q.new_zeros(b, hkv, g, n, width, dtype=torch.float32) if need_weights else None
    start = 0
    for s, count in enumerate(counts):
        row, head = divmod(s, hkv)
        stop = start + count
        k = store.keys[start:stop].view(1, 1, count, d)
        v = store.values[start:stop].view(1, 1, count, d)
        pos = store.positions[start:stop].view(1, 1, count)
        qs = q[row:row + 1, head * g:(head + 1) * g]
        if count == 0:  # a head that keeps nothing contributes nothing (as a softmax over no key would)
            out[row, head * g:(head + 1) * g] = 0
            continue
        o, w = dense_attention(qs, k, v, q_pos[row:row + 1], pos, specs[head], need_weights)
        out[row, head * g:(head + 1) * g] = o[0]
        if need_weights:
            weights[row, head, :, :, :count] = w[0, 0]
        start = stop
    return out, weights
