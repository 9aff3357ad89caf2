"""AdaKV: one top-k over every KV head of a layer, so heads that need more tokens get more.

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference",
2024, https://arxiv.org/abs/2407.11550

Wraps any scorer (``scorer``, default Expected Attention): a layer keeps ``H_kv * kept_tokens(n)`` tokens per
row, the best scores over all its KV heads together, after each head's guaranteed ``floor * kept_tokens(n)``
best ones (kvpress's ``alpha_safeguard``). Heads keep different counts, stored ragged
(:class:`kvcomp.ragged.RaggedStore`: ``[N, D]`` keys and values with a ``[B, H_kv]`` index, no padding to the
largest head) and attended segment by segment. kvpress's AdaKVPress masks the evicted keys instead and frees
no memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcomp import validation
from kvcomp.allocation import ScorerWrapper, adaptive_keep
from kvcomp.ragged import RaggedStore


@dataclass
class AdaKV(ScorerWrapper):
    floor: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.fraction("floor", self.floor, owner=self, hint=" (share of the per-head budget each head keeps)")

    def select(self, store, scores, budget, ctx):
        # store: padded [B, H_kv, L] (the prompt, or a decode step's padded view); scores alike.
        return RaggedStore.from_dense(store, adaptive_keep(scores, store.valid, budget, self.floor))

    def over_budget(self, stored, budget) -> bool:
        return bool((stored.sum(1) > budget * stored.shape[1]).any())
