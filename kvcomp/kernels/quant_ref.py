"""Pure-torch reference for KIVI-style quantization: pack/unpack, quantize/dequantize, blockwise attention.

A Triton kernel with the same signature will sit beside each function; these define what it must compute.

Asymmetric integer quantization of a group of values ``x``: ``scale = (max - min) / (2**bits - 1)``,
``zero = min``, ``code = round((x - zero) / scale)`` clamped to ``[0, 2**bits - 1]``, and
``x_hat = code * scale + zero``, so ``|x - x_hat| <= scale / 2``. Statistics are computed in float32 (float64
for a float64 model); ``scale`` and ``zero`` are stored in the model dtype, and codes are computed against the
*stored* scale and zero, so the bound holds for what is stored (exactly in float32/64; in bfloat16 up to the
rounding of ``zero``).

Layout (``B`` batch, ``H`` KV heads, ``N`` groups, ``G`` tokens per group, ``D`` head dim, ``C`` channels per
value group): codes are packed along the channels, ``D * bits / 8`` bytes per token and head.
"""

from __future__ import annotations

import torch

from kvcomp.ops import softcap as cap_logits
from kvcomp.ops import visible

BITS = (2, 4, 8)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., n]`` uint8 codes in ``[0, 2**bits)`` -> ``[..., n * bits // 8]`` uint8, ``8 // bits`` per byte
    (the first code in the lowest bits). ``n`` must be a multiple of ``8 // bits``."""
    per_byte = 8 // bits
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (grouped << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., m]`` uint8 -> ``[..., m * 8 // bits]`` uint8 codes."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))  # explicit: may hold 0 groups


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize groups of ``x`` along ``dim``: returns uint8 codes (shape of ``x``, unpacked) and ``scale``,
    ``zero`` (shape of ``x`` without ``dim``, dtype of ``x``)."""
    xc = x.to(_compute_dtype(x.dtype))
    lo, hi = xc.amin(dim), xc.amax(dim)
    scale = ((hi - lo) / (2**bits - 1)).to(x.dtype)
    zero = lo.to(x.dtype)
    s, z = scale.to(xc.dtype).unsqueeze(dim), zero.to(xc.dtype).unsqueeze(dim)
    codes = ((xc - z) / torch.where(s > 0, s, 1.0)).round_().clamp_(0, 2**bits - 1)
    return codes.to(torch.uint8), scale, zero


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dim: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``codes * scale + zero`` with ``scale``/``zero`` broadcast along ``dim``; computed in float32 (or
    float64), returned in ``dtype`` (default: the dtype of ``scale``)."""
    cdt = _compute_dtype(scale.dtype)
    out = codes.to(cdt) * scale.to(cdt).unsqueeze(dim) + zero.to(cdt).unsqueeze(dim)
    return out.to(dtype or scale.dtype)


def quantize_keys(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys per channel: ``k`` ``[B, H, N, G, D]`` -> packed ``[B, H, N, G, D*bits/8]``, scale and zero
    ``[B, H, N, D]`` (one per group of ``G`` tokens and channel)."""
    codes, scale, zero = quantize(k, bits, dim=-2)
    return pack(codes, bits), scale, zero


def dequantize_keys(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize_keys`: -> ``[B, H, N, G, D]``."""
    return dequantize(unpack(packed, bits), scale, zero, dim=-2, dtype=dtype)


def quantize_values(
    v: torch.Tensor, bits: int, channels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values per token: ``v`` ``[B, H, N, G, D]`` -> packed ``[B, H, N, G, D*bits/8]``, scale and zero
    ``[B, H, N, G, D/C]`` (one per token and group of ``C = channels`` channels)."""
    grouped = v.reshape(*v.shape[:-1], v.shape[-1] // channels, channels)
    codes, scale, zero = quantize(grouped, bits, dim=-1)
    return pack(codes.flatten(-2), bits), scale, zero


def dequantize_values(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize_values`: -> ``[B, H, N, G, D]``."""
    codes = unpack(packed, bits)
    codes = codes.reshape(*codes.shape[:-1], scale.shape[-1], codes.shape[-1] // max(scale.shape[-1], 1))
    return dequantize(codes, scale, zero, dim=-1, dtype=dtype).flatten(-2)


def quant_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    positions: torch.Tensor,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    residual_positions: torch.Tensor,
    bits: int,
    scaling: float,
    block_tokens: int = 1024,
    sentinel: int = 2**30,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` over quantized groups plus a full-precision residual, with an online softmax.

    q: ``[B, H_q, n, D]``; q_pos: ``[B, n]``; key/value codes and scales as :func:`quantize_keys` /
    :func:`quantize_values` return them for ``N`` groups; positions: ``[B, H, N, G]``; residual keys/values
    ``[B, H, R, D]``, residual_positions ``[B, H, R]`` (``sentinel`` = empty slot). Visibility, soft-capping
    and sinks are those of :mod:`kvcomp.ops` (``window``, ``softcap``, ``sinks`` ``[H_q]`` as in
    :class:`kvcomp.ops.AttentionSpec`); a query that sees no key sees every slot (as ``dense_attention``
    does, so padding queries stay finite). Returns ``[B, H_q, n, D]`` in ``q``'s dtype.

    Materialized at a time: the dequantized keys and values of one block of ``block_tokens`` tokens
    (whole groups), ``[B, H, block, D]`` each in float32 (float64 for a float64 model), and its logits
    ``[B, H, H_q/H * n, block]``; never the whole dequantized cache.
    """
    b, hq, n, d = q.shape
    h, n_groups, group = positions.shape[1], positions.shape[2], positions.shape[3]
    g = hq // h
    cdt = _compute_dtype(q.dtype)
    qg = q.reshape(b, h, g * n, d).to(cdt)
    q_pos = q_pos.long()
    first = torch.full((b, h), sentinel, dtype=torch.long, device=q.device)
    for p in (positions, residual_positions):
        if p.shape[2]:
            first = torch.minimum(first, p.flatten(2).amin(-1).long())
    blind = (first[:, :, None, None] > q_pos[:, None, None, :])[..., None]  # [B, H, 1, n, 1]: sees no key

    m = torch.full((b, h, g * n, 1), float("-inf"), dtype=cdt, device=q.device)
    denom = torch.zeros(b, h, g * n, 1, dtype=cdt, device=q.device)
    if sinks is not None:  # the sink is one more logit whose value is zero: it starts the running softmax
        m = sinks.to(device=q.device, dtype=cdt).view(1, h, g, 1, 1).expand(b, h, g, n, 1).reshape(b, h, g * n, 1)
        denom = torch.ones_like(m)
    acc = torch.zeros(b, h, g * n, d, dtype=cdt, device=q.device)

    def step(k, v, k_pos):
        nonlocal m, denom, acc
        length = k.shape[2]
        logits = cap_logits(torch.matmul(qg, k.transpose(-1, -2)) * scaling, softcap)  # [B, H, g*n, L]
        allowed = visible(q_pos[:, None, None, :, None], k_pos.long()[:, :, None, None, :], window) | blind
        allowed = allowed.expand(b, h, g, n, length).reshape(b, h, g * n, length)
        logits = logits.masked_fill(~allowed, float("-inf"))
        m_new = torch.maximum(m, logits.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
        p = torch.exp(logits - m_safe)
        correction = torch.exp(m - m_safe)
        denom = denom * correction + p.sum(-1, keepdim=True)
        acc = acc * correction + torch.matmul(p, v)
        m = m_new

    per_block = max(1, block_tokens // group)
    for start in range(0, n_groups, per_block):
        sl = slice(start, min(n_groups, start + per_block))
        k = dequantize_keys(key_codes[:, :, sl], key_scale[:, :, sl], key_zero[:, :, sl], bits, cdt)
        v = dequantize_values(value_codes[:, :, sl], value_scale[:, :, sl], value_zero[:, :, sl], bits, cdt)
        step(k.flatten(2, 3), v.flatten(2, 3), positions[:, :, sl].flatten(2))
    if residual_positions.shape[-1]:
        step(residual_keys.to(cdt), residual_values.to(cdt), residual_positions)
    return (acc / denom).reshape(b, hq, n, d).to(q.dtype)
