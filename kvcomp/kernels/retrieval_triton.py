"""Triton kernels for retrieval scoring (same signatures and results as :mod:`kvcomp.kernels.retrieval_ref`).

One program per (row, KV head, block of pages or tokens); the query group of the KV head is loaded once and
the group reduction happens in registers, so the digests (or low-bit keys) are read exactly once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcomp.kernels import quant_triton
from kvcomp.kernels.quant_triton import _check_bits, _pow2
from kvcomp.kernels.retrieval_ref import REDUCTIONS


@triton.jit
def _reduce_group(scores, mask_g, G, REDUCE: tl.constexpr):
    # scores: [BLOCK_G, BLOCK_N] -> [BLOCK_N]; REDUCE 0 = max, 1 = sum, 2 = mean
    if REDUCE == 0:
        return tl.max(tl.where(mask_g[:, None], scores, float("-inf")), axis=0)
    total = tl.sum(tl.where(mask_g[:, None], scores, 0.0), axis=0)
    if REDUCE == 2:
        total = total / G
    return total


@triton.jit
def _page_scores_kernel(q_ptr, max_ptr, min_ptr, out_ptr, G, P, D,
                        REDUCE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_bh = tl.program_id(0).to(tl.int64)
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g, mask_p, mask_d = offs_g < G, offs_p < P, offs_d < D
    q = tl.load(q_ptr + (pid_bh * G + offs_g)[:, None] * D + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    page = (pid_bh * P + offs_p)[:, None] * D + offs_d[None, :]
    mask_pd = mask_p[:, None] & mask_d[None, :]
    hi = tl.load(max_ptr + page, mask=mask_pd, other=0.0).to(tl.float32)
    lo = tl.load(min_ptr + page, mask=mask_pd, other=0.0).to(tl.float32)
    bound = tl.sum(tl.maximum(q[:, None, :] * hi[None, :, :], q[:, None, :] * lo[None, :, :]), axis=2)
    tl.store(out_ptr + pid_bh * P + offs_p, _reduce_group(bound, mask_g, G, REDUCE), mask=mask_p)


@triton.jit
def _quant_key_scores_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, out_ptr, G, L, NG, D, scaling,
                             GROUP: tl.constexpr, BITS: tl.constexpr, PACKED: tl.constexpr, REDUCE: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             DOT: tl.constexpr):
    pid_bh = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g, mask_n, mask_d = offs_g < G, offs_n < L, offs_d < D
    q = tl.load(q_ptr + (pid_bh * G + offs_g)[:, None] * D + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    per_byte = 8 // BITS
    mask_nd = mask_n[:, None] & mask_d[None, :]
    tok = pid_bh * L + offs_n
    grp = pid_bh * NG + offs_n // GROUP
    kc = tl.load(kc_ptr + tok[:, None] * PACKED + (offs_d // per_byte)[None, :], mask=mask_nd, other=0).to(tl.int32)
    ks = tl.load(ks_ptr + grp[:, None] * D + offs_d[None, :], mask=mask_nd, other=0.0).to(tl.float32)
    kz = tl.load(kz_ptr + grp[:, None] * D + offs_d[None, :], mask=mask_nd, other=0.0).to(tl.float32)
    k = ((kc >> ((offs_d % per_byte) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32) * ks + kz
    s = tl.dot(q, tl.trans(k), input_precision=DOT) * scaling  # [BLOCK_G, BLOCK_N]
    tl.store(out_ptr + tok, _reduce_group(s, mask_g, G, REDUCE), mask=mask_n)


def _reduce_code(reduce: str) -> int:
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {', '.join(REDUCTIONS)}; got {reduce!r}.")
    return REDUCTIONS.index(reduce)


def page_scores(q: torch.Tensor, page_max: torch.Tensor, page_min: torch.Tensor, reduce: str = "max") -> torch.Tensor:
    """See :func:`kvcomp.kernels.retrieval_ref.page_scores`."""
    b, hq, _, d = q.shape
    h, pages = page_max.shape[1], page_max.shape[2]
    g = hq // h
    out = torch.empty(b, h, pages, dtype=torch.float32, device=q.device)
    block_p = 32
    _page_scores_kernel[(b * h, triton.cdiv(pages, block_p))](
        q.reshape(b, h, g, d).contiguous(), page_max.contiguous(), page_min.contiguous(), out, g, pages, d,
        REDUCE=_reduce_code(reduce), BLOCK_G=_pow2(g, 1), BLOCK_P=block_p, BLOCK_D=_pow2(d),
    )
    return out


def quant_key_scores(
    q: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    bits: int,
    scaling: float = 1.0,
    reduce: str = "max",
) -> torch.Tensor:
    """See :func:`kvcomp.kernels.retrieval_ref.quant_key_scores`."""
    _check_bits(bits)
    b, hq, _, d = q.shape
    h, n_groups, group = key_codes.shape[1], key_codes.shape[2], key_codes.shape[3]
    g = hq // h
    length = n_groups * group
    out = torch.empty(b, h, length, dtype=torch.float32, device=q.device)
    block_n = 64
    _quant_key_scores_kernel[(b * h, triton.cdiv(length, block_n))](
        q.reshape(b, h, g, d).contiguous(), key_codes.contiguous(), key_scale.contiguous(), key_zero.contiguous(),
        out, g, length, n_groups, d, float(scaling),
        GROUP=group, BITS=bits, PACKED=key_codes.shape[-1], REDUCE=_reduce_code(reduce),
        BLOCK_G=_pow2(g), BLOCK_N=block_n, BLOCK_D=_pow2(d), DOT=quant_triton.DOT_PRECISION,
    )
    return out
