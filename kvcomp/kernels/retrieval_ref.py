"""Pure-torch references for retrieval scoring: which pages or tokens a decoding query should fetch.

* :func:`page_scores`: Quest / FreeKV page digests. A page of keys is summarised by its per-channel maximum
  and minimum; ``sum_d max(q_d * max_d, q_d * min_d)`` is an upper bound of ``q . k`` for every key of the
  page.
* :func:`quant_key_scores`: SpeCache-style approximate logits from a low-bit copy of the keys (KIVI layout
  of :func:`kvcomp.kernels.quant_ref.quantize_keys`).
* :func:`speculation_check`: how well a speculative prefetch (the last step's selection) fits this step's: which
  units it holds, and how far each KV head's query moved.

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


def members(units: torch.Tensor, among: torch.Tensor, n_units: int) -> torch.Tensor:
    """``[B, H, k]`` whether each of ``units`` (``[B, H, k]``, -1: none) is one of ``among`` (``[B, H, k2]``,
    -1: none), every unit below ``n_units``: one mask over the units, not a ``k x k2`` comparison."""
    mask = torch.zeros(*among.shape[:2], n_units + 1, dtype=torch.bool, device=among.device)
    mask.scatter_(2, among.masked_fill(among < 0, n_units), True)
    mask[..., n_units] = False
    return mask.gather(2, units.masked_fill(units < 0, n_units))


def speculation_check(qg: torch.Tensor, prev: torch.Tensor, units: torch.Tensor, spec: torch.Tensor,
                      n_units: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A speculative prefetch ``spec`` against this step's selection ``units`` (``[B, H_kv, k2]`` and
    ``[B, H_kv, k]``, -1: none, every unit below ``n_units``), and this step's grouped queries ``qg`` against
    the last step's ``prev`` (``[B, H_kv, G, D]``): ``(held [B, H_kv, k] bool, recall [B, H_kv], cos
    [B, H_kv])``: which of ``units`` the prefetch holds, their share (1 where ``k == 0``), and the cosine
    similarity of the queries averaged over the group (float32)."""
    held = members(units, spec, n_units)
    b, h = units.shape[:2]
    recall = held.float().mean(-1) if units.shape[-1] else torch.ones(b, h, device=units.device)
    cos = torch.nn.functional.cosine_similarity(qg.float(), prev.float(), dim=-1).mean(-1)
    return held, recall, cos
