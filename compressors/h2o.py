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
from kvcomp.selection import TokenSelection, TokenStore, compact, recent_mask, select_top, store_from_block

_PREFILL_CHUNK = 256


def accumulated_attention(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, q_real: torch.Tensor,
                          k_pos: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention each key receives, summed over the real queries and the query group.

    q: [B, H_q, n, D], k: [B, H_kv, L, D], q_pos / q_real: [B, n] positions / real-token flags of the
    queries, k_pos: [B, H_kv, L] (SENTINEL = padding) -> [B, H_kv, L] float32.
    Queries go in chunks, each against the keys up to the last one it can see, so the ``n x L`` matrix
    is never whole and the causal upper triangle is mostly skipped.
    """
    b, hq, n, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    q_real = q_real.float()
    total = torch.zeros(b, hkv, length, dtype=torch.float32, device=q.device)
    for start in range(0, n, _PREFILL_CHUNK):
        stop = min(n, start + _PREFILL_CHUNK)
        m = stop - start
        visible = (k_pos <= q_pos[:, start:stop].max()).any(0).any(0)
        if not bool(visible.any()):
            continue
        lim = int(visible.nonzero().max()) + 1
        qc = q[:, :, start:stop].reshape(b, hkv, g * m, d)
        logits = torch.matmul(qc, k[:, :, :lim].transpose(-1, -2)).float().view(b, hkv, g, m, lim)
        allowed = k_pos[:, :, None, None, :lim] <= q_pos[:, None, None, start:stop, None]  # [B, H_kv, 1, m, lim]
        allowed = allowed | ~allowed.any(-1, keepdim=True)  # padding queries: finite, then zero-weighted
        probs = logits.mul_(scaling).masked_fill_(~allowed, float("-inf")).softmax(-1)
        # Sum over the group and the real queries as one batched matmul (einsum here was ~30x slower on CPU).
        weights = q_real[:, start:stop].view(b, 1, 1, m).expand(b, hkv, g, m).reshape(b, hkv, 1, g * m)
        total[..., :lim] += torch.matmul(weights, probs.view(b, hkv, g * m, lim)).view(b, hkv, lim)
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

    def prefill(self, layer, q, k, v, ctx):
        store = store_from_block(k, v, ctx)

        def accumulate():
            return accumulated_attention(q, k, ctx.query_positions, ctx.query_valid, ctx.positions, ctx.scaling)

        # Every prompt token gets its accumulated attention, also when nothing is evicted yet, so that
        # decode-time eviction starts from the prompt's statistics. It is the same for every budget: a sweep
        # sharing one prefill (kvcomp.shared_prefill) computes it once per layer.
        if ctx.shared is None:
            store.scores = accumulate()
        else:
            store.scores = ctx.shared.get("h2o.accumulated_attention", accumulate).clone()
        store.scores.masked_fill_(~store.valid, 0.0)
        n_real = store.valid[:, 0].sum(-1)
        budget = self.kept_tokens(n_real)
        if bool((budget >= n_real).all()):
            return compact(store)
        return select_top(store, self._protect_recent(store.scores, store.positions, ctx.seen, budget), budget)

    def decode_score(self, store: TokenStore, ctx):
        return self._protect_recent(store.scores, store.positions, ctx.seen, self.kept_tokens(ctx.seen))

    def observe(self, layer, state: TokenStore, weights, ctx):
        # weights: [B, H_kv, G, n_q, L] -> accumulate over the group and the new queries.
        state.scores += weights.sum(dim=(2, 3))
