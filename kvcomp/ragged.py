"""Ragged per-head token stores: each KV head keeps its own number of tokens, with no padding.

Head-wise budgets (AdaKV, KVzip's global threshold, DuoAttention-style streaming heads) keep different counts
per KV head. A padded ``[B, H_kv, L_max, D]`` layout would store ``L_max`` slots for every head; this one
stores the kept tokens of all heads of a layer back to back, segment ``b * H_kv + h`` holding row ``b``'s KV
head ``h`` in position order::

    keys, values: [C, D]       C slots: the kept tokens of every segment, plus each segment's spare slots
    positions:    [C] int32    original positions (a spare slot's entries are unused: the lengths tell)
    lengths:      [B, H_kv] int64, tokens per segment
    starts:       [B, H_kv] int64, the slot where each segment begins; None when the segments are packed
                  back to back with no spare slot (C = N, the kept tokens; offsets are the lengths' cumsum)

A prefill's store is packed: ``nbytes()`` = ``N * (2 * D * itemsize + 4) + 8 * B * H_kv`` (plus any per-token
statistics) against ``B * H_kv * L_max * (2 * D * itemsize + 4)`` for the padded layout. Decoding appends to
every segment, so the first append copies the store once into one with spare slots after each segment
(:func:`_spare`: 1/64 of the longest segment, 8 to 64 slots, counted by ``nbytes``), and later appends write
there, copying nothing until a segment is full. DuoAttention's streaming heads slide their window in place
(:meth:`RaggedStore.drop_spans`: the window's tokens move up one slot; no other segment is touched).

Attention (:func:`ragged_attention`) runs each segment's contiguous slice against its query group through
:func:`kvcomp.ops.dense_attention` (the one visibility rule, softcap and sinks), so nothing is padded or copied
per step. Scoring at an eviction step may use :meth:`RaggedStore.padded`, a padded *view* built for that step
only (documented where used); the store itself never holds padding.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvcomp.ops import SENTINEL, AttentionSpec, dense_attention


def _spare(longest: int) -> int:
    """Spare slots each segment gets when a ragged store must copy: 1/64 of its longest segment, 8 to 64, so
    a long store is copied once every 8 to 64 decode steps instead of every step (under 2% more memory on
    long segments, counted by nbytes)."""
    return min(64, max(8, longest // 64))


class Layout(NamedTuple):
    """A ragged store's segments on the host, in segment order: where each begins, its slots, its tokens."""

    starts: list[int]
    capacities: list[int]
    lengths: list[int]


@dataclass
class RaggedStore:
    """Kept tokens of one layer, ragged over (row, KV head) segments; see the module docstring.

    scores / aux: optional ``[C]`` float32 per-token statistics (aligned with ``keys``); extra: per-layer
    tensors a method keeps with the layer (Expected Attention's query statistics), counted in ``nbytes``.
    Per-token tensors (``[C]``, ``[C, D]``) hold a spare slot's entries too (unused): :attr:`valid` tells the
    kept ones.

    In-place edits: a store :meth:`cat` built by copying owns its tensors (``_owned``, not a field: a store
    made with ``dataclasses.replace``, loaded from a store or taken as a snapshot does not); :meth:`select` then
    moves the kept tokens within their segments instead of copying the store, and the result owns the tensors
    in turn. :meth:`cat` writes into spare slots of any store (beyond every segment's length, which no
    snapshot sees); of two stores sharing tensors only one may be extended, the other being discarded.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    scores: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] | None = None
    starts: torch.Tensor | None = None

    # -- layout -----------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.lengths.shape)  # (B, H_kv)

    @property
    def valid(self) -> torch.Tensor:
        """``[C]`` bool: the slots holding a kept token (not a spare one). Read from the lengths, not from the
        positions: a snapshot sharing this store's tensors sees later appends' tokens in its spare slots."""
        if self.starts is None:
            return torch.ones(self.keys.shape[0], dtype=torch.bool, device=self.keys.device)
        seg, slot = self._slots()
        return slot < self.lengths.reshape(-1)[seg]

    def _slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(segment, slot within it)`` of every slot: ``[C]`` each."""
        seg = self.segment_ids()
        return seg, torch.arange(seg.numel(), device=seg.device) - self.segment_starts()[seg]

    def layout(self) -> Layout:
        """The segments on the host: read back once per store and kept with it (for the ``lengths`` and
        ``starts`` tensors it was read from, which are never written in place), so a decode step's append and
        attention read nothing back."""
        cached = getattr(self, "_layout", None)
        if cached is not None and cached[0] is self.lengths and cached[1] is self.starts:
            return cached[2]
        lengths = self.lengths.reshape(-1).tolist()
        if self.starts is None:
            starts, caps = [0, *itertools.accumulate(lengths)][:-1], lengths
        else:
            starts = self.starts.reshape(-1).tolist()
            caps = [b - a for a, b in zip(starts, [*starts[1:], self.keys.shape[0]])]
        return self._keep_layout(Layout(starts, caps, lengths))

    def _keep_layout(self, layout: Layout) -> Layout:
        self._layout = (self.lengths, self.starts, layout)
        return layout

    def counts(self) -> list[int]:
        return list(self.layout().lengths)

    def segment_starts(self) -> torch.Tensor:
        """``[B * H_kv]`` long: the slot where each segment begins."""
        lengths = self.lengths.reshape(-1)
        return torch.cumsum(lengths, 0) - lengths if self.starts is None else self.starts.reshape(-1)

    def segment_ids(self) -> torch.Tensor:
        """``[C]`` long: the segment ``b * H_kv + h`` of each slot."""
        caps = torch.tensor(self.layout().capacities, device=self.keys.device)
        return torch.repeat_interleave(torch.arange(caps.numel(), device=self.keys.device), caps,
                                       output_size=self.keys.shape[0])

    def segments(self, x: torch.Tensor) -> list[torch.Tensor]:
        """A per-token tensor (``[C, ...]``) split into its segments' kept tokens (views), in segment order."""
        layout = self.layout()
        return [x[s:s + n] for s, n in zip(layout.starts, layout.lengths)]

    def per_token(self) -> list[torch.Tensor | None]:
        return [self.keys, self.values, self.positions, self.scores, self.aux]

    def tensors(self) -> list[torch.Tensor]:
        fixed = [*self.per_token(), self.lengths, self.starts]
        return [t for t in fixed if t is not None] + list((self.extra or {}).values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def stored_tokens(self) -> torch.Tensor:
        return self.lengths

    # -- conversions ------------------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, store, keep: torch.Tensor | None = None) -> RaggedStore:
        """The real slots of a padded ``TokenStore`` (``[B, H, L]`` slots; ``keep`` narrows them), in slot
        order, packed."""
        mask = store.valid if keep is None else store.valid & keep
        index = mask.nonzero(as_tuple=True)  # found once for every per-slot tensor

        def take(t):
            return None if t is None else t[index]

        return cls(
            keys=take(store.keys), values=take(store.values), positions=take(store.positions),
            lengths=mask.sum(-1).to(torch.int64), scores=take(store.scores), aux=take(getattr(store, "aux", None)),
            extra=getattr(store, "extra", None),
        )

    def slot_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(segment, slot, index)``: the segment and padded-layout slot of each kept token, ``[N]`` each, and
        the token's slot in this store (``[N]`` long; None when packed: the kept tokens are all the slots)."""
        seg, slot = self._slots()
        if self.starts is None:
            return seg, slot, None
        index = (slot < self.lengths.reshape(-1)[seg]).nonzero().squeeze(1)
        return seg[index], slot[index], index

    def _width(self) -> int:
        return max(self.layout().lengths, default=0)

    def padded(self):
        """A padded ``TokenStore`` ``[B, H, L_max]`` of the same tokens (SENTINEL in unused slots); built on
        demand for an eviction step's scoring, never kept."""
        from kvcomp.selection import TokenStore

        d = self.keys.shape[-1]
        keys, values, positions, scores, aux = (self.pad(t, fill, shape) if t is not None else None for t, fill, shape in (
            (self.keys, 0, (d,)), (self.values, 0, (d,)), (self.positions, SENTINEL, ()), (self.scores, 0.0, ()),
            (self.aux, float("nan"), ())))
        return TokenStore(keys, values, positions, scores, aux=aux, extra=self.extra)

    def pad(self, x: torch.Tensor, fill: float = 0.0, shape: tuple[int, ...] = ()) -> torch.Tensor:
        """``[C, *shape]`` per-token values -> ``[B, H, L_max, *shape]`` (``fill`` in unused slots)."""
        b, h = self.shape
        width = self._width()
        seg, slot, index = self.slot_index()
        out = torch.full((b * h * width, *shape), fill, dtype=x.dtype, device=x.device)
        out[seg * width + slot] = x if index is None else x[index]
        return out.view(b, h, width, *shape)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, L_max]`` (the layout of :meth:`pad` and :meth:`padded`) -> ``[C]`` (0 in a spare slot)."""
        seg, slot, index = self.slot_index()
        taken = x.reshape(-1)[seg * x.shape[-1] + slot]
        if index is None:
            return taken
        out = x.new_zeros(self.keys.shape[0])
        out[index] = taken
        return out

    # -- edits ------------------------------------------------------------------------------------------
    def select(self, keep: torch.Tensor) -> RaggedStore:
        """Keep the tokens where ``keep`` (``[C]`` bool; spare slots ignored) holds: in place (the kept tokens
        move up within their segments) when this store owns its tensors, else a packed copy."""
        seg, slot = self._slots()
        if self.starts is not None:
            keep = keep & (slot < self.lengths.reshape(-1)[seg])  # a spare slot is never kept
        if bool(keep.sum() == self.lengths.sum()):
            return self
        lengths = torch.zeros(self.lengths.numel(), dtype=torch.int64, device=keep.device)
        lengths.index_add_(0, seg, keep.to(torch.int64))
        if self.starts is not None and getattr(self, "_owned", False):
            return self._select_in_place(keep, seg, slot, lengths)
        index = keep.nonzero().squeeze(1)  # found once for every per-token tensor

        def take(t):
            return None if t is None else t.index_select(0, index)

        return RaggedStore(take(self.keys), take(self.values), take(self.positions), lengths.view(self.shape),
                           take(self.scores), take(self.aux), self.extra)

    def _select_in_place(self, keep: torch.Tensor, seg: torch.Tensor, slot: torch.Tensor, lengths: torch.Tensor
                         ) -> RaggedStore:
        """:meth:`select`'s in-place case; ``seg``, ``slot``: :meth:`_slots`."""
        starts = self.segment_starts()
        kept = keep.to(torch.int64)
        before = torch.cumsum(kept, 0) - kept  # kept tokens before each slot
        rank = before - before[starts][seg]  # a kept token's slot within its segment once that is compacted
        src = (keep & (rank != slot)).nonzero().squeeze(1)
        dst = (starts[seg] + rank)[src]
        for t in self.per_token():
            if t is not None:
                t[dst] = t[src]  # the right side is gathered first (a copy), so overlapping moves are safe
        out = self.replace(lengths=lengths.view(self.shape))
        out._owned = True
        return out

    def drop_spans(self, spans: dict[int, tuple[int, int]]) -> RaggedStore:
        """Drop, in each segment ``s`` of ``spans`` (``s -> (a, d)``), its ``d`` tokens from its slot ``a`` on, the
        later ones moving up: in place when this store owns its tensors (only those segments' tokens move;
        DuoAttention's sliding windows), else by :meth:`select` (a packed copy)."""
        spans = {s: (a, d) for s, (a, d) in spans.items() if d}
        if not spans:
            return self
        layout = self.layout()
        starts = layout.starts
        if self.starts is None or not getattr(self, "_owned", False):
            keep = torch.ones(self.keys.shape[0], dtype=torch.bool, device=self.keys.device)
            for s, (a, d) in spans.items():
                keep[starts[s] + a:starts[s] + a + d] = False
            return self.select(keep)
        counts = list(layout.lengths)
        for s, (a, d) in spans.items():
            first, end = starts[s] + a, starts[s] + counts[s]
            for t in self.per_token():
                if t is not None:
                    t[first:end - d] = t[first + d:end].clone()
            counts[s] -= d
        out = self.replace(lengths=torch.tensor(counts, dtype=self.lengths.dtype, device=self.lengths.device
                                                ).view(self.shape))
        out._owned = True
        out._keep_layout(Layout(starts, layout.capacities, counts))
        return out

    def cat(self, other) -> RaggedStore:
        """Append a dense block (``TokenStore`` ``[B, H, n]``; SENTINEL slots dropped) after each segment: into
        the spare slots when every segment has room, else into a copy with spare slots (:func:`_spare`)."""
        valid = other.valid
        n_seg, n = self.lengths.numel(), other.keys.shape[2]
        device = self.keys.device
        layout = self.layout()
        all_real = getattr(other, "all_real", False) or bool(valid.all())
        added = [n] * n_seg if all_real else valid.reshape(n_seg, n).sum(-1).tolist()
        grown = [length + a for length, a in zip(layout.lengths, added)]
        new = [other.keys, other.values, other.positions.to(self.positions.dtype),
               None if self.scores is None else other.scores if other.scores is not None
               else self.scores.new_zeros(other.positions.shape),
               None if self.aux is None else getattr(other, "aux", None) if getattr(other, "aux", None) is not None
               else self.aux.new_full(other.positions.shape, float("nan"))]
        if self.starts is not None and all(g <= c for g, c in zip(grown, layout.capacities)):
            starts, caps, starts_t = layout.starts, layout.capacities, self.starts
            buffers, owned = self.per_token(), getattr(self, "_owned", False)
        else:
            spare = _spare(max(grown, default=0))
            caps = [g + spare for g in grown]
            starts = [0, *itertools.accumulate(caps)][:-1]
            starts_t = torch.tensor(starts, dtype=torch.int64, device=device).view(self.shape)
            buffers, owned = self._copied(starts_t.reshape(-1), sum(caps)), True
        base = torch.tensor([a + length for a, length in zip(starts, layout.lengths)], device=device).view(n_seg, 1)
        if all_real:
            dst = (base + torch.arange(n, device=device)).reshape(-1)
            pick = None
        else:
            pick = valid.reshape(n_seg, n)
            dst = (base + torch.cumsum(pick, -1) - 1)[pick]
        for buf, t in zip(buffers, new):
            if buf is not None:
                t = t.reshape(n_seg * n, *t.shape[3:]) if pick is None else t.reshape(n_seg, n, *t.shape[3:])[pick]
                buf[dst] = t
        lengths = torch.tensor(grown, dtype=self.lengths.dtype, device=device).view(self.shape)
        out = RaggedStore(*buffers[:3], lengths, buffers[3], buffers[4], self.extra, starts_t)
        out._owned = owned
        out._keep_layout(Layout(starts, caps, grown))
        return out

    def _copied(self, starts: torch.Tensor, size: int) -> list[torch.Tensor | None]:
        """The per-token tensors copied into ``size`` slots, segment ``s`` from slot ``starts[s]`` on (the rest
        spare: zeros, SENTINEL positions, NaN aux)."""
        seg, slot, index = self.slot_index()
        dst = starts[seg] + slot
        out = []
        for t, fill in zip(self.per_token(), (0, 0, SENTINEL, 0.0, float("nan"))):
            if t is None:
                out.append(None)
                continue
            buf = torch.full((size, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
            buf[dst] = t if index is None else t[index]
            out.append(buf)
        return out

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
    layout = store.layout()
    counts = layout.lengths
    width = max(counts) if counts else 0
    out = torch.empty_like(q)
    weights = q.new_zeros(b, hkv, g, n, width, dtype=torch.float32) if need_weights else None
    # A decode query of a full-attention layer sees every kept token (all precede it; a segment holds no padding).
    all_visible = spec.window is None and n == 1
    starts = layout.starts
    for s, count in enumerate(counts):
        row, head = divmod(s, hkv)
        start = starts[s]
        stop = start + count
        k = store.keys[start:stop].view(1, 1, count, d)
        v = store.values[start:stop].view(1, 1, count, d)
        pos = store.positions[start:stop].view(1, 1, count)
        qs = q[row:row + 1, head * g:(head + 1) * g]
        if count == 0:  # a head that keeps nothing contributes nothing (as a softmax over no key would)
            out[row, head * g:(head + 1) * g] = 0
            continue
        o, w = dense_attention(qs, k, v, q_pos[row:row + 1], pos, specs[head], need_weights, all_visible=all_visible)
        out[row, head * g:(head + 1) * g] = o[0]
        if need_weights:
            weights[row, head, :, :, :count] = w[0, 0]
    return out, weights
