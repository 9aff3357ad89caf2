"""TOVA: keep the tokens the newest query attends to most, re-scored and evicting at every step.

Oren et al., "Transformers are Multi-State RNNs" (Token Omission Via Attention), EMNLP 2024,
https://arxiv.org/abs/2401.06104

At prefill the score of a token is the attention the prompt's last query gives it (the layer's own attention:
window, soft-cap, sinks), averaged over all query heads of the layer (``aggregate="all"``, the default: the
paper's and kvpress's choice, so every KV head keeps the same tokens; on SmolLM2-135M it kept needles the
per-group mean lost) or over the query heads of each KV head's group (``"group"``), ``[B, H_kv, n]``. While decoding, each forward's attention is observed and, once it is done
(``evict_after_attention``), the cache is brought back to its budget with that step's last query: the current
token is scored with everything else, not evicted before its own attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvcomp import validation
from kvcomp.compressor import Capabilities
from kvcomp.ops import attention_probs, visible
from kvcomp.selection import TokenSelection


@dataclass
class TOVA(TokenSelection):
    aggregate: str = "all"

    capabilities: ClassVar[Capabilities] = Capabilities(decode_time=True, needs_attention_weights=True)
    evict_after_attention: ClassVar[bool] = True
    transient_scores: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.choice("aggregate", self.aggregate, ("group", "all"), owner=self)

    def _reduce(self, last):
        # last: [B, H_kv, G, L] attention of the newest query of each head -> [B, H_kv, L]
        scores = last.mean(2)
        return scores.mean(1, keepdim=True).expand_as(scores) if self.aggregate == "all" else scores

    def score(self, q, k, v, ctx):
        # q: [B, H_q, n_q, D], k: [B, H_kv, n, D] -> [B, H_kv, n]; the last query column is real in every row
        b, hq, _, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        g = hq // hkv
        q_last = q[:, :, -1:].reshape(b, hkv, g, d)
        q_pos = ctx.query_positions[:, -1]
        allowed = visible(q_pos.view(b, 1, 1, 1), ctx.positions.unsqueeze(2), ctx.spec.window)
        probs = attention_probs(q_last, k, allowed.expand(b, hkv, g, n), ctx.spec, ctx.spec.grouped_sinks(hkv, 1, q.device))
        return self._reduce(probs.nan_to_num(0.0))

    def observe(self, layer, state, weights, ctx):
        # weights: [B, H_kv, G, n_q, L] over the stored slots; the newest query decides this step's eviction.
        state.scores = state.unpad(self._reduce(weights[:, :, :, -1]))

    def decode_score(self, store, ctx):
        return store.scores
