"""Pure-torch references for retrieval scoring: which pages or tokens a decoding query should fetch.

* :func:`page_scores`: Quest / FreeKV page digests. A page of keys is summarised by its per-channel maximum
  and minimum; ``sum_d max(q_d * max_d, q_d * min_d)`` is an upper bound of ``q . k`` for every key of the
  page.
* :func:`quant_key_scores`: SpeCache-style approximate logits from a low-bit copy of the keys (KIVI layout
  of :func:`kvcomp.kernels.quant_ref.quantize_keys`).

Both aggregate over each KV head's query group (``reduce``: ``"max"``, ``"sum"`` or ``"mean"``), since keys
are stored and fetched per KV head, and return float32 ``[B, H_kv, ...]``.
"""

from __future__ import annotations

import torch

from kvcomp.kernels import quant_ref

REDUCTIONS = ("max", "sum", "mean")


def _group_reduce(scores: torch.Tensor, reduce: str) -> torch.Tensor:
    # scores: [B, H_kv, G, ...] -> [B, H_kv, ...]
    if reduce == "max":
        return scores.amax(2)
    if reduce == "sum":
        return scores.sum(2)
    if reduce == "mean":
        return scores.mean(2)
    raise ValueError(f"reduce must be one of {', '.join(REDUCTIONS)}; got {reduce!r}.")


def page_scores(q: torch.Tensor, page_max: torch.Tensor, page_min: torch.Tensor, reduce: str = "max") -> torch.Tensor:
    """Upper bound of ``q . k`` over each page.

    q: ``[B, H_q, 1, D]`` (one decoding query per head); page_max, page_min: ``[B, H_kv, P, D]`` per-channel
    extremes of each page's keys. Returns ``[B, H_kv, P]`` float32 (unscaled logits' bound).
    """
    b, hq, _, d = q.shape
    h = page_max.shape[1]
    qg = q.reshape(b, h, hq // h, 1, d).float()  # [B, H, G, 1, D]
    bound = torch.maximum(qg * page_max.float().unsqueeze(2), qg * page_min.float().unsqueeze(2)).sum(-1)
    return _group_reduce(bound, reduce)


def quant_key_scores(
    q: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    bits: int,
    scaling: float = 1.0,
    reduce: str = "max",
) -> torch.Tensor:
    """Approximate logits ``scaling * q . k_hat`` of every quantized key.

    q: ``[B, H_q, 1, D]``; key_codes ``[B, H_kv, N, G, D * bits / 8]``, key_scale / key_zero ``[B, H_kv, N, D]``
    as :func:`kvcomp.kernels.quant_ref.quantize_keys` returns them. Returns ``[B, H_kv, N * G]`` float32.
    """
    b, hq, _, d = q.shape
    h = key_codes.shape[1]
    keys = quant_ref.dequantize_keys(key_codes, key_scale, key_zero, bits, torch.float32).flatten(2, 3)
    qg = q.reshape(b, h, hq // h, d).float()
    logits = torch.matmul(qg, keys.transpose(-1, -2)) * scaling  # [B, H, G, L]
    return _group_reduce(logits, reduce)
