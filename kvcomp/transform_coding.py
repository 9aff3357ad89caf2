"""Transform coding of K/V (KVTC-style): RoPE undo/redo, DP bit allocation, coefficient quantization,
entropy-coded blocks and blockwise attention with an online softmax.

Used by :mod:`compressors.kvtc`; the calibration that produces the per-component statistics lives in
:mod:`kvcomp.kvtc_calibration`.

Quantizer. A principal-component coefficient ``y`` stored in a width of ``b`` bits (``b`` in 2, 4, 8) is
rounded to one of ``2 * m + 1`` symmetric levels ``k * step`` (``m = 2**(b-1) - 1``: 3, 15 or 255 levels, zero
included), stored as the byte ``k + m``. Each width comes with several steps (:data:`STEP_MULTIPLES`): the
width's calibrated step (the clipping range minimising the squared error on calibration data) and coarser
ones ``sqrt(2)`` apart. With an entropy coder behind it, a coarser step is a lower rate at a higher error, so
the menu of (width, step) *options* fills the rate-distortion curve between the widths (one step per width
left the DP only 0, ~1.5, ~3.5 and ~6 bits per component and it sat ~2.8x above the Gaussian bound,
``experiments/kvtc_bound.py``). Steps live in the calibration artifact, so a sequence stores no scales.
Option 0 drops the component (reconstructed as the calibration mean).

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

from kvcomp.ops import SENTINEL, AttentionSpec, softcap, visible

BITS = (0, 2, 4, 8)
# Steps per stored width: the width's calibrated step times sqrt(2)**j, j < STEP_MULTIPLES[width]. The coarsest
# step of a width reaches about the finest of the next narrower one (8 bits: ~0.1 sigma .. ~0.5 sigma).
STEP_MULTIPLES = {2: 3, 4: 4, 8: 6}
# Option index -> stored width; option 0 drops the component.
OPTION_BITS = (0,) + tuple(b for b in BITS[1:] for _ in range(STEP_MULTIPLES[b]))
OPTION_SCALE = (0.0,) + tuple(2.0 ** (j / 2) for b in BITS[1:] for j in range(STEP_MULTIPLES[b]))
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


def rope_table(length: int, inv_freq: torch.Tensor, scaling: float = 1.0):
    """cos, sin ``[length, 2 * len(inv_freq)]`` float32 of positions ``0 .. length - 1`` (index them by
    position instead of recomputing: the values are those :func:`apply_rope` computes)."""
    return _cos_sin(torch.arange(length, device=inv_freq.device), inv_freq, scaling, torch.float32)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``cos.shape[-1]`` channels of ``x`` ``[..., D]``
    (float32), the rest unchanged; ``cos``, ``sin`` broadcast against ``x``."""
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    out = x.clone() if rot < x.shape[-1] else torch.empty_like(x)
    torch.mul(x[..., :rot], cos, out=out[..., :rot])
    out[..., :half].addcmul_(x[..., half:rot], sin[..., :half], value=-1)
    out[..., half:rot].addcmul_(x[..., :half], sin[..., half:])
    return out


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
    """Inverse of :func:`apply_rope`: rotate back by ``-theta`` and divide by ``scaling**2``.

    ``x * cos - rotate_half(x) * sin`` written into one buffer: each half takes the other half's product in a
    separate multiply and add (the roundings of the expression; no fused multiply-add), and nothing is
    concatenated when every channel rotates."""
    rot, half = 2 * inv_freq.shape[-1], inv_freq.shape[-1]
    xr = x[..., :rot].to(torch.promote_types(x.dtype, torch.float32))
    cos, sin = _cos_sin(positions, inv_freq, scaling, xr.dtype)
    out = xr * cos
    out[..., :half] += xr[..., half:] * sin[..., :half]
    out[..., half:] -= xr[..., :half] * sin[..., half:]
    if scaling != 1.0:
        out /= scaling * scaling
    return out.to(x.dtype) if rot == x.shape[-1] else torch.cat([out.to(x.dtype), x[..., rot:]], dim=-1)


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
def allocate_options(err: np.ndarray, rate: np.ndarray, budget: float, group_size: int, resolution: int = 8):
    """Dynamic programming over groups of ``group_size`` consecutive components (variance order).

    err, rate: ``[n_options, C]`` squared error and coded bits per token of each component under each quantizer
    option (calibration statistics; option 0 drops the component: its rate is 0). Chooses one option per group
    minimising the summed error with the summed rate at most ``budget`` bits per token (rates rounded up to
    ``1/resolution`` bit). Returns ``[C]`` int option indices.
    """
    n_options, c = err.shape
    n_groups = -(-c // group_size)
    cap = max(0, int(np.floor(budget * resolution)))
    g_err = np.stack([err[:, g * group_size:(g + 1) * group_size].sum(1) for g in range(n_groups)], 1)
    g_rate = np.stack([rate[:, g * group_size:(g + 1) * group_size].sum(1) for g in range(n_groups)], 1)
    g_cost = np.ceil(g_rate * resolution - 1e-9).astype(np.int64)  # [n_options, n_groups]
    cap = min(cap, int(g_cost.max(0).sum()))
    best = np.zeros(cap + 1)  # best[r]: least error of the groups so far with rate <= r
    choice = np.zeros((n_groups, cap + 1), dtype=np.int64)
    for g in range(n_groups):
        options = np.full((n_options, cap + 1), np.inf)
        for j in range(n_options):
            cost = g_cost[j, g]
            if cost <= cap:
                options[j, cost:] = best[: cap + 1 - cost] + g_err[j, g]
        choice[g] = options.argmin(0)
        best = options.min(0)
    chosen = np.zeros(c, dtype=np.int64)
    r = cap
    for g in reversed(range(n_groups)):
        j = choice[g, r]
        chosen[g * group_size:(g + 1) * group_size] = j
        r -= g_cost[j, g]
    return chosen


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
    """``[256]`` lookup table whose entry for a byte holds its ``k`` base-``2m + 1`` digits as the low bytes of
    one integer (a uint16 for ``k = 2``, a uint64 for ``k = 5``): unpacking is one gather of whole words,
    several times faster in numpy than gathering ``[256, k]`` rows."""
    k, base = _PER_BYTE[bits], 2 * max_level(bits) + 1
    digits = np.zeros((256, 2 if k == 2 else 8), dtype=np.uint8)
    digits[:, :k] = np.stack([(np.arange(256) // base**i) % base for i in range(k)], 1)
    return digits.view(np.uint16 if k == 2 else np.uint64).reshape(256)


_DIGITS = {bits: _digits(bits) for bits in (2, 4)}


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`_pack` along the last axis: ``[..., bytes]`` -> ``[..., bytes * k]`` codes."""
    if bits == 8:
        return packed
    k = _PER_BYTE[bits]
    words = _DIGITS[bits][packed].view(np.uint8).reshape(*packed.shape, -1)
    return words.reshape(*packed.shape[:-1], -1) if k == 2 else words[..., :k].reshape(*packed.shape[:-1], -1)


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


def coding_order(bits: np.ndarray) -> np.ndarray:
    """The components of a ``[C]`` allocation in the order their codes are stored: by bit width (2, 4, 8),
    then by index; dropped components (0 bits) are not stored."""
    return np.concatenate([np.flatnonzero(bits == b) for b in BITS[1:]])


def block_segments(bits: np.ndarray) -> list[list[tuple[int, int, int]]]:
    """``(kind, bits, components)`` of the coded segments of each KV head's blocks, in coding order, for an
    allocation ``bits`` ``[H, 2, C]`` (kind 0 keys, 1 values)."""
    return [[(kind, b, int((bits[h, kind] == b).sum())) for kind in range(2) for b in BITS[1:]
             if (bits[h, kind] == b).any()] for h in range(bits.shape[0])]


def decode_blocks(blocks: list[list[list[bytes]]], segments: list[list[tuple[int, int, int]]], n_blocks: int):
    """Inverse of :func:`encode_block` for the blocks of one layer: ``blocks[b][h]`` (at most ``n_blocks``,
    each of ``n`` tokens; an empty ``bytes`` is a hole: ``n`` slots holding no token) whose KV head ``h``
    codes the :func:`block_segments` ``segments[h]``.

    Returns positions ``[B, H, n_blocks * n]`` int64 (``SENTINEL`` in holes and past a row and head's last
    block) and codes ``[2, B, H, n_blocks * n, S]`` uint8 (keys, values; zero where no token is), the ``S``
    columns the stored components in :func:`coding_order`, zero-padded to the most any KV head stores. The
    frames of all blocks of a KV head are decompressed by one call (zstd reads across frames); unpacking is
    one table gather per segment."""
    rows, heads = len(blocks), len(blocks[0])
    n = next(struct.unpack_from("<H", f)[0] for row in blocks for head in row for f in head if f)
    stored = max(sum(c for kind, _, c in head if kind == k) for head in segments for k in range(2))
    positions = np.full((rows, heads, n_blocks, n), SENTINEL, dtype=np.int64)
    codes = np.zeros((2, rows, heads, n_blocks, n, stored), dtype=np.uint8)
    for h in range(heads):
        sizes = [-(-n * c // _PER_BYTE[b]) for _, b, c in segments[h]]
        header = _block_header(len(sizes))
        frames, firsts, slots = [], np.full((rows, n_blocks), -1, dtype=np.int64), []
        for i in range(rows):
            for j, block in enumerate(blocks[i][h]):
                if not block:
                    continue
                slots.append(i * n_blocks + j)
                _, contiguous, value, *_ = header.unpack_from(block)
                at = header.size
                if contiguous:
                    firsts[i, j] = value
                else:  # a frame of position deltas
                    raw = _DECOMPRESSOR.decompress(memoryview(block)[at:at + value], max_output_size=4 * n)
                    positions[i, h, j] = np.cumsum(np.frombuffer(raw, dtype="<i4").astype(np.int64))
                    at += value
                frames.append(memoryview(block)[at:])
        where = firsts >= 0
        positions[:, h][where] = firsts[where][:, None] + np.arange(n)
        raw = _DECOMPRESSOR.decompressobj(read_across_frames=True).decompress(b"".join(frames))
        if len(raw) != len(frames) * sum(sizes):
            raise ValueError(f"corrupt KVTC blocks: {len(raw)} decoded bytes, expected {len(frames) * sum(sizes)}")
        raw = np.frombuffer(raw, dtype=np.uint8).reshape(len(frames), sum(sizes))
        if len(slots) != rows * n_blocks:  # holes, and rows and heads with fewer blocks, leave zeros
            full = np.zeros((rows * n_blocks, raw.shape[1]), dtype=np.uint8)
            full[slots] = raw
            raw = full
        raw = raw.reshape(rows, n_blocks, -1)
        at, filled = 0, [0, 0]
        for (kind, b, c), size in zip(segments[h], sizes):
            codes[kind, :, h, :, :, filled[kind]:filled[kind] + c] = (  # component-major as coded -> token-major
                _unpack(raw[..., at:at + size], b)[..., : n * c].reshape(rows, n_blocks, c, n).transpose(0, 1, 3, 2))
            at, filled[kind] = at + size, filled[kind] + c
    return positions.reshape(rows, heads, -1), codes.reshape(2, rows, heads, n_blocks * n, stored)


# -- live codes ----------------------------------------------------------------------------------------------
# The form a working cache attends: every token's codes at their fixed width, packed into bytes token by token
# (the same base-(2m + 1) packing as a block's segments: 5 ternary codes or 2 15-level codes a byte), so a
# decode step reads them without entropy decoding. Entropy-coded blocks are the stored form.
def live_segments(bits: np.ndarray) -> list[list[list[tuple[int, int]]]]:
    """``[H][kind]`` -> ``(bits, components)`` of each stored width in :func:`coding_order`, for an allocation
    ``bits`` ``[H, 2, C]``."""
    return [[[(b, int((bits[h, kind] == b).sum())) for b in BITS[1:] if (bits[h, kind] == b).any()]
             for kind in range(2)] for h in range(bits.shape[0])]


def live_width(segments: list[tuple[int, int]]) -> int:
    """Bytes per token of one KV head's codes of one kind in the live form."""
    return sum(-(-c // _PER_BYTE[b]) for b, c in segments)


def pack_live(codes: torch.Tensor, segments: list[tuple[int, int]], width: int) -> torch.Tensor:
    """Codes ``[..., S]`` uint8 in :func:`coding_order` (``S`` at least the components ``segments`` store) ->
    ``[..., width]`` uint8, each segment's codes ``_PER_BYTE`` to a byte (zero bytes pad to ``width``)."""
    out = torch.zeros(*codes.shape[:-1], width, dtype=torch.uint8, device=codes.device)
    at = put = 0
    for b, c in segments:
        k, base = _PER_BYTE[b], 2 * max_level(b) + 1
        x = codes[..., at:at + c].to(torch.int32)
        nb = -(-c // k)
        if k > 1:
            x = torch.nn.functional.pad(x, (0, nb * k - c)).view(*x.shape[:-1], nb, k)
            x = (x * (base ** torch.arange(k, dtype=torch.int32, device=x.device))).sum(-1)
        out[..., put:put + nb] = x.to(torch.uint8)
        at, put = at + c, put + nb
    return out


_LIVE_DIGITS: dict[tuple[int, str], torch.Tensor] = {}


def _digit_table(bits: int, device: torch.device) -> torch.Tensor:
    key = (bits, str(device))
    if key not in _LIVE_DIGITS:
        k, base = _PER_BYTE[bits], 2 * max_level(bits) + 1
        table = torch.stack([(torch.arange(256) // base**i) % base for i in range(k)], 1).to(torch.uint8)
        _LIVE_DIGITS[key] = table.to(device)
    return _LIVE_DIGITS[key]


def unpack_live(packed: torch.Tensor, segments: list[tuple[int, int]], stored: int) -> torch.Tensor:
    """Inverse of :func:`pack_live`: ``[..., width]`` -> codes ``[..., stored]`` uint8 (zeros past the
    components ``segments`` store)."""
    out = torch.zeros(*packed.shape[:-1], stored, dtype=torch.uint8, device=packed.device)
    at = put = 0
    for b, c in segments:
        nb = -(-c // _PER_BYTE[b])
        x = packed[..., at:at + nb]
        if b != 8:
            x = _digit_table(b, packed.device)[x.long()].flatten(-2)
        out[..., put:put + c] = x[..., :c]
        at, put = at + nb, put + c
    return out


def int16_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A reconstruction basis ``[H, S, D]`` (codes @ basis) moved onto an int16 grid per KV head and channel:
    ``(grid, pairs, scale)`` with ``grid[h, s, d] == scale[h, d] * pairs[h, s // 2, d, s % 2]`` (float32; each entry
    moves by at most 1/65534 of its channel's largest, far below the quantization step), ``pairs``
    ``[H, ceil(S / 2), D, 2]`` int16 (each channel's two components side by side, zero past S) and ``scale``
    ``[H, D]``. A sum of S codes (< 255) times the integers fits int32 exactly, so a kernel may rebuild keys as
    ``scale * (codes @ integers)`` and get ``codes @ grid`` to float rounding."""
    h, s, d = weight.shape
    top = min(32767, (2**31 - 1) // (254 * max(s, 1)))
    largest = weight.abs().amax(1)  # [H, D]
    scale = torch.where(largest > 0, largest / top, torch.ones_like(largest)).float()
    ints = torch.round(weight.float() / scale[:, None]).clamp(-top, top)
    padded = torch.zeros(h, -(-s // 2) * 2, d)
    padded[:, :s] = ints
    pairs = padded.view(h, -1, 2, d).transpose(2, 3).to(torch.int16).contiguous()
    return (ints * scale[:, None]).to(weight.device), pairs, scale


# -- attention -----------------------------------------------------------------------------------------------
class OnlineSoftmax:
    """Attention of ``q`` ``[B, H_q, n, D]`` (positions ``q_pos`` ``[B, n]``) accumulated over blocks of K/V
    (``[B, H_kv, L, D]``, positions ``[B, H_kv, L]``), as flash attention does: only one block's logits exist
    at a time. Visibility, soft-capping and sinks are the layer's (``spec``, through :mod:`kvcomp.ops`). A
    query that sees no key at all (a padding query) returns zeros."""

    def __init__(self, q: torch.Tensor, q_pos: torch.Tensor, n_kv_heads: int, spec: AttentionSpec):
        b, hq, n, d = q.shape
        self.shape, self.h, self.g = (b, hq, n, d), n_kv_heads, hq // n_kv_heads
        self.cdt = torch.promote_types(q.dtype, torch.float32)
        self.dtype = q.dtype
        self.q = q.reshape(b, n_kv_heads, self.g * n, d).to(self.cdt)
        self.q_pos = q_pos.long()
        self.spec = spec
        self.m = torch.full((b, n_kv_heads, self.g * n, 1), float("-inf"), dtype=self.cdt, device=q.device)
        self.denom = torch.zeros_like(self.m)
        sinks = spec.grouped_sinks(n_kv_heads, n, q.device)
        if sinks is not None:  # a sink is one more logit with a zero value: it starts the running softmax
            self.m = sinks.to(self.cdt).expand_as(self.m).clone()
            self.denom = torch.ones_like(self.m)
        self.acc = torch.zeros(b, n_kv_heads, self.g * n, d, dtype=self.cdt, device=q.device)

    def step(self, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor,
             v_weight: torch.Tensor | None = None, v_offset: torch.Tensor | None = None) -> None:
        """Fold in one block. With ``v_weight`` ``[H_kv, S, D]`` and ``v_offset`` ``[H_kv, D]``, ``v``
        ``[B, H_kv, L, S]`` holds coefficients of the values ``v @ v_weight + v_offset``: the probabilities
        are applied to the coefficients and projected once (``p @ v @ v_weight``, cheap for few queries)
        instead of reconstructing every value."""
        b, _, n, _ = self.shape
        length = k.shape[2]
        if length == 0:
            return
        logits = softcap(torch.matmul(self.q, k.to(self.cdt).transpose(-1, -2)) * self.spec.scaling, self.spec.softcap)
        allowed = visible(self.q_pos[:, None, None, :, None], k_pos.long()[:, :, None, None, :], self.spec.window)
        allowed = allowed.expand(b, self.h, self.g, n, length).reshape(b, self.h, self.g * n, length)
        logits = logits.masked_fill(~allowed, float("-inf"))
        m_new = torch.maximum(self.m, logits.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
        p = torch.exp(logits - m_safe)
        correction = torch.exp(self.m - m_safe)
        self.denom = self.denom * correction + p.sum(-1, keepdim=True)
        pv = torch.matmul(p, v.to(self.cdt))
        if v_weight is not None:
            pv = torch.matmul(pv, v_weight.to(self.cdt)) + p.sum(-1, keepdim=True) * v_offset[:, None].to(self.cdt)
        self.acc = self.acc * correction + pv
        self.m = m_new

    def result(self) -> torch.Tensor:
        out = torch.where(self.denom > 0, self.acc / self.denom.clamp_min(1e-30), 0.0)
        return out.reshape(self.shape).to(self.dtype)
