"""CompressedCache: a ``transformers.Cache`` whose layers delegate storage and attention to a compressor.

A layer has two lengths, as ``DynamicSlidingWindowLayer`` does: ``get_seq_length()`` counts tokens seen
(logical; what ``generate`` uses for positions and input slicing) and the physical length counts slots
stored. Padding tokens of a left-padded batch are never stored: their positions are SENTINEL when they reach
a compressor, and the selection drops them.

Each layer attends as the model says (its :class:`~kvcomp.ops.AttentionSpec`, from
:func:`kvcomp.attention.layer_specs`). A sliding-window layer holds at most its window: compressors that
compress such layers (``sliding_layers = "compress"``, token selection) keep only tokens a later query can
see; for the others the layer is a :class:`~kvcomp.selection.WindowStore`, exactly what transformers' own
sliding layer holds. ``memory_factor`` is relative to what transformers' own cache holds for the model
(:meth:`CompressedCache.full_bytes`), so bounded sliding layers do not inflate it.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcomp import host, metrics
from kvcomp.attention import install, layer_specs, set_active, take_input_ids
from kvcomp.compressor import SENTINEL, Compressor, CompressorError, LayerContext
from kvcomp.ops import AttentionSpec, dense_attention, received_attention
from kvcomp.selection import WindowStore


@dataclass
class LayerSnapshot:
    """What :meth:`CompressedLayer.rollback` restores: the compressor's snapshot and the layer's counters."""

    state: Any
    seen_total: int
    seen: torch.Tensor | None
    next_position: torch.Tensor | None


class CompressedLayer(CacheLayerMixin):
    is_compileable = False  # variable length
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, compressor: Compressor, layer_idx: int, owner: CompressedCache, spec: AttentionSpec):
        super().__init__()
        self.spec = spec
        self.is_sliding = spec.window is not None
        # What this layer's state is built by: the compressor, or the exact window of a sliding layer.
        self.compressor = compressor
        if self.is_sliding and compressor.sliding_layers != "compress":
            self.compressor = WindowStore()
        self.layer_idx = layer_idx
        self.owner = owner
        self.state = None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.seen_total = 0  # tokens seen including padding: the logical length transformers expects
        self.seen: torch.Tensor | None = None  # [B] real tokens seen per row
        self.next_position: torch.Tensor | None = None  # [B] position of the next real token
        self.split: int | None = None  # verified tokens at the start of this forward (lossless decoding)

    # -- transformers' side ----------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        batch = key_states.shape[0]
        self.owner.compressor.check(batch)
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.kv_shape = (key_states.shape[1], key_states.shape[-1])  # KV heads and head dim, as the model has them
        self.seen = host.known(torch.zeros(batch, dtype=torch.long, device=self.device), [0] * batch)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending is not None:
            raise RuntimeError(
                "CompressedCache: the previous K/V of this layer were never consumed by the 'kvcomp' attention "
                "function. Build the cache with CompressedCache(model, compressor), which installs it, and do not "
                "change model.config._attn_implementation afterwards."
            )
        if self.layer_idx == 0:  # the first layer of a forward: its input ids, recorded by the embedding
            self.owner.block_ids = take_input_ids()
        if self.owner.tee is not None:
            self.owner.tee(self.layer_idx, key_states, value_states)
        self.split = None
        staged = self.owner.staged
        if staged is not None:
            # Lossless decoding: the first m tokens of this forward were verified by the full model; their
            # K/V replace the ones this (draft) forward computed, and a snapshot is taken right after them.
            keys, values = staged[0][self.layer_idx], staged[1][self.layer_idx]
            self.split = keys.shape[-2]
            key_states = torch.cat([keys.to(key_states.dtype), key_states[:, :, self.split:]], dim=2)
            value_states = torch.cat([values.to(value_states.dtype), value_states[:, :, self.split:]], dim=2)
        self.pending = (key_states, value_states)
        self.seen_total += key_states.shape[-2]
        set_active(self)
        # What the model's attention receives is ignored by "kvcomp" attention, which takes `pending`.
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen_total

    def physical_length(self) -> int:
        if self.state is None:
            return 0
        return int(self.compressor.stored_tokens(self.state).max())

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self.physical_length()
        return stored + query_length, self.seen_total - stored

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = None
        self.pending = None
        self.seen_total = 0
        self.seen = self.next_position = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("CompressedLayer cannot be cropped; lossless decoding rolls back the compressor state.")

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(
            "CompressedCache does not support beam search or batch reordering yet; use greedy or sampling."
        )

    reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported

    # -- rollback (lossless decoding) -------------------------------------------------------------------
    def checkpoint(self) -> LayerSnapshot:
        return LayerSnapshot(
            None if self.state is None else self.compressor.checkpoint(self.state),
            self.seen_total, self.seen, self.next_position,
        )

    def rollback(self, snapshot: LayerSnapshot) -> None:
        self.state = snapshot.state if self.state is None else self.compressor.rollback(self.state, snapshot.state)
        self.seen_total, self.seen, self.next_position = snapshot.seen_total, snapshot.seen, snapshot.next_position

    # -- kvcomp's side ---------------------------------------------------------------------------------
    def forward(self, query: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor, all_real: bool = False):
        """Attention for the parked K/V. query: [B, H_q, n, D]; position_ids, valid: [B, n]; ``all_real``: every
        token of the forward is real (known on the host)."""
        k, v = self.pending
        self.pending = None
        m = self.split
        if m is None:
            return self._attend(query, k, v, position_ids, valid, all_real)
        # Verified prefix first, then the snapshot lossless decoding rolls back to, then the drafted tokens.
        n = k.shape[-2]
        outs = []
        if m:
            outs.append(self._attend(query[:, :, :m], k[:, :, :m], v[:, :, :m], position_ids[:, :m], valid[:, :m],
                                     all_real))
        snapshot = self.checkpoint()
        snapshot.seen_total -= n - m  # update() counted the whole forward already
        self.owner.snapshots[self.layer_idx] = snapshot
        if m < n:
            outs.append(self._attend(query[:, :, m:], k[:, :, m:], v[:, :, m:], position_ids[:, m:], valid[:, m:],
                                     all_real))
        return torch.cat(outs, dim=2)

    def context(self, query_heads: int, k: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor,
                all_real: bool = False) -> LayerContext:
        """Count the block's tokens and describe them to the compressor."""
        b, hkv, n, _ = k.shape
        positions, count, following = self.owner.block_terms(position_ids, valid)
        before = host.known_values(self.seen)
        self.seen = self.seen + count
        # Kept on the host as well, so that a decode step's budgets read nothing back (kvcomp.host): counted when
        # the block has no padding, read once otherwise (a padded block; the first block after a context was
        # loaded or replayed).
        if all_real and before is not None:
            host.known(self.seen, (s + n for s in before))
        else:
            host.known(self.seen, self.seen.tolist())
        self.next_position = torch.maximum(self.next_position, following)
        return LayerContext(
            layer=self.layer_idx,
            positions=positions.view(b, 1, n).expand(b, hkv, n),
            query_positions=position_ids,
            query_valid=valid,
            seen=self.seen,
            spec=self.spec,
            n_groups=query_heads // hkv,
            question_length=self.owner.question_length,
            next_position=self.next_position,
            token_ids=self.owner.block_ids if self.owner.block_ids is not None and
            tuple(self.owner.block_ids.shape) == (b, n) else None,
            all_real=all_real,
        )

    def build(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext) -> None:
        """The state from a prefilled block (its attention ran on the full K/V)."""
        self.state = self.compressor.prefill(self.layer_idx, q, k, v, ctx)
        self.owner.layer_built(self, ctx)

    def _attend(self, query, k, v, position_ids, valid, all_real: bool = False):
        if self.state is not None and k.shape[2] > 1 and self.layer_idx == 0:
            self._check_continues(position_ids, valid)
        ctx = self.context(query.shape[1], k, position_ids, valid, all_real)
        if self.state is None:
            if self.compressor.capabilities.prefill_received:
                received, out = received_attention(query, k, position_ids, valid, ctx.positions, self.spec, v)
                ctx = dataclasses.replace(ctx, received=received)
            else:
                out, _ = dense_attention(query, k, v, position_ids, ctx.positions, self.spec)
            self.build(query, k, v, ctx)
            return out
        self.state = self.compressor.append(self.layer_idx, self.state, k, v, ctx)
        out = self.compressor.attend(self.layer_idx, self.state, query, ctx)
        self.state = self.compressor.after_attend(self.layer_idx, self.state, ctx)
        return out

    def absorb(self, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor) -> None:
        """Append verified K/V (``[B, H_kv, m, D]``; ``position_ids``, ``valid``: ``[B, m]``) without a forward, as
        the same tokens' decode steps would store them (see :meth:`CompressedCache.absorb_verified`)."""
        self.seen_total += k.shape[-2]
        ctx = self.context(self.owner.query_heads, k, position_ids, valid, bool(valid.all()))
        self.state = self.compressor.append(self.layer_idx, self.state, k, v, ctx)
        self.state = self.compressor.after_attend(self.layer_idx, self.state, ctx)

    def _check_continues(self, position_ids: torch.Tensor, valid: torch.Tensor) -> None:
        """A block over a filled cache must continue its sequence: a second ``generate`` on the same cache (which
        transformers would feed as a shortened "continuation") is refused instead of answering from the wrong
        history. (Only multi-token blocks are checked: one host sync per prompt block, none per decode step.)"""
        if bool((valid & (position_ids < self.next_position.view(-1, 1))).any()):
            raise CompressorError(
                f"This CompressedCache already holds a sequence ({self.seen_total} tokens) and the new input does not "
                "continue it: build a new CompressedCache(model, compressor) for every generate() call on a new prompt "
                "(a cache can only continue the sequence it holds)."
            )

    def full_bytes(self) -> int:
        """Bytes transformers' own cache holds for this layer's real tokens (a sliding layer: the last
        ``window - 1`` of each row), in the layer's dtype."""
        if self.state is None:
            return 0
        held = self.seen if self.spec.window is None else self.seen.clamp(max=self.spec.window - 1)
        heads, head_dim = self.kv_shape
        return int(held.sum()) * heads * head_dim * 2 * self.dtype.itemsize


class CompressedCache(Cache):
    """``model.generate(ids, cache=CompressedCache(model, compressor))`` compresses at prefill and, for
    decode-time methods, while decoding. ``question_length`` tells query-aware methods how many trailing
    prompt tokens hold the question, one count per row or one for all (optional)."""

    def __init__(self, model, compressor: Compressor, question_length: int | list[int] | None = None):
        install(model)
        compressor.bind(model)
        self._model = weakref.ref(model)
        self.block_ids: torch.Tensor | None = None  # input ids of the forward now running (see attention.install)
        self._prefill_contexts: dict[int, LayerContext] = {}
        self._block_memo: tuple | None = None  # (position_ids, valid, their terms): see block_terms
        if isinstance(question_length, int):
            question_length = [question_length]
        if question_length is not None:
            question_length = torch.as_tensor(question_length, dtype=torch.long, device=model.device)
        self.compressor = compressor
        self.question_length = question_length
        self.specs = layer_specs(model)
        self.query_heads = model.config.get_text_config(decoder=True).num_attention_heads
        layers = [CompressedLayer(compressor, i, self, spec) for i, spec in enumerate(self.specs)]
        super().__init__(layers=layers)
        # Lossless decoding (kvcomp.lossless): `tee(layer, k, v)` receives every K/V block the model computes;
        # `staged` holds verified K/V (per layer, [B, H_kv, m, D]) for the first m tokens of the next forward.
        self.tee: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        self.staged: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.snapshots: list[LayerSnapshot | None] = [None] * len(layers)

    @property
    def model(self):
        """The model this cache serves."""
        return self._model()

    def block_terms(self, position_ids: torch.Tensor, valid: torch.Tensor):
        """``(positions, count, following)`` of a block (``position_ids``, ``valid`` ``[B, n]``): positions with
        SENTINEL for padding, real tokens per row, and the position after the row's last real token (-1 + 1 for
        a row of padding). Every layer of a forward gets the same two tensors (kvcomp.attention), so they are
        computed once per forward, not once per layer."""
        memo = self._block_memo
        if memo is not None and memo[0] is position_ids and memo[1] is valid:
            return memo[2]
        positions = torch.where(valid, position_ids, SENTINEL)
        terms = (positions, valid.sum(1), positions.masked_fill(~valid, -1).amax(1) + 1)
        self._block_memo = (position_ids, valid, terms)  # holding the keys keeps their ids from being reused
        return terms

    def layer_built(self, layer: CompressedLayer, ctx: LayerContext) -> None:
        """A layer's state was built from the prefill; once all are, the compressor's ``after_prefill`` runs."""
        self._prefill_contexts[layer.layer_idx] = ctx
        if len(self._prefill_contexts) == len(self.layers):
            contexts, self._prefill_contexts = self._prefill_contexts, {}
            self.compressor.after_prefill(self, contexts)

    # -- lossless decoding -----------------------------------------------------------------------------
    def stage_verified(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """The next forward's first ``m`` tokens use these verified K/V (``[B, H_kv, m, D]`` per layer, ``m``
        may be 0), and each layer snapshots itself right after them into :attr:`snapshots`."""
        self.staged = (keys, values)
        self.snapshots = [None] * len(self.layers)

    @property
    def absorbs_verified(self) -> bool:
        """Whether verified tokens can be appended without a forward (:meth:`absorb_verified`): what the
        compressor keeps does not depend on decode steps' queries or attention
        (``Capabilities.state_uses_queries``)."""
        return not self.compressor.capabilities.state_uses_queries

    def absorb_verified(self, keys: list[torch.Tensor], values: list[torch.Tensor], position_ids: torch.Tensor,
                        valid: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        """Append tokens the full model verified (lossless decoding) with their verified K/V (``[B, H_kv, m, D]``
        per layer; ``position_ids``, ``valid``, ``ids``: ``[B, m]``), without running the draft model over them:
        each layer's compressor appends them as it would in a forward (same context, then ``after_attend``),
        only their queries, attention and MLPs are not computed, since nothing is kept of them. Only when
        :attr:`absorbs_verified`."""
        if not self.absorbs_verified:
            raise RuntimeError(f"CompressedCache: what {type(self.compressor).__name__} keeps depends on decode "
                               "steps' queries; feed verified tokens through a forward (stage_verified).")
        self.block_ids = ids
        for layer, k, v in zip(self.layers, keys, values):
            layer.absorb(k.to(layer.dtype), v.to(layer.dtype), position_ids, valid)
        self.block_ids = None

    def take_snapshots(self) -> list[LayerSnapshot]:
        """The snapshots the last staged forward took (one per layer); unstages."""
        if self.staged is None or any(s is None for s in self.snapshots):
            raise RuntimeError("CompressedCache: no forward ran since stage_verified().")
        snapshots, self.snapshots, self.staged = self.snapshots, [None] * len(self.layers), None
        return snapshots

    def checkpoint(self) -> list[LayerSnapshot]:
        return [layer.checkpoint() for layer in self.layers]

    def rollback(self, snapshots: list[LayerSnapshot]) -> None:
        """Every layer as it was at ``snapshots`` (from :meth:`checkpoint` or :meth:`take_snapshots`)."""
        for layer, snapshot in zip(self.layers, snapshots):
            layer.rollback(snapshot)

    # -- accounting ------------------------------------------------------------------------------------
    def resident_bytes(self) -> dict[str, int]:
        """Bytes per tier of the tensors the compressor states hold right now."""
        total = {"device": 0, "host": 0, "disk": 0}
        for layer in self.layers:
            if layer.state is not None:
                for tier, n in layer.compressor.nbytes(layer.state).items():
                    total[tier] = total.get(tier, 0) + n
        return total

    def full_bytes(self) -> int:
        """Bytes transformers' own cache (``DynamicCache(config=model.config)``, same dtype) would hold for the
        real tokens seen: every token on full-attention layers, the last ``window - 1`` on sliding ones."""
        return sum(layer.full_bytes() for layer in self.layers)

    def memory_factor(self) -> float:
        return metrics.fast_tier_factor(self.full_bytes(), self.resident_bytes())

    def stored_bytes(self) -> int:
        """Bytes of every layer's stored form (``Compressor.stored_nbytes``: what a saved context keeps; KVTC's
        entropy-coded blocks), against the live :meth:`resident_bytes`."""
        return sum(layer.compressor.stored_nbytes(layer.state) for layer in self.layers if layer.state is not None)

    def stored_factor(self) -> float:
        """The memory factor of the stored form (``full_bytes() / stored_bytes()``)."""
        return metrics.fast_tier_factor(self.full_bytes(), self.stored_bytes())

    def kept_tokens(self) -> list[torch.Tensor]:
        """Per layer, ``[B, H_kv]`` tokens stored."""
        return [layer.compressor.stored_tokens(layer.state) for layer in self.layers if layer.state is not None]


class TierLayer(CacheLayerMixin):
    """A cache layer whose past K/V live elsewhere (a :class:`kvcomp.full_kv.TieredFullKV`'s tier): each forward
    takes them from ``owner.fetch(layer)`` (prefetched), and the new tokens' K/V stay in ``new`` until the owner
    commits the accepted ones (so rejected drafts never reach the tier). ``owner`` provides
    ``fetch(layer) -> (K, V) | None`` and ``length(layer) -> int``."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, owner, layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.new = (key_states, value_states)
        past = self.owner.fetch(self.layer_idx)
        if past is None:
            return key_states, value_states
        return torch.cat([past[0], key_states], dim=2), torch.cat([past[1], value_states], dim=2)

    def get_seq_length(self) -> int:
        return self.owner.length(self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


def tier_cache(owner, n_layers: int) -> Cache:
    """A transformers ``Cache`` of :class:`TierLayer` over ``owner`` (what the verification forward runs on)."""
    return Cache(layers=[TierLayer(owner, i) for i in range(n_layers)])
