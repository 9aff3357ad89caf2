"""Decode-time eviction for any scorer: keep a selection at a target size while generating.

kvpress's DecodingPress, for every kvcomp selection method and allocator: ``DecodeEvict(scorer=...)``
compresses the prompt by its own ``compression_ratio`` / ``budget`` (default: not at all) and, while decoding,
brings each layer back to ``target_size`` tokens per KV head (or, with ``target_size=None``, to
``kept_tokens(held)``: the ratio of what an uncompressed cache holds) whenever it has grown ``interval`` tokens
past it: ``interval=1`` evicts at every step, larger intervals score less often and let the cache grow up to
``target_size + interval - 1`` in between. The default, 10, is kvpress's (its DecodingPress compresses every
``compression_steps=10`` steps): re-scoring every stored token at every step costs more than the attention it
saves (Expected Attention's covariance term is one ``L x D x G D`` product per layer). Scores come from the
scorer's decode-time score (re-scoring the stored keys; TOVA's is its current step's attention, so eviction then
runs after the step's attention); a scorer without one (SnapKV) ranks by the scores it gave at prefill (kept
with the layer), generated tokens ahead of every prompt token and newer ones first. An allocator as scorer
(``scorer=AdaKV(...)``) keeps its head-wise allocation at every eviction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcomp import host, validation
from kvcomp.allocation import ScorerWrapper
from kvcomp.compressor import Capabilities


def prefill_rank_score(store) -> torch.Tensor:
    """``[B, H, L]``: the prefill scores kept in ``store.aux``; tokens without one (generated) above every finite
    prefill score of their head, newer higher."""
    aux = store.aux
    new = torch.isnan(aux)
    finite = aux.masked_fill(new | ~torch.isfinite(aux), float("-inf")).amax(-1, keepdim=True).clamp_min(0.0)
    return torch.where(new, finite + 1.0 + store.positions.float(), aux)


@dataclass
class DecodeEvict(ScorerWrapper):
    target_size: int | None = None
    interval: int = 10

    capabilities: ClassVar[Capabilities] = Capabilities(decode_time=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.positive_int("target_size", self.target_size, none=True, owner=self,
                                hint=" (tokens per KV head kept while decoding; None: the compression ratio)")
        validation.positive_int("interval", self.interval, owner=self, hint=" (decode steps between evictions)")
        self.inner.enable_decode_scoring()
        self.keeps_prefill_scores = not self.has_decode_score()

    def wrapped_capabilities(self, inner):
        return dataclasses.replace(inner, lossy=True, decode_time=True)

    def decode_budget(self, ctx) -> torch.Tensor:
        held = self.held_tokens(ctx)
        return host.clamp(held, high=self.target_size) if self.target_size is not None else self.layer_budget(held, ctx)

    def decode_scores(self, view, ctx) -> torch.Tensor:
        return self.decode_score(view, ctx) if self.has_decode_score() else prefill_rank_score(view)

    def evict(self, store, ctx):
        budget = self.decode_budget(ctx)
        if not self.over_budget(store.stored_tokens(), host.offset(budget, self.interval - 1)):
            return store
        view = store.padded()
        return self.select(view, self.decode_scores(view, ctx), budget, ctx)
