"""Transform coding of K/V (KVTC-style): RoPE undo/redo, DP bit allocation, coefficient quantization,
entropy-coded blocks and blockwise attention with an online softmax.

Used by :mod:`compressors.kvtc`; the calibration that produces the per-component statistics lives in
:mod:`kvcomp.kvtc_calibration`.

Quantizer. A principal-component coefficient ``y`` coded with ``b`` bits (``b`` in 2, 4, 8) is rounded to one
of ``2 * m + 1`` symmetric levels ``k * step`` (``m = 2**(b-1) - 1``: 3, 15 or 255 levels, zero included),
stored as the byte ``k + m``. The step of each component and bit width is calibrated once (the clipping range
minimising the squared error on calibration data) and lives in the artifact, so a sequence stores no scales.
``b = 0`` drops the component (reconstructed as the calibration mean).

Coded block. ``block_size`` tokens of one row and KV head (layout in :func:`encode_block`): a small header,
the positions (the first one alone when they are contiguous), then for keys and for values one zstd frame
per bit width in use (magicless, no checksum, no content size: the decoded size follows from the count and
the bit allocation) holding that width's codes, component-major and packed several to a byte.
"""

from __future__ import annotations

import struct

import numpy as np
import torch
import zstandard

BITS = (0, 2, 4, 8)
ZSTD_LEVEL = 9
_PARAMS = zstandard.ZstdCompressionParameters.from_level(
    ZSTD_LEVEL, format=zstandard.FORMAT_ZSTD1_MAGICLESS, write_content_size=0, write_checksum=0, write_dict_id=0
)
_COMPRESSOR = zstandard.ZstdCompressor(compression_params=_PARAMS)
_DECOMPRESSOR = zstandard.ZstdDecompressor(format=zstandard.FORMAT_ZSTD1_MAGICLESS)


# -- RoPE ----------------------------------------------------------------------------------------------------
def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    # positions [...]; returns cos, sin [..., 2 * len(inv_freq)] in dtype. The angles are float32 products as
    # in transformers' rotary embedding (so they match the cached keys).
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(device=positions.device, dtype=torch.float32)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0):
    """Rotate ``x`` ``[..., D]`` by its ``positions`` ``[...]`` as transformers' Llama-family
    ``apply_rotary_pos_emb`` does (``x * cos + rotate_half(x) * sin``, both scaled by ``scaling``); a partial
    rotary embedding rotates the first ``2 * len(inv_freq)`` channels. Computed in float32 at least; returns
    ``x``'s dtype."""
    rot = 2 * inv_freq.shape[-1]
    xr = x[..., :rot].to(torch.promote_types(x.dtype, torch.float32))
    cos, sin = _cos_sin(positions, inv_freq, scaling, xr.dtype)
    out = xr * cos + _rotate_half(xr) * sin
    return torch.cat([out.to(x.dtype), x[..., rot:]], dim=-1)


def undo_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0):
    """Inverse of :func:`apply_rope`: rotate back by ``-theta`` and divide by ``scaling**2``."""
    rot = 2 * inv_freq.shape[-1]
    xr = x[..., :rot].to(torch.promote_types(x.dtype, torch.float32))
    cos, sin = _cos_sin(positions, inv_freq, scaling, xr.dtype)
    out = (xr * cos - _rotate_half(xr) * sin) / (scaling * scaling)
    return torch.cat([out.to(x.dtype), x[..., rot:]], dim=-1)


# -- quantization --------------------------------------------------------------------------------------------
def max_level(bits: torch.Tensor | int):
    """``m = 2**(bits-1) - 1`` (0 for 0 bits): codes lie in ``[0, 2m]``."""
    if isinstance(bits, int):
        return (1 << (bits - 1)) - 1 if bits else 0
    return torch.where(bits > 0, (2 ** (bits.clamp(min=1) - 1)) - 1, 0)


def quantize(y: torch.Tensor, step: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    """Coefficients ``y`` ``[..., C]`` -> uint8 codes ``round(y / step)`` clamped to ``[-m, m]``, plus ``m``.
    ``step``, ``level`` (``m``) broadcast against ``y``; components with ``m = 0`` get code 0."""
    safe = torch.where(step > 0, step, 1.0)
    k = torch.round(y / safe)
    k = torch.minimum(torch.maximum(k, -level), level)
    return (k + level).to(torch.uint8)


def dequantize(codes: torch.Tensor, step: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize` (float32): ``(code - m) * step``, 0 where ``step`` is 0."""
    return (codes.to(torch.float32) - level) * step


# -- bit allocation ------------------------------------------------------------------------------------------
def allocate_bits(err: np.ndarray, rate: np.ndarray, budget: float, group_size: int, resolution: int = 8):
    """Dynamic programming over groups of ``group_size`` consecutive components (variance order).

    err, rate: ``[len(BITS), C]`` squared error and coded bits per token of each component at each bit width
    (calibration statistics; ``rate`` of 0 bits is 0). Chooses one width per group minimising the summed error
    with the summed rate at most ``budget`` bits per token (rates rounded up to ``1/resolution`` bit).
    Returns ``[C]`` int bits per component.
    """
    n_bits, c = err.shape
    n_groups = -(-c // group_size)
    cap = max(0, int(np.floor(budget * resolution)))
    g_err = np.stack([err[:, g * group_size:(g + 1) * group_size].sum(1) for g in range(n_groups)], 1)
    g_rate = np.stack([rate[:, g * group_size:(g + 1) * group_size].sum(1) for g in range(n_groups)], 1)
    g_cost = np.ceil(g_rate * resolution - 1e-9).astype(np.int64)  # [n_bits, n_groups]
    cap = min(cap, int(g_cost.max(0).sum()))
    best = np.zeros(cap + 1)  # best[r]: least error of the groups so far with rate <= r
    choice = np.zeros((n_groups, cap + 1), dtype=np.int64)
    for g in range(n_groups):
        options = np.full((n_bits, cap + 1), np.inf)
        for j in range(n_bits):
            cost = g_cost[j, g]
            if cost <= cap:
                options[j, cost:] = best[: cap + 1 - cost] + g_err[j, g]
        choice[g] = options.argmin(0)
        best = options.min(0)
    bits = np.zeros(c, dtype=np.int64)
    r = cap
    for g in reversed(range(n_groups)):
        j = choice[g, r]
        bits[g * group_size:(g + 1) * group_size] = BITS[j]
        r -= g_cost[j, g]
    return bits


# -- coded blocks --------------------------------------------------------------------------------------------
_PER_BYTE = {2: 5, 4: 2, 8: 1}  # codes packed into one byte before entropy coding: 3**5, 15**2, 255 < 256


def _pack(codes: np.ndarray, bits: int) -> bytes:
    """Component-major codes ``[n, c]`` of one bit width -> bytes, ``_PER_BYTE[bits]`` codes a byte in base
    ``2m + 1`` (zstd's Huffman stage spends at least one bit a byte, so a 1.3-bit ternary code alone would
    cost a whole bit)."""
    flat = np.ascontiguousarray(codes.T).reshape(-1)
    k, base = _PER_BYTE[bits], 2 * max_level(bits) + 1
    if k == 1:
        return flat.tobytes()
    pad = (-flat.size) % k
    flat = np.concatenate([flat, np.full(pad, max_level(bits), dtype=np.uint8)]).reshape(-1, k).astype(np.int32)
    return (flat * base ** np.arange(k, dtype=np.int32)).sum(1).astype(np.uint8).tobytes()


def _digits(bits: int) -> np.ndarray:
    """``[256, k]`` lookup table: the base-``2m + 1`` digits of every byte (unpacking is one gather)."""
    k, base = _PER_BYTE[bits], 2 * max_level(bits) + 1
    return np.stack([(np.arange(256) // base**i) % base for i in range(k)], 1).astype(np.uint8)


_DIGITS = {bits: _digits(bits) for bits in _PER_BYTE}


def segment_widths(bits: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(width, column mask)`` of each non-empty bit width of a ``[C]`` allocation, in coding order."""
    return [(b, bits == b) for b in BITS[1:] if (bits == b).any()]


def _block_header(n_segments: int) -> struct.Struct:
    return struct.Struct("<HBi" + "H" * n_segments)


def encode_block(positions: np.ndarray, segments: list[tuple[int, np.ndarray]]) -> bytes:
    """One coded block of ``n`` tokens: positions ``[n]`` and ``(bits, codes [n, c])`` segments -> bytes.

    Layout: a header (uint16 ``n``, uint8 flag, int32, uint16 length of each segment), then the frames.
    Contiguous positions (flag 1) are the header's int32 (the first position) alone; otherwise the int32 is
    the length of a zstd frame of int32 position deltas. Then one zstd frame per segment: the packed codes
    of one bit width (so each gets its own Huffman table)."""
    pos = positions.astype(np.int64)
    frames = [_COMPRESSOR.compress(_pack(codes, bits)) for bits, codes in segments]
    if any(len(f) > 0xFFFF for f in frames):
        raise ValueError("a coded segment exceeds 65535 bytes; use a smaller block_size")
    lengths = [len(f) for f in frames]
    if pos.size and bool((np.diff(pos) == 1).all()):
        head = _block_header(len(frames)).pack(len(pos), 1, int(pos[0]), *lengths)
    else:
        frames.insert(0, _COMPRESSOR.compress(np.diff(pos, prepend=0).astype("<i4").tobytes()))
        head = _block_header(len(lengths)).pack(len(pos), 0, len(frames[0]), *lengths)
    return head + b"".join(frames)


def decode_blocks(frames: list[bytes], widths: list[tuple[int, int]]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Inverse of :func:`encode_block` for blocks of equal length ``n``, given ``(bits, columns)`` of each
    segment: positions ``[len(frames) * n]`` int64 and each segment's codes ``[len(frames) * n, columns]``
    uint8 (the entropy decoding is per block; unpacking runs once over all of them)."""
    if not frames:
        return np.zeros(0, dtype=np.int64), [np.zeros((0, c), dtype=np.uint8) for _, c in widths]
    header = _block_header(len(widths))
    n = header.unpack_from(frames[0])[0]
    out_sizes = [-(-n * c // _PER_BYTE[bits]) for bits, c in widths]
    decompress = _DECOMPRESSOR.decompress
    positions, raws = [], [[] for _ in widths]
    for frame in frames:
        _, contiguous, value, *lengths = header.unpack_from(frame)
        view, at = memoryview(frame), header.size
        if contiguous:
            positions.append(np.arange(value, value + n, dtype=np.int64))
        else:
            raw = decompress(view[at:at + value], max_output_size=4 * n)
            positions.append(np.cumsum(np.frombuffer(raw, dtype="<i4").astype(np.int64)))
            at += value
        for out, size, out_size in zip(raws, lengths, out_sizes):
            out.append(decompress(view[at:at + size], max_output_size=out_size))
            at += size
    count = len(frames)
    segments = []
    for raw, (bits, c) in zip(raws, widths):
        x = np.frombuffer(b"".join(raw), dtype=np.uint8).reshape(count, -1)
        if _PER_BYTE[bits] > 1:
            x = _DIGITS[bits][x].reshape(count, -1)
        segments.append(x[:, : n * c].reshape(count, c, n).transpose(0, 2, 1).reshape(count * n, c))
    return np.concatenate(positions), segments


# -- attention -----------------------------------------------------------------------------------------------
class OnlineSoftmax:
    """Attention of ``q`` ``[B, H_q, n, D]`` (positions ``q_pos`` ``[B, n]``) accumulated over blocks of K/V
    (``[B, H_kv, L, D]``, positions ``[B, H_kv, L]``; a key is visible when ``key_pos <= query_pos``), as
    flash attention does: only one block's logits exist at a time. A query that sees no key at all (a padding
    query) returns zeros."""

    def __init__(self, q: torch.Tensor, q_pos: torch.Tensor, n_kv_heads: int, scaling: float):
        b, hq, n, d = q.shape
        self.shape, self.h, self.g = (b, hq, n, d), n_kv_heads, hq // n_kv_heads
        self.cdt = torch.promote_types(q.dtype, torch.float32)
        self.dtype = q.dtype
        self.q = q.reshape(b, n_kv_heads, self.g * n, d).to(self.cdt)
        self.q_pos = q_pos.long()
        self.scaling = scaling
        self.m = torch.full((b, n_kv_heads, self.g * n, 1), float("-inf"), dtype=self.cdt, device=q.device)
        self.denom = torch.zeros_like(self.m)
        self.acc = torch.zeros(b, n_kv_heads, self.g * n, d, dtype=self.cdt, device=q.device)

    def step(self, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor) -> None:
        b, _, n, _ = self.shape
        length = k.shape[2]
        if length == 0:
            return
        logits = torch.matmul(self.q, k.to(self.cdt).transpose(-1, -2)) * self.scaling
        allowed = k_pos.long()[:, :, None, None, :] <= self.q_pos[:, None, None, :, None]
        allowed = allowed.expand(b, self.h, self.g, n, length).reshape(b, self.h, self.g * n, length)
        logits = logits.masked_fill(~allowed, float("-inf"))
        m_new = torch.maximum(self.m, logits.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
        p = torch.exp(logits - m_safe)
        correction = torch.exp(self.m - m_safe)
        self.denom = self.denom * correction + p.sum(-1, keepdim=True)
        self.acc = self.acc * correction + torch.matmul(p, v.to(self.cdt))
        self.m = m_new

    def result(self) -> torch.Tensor:
        out = torch.where(self.denom > 0, self.acc / self.denom.clamp_min(1e-30), 0.0)
        return out.reshape(self.shape).to(self.dtype)
