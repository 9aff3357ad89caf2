"""StreamingLLM: attention sinks plus a recent window.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
https://arxiv.org/abs/2309.17453

Keeps the first ``n_sink`` tokens and the most recent ones, at prefill and at every decoding step, so the
cache never holds more than ``kept_tokens(seen)`` tokens per KV head however long the generation.
Kept keys keep their original RoPE positions (no re-rotation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcomp import validation
from kvcomp.compressor import Capabilities
from kvcomp.selection import TokenSelection, TokenStore


def sink_recency_score(positions: torch.Tensor, n_sink: int) -> torch.Tensor:
    """``[..., L]`` score: sinks first, then newer tokens before older ones."""
    score = positions.float()
    return score.masked_fill(positions < n_sink, float("inf"))


@dataclass
class StreamingLLM(TokenSelection):
    n_sink: int = 4

    capabilities: ClassVar[Capabilities] = Capabilities(decode_time=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.non_negative_int("n_sink", self.n_sink, owner=self, hint=" (attention sinks kept)")

    def score(self, q, k, v, ctx):
        # q, k: [B, H, n, D] -> [B, H_kv, n]
        return sink_recency_score(ctx.positions, self.n_sink)

    def decode_score(self, store: TokenStore, ctx):
        return sink_recency_score(store.positions, self.n_sink)
