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
from kvcomp.ops import received_attention
from kvcomp.selection import TokenSelection, TokenStore, recent_mask


@dataclass
class H2O(TokenSelection):
    recent_fraction: float = 0.5

    capabilities: ClassVar[Capabilities] = Capabilities(decode_time=True, needs_attention_weights=True,
                                                        prefill_received=True)

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
        # decode-time eviction starts from the prompt's statistics. A prefill computes it in its own attention
        # pass (ctx.received, see Capabilities.prefill_received); a sweep sharing one prefill
        # (kvcomp.shared_prefill) computes it once per layer for every budget.
        if ctx.received is not None:
            return ctx.received

        def accumulate():
            return received_attention(q, k, ctx.query_positions, ctx.query_valid, ctx.positions, ctx.spec)[0]

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
