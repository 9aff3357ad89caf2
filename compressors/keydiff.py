"""KeyDiff: keep the tokens whose keys are least similar to the layer head's mean key.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", 2025, https://arxiv.org/abs/2504.15364

The anchor of each row and KV head is the mean of its real keys after L2 normalisation; a token's score is
minus its cosine similarity to that anchor (``[B, H_kv, n, D]`` keys -> ``[B, H_kv, n]``), so distinctive keys are
kept. Padding and empty slots are left out of the mean. The paper applies it block by block as the prompt is
read; here the prompt is scored at once (kvpress's KeyDiffPress does the same), and while decoding the anchor
is the mean over the stored keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcomp.selection import TokenSelection


def key_diff_score(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``keys`` ``[B, H, L, D]``, ``valid`` ``[B, H, L]`` -> ``[B, H, L]`` ``-cos(k, mean normalized key)``."""
    unit = F.normalize(keys.float(), dim=-1) * valid.unsqueeze(-1)
    anchor = unit.sum(2, keepdim=True) / valid.sum(-1).clamp_min(1).view(*valid.shape[:2], 1, 1)
    return -F.cosine_similarity(keys.float(), anchor, dim=-1)


@dataclass
class KeyDiff(TokenSelection):
    def score(self, q, k, v, ctx):
        return key_diff_score(k, ctx.valid)

    def decode_score(self, store, ctx):
        return key_diff_score(store.keys, store.valid)
