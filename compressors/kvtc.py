"""KVTC: transform coding of the KV cache (PCA, DP bit allocation, quantization, entropy coding).

Staniszewski & Łańcucki, "KV Cache Transform Coding for Compact Storage in LLM Inference", ICLR 2026,
https://arxiv.org/abs/2511.01815

The first ``n_sink`` tokens of each row and KV head and its newest ``window`` to ``window + block_size - 1``
tokens stay in full precision. Whenever the window reaches ``window + block_size`` tokens its oldest
``block_size`` become one coded block: keys lose their RoPE rotation (positions from ``ctx.positions``, the
model's ``inv_freq``/``attention_scaling`` from the artifact), keys and values are projected on their layer's
and KV head's PCA basis, each group of ``group_size`` components is quantized with the quantizer option (a
stored width of 0, 2, 4 or 8 bits and a calibrated step) the DP chose, and the block's codes are appended to
the live codes (below). Prefill codes every whole block beyond the window at once. ``keys="post_rope"`` codes
the keys as the cache holds them, with RoPE, on bases calibrated that way (``kvcomp calibrate kvtc --keys
post_rope``; "Key space" in :mod:`kvcomp.kvtc_calibration`): a worse rate-distortion, and a decode step that
projects each query on the key basis once instead of rebuilding every key.

Rate. ``compression_factor`` is the target for the coded tokens over the uncompressed cache in the run's
dtype: the DP (:func:`kvcomp.kvtc_calibration.allocate`) gives keys and values of each KV head
``head_dim * dtype_bits / compression_factor`` bits per token each, counted as the calibrated entropy of the
codes, and minimises the calibrated squared error. The measured stored factor is lower at short contexts
(sinks and window are uncompressed) and differs from the target by how far zstd is from the entropy; the live
factor is lower still (fixed widths instead of entropy).

Live and stored forms. A working state holds the coded tokens' codes at their fixed widths, packed token by
token (:func:`kvcomp.transform_coding.pack_live`: 5 ternary or 2 15-level codes a byte, 8-bit codes as they
are): a decode step reads them as they are, with no entropy decoding. The entropy-coded blocks are the form a
store keeps (:meth:`KVTC.stored_form`, one zstd-coded ``bytes`` per block, layout in
:mod:`kvcomp.transform_coding`); :meth:`KVTC.restored` turns them back into the live codes, bit-identical.
So KVTC has two memory factors: ``memory_factor`` counts the live bytes (what decoding holds and reads),
:meth:`KVTC.stored_nbytes` the entropy-coded ones (what a saved context or an offloaded cache costs); the
``compression_factor`` target is a rate of the stored form.

Bytes. ``nbytes()`` counts the live codes, their int32 positions, the full-precision sink and window tensors
(K, V, int32 positions) and the ``[B, H_kv]`` int64 count of coded tokens (and, in a stored form, its blocks:
``len()`` of each ``bytes``). The calibration artifact (bases, means, steps) is shared by every sequence of
the model: :meth:`KVTC.basis_bytes` reports it once, and it is not in ``nbytes()``.

Decoding. :meth:`KVTC.attend` never materializes the whole reconstructed cache. On the CPU in float32 it
calls the fused C kernel :func:`kvcomp.kernels.cpu_native.kvtc_attention` (one pass over the packed codes:
each visible key rebuilt once for its query group, four at a time, in exact int32 sums of the codes times the
key basis moved onto an int16 grid where the CPU has AVX-512 VNNI (32 multiply-adds an instruction against 16
in float; the grid moves an entry by at most 1/65534 of its channel's largest, and every path, torch's
included, uses the same grid basis), the probabilities applied to the value codes and projected once; the
full-precision sinks and window read where they are, not concatenated).
Elsewhere ``_DECODE_TOKENS`` (1024) coded tokens at a time are unpacked (one table gather per width) and turned
into floats: keys by one batched matmul of the codes with the basis (dequantization folded in, ``codes @ weight
+ offset``) and RoPE from a cos/sin table indexed by position; values stay coefficients, the online softmax
applies its probabilities to them and projects the ``[B, H_kv, G * n, S]`` result once (cheap for a few
queries, instead of reconstructing every value). Then the sinks and the window. The keys' rebuild is the floor
of a step: the PCA basis is fitted to keys without RoPE, so every key is rebuilt (``S x D`` multiply-adds)
before its rotation. With ``keys="post_rope"`` nothing is rotated and the C kernel takes each key's logit as
``q . offset + codes . (W q)`` (``S`` multiply-adds per key and query row).
:meth:`KVTC.materialize` (for composition after KVTC and for tests) does reconstruct everything at once.

Composition. Token selection before KVTC (``Compose(SnapKV(0.5), KVTC())``) hands over each KV head's kept
tokens with their original positions; KVTC codes each row and KV head separately, so heads holding different
tokens are fine (that is why the PCA bases are per KV head, see :mod:`kvcomp.kvtc_calibration`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvcomp import kvtc_calibration as calibration
from kvcomp import transform_coding as tc
from kvcomp import validation
from kvcomp.compressor import SENTINEL, Capabilities, Compressor, CompressorError
from kvcomp.kernels import cpu_native
from kvcomp.selection import TokenStore, compact, store_of_new

_DECODE_TOKENS = 1024  # coded tokens reconstructed (as float32) at a time in attend()


@dataclass
class KVTCState:
    """sinks, window: full-precision ``TokenStore`` s (``[B, H_kv, S|W, D]``); the coded tokens, live:
    positions ``[B, H_kv, T]`` int32 (``SENTINEL`` in a hole: the slots of a block that a row and KV head had no
    tokens for when others coded one), key_codes ``[B, H_kv, T, W_k]`` and value_codes ``[B, H_kv, T, W_v]``
    uint8 (:func:`kvcomp.transform_coding.pack_live` with each KV head's allocation, padded to the widest
    head); coded_tokens ``[B, H_kv]`` int64; last_position: the largest coded position (so the RoPE table is
    sized without reading a tensor); uniform: every row and KV head holds the same positions.

    blocks: None while working; in the stored form (:meth:`KVTC.stored_form`) ``blocks[b][h]`` holds one
    entropy-coded block per ``block_size`` slots (``b""`` for a hole) and the live tensors are empty."""

    layer: int
    sinks: TokenStore
    window: TokenStore
    coded_tokens: torch.Tensor
    positions: torch.Tensor
    key_codes: torch.Tensor
    value_codes: torch.Tensor
    last_position: int = -1
    uniform: bool = True
    blocks: list[list[list[bytes]]] | None = None

    def coded_bytes(self) -> int:
        """Bytes of the entropy-coded blocks (0 while working: see :meth:`KVTC.stored_nbytes`)."""
        return 0 if self.blocks is None else sum(len(f) for row in self.blocks for head in row for f in head)

    def live_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.positions, self.key_codes, self.value_codes))


@dataclass
class KVTC(Compressor):
    compression_factor: float = 8.0
    artifact: str | None = None  # None: the model's default path (see kvcomp.kvtc_calibration)
    n_sink: int = 4
    window: int = 128
    block_size: int = 64
    group_size: int = 4  # principal components per DP group
    keys: str = "pre_rope"  # "post_rope": keys coded with their RoPE, decoded without rebuilding them

    capabilities: ClassVar[Capabilities] = Capabilities(lossy=True, decode_time=True, needs_calibration=True,
                                                        decode_uses_queries=False)

    def __post_init__(self) -> None:
        validation.finite_float("compression_factor", self.compression_factor, 1.0, owner=self,
                                hint=" (target over the 16/32-bit KV)")
        validation.path_or_none("artifact", self.artifact, owner=self)
        validation.non_negative_int("n_sink", self.n_sink, owner=self)
        validation.non_negative_int("window", self.window, owner=self)
        validation.positive_int("block_size", self.block_size, high=512, owner=self,
                                hint=" tokens (2-byte segment lengths)")
        validation.positive_int("group_size", self.group_size, owner=self, hint=" (principal components per DP group)")
        validation.choice("keys", self.keys, calibration.KEY_SPACES, owner=self)
        self._calibration: calibration.Calibration | None = None
        self._codecs: dict = {}
        if self.artifact is not None:
            self._calibration = self._checked(calibration.load_artifact(self.artifact))

    def params(self) -> dict:
        """The fields plus ``calibration``: the digest of the loaded artifact (None before :meth:`bind`), so a
        resumed run does not mix records coded with another calibration."""
        return {**super().params(), "calibration": self._calibration.digest if self._calibration else None}

    # -- calibration ---------------------------------------------------------------------------------------
    def bind(self, model) -> None:
        if self._calibration is None:
            path = calibration.default_artifact_path(model, self.keys)
            if not path.is_file():
                option = "" if self.keys == "pre_rope" else f" --keys {self.keys}"
                raise CompressorError(
                    f"KVTC needs a calibration artifact for this model and none was given (artifact=None) or found "
                    f"at {path}. Create it with: kvcomp calibrate kvtc --model <this model>{option} --out {path}"
                )
            self._calibration = self._checked(calibration.load_artifact(path))
        self._calibration.check_model(model)

    def _checked(self, cal: calibration.Calibration) -> calibration.Calibration:
        if cal.keys != self.keys:
            raise CompressorError(
                f"The KVTC artifact {cal.path} holds bases of {cal.keys} keys and this KVTC codes {self.keys} keys: "
                f"pass keys={cal.keys!r}, or an artifact made with `kvcomp calibrate kvtc --keys {self.keys}`."
            )
        return cal

    @property
    def post_rope(self) -> bool:
        return self.keys == "post_rope"

    @property
    def calibration(self) -> calibration.Calibration:
        if self._calibration is None:
            raise CompressorError(
                f"KVTC has no calibration artifact: pass artifact=<path> from `{calibration.CALIBRATE_COMMAND}`."
            )
        return self._calibration

    def basis_bytes(self) -> int:
        """One-off bytes of the shared calibration (bases, means, quantizer tables), not per sequence."""
        return self.calibration.nbytes()

    def codec(self, layer: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Per-layer tensors: for coding, basis ``[H, 2, D, D]``, mean, step and level ``[H, 2, D]`` (step 0
        for dropped components) on ``device`` and bits ``[H, 2, D]`` (CPU); for decoding, ``key_weight`` and
        ``value_weight`` ``[H, S, D]`` and ``key_offset``, ``value_offset`` ``[H, D]`` (contiguous: the C kernel
        reads them) with ``codes @ weight + offset`` the reconstruction of the ``S`` stored codes in
        :func:`kvcomp.transform_coding.coding_order` (dequantization folded in; keys coded without RoPE:
        ``key_weight`` on an int16 grid and ``key_int`` its integers and scales for the C kernel's integer
        rebuild, :func:`kvcomp.transform_coding.int16_grid`; None for keys coded after RoPE), the
        :func:`kvcomp.transform_coding.block_segments` of each KV head's blocks (the stored form), the live
        layout (``live``: each KV head's ``(width, components)`` per kind; ``widths``: bytes per token of keys
        and values; ``orders``: each KV head's coding order per kind) and ``counts`` ``[H, 2, 3]``
        (components per width, for the C kernel)."""
        key = (layer, torch.finfo(dtype).bits, str(device))
        if key not in self._codecs:
            cal = self.calibration
            if layer >= cal.basis.shape[0]:
                raise CompressorError(f"the KVTC artifact {cal.path} has {cal.basis.shape[0]} layers, not {layer + 1}.")
            _, bits, step = calibration.allocate(cal, layer, key[1], float(self.compression_factor), self.group_size)
            level, basis, mean = tc.max_level(bits).float(), cal.basis[layer].float(), cal.mean[layer].float()
            scaled = basis * step[..., None]  # [H, 2, C, D]: dequantization is (code - level) * step
            offset = mean - torch.einsum("hkc,hkcd->hkd", level, scaled)
            weight = torch.zeros(*bits.shape[:2], int((bits > 0).sum(-1).max()), basis.shape[-1])
            orders = [[tc.coding_order(bits[h, kind].numpy()) for kind in range(2)] for h in range(bits.shape[0])]
            for h, kind in np.ndindex(*bits.shape[:2]):
                order = torch.from_numpy(orders[h][kind])
                weight[h, kind, : len(order)] = scaled[h, kind, order]
            key_int = None  # rebuilt keys: the basis on an int16 grid, for the C kernel's integer sums
            if not self.post_rope:
                grid, pairs, scale = tc.int16_grid(weight[:, 0])
                weight[:, 0], key_int = grid, (pairs, scale)
            live = tc.live_segments(bits.numpy())  # [H][kind] -> (width, components) of the live codes
            widths = tuple(max(tc.live_width(head[kind]) for head in live) for kind in range(2))
            self._codecs[key] = dict(basis=cal.basis[layer].to(device), mean=cal.mean[layer].to(device),
                                     step=step.to(device), level=level.to(device), bits=bits,
                                     inv_freq=cal.inv_freq.to(device), segments=tc.block_segments(bits.numpy()),
                                     live=live, widths=widths, orders=orders,
                                     counts=torch.tensor([[[dict(segs).get(b, 0) for b in tc.BITS[1:]] for segs in head]
                                                          for head in live]),
                                     key_weight=weight[:, 0].contiguous().to(device),
                                     key_offset=offset[:, 0].contiguous().to(device),
                                     value_weight=weight[:, 1].contiguous().to(device),
                                     value_offset=offset[:, 1].contiguous().to(device), key_int=key_int)
        return self._codecs[key]

    def rope_table(self, length: int, device: torch.device | str):
        """cos, sin ``[>= length, D]`` float32 by position (grown by doubling, shared by all layers)."""
        return self._rope(length, device)[:2]

    def rope_half_table(self, length: int, device: torch.device | str):
        """The first halves of :meth:`rope_table` (rotate-half's two halves are equal): what the C kernel
        reads for each rebuilt key, half the bytes."""
        return self._rope(length, device)[2:]

    def _rope(self, length: int, device: torch.device | str):
        key = ("rope", str(device))
        if key not in self._codecs or self._codecs[key][0].shape[0] < length:
            size = max(4096, 1 << (length - 1).bit_length())
            inv_freq = self.calibration.inv_freq.to(device)
            cos, sin = tc.rope_table(size, inv_freq, self.calibration.attention_scaling)
            half = cos.shape[-1] // 2
            self._codecs[key] = (cos, sin, cos[:, :half].contiguous(), sin[:, :half].contiguous())
        return self._codecs[key]

    # -- hooks ---------------------------------------------------------------------------------------------
    def prefill(self, layer, q, k, v, ctx):
        store = compact(TokenStore(k, v, ctx.positions.to(torch.int32)))
        s = min(self.n_sink, store.positions.shape[-1])
        # A copy: a slice would keep the whole prompt's K/V alive under four tokens.
        sinks = TokenStore(*(t[:, :, :s].clone() for t in (store.keys, store.values, store.positions)))
        rest = TokenStore(store.keys[:, :, s:], store.values[:, :, s:], store.positions[:, :, s:])
        b, h = k.shape[:2]
        codec = self.codec(layer, k.dtype, k.device)
        empty = [torch.zeros(b, h, 0, w, dtype=torch.uint8, device=k.device) for w in codec["widths"]]
        state = KVTCState(layer, sinks, rest, torch.zeros(b, h, dtype=torch.long, device=k.device),
                          torch.zeros(b, h, 0, dtype=torch.int32, device=k.device), *empty)
        return self._flush(layer, state, compact(rest))

    def append(self, layer, state: KVTCState, k, v, ctx):
        return self._flush(layer, state, compact(state.window.cat(store_of_new(k, v, ctx))))

    def _flush(self, layer: int, state: KVTCState, window: TokenStore) -> KVTCState:
        """Code the oldest whole blocks of ``window`` that lie beyond the last ``self.window`` tokens."""
        if window.positions.shape[-1] < self.window + self.block_size:  # no row can have a whole block yet
            state.window = window
            return state
        n_blocks = (window.valid.sum(-1) - self.window).clamp(min=0) // self.block_size  # [B, H]
        take = int(n_blocks.max()) * self.block_size
        if take == 0:
            state.window = window
            return state
        codec = self.codec(layer, window.keys.dtype, window.keys.device)
        ck, cv, pos = self._encode(codec, window.keys[:, :, :take], window.values[:, :, :take],
                                   window.positions[:, :, :take])
        hole = np.arange(take) >= (n_blocks.cpu().numpy() * self.block_size)[..., None]  # [B, H, take]
        pos = np.where(hole, SENTINEL, pos)
        device = window.keys.device
        packed = []
        for kind, codes in enumerate((ck, cv)):
            codes = np.where(hole[..., None], 0, codes)
            packed.append(torch.stack([tc.pack_live(torch.from_numpy(codes[:, h][..., codec["orders"][h][kind]]),
                                                    codec["live"][h][kind], codec["widths"][kind])
                                       for h in range(codes.shape[1])], 1).to(device))
        state.positions = torch.cat([state.positions, torch.from_numpy(pos.astype(np.int32)).to(device)], dim=-1)
        state.key_codes = torch.cat([state.key_codes, packed[0]], dim=2)
        state.value_codes = torch.cat([state.value_codes, packed[1]], dim=2)
        state.last_position = max(state.last_position, int(pos[~hole].max()))
        state.uniform = state.uniform and bool((pos == pos[:1, :1]).all())
        state.coded_tokens = state.coded_tokens + n_blocks * self.block_size
        # Drop the coded slots from the window: shift each row and head left by its own coded count.
        length = window.positions.shape[-1]
        index = torch.arange(length, device=device).view(1, 1, -1) + (n_blocks * self.block_size)[..., None]
        state.window = compact(window.gather(index.clamp(max=length - 1), index < length))
        return state

    def _encode(self, codec, keys, values, positions):
        """``[B, H, T, D]`` K/V (post-RoPE keys) -> key codes, value codes ``[B, H, T, D]`` uint8 (numpy)
        and positions ``[B, H, T]``."""
        cal = self.calibration
        pre = keys.float() if self.post_rope else tc.undo_rope(
            keys.float(), positions.clamp(max=SENTINEL - 1), codec["inv_freq"], cal.attention_scaling)
        codes = []
        for kind, x in enumerate((pre, values.float())):
            y = torch.einsum("bhtd,hcd->bhtc", x - codec["mean"][:, kind, None], codec["basis"][:, kind])
            codes.append(tc.quantize(y, codec["step"][:, kind, None], codec["level"][:, kind, None]).cpu().numpy())
        return codes[0], codes[1], positions.cpu().numpy()

    def _unpacked(self, codec, state: KVTCState, kind: int, sl: slice) -> torch.Tensor:
        """The live codes of ``kind`` (0 keys, 1 values) in slots ``sl``: ``[B, H, t, S]`` uint8, coding order."""
        packed = (state.key_codes, state.value_codes)[kind][:, :, sl]
        stored = codec["key_weight"].shape[1]
        return torch.stack([tc.unpack_live(packed[:, h], codec["live"][h][kind], stored)
                            for h in range(packed.shape[1])], 1)

    def _decoded_chunks(self, layer: int, state: KVTCState, dtype: torch.dtype, per_chunk: int):
        """Yield ``(keys, value coefficients, positions)`` of ``per_chunk`` coded tokens at a time: keys
        ``[B, H, T, D]`` float32 (reconstructed, RoPE re-applied unless they were coded with it), values ``[B, H, T, S]`` float32 with
        :meth:`reconstruct_values` the values they stand for, positions ``[B, H, T]`` (``SENTINEL`` in holes),
        all from the live codes."""
        if state.blocks is not None:
            raise CompressorError("this KVTC state is in its stored form; KVTC.restored() makes it attendable.")
        device = state.positions.device
        codec = self.codec(layer, dtype, device)
        if not self.post_rope:
            cos_table, sin_table = self.rope_table(state.last_position + 1, device)
        for start in range(0, state.positions.shape[-1], per_chunk):
            sl = slice(start, start + per_chunk)
            p = state.positions[..., sl]
            coeffs = [self._unpacked(codec, state, kind, sl).float() for kind in (0, 1)]
            keys = torch.matmul(coeffs[0], codec["key_weight"]) + codec["key_offset"][:, None]  # [B, H, T, D]
            if self.post_rope:
                yield keys, coeffs[1], p
                continue
            index = p.masked_fill(p >= SENTINEL, 0).long()
            if state.uniform:  # the usual case: all rows and heads hold the same tokens
                index = index[0, 0]
            cos, sin = (t.index_select(0, index.reshape(-1)).view(*index.shape, -1) for t in (cos_table, sin_table))
            yield tc.rotate(keys, cos, sin), coeffs[1], p

    # -- stored form ---------------------------------------------------------------------------------------
    def stored_form(self, layer, state: KVTCState) -> KVTCState:
        """The state as a store keeps it: the live codes entropy-coded into blocks (one per ``block_size``
        slots of a row and KV head, ``b""`` for a hole), the live tensors empty. The live state is unchanged."""
        if state.blocks is not None:
            return state
        codec = self.codec(layer, state.window.keys.dtype, state.positions.device)
        pos = state.positions.cpu().numpy()
        codes = [self._unpacked(codec, state, kind, slice(None)).cpu().numpy() for kind in (0, 1)]
        b, h, t = pos.shape
        n = self.block_size
        blocks = [[[] for _ in range(h)] for _ in range(b)]
        for i, j in np.ndindex(b, h):
            for start in range(0, t, n):
                p = pos[i, j, start:start + n]
                if p[0] >= SENTINEL:
                    blocks[i][j].append(b"")
                    continue
                segments, at = [], [0, 0]
                for kind, bits, c in codec["segments"][j]:
                    segments.append((bits, codes[kind][i, j, start:start + n, at[kind]:at[kind] + c]))
                    at[kind] += c
                blocks[i][j].append(tc.encode_block(p, segments))
        return dataclasses.replace(state, positions=state.positions[:, :, :0].clone(),
                                   key_codes=state.key_codes[:, :, :0].clone(),
                                   value_codes=state.value_codes[:, :, :0].clone(), blocks=blocks)

    def component_codes(self, state: KVTCState) -> list[list[torch.Tensor]]:
        """The quantized codes the stored blocks entropy-code: ``[h][kind]`` (kind 0 keys, 1 values) ``[B, T, c]``
        uint8, the ``c`` components KV head ``h`` stores in :func:`kvcomp.transform_coding.coding_order` (a hole's
        slots hold zeros: ``state.positions`` is ``SENTINEL`` there). From the live codes; for analysis."""
        codec = self.codec(state.layer, state.window.keys.dtype, state.positions.device)
        unpacked = [self._unpacked(codec, state, kind, slice(None)) for kind in (0, 1)]
        return [[unpacked[kind][:, h, :, :sum(c for k, _, c in codec["segments"][h] if k == kind)]
                 for kind in (0, 1)] for h in range(state.positions.shape[1])]

    def stored_nbytes(self, state: KVTCState) -> int:
        return self.nbytes(self.stored_form(state.layer, state))["device"]

    def restored(self, layer, state: KVTCState, convert: bool = True) -> KVTCState:
        """A state read back from a store holds its entropy-coded blocks: decode them into the live codes (the
        only form a decode step attends), bit-identical to the state the in-process cache had. ``convert`` does
        not apply: the stored form is never attended."""
        if state.blocks is None:
            return state
        device = state.positions.device
        codec = self.codec(layer, state.window.keys.dtype, device)
        slots = len(state.blocks[0][0])
        if not slots:
            return dataclasses.replace(state, blocks=None)
        pos, codes = tc.decode_blocks(state.blocks, codec["segments"], slots)
        packed = [torch.stack([tc.pack_live(torch.from_numpy(codes[kind][:, j]), codec["live"][j][kind],
                                            codec["widths"][kind]) for j in range(pos.shape[1])], 1).to(device)
                  for kind in (0, 1)]
        return dataclasses.replace(state, positions=torch.from_numpy(pos.astype(np.int32)).to(device),
                                   key_codes=packed[0], value_codes=packed[1], blocks=None)

    # -- decoding ------------------------------------------------------------------------------------------
    def reconstruct_values(self, layer: int, coeffs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Value coefficients ``[B, H, T, S]`` from :meth:`_decoded_chunks` -> values ``[B, H, T, D]`` float32."""
        codec = self.codec(layer, dtype, coeffs.device)
        return torch.matmul(coeffs, codec["value_weight"]) + codec["value_offset"][:, None]

    def materialize(self, state: KVTCState):
        """Everything reconstructed at once (for composition and tests; attend() does not call this)."""
        dtype = state.window.keys.dtype
        parts = [(state.sinks.keys, state.sinks.values, state.sinks.positions)]
        for k, c, p in self._decoded_chunks(state.layer, state, dtype, per_chunk=1 << 62):
            v = self.reconstruct_values(state.layer, c, dtype)
            parts.append((k.to(dtype), v.to(dtype), p))
        parts.append((state.window.keys, state.window.values, state.window.positions))
        return tuple(torch.cat([p[i] for p in parts], dim=2) for i in range(3))

    def attend(self, layer, state: KVTCState, q, ctx):
        codec = self.codec(layer, state.window.keys.dtype, state.window.keys.device)
        if state.positions.shape[-1] and cpu_native.supports_kvtc(q, state.window.keys, state.sinks.keys):
            return self._attend_native(codec, state, q, ctx)
        acc = tc.OnlineSoftmax(q, ctx.query_positions, state.window.keys.shape[1], ctx.spec)
        acc.step(state.sinks.keys, state.sinks.values, state.sinks.positions)
        if state.positions.shape[-1]:
            for k, c, p in self._decoded_chunks(layer, state, state.window.keys.dtype, _DECODE_TOKENS):
                acc.step(k, c, p, codec["value_weight"], codec["value_offset"])
        acc.step(state.window.keys, state.window.values, state.window.positions)
        return acc.result()

    def _attend_native(self, codec, state: KVTCState, q, ctx):
        """The fused C kernel (float32 on the CPU): one pass over the packed codes, each key rebuilt once for
        its query group (or, post-RoPE, each query projected on the key basis once), the values' probabilities
        applied to their codes and projected once."""
        if state.blocks is not None:
            raise CompressorError("this KVTC state is in its stored form; KVTC.restored() makes it attendable.")
        cos, sin = (None, None) if self.post_rope else self.rope_half_table(state.last_position + 1, q.device)
        spec, window, sinks = ctx.spec, state.window, state.sinks
        return cpu_native.kvtc_attention(
            q, ctx.query_positions, state.key_codes, state.value_codes, state.positions, codec["counts"],
            codec["key_weight"], codec["key_offset"], codec["value_weight"], codec["value_offset"], cos, sin,
            window.keys, window.values, window.positions, spec.scaling, spec.window, spec.softcap, spec.sinks,
            int_keys=codec["key_int"], head=(sinks.keys, sinks.values, sinks.positions)).to(q.dtype)

    def checkpoint(self, state: KVTCState) -> KVTCState:
        """A shallow copy: appending never writes into a state's tensors (the window and the live codes are
        rebuilt by ``torch.cat``), so the snapshot's tensors stay as they are."""
        return dataclasses.replace(state)

    def nbytes(self, state: KVTCState) -> dict[str, int]:
        dense = state.sinks.nbytes() + state.window.nbytes() + state.live_bytes()
        coded = state.coded_bytes() + state.coded_tokens.numel() * state.coded_tokens.element_size()
        return {"device": dense + coded, "host": 0, "disk": 0}

    def stored_tokens(self, state: KVTCState) -> torch.Tensor:
        return state.sinks.valid.sum(-1) + state.coded_tokens + state.window.valid.sum(-1)
