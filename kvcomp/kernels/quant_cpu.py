"""Vectorised torch implementation of :func:`kvcomp.kernels.quant_ref.quant_attention` (the CPU path).

Same signature and result as the reference, organised for a CPU, where a decode step is a handful of large
tensor operations rather than many small ones:

* codes are unpacked a *bit plane* at a time with 32-bit integer operations on the packed bytes (4 bytes per
  operation, no interleaving): plane ``p`` holds channel ``j * P + p`` of every byte ``j``, so the
  dequantized block is stored in plane-major channel order and the query (and the key scales) are
  permuted once instead of the block;
* the float block lives in a workspace reused across layers and steps (it stays in the last-level cache);
* keys: ``codes * scale + zero`` in place (one ``addcmul``), then one matmul for all query heads of a KV
  head; values are never scaled: ``p @ (c * s + z) = (p * s) @ c + p @ z`` per channel group, so the
  value scales multiply the (small) probabilities instead of the (large) block;
* two passes (logits of every block, one softmax, then values) instead of an online softmax, because the
  logits ``[B, H, G * n, L]`` are small when decoding.

Materialized at a time: one block of ``block_tokens`` dequantized keys or value codes in float32 (float64
for a float64 model), ``[B, H, block, D]``, and the logits; never the whole dequantized cache.
"""

from __future__ import annotations

import torch

from kvcomp.kernels.quant_ref import BITS, _compute_dtype, pack, unpack
from kvcomp.ops import softcap as cap_logits
from kvcomp.ops import softmax, visible

__all__ = ["BITS", "pack", "unpack", "quant_attention", "plane_order"]

_workspace: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements, reused across calls (one per device and dtype)."""
    key = (torch.device(device), dtype)
    buf = _workspace.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable both inside and outside inference mode
            buf = torch.empty(numel, dtype=dtype, device=device)
        _workspace[key] = buf
    return buf[:numel]


def plane_order(head_dim: int, bits: int, device=None) -> torch.Tensor:
    """``[D]`` original channel of each column of a plane-major block: column ``p * D/P + j`` holds channel
    ``j * P + p`` (``P = 8 // bits`` codes per byte)."""
    per_byte = 8 // bits
    width = head_dim // per_byte
    return (torch.arange(width, device=device) * per_byte + torch.arange(per_byte, device=device).view(-1, 1)).flatten()


_orders: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _plane_indices(head_dim: int, bits: int, channels: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(plane order, its inverse, value channel group of each plane-major column), cached per shape."""
    key = (head_dim, bits, channels, torch.device(device))
    if key not in _orders:
        with torch.inference_mode(False):
            order = plane_order(head_dim, bits, device)
            restore = torch.empty_like(order)
            restore[order] = torch.arange(head_dim, device=device)
            _orders[key] = (order, restore, order // channels)
    return _orders[key]


def unpack_planes(packed: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """``packed`` ``[..., D * bits / 8]`` uint8 -> ``out`` ``[..., D]`` (float) in plane-major channel order."""
    if bits == 8:
        return out.copy_(packed)
    per_byte, width = 8 // bits, packed.shape[-1]
    mask = (1 << bits) - 1
    words = None
    if width % 4 == 0 and packed.stride(-1) == 1:
        try:
            words = packed.view(torch.int32)  # four bytes per operation
            mask = mask * 0x01010101
        except RuntimeError:
            words = None
    source = packed if words is None else words
    for p in range(per_byte):  # bit planes (at most 4), not data
        plane = (source >> (p * bits)) & mask if p else source & mask
        out[..., p * width : (p + 1) * width].copy_(plane if words is None else plane.view(torch.uint8))
    return out


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
    """See :func:`kvcomp.kernels.quant_ref.quant_attention`."""
    b, hq, n, d = q.shape
    h, n_groups, group = positions.shape[1], positions.shape[2], positions.shape[3]
    g = hq // h
    cdt = _compute_dtype(q.dtype)
    q_pos = q_pos.long()
    qg = q.reshape(b, h, g * n, d).to(cdt)

    per_block = max(1, block_tokens // group)
    n_value_groups = value_scale.shape[-1]
    order, restore, column_group = _plane_indices(d, bits, d // n_value_groups, q.device)
    ks = key_scale.index_select(-1, order).to(cdt).unsqueeze(3)  # [B, H, N, 1, D]
    kz = key_zero.index_select(-1, order).to(cdt).unsqueeze(3)
    q_planes = qg.index_select(-1, order)

    # Pass 1: logits of every quantized block, then of the residual window.
    logits = []
    for start in range(0, n_groups, per_block):  # one block unless the cache is longer than block_tokens
        stop = min(n_groups, start + per_block)
        block = workspace(b * h * (stop - start) * group * d, cdt, q.device).view(b, h, stop - start, group, d)
        unpack_planes(key_codes[:, :, start:stop], bits, block)
        torch.addcmul(kz[:, :, start:stop], block, ks[:, :, start:stop], out=block)
        logits.append(torch.matmul(q_planes, block.view(b, h, -1, d).transpose(-1, -2)))
    if residual_positions.shape[-1]:
        logits.append(torch.matmul(qg, residual_keys.to(cdt).transpose(-1, -2)))
    logits = torch.cat(logits, dim=-1) if len(logits) > 1 else logits[0]
    logits = cap_logits(logits.mul_(scaling), softcap).view(b, h, g, n, -1)

    # Mask by positions; a query that sees no key sees every slot (as the reference does).
    k_pos = torch.cat([positions.flatten(2), residual_positions], dim=2)  # [B, H, L + R]
    allowed = visible(q_pos[:, None, :, None], k_pos[:, :, None, :].long(), window)  # [B, H, n, L + R]
    if not bool(allowed.all()):
        allowed = allowed | ~allowed.any(-1, keepdim=True)
        logits = logits.masked_fill_(~allowed.unsqueeze(2), float("-inf"))
    sink_logits = None if sinks is None else sinks.to(device=q.device, dtype=cdt).view(1, h, g, 1, 1)
    probs = softmax(logits, sink_logits).view(b, h, g * n, -1)

    # Pass 2: values. Per channel group c: p @ (codes * s_c + z_c) = (p * s_c) @ codes + p @ z_c.
    out = torch.zeros(b, h, g * n, d, dtype=cdt, device=q.device)
    for start in range(0, n_groups, per_block):
        stop = min(n_groups, start + per_block)
        t0, t1 = start * group, stop * group
        block = workspace(b * h * (t1 - t0) * d, cdt, q.device).view(b, h, t1 - t0, d)
        unpack_planes(value_codes[:, :, start:stop].flatten(2, 3), bits, block)
        p = probs[..., t0:t1]  # [B, H, M, T]
        vs = value_scale[:, :, start:stop].flatten(2, 3).to(cdt)  # [B, H, T, C]
        vz = value_zero[:, :, start:stop].flatten(2, 3).to(cdt)
        if n_value_groups == 1:
            out.add_(torch.matmul(p * vs.transpose(-1, -2), block)).add_(torch.matmul(p, vz))
            continue
        scaled = (p.unsqueeze(-2) * vs.transpose(-1, -2).unsqueeze(2)).flatten(2, 3)  # [B, H, M * C, T]
        per_group = torch.matmul(scaled, block).view(b, h, g * n, n_value_groups, d)
        out += per_group.gather(3, column_group.view(1, 1, 1, 1, d).expand(b, h, g * n, 1, d)).squeeze(3)
        out += torch.matmul(p, vz).index_select(-1, column_group)
    out = out.index_select(-1, restore)  # back to the original channel order
    n_quant = n_groups * group
    if residual_positions.shape[-1]:
        out += torch.matmul(probs[..., n_quant:], residual_values.to(cdt))
    return out.reshape(b, hq, n, d).to(q.dtype)
