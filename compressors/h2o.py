"""H2O: heavy hitters (accumulated attention) plus recent tokens, evicting while decoding.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
NeurIPS 2023, https://arxiv.org/abs/2306.14048

Each stored token carries its attention received so far, summed over the queries of the prompt and of
every decoding step and over the query heads of its KV head's group (scores ``[B, H_kv, L]``). The budget is
split into the ``recent_fraction`` newest tokens, always kept, and heavy hitters; one token is evicted
whenever a new one would push the cache past its budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcomp import validation
from kvcomp.compressor import Capabilities
from kvcomp.ops import AttentionSpec, attention_probs, reach, rows_per_chunk, visible
from kvcomp.selection import TokenSelection, TokenStore, recent_mask


def accumulated_attention(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, q_real: torch.Tensor,
                          k_pos: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """Attention each key receives (the layer's own: causal, window, soft-cap, sinks), summed over the real
    queries and the query group.

    q: [B, H_q, n, D], k: [B, H_kv, L, D], q_pos / q_real: [B, n] positions / real-token flags of the
    queries, k_pos: [B, H_kv, L] (SENTINEL = padding) -> [B, H_kv, L] float32.
    Queries go in chunks, each against the keys up to the last one it can see, so the ``n x L`` matrix
    is never whole and the causal upper triangle is mostly skipped.
    """
    b, hq, n, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    total = torch.zeros(b, hkv, length, dtype=torch.float32, device=q.device)
    chunk = rows_per_chunk(b * hq, length)
    if spec.plain and spec.window is None and n == length and bool(q_real.all()) and bool(
            (k_pos == q_pos.view(b, 1, n)).all()):
        return _causal_prompt_attention(q, k, q_pos, k_pos, spec.scaling, total, chunk)
    q_real = q_real.float()
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        m = stop - start
        # Slots some query of the chunk can see: a sliding layer touches a band of keys, not every earlier one.
        lo, hi = reach(q_pos[:, start:stop], k_pos, spec.window)
        qc = q[:, :, start:stop].reshape(b, hkv, g * m, d)
        allowed = visible(q_pos[:, None, None, start:stop, None], k_pos[:, :, None, None, lo:hi], spec.window)
        allowed = allowed | ~allowed.any(-1, keepdim=True)  # padding queries: finite, then zero-weighted
        allowed = allowed.expand(b, hkv, g, m, hi - lo).reshape(b, hkv, g * m, hi - lo)
        probs = attention_probs(qc, k[:, :, lo:hi], allowed, spec, spec.grouped_sinks(hkv, m, q.device))
        # Sum over the group and the real queries as one batched matmul (einsum here was ~30x slower on CPU).
        weights = q_real[:, start:stop].view(b, 1, 1, m).expand(b, hkv, g, m).reshape(b, hkv, 1, g * m)
        total[..., lo:hi] += torch.matmul(weights, probs).view(b, hkv, hi - lo)
    return total


def _causal_prompt_attention(q, k, q_pos, k_pos, scaling: float, total: torch.Tensor, chunk: int) -> torch.Tensor:
    """:func:`accumulated_attention` of an unpadded prompt over its own keys on a plain full-attention layer
    (the common prefill): every key before a query chunk is visible to all of it, so only the chunk's diagonal
    block is masked (by :func:`kvcomp.ops.visible`), the scale is folded into the queries and the softmax is
    torch's own. ~2.5x faster than the general path at 4K tokens, which builds and applies a mask over every
    key of every chunk."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        m = stop - start
        qc = (q[:, :, start:stop] * scaling).reshape(b, hkv, g * m, d)
        logits = torch.matmul(qc, k[:, :, :stop].transpose(-1, -2)).float()  # [B, H_kv, G * m, stop]
        hidden = ~visible(q_pos[:, None, None, start:stop, None], k_pos[:, :, None, None, start:stop])
        logits[..., start:stop].view(b, hkv, g, m, m).masked_fill_(hidden, float("-inf"))
        total[..., :stop] += logits.softmax(-1).sum(2)
    return total


@dataclass
class H2O(TokenSelection):
    recent_fraction: float = 0.5

    capabilities: ClassVar[Capabilities] = Capabilities(decode_time=True, needs_attention_weights=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.fraction("recent_fraction", self.recent_fraction, owner=self,
                            hint=" (share of the budget kept for the newest tokens)")

    def _protect_recent(self, scores, positions, seen, kept):
        # The newest ceil(recent_fraction * kept) tokens of each row are never evicted.
        window = torch.ceil(kept.float() * self.recent_fraction).long()
        return scores.masked_fill(recent_mask(positions, seen, window), float("inf"))

    def prefill_stats(self, q, k, v, ctx):
        # Every prompt token gets its accumulated attention, also when nothing is evicted yet, so that
        # decode-time eviction starts from the prompt's statistics. It is the same for every budget: a sweep
        # sharing one prefill (kvcomp.shared_prefill) computes it once per layer.
        def accumulate():
            return accumulated_attention(q, k, ctx.query_positions, ctx.query_valid, ctx.positions, ctx.spec)

        if ctx.shared is None:
            return accumulate()
        return ctx.shared.get("h2o.accumulated_attention", accumulate).clone()

    def prefill_score(self, store, q, k, v, ctx, budget):
        return self._protect_recent(store.scores, store.positions, ctx.seen, budget)

    def decode_score(self, store: TokenStore, ctx):
        return self._protect_recent(store.scores, store.positions, ctx.seen, self.kept_tokens(ctx.seen))

    def observe(self, layer, state: TokenStore, weights, ctx):
        # weights: [B, H_kv, G, n_q, L] -> accumulate over the group and the new queries.
        state.scores += state.unpad(weights.sum(dim=(2, 3)))
