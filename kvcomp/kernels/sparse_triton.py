"""Triton kernel for sparse decode attention over selected tokens or pages (same signature and result as
:func:`kvcomp.kernels.sparse_ref.sparse_attention`).

Flash-decoding over the selected slots: one program per (row, KV head, block of query rows, split of the
selected slots); it gathers the selected K/V rows straight from the full cache (never materializing them),
runs an online softmax and writes a partial that :func:`kvcomp.kernels.quant_triton._combine` merges.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcomp.kernels import quant_triton
from kvcomp.kernels.quant_triton import _combine, _online_update, _pow2, _softcap, row_sinks, split_plan


@triton.jit
def _sparse_attention_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, o_ptr, m_ptr, l_ptr,
    M, L, K, D, n_splits, split_slots, scaling, softcap,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q = tl.load(q_ptr + (pid_bh * M + offs_m)[:, None] * D + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    start = pid_s * split_slots
    stop = tl.minimum(start + split_slots, K * PAGE)
    for s0 in range(start, stop, BLOCK_N):
        offs_n = s0 + tl.arange(0, BLOCK_N)
        in_range = offs_n < stop
        page = tl.load(idx_ptr + pid_bh * K + offs_n // PAGE, mask=in_range, other=-1).to(tl.int64)
        tok = page * PAGE + offs_n % PAGE
        valid = in_range & (page >= 0) & (tok < L)
        rows = (pid_bh * L + tl.where(valid, tok, 0))[:, None] * D + offs_d[None, :]
        mask_nd = valid[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + rows, mask=mask_nd, other=0.0).to(tl.float32)
        s = _softcap(tl.dot(q, tl.trans(k), input_precision=DOT) * scaling, softcap, HAS_SOFTCAP)
        s = tl.where(valid[None, :], s, float("-inf"))
        p, m_i, l_i, acc = _online_update(s, m_i, l_i, acc)
        v = tl.load(v_ptr + rows, mask=mask_nd, other=0.0).to(tl.float32)
        acc += tl.dot(p, v, input_precision=DOT)
    part = (pid_bh * n_splits + pid_s) * M + offs_m
    tl.store(o_ptr + part[:, None] * D + offs_d[None, :], acc, mask=mask_m[:, None] & mask_d[None, :])
    tl.store(m_ptr + part, m_i, mask=mask_m)
    tl.store(l_ptr + part, l_i, mask=mask_m)


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
    """See :func:`kvcomp.kernels.sparse_ref.sparse_attention`."""
    b, hq, n, d = q.shape
    h, length = keys.shape[1], keys.shape[2]
    k_sel = indices.shape[-1]
    rows = hq // h * n
    block_m = _pow2(min(rows, 64))
    slots = k_sel * page_size
    block_n = 64 if slots >= 4096 else 16
    m_blocks = triton.cdiv(rows, block_m)
    n_splits, split_slots = split_plan(slots, b * h * m_blocks, block_n)
    n_splits = max(1, n_splits)
    o = torch.empty(b * h, n_splits, rows, d, dtype=torch.float32, device=q.device)
    m = torch.empty(b * h, n_splits, rows, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    _sparse_attention_kernel[(b * h, m_blocks, n_splits)](
        q.reshape(b, h, rows, d).contiguous(), keys.contiguous(), values.contiguous(),
        indices.contiguous(), o, m, l_sum,
        rows, length, k_sel, d, n_splits, split_slots, float(scaling), float(softcap or 1.0),
        PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_pow2(d), DOT=quant_triton.DOT_PRECISION,
        HAS_SOFTCAP=softcap is not None,
    )
    return _combine(o, m, l_sum, row_sinks(sinks, b, h, n, q.device)).reshape(b, hq, n, d).to(q.dtype)
