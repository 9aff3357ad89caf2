"""KNorm: keep the tokens whose keys have the smallest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024,
https://arxiv.org/abs/2406.11430

Keys with a low norm draw high attention (the paper's observation), so ``score = -||k||`` per stored token
(``k``: ``[B, H_kv, n, D]`` -> ``[B, H_kv, n]``). It needs no query and no attention weights, so the same
score serves the prefill and decode-time eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcomp.selection import TokenSelection


def key_norm_score(keys):
    """``[..., L, D]`` keys -> ``[..., L]`` score ``-||k||_2`` (float32)."""
    return -keys.float().norm(dim=-1)


@dataclass
class KNorm(TokenSelection):
    def score(self, q, k, v, ctx):
        return key_norm_score(k)

    def decode_score(self, store, ctx):
        return key_norm_score(store.keys)
