"""KVTC: transform coding of the KV cache (PCA, DP bit allocation, quantization, entropy coding).

Staniszewski & Łańcucki, "KV Cache Transform Coding for Compact Storage in LLM Inference", ICLR 2026,
https://arxiv.org/abs/2511.01815

The first ``n_sink`` tokens of each row and KV head and its newest ``window`` to ``window + block_size - 1``
tokens stay in full precision. Whenever the window reaches ``window + block_size`` tokens its oldest
``block_size`` become one coded block: keys lose their RoPE rotation (positions from ``ctx.positions``, the
model's ``inv_freq``/``attention_scaling`` from the artifact), keys and values are projected on their layer's
and KV head's PCA basis, each group of ``group_size`` components is quantized with the quantizer option (a
stored width of 0, 2, 4 or 8 bits and a calibrated step) the DP chose, and the block is zstd-coded into a
``bytes`` object (layout in :mod:`kvcomp.transform_coding`).
Prefill codes every whole block beyond the window at once.

Rate. ``compression_factor`` is the target for the coded tokens over the uncompressed cache in the run's
dtype: the DP (:func:`kvcomp.kvtc_calibration.allocate`) gives keys and values of each KV head
``head_dim * dtype_bits / compression_factor`` bits per token each, counted as the calibrated entropy of the
codes, and minimises the calibrated squared error. The measured ``memory_factor`` is lower at short contexts
(sinks and window are uncompressed) and differs from the target by how far zstd is from the entropy.

Bytes. ``nbytes()`` counts the coded blocks (header, positions, codes: ``len()`` of each ``bytes``), the
full-precision sink and window tensors (K, V, int32 positions), the ``[B, H_kv]`` int64 count of coded
tokens and, in a state loaded from a store, its decoded codes. The calibration artifact (bases, means, steps) is shared by every sequence of the model:
:meth:`KVTC.basis_bytes` reports it once, and it is not in ``nbytes()``.

Decoding. :meth:`KVTC.attend` never materializes the whole reconstructed cache. It entropy-decodes all coded
blocks of a layer into uint8 codes (``[2, B, H_kv, T, S]``, a quarter of float32 K/V; one zstd call per KV head
reads across all its frames, one table gather per segment unpacks them) and turns ``_DECODE_TOKENS`` (1024)
tokens at a time into floats: keys by one batched matmul of the codes with the basis (dequantization folded
in, ``codes @ weight + offset``) and RoPE from a cos/sin table indexed by position; values stay coefficients,
the online softmax applies its probabilities to them and projects the ``[B, H_kv, G * n, S]`` result once
(cheap for a few queries, instead of reconstructing every value). Then the sinks and the window. Nothing
decoded is kept between steps, so each decode step entropy-decodes the whole coded cache: on SmolLM2-135M at
4K tokens (one thread, shared CPU) a step takes about 0.5-0.6 s against 1.1-1.4 s before this decoding
and 0.14 s uncompressed; zstd's per-frame cost (~27K small frames a step) and the keys' matmul are its floor.
:meth:`KVTC.materialize` (for composition after KVTC and for tests) does reconstruct everything at once.

Storage. The coded blocks are KVTC's stored form: a saved context (:mod:`kvcomp.contexts`) keeps them as the
bytes they are, and :meth:`KVTC.restored` entropy-decodes them once when the context is loaded; the loaded
state keeps the uint8 codes (``KVTCState.decoded``, counted by ``nbytes()``) and decode steps only turn them
into floats, decoding only blocks coded after the load.

Composition. Token selection before KVTC (``Compose(SnapKV(0.5), KVTC())``) hands over each KV head's kept
tokens with their original positions; KVTC codes each row and KV head separately, so heads holding different
tokens are fine (that is why the PCA bases are per KV head, see :mod:`kvcomp.kvtc_calibration`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvcomp import kvtc_calibration as calibration
from kvcomp import transform_coding as tc
from kvcomp import validation
from kvcomp.compressor import SENTINEL, Capabilities, Compressor, CompressorError
from kvcomp.selection import TokenStore, compact, store_of_new

_DECODE_TOKENS = 1024  # coded tokens reconstructed (as float32) at a time in attend()


@dataclass
class KVTCState:
    """sinks, window: full-precision ``TokenStore`` s (``[B, H_kv, S|W, D]``); blocks[b][h]: coded blocks of
    row b and KV head h, oldest first, each ``block_size`` tokens; coded_tokens: ``[B, H_kv]`` int64.

    decoded: None, or (after :meth:`KVTC.restored`: a context loaded from a store) the entropy-decoded blocks,
    ``(positions [B, H_kv, T] int64, codes [2, B, H_kv, T, S] uint8, blocks decoded per row and head)``, kept so
    that decode steps do not entropy-decode the whole layer again; blocks coded later are decoded as they come.
    Its bytes are resident and counted by :meth:`KVTC.nbytes`."""

    layer: int
    sinks: TokenStore
    blocks: list[list[list[bytes]]]
    coded_tokens: torch.Tensor
    window: TokenStore
    decoded: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def coded_bytes(self) -> int:
        return sum(len(f) for row in self.blocks for head in row for f in head)

    def decoded_bytes(self) -> int:
        return 0 if self.decoded is None else sum(t.numel() * t.element_size() for t in self.decoded[:2])


@dataclass
class KVTC(Compressor):
    compression_factor: float = 8.0
    artifact: str | None = None  # None: the model's default path (see kvcomp.kvtc_calibration)
    n_sink: int = 4
    window: int = 128
    block_size: int = 64
    group_size: int = 4  # principal components per DP group

    capabilities: ClassVar[Capabilities] = Capabilities(lossy=True, decode_time=True, needs_calibration=True)

    def __post_init__(self) -> None:
        validation.finite_float("compression_factor", self.compression_factor, 1.0, owner=self,
                                hint=" (target over the 16/32-bit KV)")
        validation.path_or_none("artifact", self.artifact, owner=self)
        validation.non_negative_int("n_sink", self.n_sink, owner=self)
        validation.non_negative_int("window", self.window, owner=self)
        validation.positive_int("block_size", self.block_size, high=512, owner=self,
                                hint=" tokens (2-byte segment lengths)")
        validation.positive_int("group_size", self.group_size, owner=self, hint=" (principal components per DP group)")
        self._calibration: calibration.Calibration | None = None
        self._codecs: dict = {}
        if self.artifact is not None:
            self._calibration = calibration.load_artifact(self.artifact)

    def params(self) -> dict:
        """The fields plus ``calibration``: the digest of the loaded artifact (None before :meth:`bind`), so a
        resumed run does not mix records coded with another calibration."""
        return {**super().params(), "calibration": self._calibration.digest if self._calibration else None}

    # -- calibration ---------------------------------------------------------------------------------------
    def bind(self, model) -> None:
        if self._calibration is None:
            path = calibration.default_artifact_path(model)
            if not path.is_file():
                raise CompressorError(
                    f"KVTC needs a calibration artifact for this model and none was given (artifact=None) or found "
                    f"at {path}. Create it with: kvcomp calibrate kvtc --model <this model> --out {path}"
                )
            self._calibration = calibration.load_artifact(path)
        self._calibration.check_model(model)

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
        for dropped components) on ``device`` and bits ``[H, 2, D]`` (CPU); for decoding, ``weight``
        ``[H, 2, S, D]`` and ``offset`` ``[H, 2, D]`` with ``codes @ weight + offset`` the reconstruction of
        the ``S`` stored codes in :func:`kvcomp.transform_coding.coding_order` (dequantization folded in),
        and the :func:`kvcomp.transform_coding.block_segments` of each KV head's blocks."""
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
            for h, kind in np.ndindex(*bits.shape[:2]):
                order = torch.from_numpy(tc.coding_order(bits[h, kind].numpy()))
                weight[h, kind, : len(order)] = scaled[h, kind, order]
            self._codecs[key] = dict(basis=cal.basis[layer].to(device), mean=cal.mean[layer].to(device),
                                     step=step.to(device), level=level.to(device), bits=bits,
                                     inv_freq=cal.inv_freq.to(device), weight=weight.to(device),
                                     offset=offset.to(device), segments=tc.block_segments(bits.numpy()))
        return self._codecs[key]

    def rope_table(self, length: int, device: torch.device | str):
        """cos, sin ``[>= length, D]`` float32 by position (grown by doubling, shared by all layers)."""
        key = ("rope", str(device))
        if key not in self._codecs or self._codecs[key][0].shape[0] < length:
            size = max(4096, 1 << (length - 1).bit_length())
            inv_freq = self.calibration.inv_freq.to(device)
            self._codecs[key] = tc.rope_table(size, inv_freq, self.calibration.attention_scaling)
        return self._codecs[key]

    # -- hooks ---------------------------------------------------------------------------------------------
    def prefill(self, layer, q, k, v, ctx):
        store = compact(TokenStore(k, v, ctx.positions.to(torch.int32)))
        s = min(self.n_sink, store.positions.shape[-1])
        # A copy: a slice would keep the whole prompt's K/V alive under four tokens.
        sinks = TokenStore(*(t[:, :, :s].clone() for t in (store.keys, store.values, store.positions)))
        rest = TokenStore(store.keys[:, :, s:], store.values[:, :, s:], store.positions[:, :, s:])
        b, h = k.shape[:2]
        state = KVTCState(layer, sinks, [[[] for _ in range(h)] for _ in range(b)],
                          torch.zeros(b, h, dtype=torch.long, device=k.device), rest)
        return self._flush(layer, state, compact(rest))

    def append(self, layer, state: KVTCState, k, v, ctx):
        return self._flush(layer, state, compact(state.window.cat(store_of_new(k, v, ctx))))

    def _flush(self, layer: int, state: KVTCState, window: TokenStore) -> KVTCState:
        """Code the oldest whole blocks of ``window`` that lie beyond the last ``self.window`` tokens."""
        n_blocks = (window.valid.sum(-1) - self.window).clamp(min=0) // self.block_size  # [B, H]
        take = int(n_blocks.max()) * self.block_size
        if take == 0:
            state.window = window
            return state
        codec = self.codec(layer, window.keys.dtype, window.keys.device)
        ck, cv, pos = self._encode(codec, window.keys[:, :, :take], window.values[:, :, :take],
                                   window.positions[:, :, :take])
        bits = codec["bits"].numpy()
        for b, h in zip(*np.nonzero(n_blocks.cpu().numpy())):
            widths = [(codes, tc.segment_widths(bits[h, kind])) for kind, codes in enumerate((ck, cv))]
            for j in range(int(n_blocks[b, h])):
                sl = slice(j * self.block_size, (j + 1) * self.block_size)
                segments = [(w, codes[b, h, sl][:, cols]) for codes, ws in widths for w, cols in ws]
                state.blocks[b][h].append(tc.encode_block(pos[b, h, sl], segments))
        state.coded_tokens = state.coded_tokens + n_blocks * self.block_size
        # Drop the coded slots from the window: shift each row and head left by its own coded count.
        length = window.positions.shape[-1]
        index = torch.arange(length, device=window.keys.device).view(1, 1, -1) + (n_blocks * self.block_size)[..., None]
        state.window = compact(window.gather(index.clamp(max=length - 1), index < length))
        return state

    def _encode(self, codec, keys, values, positions):
        """``[B, H, T, D]`` K/V (post-RoPE keys) -> key codes, value codes ``[B, H, T, D]`` uint8 (numpy)
        and positions ``[B, H, T]``."""
        cal = self.calibration
        pre = tc.undo_rope(keys.float(), positions.clamp(max=SENTINEL - 1), codec["inv_freq"], cal.attention_scaling)
        codes = []
        for kind, x in enumerate((pre, values.float())):
            y = torch.einsum("bhtd,hcd->bhtc", x - codec["mean"][:, kind, None], codec["basis"][:, kind])
            codes.append(tc.quantize(y, codec["step"][:, kind, None], codec["level"][:, kind, None]).cpu().numpy())
        return codes[0], codes[1], positions.cpu().numpy()

    def _decoded_chunks(self, layer: int, state: KVTCState, dtype: torch.dtype, per_chunk: int):
        """Yield ``(keys, value coefficients, positions)`` of ``per_chunk`` tokens at a time: keys
        ``[B, H, T, D]`` float32 (reconstructed, RoPE re-applied), values ``[B, H, T, S]`` float32 with
        :meth:`reconstruct_values` the values they stand for, positions ``[B, H, T]`` (SENTINEL where a row
        or head has fewer blocks). The whole layer is entropy-decoded at once (uint8 codes, a quarter of
        float32 K/V: few large zstd and numpy calls); only ``per_chunk`` tokens at a time become floats."""
        device = state.window.keys.device
        codec = self.codec(layer, dtype, device)
        pos, codes = self._codes(state, codec, device)
        cos_table, sin_table = self.rope_table(int(pos.masked_fill(pos >= SENTINEL, 0).max()) + 1, device)
        for start in range(0, pos.shape[-1], per_chunk):
            p, coeffs = pos[..., start:start + per_chunk], codes[:, :, :, start:start + per_chunk].float()
            keys = torch.matmul(coeffs[0], codec["weight"][:, 0]) + codec["offset"][:, 0, None]  # [B, H, T, D]
            index = p.masked_fill(p >= SENTINEL, 0)
            if bool((index == index[:1, :1]).all()):  # the usual case: all rows and heads hold the same tokens
                index = index[0, 0]
            cos, sin = (t.index_select(0, index.reshape(-1)).view(*index.shape, -1) for t in (cos_table, sin_table))
            yield tc.rotate(keys, cos, sin), coeffs[1], p

    def _codes(self, state: KVTCState, codec, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``[B, H, T]`` and codes ``[2, B, H, T, S]`` of every coded block: from ``state.decoded``
        (extended by the blocks coded since) when the state keeps them, else entropy-decoded now."""
        counts = {len(blocks) for row in state.blocks for blocks in row}
        n_max = max(counts)
        if state.decoded is not None and len(counts) == 1:
            pos, codes, done = state.decoded
            if done < n_max:
                fresh = [[blocks[done:] for blocks in row] for row in state.blocks]
                p, c = tc.decode_blocks(fresh, codec["segments"], n_max - done)
                pos = torch.cat([pos, torch.from_numpy(p).to(device)], dim=-1)
                codes = torch.cat([codes, torch.from_numpy(c).to(device)], dim=3)
                state.decoded = (pos, codes, n_max)
            return pos, codes
        pos, codes = tc.decode_blocks(state.blocks, codec["segments"], n_max)
        return torch.from_numpy(pos).to(device), torch.from_numpy(codes).to(device)

    def restored(self, layer, state: KVTCState, convert: bool = True) -> KVTCState:
        """A state read back from a store holds the coded blocks as they were stored: with ``convert``,
        entropy-decode them once here (when every row and head holds the same number of blocks, the usual case)
        instead of at every decode step. Output is unchanged (the same codes); resident bytes grow by the
        decoded codes (uint8, a quarter of float32 K/V)."""
        counts = {len(blocks) for row in state.blocks for blocks in row}
        if convert and state.decoded is None and len(counts) == 1 and max(counts) > 0:
            device = state.window.keys.device
            codec = self.codec(layer, state.window.keys.dtype, device)
            pos, codes = tc.decode_blocks(state.blocks, codec["segments"], max(counts))
            state.decoded = (torch.from_numpy(pos).to(device), torch.from_numpy(codes).to(device), max(counts))
        return state

    def reconstruct_values(self, layer: int, coeffs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Value coefficients ``[B, H, T, S]`` from :meth:`_decoded_chunks` -> values ``[B, H, T, D]`` float32."""
        codec = self.codec(layer, dtype, coeffs.device)
        return torch.matmul(coeffs, codec["weight"][:, 1]) + codec["offset"][:, 1, None]

    def materialize(self, state: KVTCState):
        """Everything reconstructed at once (for composition and tests; attend() does not call this)."""
        dtype = state.window.keys.dtype
        parts = [(state.sinks.keys, state.sinks.values, state.sinks.positions)]
        if int(state.coded_tokens.max()):
            for k, c, p in self._decoded_chunks(state.layer, state, dtype, per_chunk=1 << 62):
                v = self.reconstruct_values(state.layer, c, dtype)
                parts.append((k.to(dtype), v.to(dtype), p.to(torch.int32)))
        parts.append((state.window.keys, state.window.values, state.window.positions))
        return tuple(torch.cat([p[i] for p in parts], dim=2) for i in range(3))

    def attend(self, layer, state: KVTCState, q, ctx):
        acc = tc.OnlineSoftmax(q, ctx.query_positions, state.window.keys.shape[1], ctx.spec)
        acc.step(state.sinks.keys, state.sinks.values, state.sinks.positions)
        if int(state.coded_tokens.max()):
            codec = self.codec(layer, state.window.keys.dtype, state.window.keys.device)
            for k, c, p in self._decoded_chunks(layer, state, state.window.keys.dtype, _DECODE_TOKENS):
                acc.step(k, c, p, codec["weight"][:, 1], codec["offset"][:, 1])
        acc.step(state.window.keys, state.window.values, state.window.positions)
        return acc.result()

    def nbytes(self, state: KVTCState) -> dict[str, int]:
        dense = state.sinks.nbytes() + state.window.nbytes()
        coded = state.coded_bytes() + state.coded_tokens.numel() * state.coded_tokens.element_size()
        return {"device": dense + coded + state.decoded_bytes(), "host": 0, "disk": 0}

    def stored_tokens(self, state: KVTCState) -> torch.Tensor:
        return state.sinks.valid.sum(-1) + state.coded_tokens + state.window.valid.sum(-1)
