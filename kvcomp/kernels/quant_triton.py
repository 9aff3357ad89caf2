"""Triton kernels for KIVI-style quantization: pack / unpack, and fused decode attention over quantized K/V.

Same signatures and results as :mod:`kvcomp.kernels.quant_ref` (layout documented there).

``quant_attention`` is flash-decoding over the packed cache: one program per (row, KV head, block of query
rows, split of the sequence), so the ``G`` query heads of a KV head (and the ``n`` queries of a block) share
every byte of K/V read. Codes are unpacked and dequantized in registers (keys: scale and zero per group and
channel; values: per token and channel group), logits go through an online softmax, and each split writes a
partial (max, sum, accumulator) that :func:`_combine` merges. The last split handles the full-precision
residual window. Masking is by positions, the rule of :func:`kvcomp.ops.visible` (causal, and the sliding
window when there is one; SENTINEL slots never visible except to a query that sees no key at all, which sees
every slot, as the reference does). Logit soft-capping is applied in the kernel, attention sinks (an extra
softmax entry with a zero value) when the splits are combined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcomp.kernels.quant_ref import BITS

MIN_SPLIT_TOKENS = 256  # fewest tokens one program walks; tests lower it to exercise many splits
TARGET_PROGRAMS = 264  # ~2 waves on a 132-SM H100/H200
# Precision of tl.dot on float32 operands: "ieee" matches the reference to float32 rounding; "tf32" uses tensor
# cores on the GPU (10-bit mantissa, far finer than 2-8-bit codes). Read at each call.
DOT_PRECISION = "ieee"


@triton.jit
def _pack_kernel(codes_ptr, out_ptr, n_out, BITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_out
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(8 // BITS):
        c = tl.load(codes_ptr + offs * (8 // BITS) + i, mask=mask, other=0).to(tl.int32)
        acc = acc | ((c & ((1 << BITS) - 1)) << (i * BITS))
    tl.store(out_ptr + offs, acc.to(tl.uint8), mask=mask)


@triton.jit
def _unpack_kernel(packed_ptr, out_ptr, n_out, BITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_out
    byte = tl.load(packed_ptr + offs // (8 // BITS), mask=mask, other=0).to(tl.int32)
    code = (byte >> ((offs % (8 // BITS)).to(tl.int32) * BITS)) & ((1 << BITS) - 1)
    tl.store(out_ptr + offs, code.to(tl.uint8), mask=mask)


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}.")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """See :func:`kvcomp.kernels.quant_ref.pack`."""
    _check_bits(bits)
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise ValueError(f"the last dimension ({codes.shape[-1]}) must be a multiple of {per_byte}.")
    codes = codes.to(torch.uint8).contiguous()
    out = torch.empty(*codes.shape[:-1], codes.shape[-1] // per_byte, dtype=torch.uint8, device=codes.device)
    n = out.numel()
    if n:
        block = 1024
        _pack_kernel[(triton.cdiv(n, block),)](codes, out, n, BITS=bits, BLOCK=block)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """See :func:`kvcomp.kernels.quant_ref.unpack`."""
    _check_bits(bits)
    packed = packed.contiguous()
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * (8 // bits), dtype=torch.uint8, device=packed.device)
    n = out.numel()
    if n:
        block = 1024
        _unpack_kernel[(triton.cdiv(n, block),)](packed, out, n, BITS=bits, BLOCK=block)
    return out


@triton.jit
def _online_update(s, m_i, l_i, acc):
    """One block of logits ``s`` [M, N] (-inf = masked) into the running max, sum and rescaled accumulator;
    returns the probabilities to multiply with the block's values."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    return p, m_new, l_i, acc


@triton.jit
def _visible(kpos, qpos, blind, window):
    """``[M, N]`` visibility of keys ``kpos`` [N] to queries ``qpos`` [M] (kvcomp.ops.visible; window 0: none)."""
    ok = (kpos[None, :] <= qpos[:, None]) & ((window <= 0) | (kpos[None, :] > qpos[:, None] - window))
    return ok | blind[:, None]


@triton.jit
def _softcap(s, cap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        s = cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)  # cap * tanh(s / cap)
    return s


@triton.jit
def _quant_attention_kernel(
    q_ptr, qpos_ptr, blind_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, pos_ptr,
    rk_ptr, rv_ptr, rpos_ptr,
    o_ptr, m_ptr, l_ptr,
    H, M, NQ, L, NG, R, D, J, n_splits, split_tokens, scaling, window, softcap,
    GROUP: tl.constexpr, BITS: tl.constexpr, PACKED: tl.constexpr, VCH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    qi = offs_m % NQ
    q = tl.load(q_ptr + (pid_bh * M + offs_m)[:, None] * D + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    qpos = tl.load(qpos_ptr + b * NQ + qi, mask=mask_m, other=0)
    blind = tl.load(blind_ptr + pid_bh * NQ + qi, mask=mask_m, other=0) != 0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if pid_s < n_splits:
        per_byte = 8 // BITS
        byte = offs_d // per_byte
        shift = ((offs_d % per_byte) * BITS)[None, :]
        vgroup = offs_d // VCH
        start = pid_s * split_tokens
        stop = tl.minimum(start + split_tokens, L)
        for t0 in range(start, stop, BLOCK_N):
            offs_n = t0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < stop
            mask_nd = mask_n[:, None] & mask_d[None, :]
            tok = pid_bh * L + offs_n  # flat token index over [B, H, N * G]
            grp = pid_bh * NG + offs_n // GROUP  # flat group index over [B, H, N]
            kc = tl.load(kc_ptr + tok[:, None] * PACKED + byte[None, :], mask=mask_nd, other=0).to(tl.int32)
            ks = tl.load(ks_ptr + grp[:, None] * D + offs_d[None, :], mask=mask_nd, other=0.0).to(tl.float32)
            kz = tl.load(kz_ptr + grp[:, None] * D + offs_d[None, :], mask=mask_nd, other=0.0).to(tl.float32)
            k = ((kc >> shift) & ((1 << BITS) - 1)).to(tl.float32) * ks + kz
            s = _softcap(tl.dot(q, tl.trans(k), input_precision=DOT) * scaling, softcap, HAS_SOFTCAP)
            kpos = tl.load(pos_ptr + tok, mask=mask_n, other=0).to(tl.int64)
            allowed = _visible(kpos, qpos, blind, window) & mask_n[None, :]
            s = tl.where(allowed, s, float("-inf"))
            p, m_i, l_i, acc = _online_update(s, m_i, l_i, acc)
            vc = tl.load(vc_ptr + tok[:, None] * PACKED + byte[None, :], mask=mask_nd, other=0).to(tl.int32)
            vs = tl.load(vs_ptr + tok[:, None] * J + vgroup[None, :], mask=mask_nd, other=0.0).to(tl.float32)
            vz = tl.load(vz_ptr + tok[:, None] * J + vgroup[None, :], mask=mask_nd, other=0.0).to(tl.float32)
            v = ((vc >> shift) & ((1 << BITS) - 1)).to(tl.float32) * vs + vz
            acc += tl.dot(p, v, input_precision=DOT)
    else:
        for t0 in range(0, R, BLOCK_N):
            offs_n = t0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < R
            mask_nd = mask_n[:, None] & mask_d[None, :]
            tok = pid_bh * R + offs_n
            k = tl.load(rk_ptr + tok[:, None] * D + offs_d[None, :], mask=mask_nd, other=0.0).to(tl.float32)
            s = _softcap(tl.dot(q, tl.trans(k), input_precision=DOT) * scaling, softcap, HAS_SOFTCAP)
            kpos = tl.load(rpos_ptr + tok, mask=mask_n, other=0).to(tl.int64)
            allowed = _visible(kpos, qpos, blind, window) & mask_n[None, :]
            s = tl.where(allowed, s, float("-inf"))
            p, m_i, l_i, acc = _online_update(s, m_i, l_i, acc)
            v = tl.load(rv_ptr + tok[:, None] * D + offs_d[None, :], mask=mask_nd, other=0.0).to(tl.float32)
            acc += tl.dot(p, v, input_precision=DOT)

    n_all = n_splits + 1
    part = (pid_bh * n_all + pid_s) * M + offs_m
    tl.store(o_ptr + part[:, None] * D + offs_d[None, :], acc, mask=mask_m[:, None] & mask_d[None, :])
    tl.store(m_ptr + part, m_i, mask=mask_m)
    tl.store(l_ptr + part, l_i, mask=mask_m)


def _combine(o: torch.Tensor, m: torch.Tensor, denom: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Merge split partials: o [BH, S, M, D], m / denom [BH, S, M] -> [BH, M, D] (zeros where nothing was
    seen). ``sinks`` [BH, M]: per query row, a sink logit (an extra softmax entry with a zero value)."""
    top = m.amax(1, keepdim=True)
    if sinks is not None:
        top = torch.maximum(top, sinks.unsqueeze(1))
    safe = torch.where(torch.isfinite(top), top, 0.0)
    weight = torch.exp(m - safe)  # exp(-inf) = 0 for empty splits
    total = (denom * weight).sum(1)
    if sinks is not None:
        total = total + torch.exp(sinks - safe.squeeze(1))
    out = (o * weight.unsqueeze(-1)).sum(1)
    return torch.where(total.unsqueeze(-1) > 0, out / total.clamp_min(1e-30).unsqueeze(-1), 0.0)


def row_sinks(sinks: torch.Tensor | None, b: int, h: int, n: int, device) -> torch.Tensor | None:
    """Sink logits ``[H_q]`` laid out per (row, KV head) and grouped query row: ``[B * H, G * n]`` float32."""
    if sinks is None:
        return None
    g = sinks.numel() // h
    rows = sinks.to(device=device, dtype=torch.float32).view(1, h, g, 1).expand(b, h, g, n)
    return rows.reshape(b * h, g * n)


def _pow2(n: int, low: int = 16) -> int:
    return max(low, triton.next_power_of_2(max(1, n)))


def split_plan(n_tokens: int, programs_per_split: int, block_n: int) -> tuple[int, int]:
    """(number of splits, tokens per split): enough programs to fill the GPU, at least MIN_SPLIT_TOKENS
    each, a multiple of ``block_n``."""
    if n_tokens == 0:
        return 0, block_n
    want = max(1, TARGET_PROGRAMS // max(1, programs_per_split))
    per_split = max(MIN_SPLIT_TOKENS, triton.cdiv(n_tokens, want))
    per_split = triton.cdiv(per_split, block_n) * block_n
    return triton.cdiv(n_tokens, per_split), per_split


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
    """See :func:`kvcomp.kernels.quant_ref.quant_attention` (``block_tokens`` is not used: a program holds
    ``BLOCK_N`` tokens in registers at a time)."""
    _check_bits(bits)
    b, hq, n, d = q.shape
    h, n_groups, group = positions.shape[1], positions.shape[2], positions.shape[3]
    r = residual_positions.shape[-1]
    g = hq // h
    rows = g * n
    length = n_groups * group
    q_pos = q_pos.long().contiguous()
    first = torch.full((b, h), sentinel, dtype=torch.long, device=q.device)
    for p in (positions, residual_positions):
        if p.shape[2]:
            first = torch.minimum(first, p.flatten(2).amin(-1).long())
    blind = (first[:, :, None] > q_pos[:, None, :]).to(torch.int8).contiguous()  # [B, H, n]

    block_m = _pow2(min(rows, 64))
    block_n = 64 if length >= 4096 else 16
    block_d = _pow2(d)
    m_blocks = triton.cdiv(rows, block_m)
    n_splits, split_tokens = split_plan(length, b * h * m_blocks, block_n)
    n_all = n_splits + 1
    o = torch.empty(b * h, n_all, rows, d, dtype=torch.float32, device=q.device)
    m = torch.empty(b * h, n_all, rows, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    grid = (b * h, m_blocks, n_all)
    _quant_attention_kernel[grid](
        q.reshape(b, h, rows, d).contiguous(), q_pos, blind,
        key_codes.contiguous(), key_scale.contiguous(), key_zero.contiguous(),
        value_codes.contiguous(), value_scale.contiguous(), value_zero.contiguous(), positions.contiguous(),
        residual_keys.contiguous(), residual_values.contiguous(), residual_positions.contiguous(),
        o, m, l_sum,
        h, rows, n, length, n_groups, r, d, value_scale.shape[-1], n_splits, split_tokens, float(scaling),
        int(window or 0), float(softcap or 1.0),
        GROUP=group, BITS=bits, PACKED=key_codes.shape[-1], VCH=d // value_scale.shape[-1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT=DOT_PRECISION, HAS_SOFTCAP=softcap is not None,
    )
    return _combine(o, m, l_sum, row_sinks(sinks, b, h, n, q.device)).reshape(b, hq, n, d).to(q.dtype)
