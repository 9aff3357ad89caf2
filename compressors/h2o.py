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

from kvcomp.compressor import Capabilities, CompressorError
from kvcomp.selection import TokenSelection, TokenStore, compact, recent_mask, select_top, store_from_block

_PREFILL_CHUNK = 512


def accumulated_attention(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                          scaling: float) -> torch.Tensor:
    """Causal attention each key receives, summed over all queries and the query group.

    q: [B, H_q, n, D], k: [B, H_kv, n, D], q_pos: [B, n], k_pos: [B, H_kv, n] -> [B, H_kv, n] float32.
    Queries are processed in chunks so the ``n x n`` matrix is never materialized whole.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    total = torch.zeros(b, hkv, n, dtype=torch.float32, device=q.device)
    for start in range(0, n, _PREFILL_CHUNK):
        stop = min(n, start + _PREFILL_CHUNK)
        qc = q[:, :, start:stop].reshape(b, hkv, g * (stop - start), d)
        logits = torch.matmul(qc, k.transpose(-1, -2)).float() * scaling
        mask = (k_pos[:, :, None, :] <= q_pos[:, None, start:stop, None]).repeat_interleave(g, dim=2)
        probs = logits.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)
        total += probs.sum(2)
    return total


@dataclass
class H2O(TokenSelection):
    recent_fraction: float = 0.5

    capabilities: ClassVar[Capabilities] = Capabilities(decode_time=True, needs_attention_weights=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.recent_fraction <= 1.0:
            raise CompressorError(f"recent_fraction must be in [0, 1], got {self.recent_fraction!r}.")

    def _protect_recent(self, scores, positions, seen, kept):
        # The newest ceil(recent_fraction * kept) tokens of each row are never evicted.
        window = torch.ceil(kept.float() * self.recent_fraction).long()
        return scores.masked_fill(recent_mask(positions, seen, window), float("inf"))

    def prefill(self, layer, q, k, v, ctx):
        store = store_from_block(k, v, ctx)
        # Every prompt token gets its accumulated attention, also when nothing is evicted yet, so that
        # decode-time eviction starts from the prompt's statistics.
        store.scores = accumulated_attention(q, k, ctx.query_positions, ctx.positions, ctx.scaling)
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
