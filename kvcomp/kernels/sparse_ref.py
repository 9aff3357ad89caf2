"""Pure-torch reference for sparse decode attention over selected tokens or pages.

Retrieval methods (Quest, FreeKV, SpeCache, top-k attention) keep the full K/V somewhere and attend, at each
decoding step, to a few selected tokens or pages of it. The Triton kernel (:mod:`sparse_triton`) gathers the
selected rows itself instead of materializing them.
"""

from __future__ import annotations

import torch

from kvcomp.ops import softcap as cap_logits
from kvcomp.ops import softmax


def selected_tokens(indices: torch.Tensor, length: int, page_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices ``[B, H, k * page_size]`` covered by page ``indices`` ``[B, H, k]`` and whether each is
    real (page index >= 0 and token < ``length``). Invalid slots index token 0."""
    offsets = torch.arange(page_size, device=indices.device)
    tokens = (indices.long().unsqueeze(-1) * page_size + offsets).flatten(-2)
    valid = (indices.unsqueeze(-1) >= 0).expand(*indices.shape, page_size).flatten(-2) & (tokens < length)
    return torch.where(valid, tokens, 0), valid


def sparse_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    scaling: float,
    page_size: int = 1,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of ``q`` over the selected pages of full K/V.

    q: ``[B, H_q, n, D]`` (usually ``n = 1``); keys, values: ``[B, H_kv, L, D]``; indices: ``[B, H_kv, k]``
    integer page indices, one set per KV head shared by its query group (``-1`` = unused slot); page ``i``
    covers tokens ``[i * page_size, (i + 1) * page_size)`` clipped to ``L`` (``page_size = 1``: token
    indices). Every query attends to every selected token (no causal mask: decoding sees the whole cache); a
    token selected twice counts twice. A row with no valid token gets zeros. ``softcap`` and ``sinks``
    (``[H_q]``) as in :class:`kvcomp.ops.AttentionSpec`. Returns ``[B, H_q, n, D]`` in ``q``'s dtype, computed
    in float32 (float64 for float64 inputs).
    """
    b, hq, n, d = q.shape
    h, length = keys.shape[1], keys.shape[2]
    cdt = torch.promote_types(q.dtype, torch.float32)
    tokens, valid = selected_tokens(indices, length, page_size)
    idx = tokens.unsqueeze(-1).expand(-1, -1, -1, d)
    k = keys.gather(2, idx).to(cdt)
    v = values.gather(2, idx).to(cdt)
    qg = q.reshape(b, h, hq // h * n, d).to(cdt)
    logits = cap_logits(torch.matmul(qg, k.transpose(-1, -2)) * scaling, softcap)
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    sink_rows = None
    if sinks is not None:
        g = hq // h
        sink_rows = sinks.to(device=q.device, dtype=cdt).view(1, h, g, 1, 1).expand(b, h, g, n, 1).reshape(b, h, g * n, 1)
    probs = softmax(logits, sink_rows).nan_to_num(0.0)
    return torch.matmul(probs, v).reshape(b, hq, n, d).to(q.dtype)
