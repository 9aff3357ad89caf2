"""Quant: KIVI-style asymmetric integer quantization of the KV cache, with a full-precision residual window.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024,
https://arxiv.org/abs/2402.02750

Keys are quantized per channel (each group of ``group_size`` consecutive tokens shares one scale and zero
point per KV head and channel), values per token (each token's channels in groups of
``min(group_size, head_dim)``). Codes are packed ``8 // bits`` to a byte; scales and zero points are stored in
the model dtype (float32 on this CPU, bfloat16 on CUDA). The newest ``residual`` to ``residual + group_size - 1``
tokens of each row and KV head stay in full precision: whenever the window reaches ``residual + group_size``
tokens its oldest ``group_size`` tokens become a new quantized group, so the cache stays quantized however long
the generation. Prefill quantizes every whole group except the tail that stays in the window.

Attention sinks: the first ``n_sink`` tokens (positions ``0 .. n_sink - 1``, default 4) also stay in full
precision, for the whole generation; ``n_sink=0`` is KIVI as published. They matter far beyond their bytes: on
the embedded SmolLM2-135M, 4-bit keys with every token quantized lost 3 of 3 probed niah_single_2 samples at 4K
(essay haystack) that the uncompressed model answers, keeping token 0 in full precision recovered 2, keeping
the first 4 recovered all 3 (values alone at 4 bits lost none). The sink tokens draw most of each head's
attention, so a small error in their logits rescales the weight of every other token.

Layout and padding: each row and KV head keeps its own tokens in position order, real tokens first (so after
SnapKV, or in a left-padded batch, a row's groups are formed over exactly the tokens it would hold alone).
Padding is never stored as a real token: its position is SENTINEL, it sits after the real tokens of the
residual window and never enters a group. When rows of a batch hold different numbers of groups, the shorter
rows' unused group slots have SENTINEL positions (masked; their bytes exist and are counted).

Bytes per stored token and KV head (``s`` = model dtype size, ``C`` = value channels per group): packed codes
``2 * D * bits / 8``, key scale + zero ``2 * D * s / group_size``, value scale + zero ``2 * (D / C) * s``, and a
4-byte int32 position (kept because after SnapKV each head holds different tokens); a window token costs
``2 * D * s + 4``, and so does a sink. At D = 64, 4 bits, group 32 in float32 that is 100 bytes against 512 (5.12x asymptotically);
at the tiny test model's D = 16 it is 32 against 128 (4x), positions and scales weighing more.

Decoding does not materialize the dequantized cache: :func:`kvcomp.kernels.quant_attention` runs the fused
Triton kernel on CUDA; on the CPU, a fused C kernel (float32, :mod:`kvcomp.kernels.cpu_native`) that holds one
token's codes at a time, or :func:`kvcomp.kernels.quant_cpu.quant_attention`, which dequantizes blocks of
``_DECODE_BLOCK`` tokens into a reused workspace. All equal the reference
:func:`kvcomp.kernels.quant_ref.quant_attention`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcomp import kernels, validation
from kvcomp.compressor import SENTINEL, Capabilities, Compressor, CompressorError
from kvcomp.kernels import quant_ref
from kvcomp.ops import take_slots
from kvcomp.selection import TokenStore, compact, store_of_new

_DECODE_BLOCK = 4096  # tokens dequantized at a time in attend() on the CPU (a few MB: stays in cache)


@dataclass
class QuantState:
    """One layer's quantized KV (``N`` groups of ``G`` tokens, ``D`` head dim, ``C`` value channels per group).

    key_codes, value_codes: ``[B, H_kv, N, G, D * bits / 8]`` uint8 (packed along channels);
    key_scale, key_zero: ``[B, H_kv, N, D]``; value_scale, value_zero: ``[B, H_kv, N, G, D / C]`` (model dtype);
    positions: ``[B, H_kv, N, G]`` int32 (SENTINEL for unused group slots);
    residual: the full-precision window, ``[B, H_kv, R, D]`` keys/values and ``[B, H_kv, R]`` positions;
    sinks: the full-precision attention sinks (positions below ``n_sink``), ``[B, H_kv, S, D]`` and ``[B, H_kv, S]``.
    """

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor
    positions: torch.Tensor
    residual: TokenStore
    sinks: TokenStore

    def group_tensors(self) -> list[torch.Tensor]:
        return [
            self.key_codes,
            self.key_scale,
            self.key_zero,
            self.value_codes,
            self.value_scale,
            self.value_zero,
            self.positions,
        ]

    def tensors(self) -> list[torch.Tensor]:
        return self.group_tensors() + self.residual.tensors() + self.sinks.tensors()

    @property
    def quantized_tokens(self) -> torch.Tensor:
        """``[B, H_kv]`` tokens held in quantized groups."""
        return (self.positions < SENTINEL).sum(dim=(2, 3))

    @property
    def residual_tokens(self) -> torch.Tensor:
        """``[B, H_kv]`` tokens held in the full-precision window."""
        return self.residual.valid.sum(-1)

    @property
    def sink_tokens(self) -> torch.Tensor:
        """``[B, H_kv]`` attention sinks held in full precision."""
        return self.sinks.valid.sum(-1)


@dataclass
class Quant(Compressor):
    bits: int = 4
    group_size: int = 32
    residual: int = 128
    n_sink: int = 4

    capabilities: ClassVar[Capabilities] = Capabilities(lossy=True, decode_time=True, supports_batch=True,
                                                        decode_uses_queries=False)

    def __post_init__(self) -> None:
        validation.choice("bits", self.bits, quant_ref.BITS, owner=self)
        validation.positive_int("group_size", self.group_size, owner=self, hint=" (tokens per key group)")
        validation.non_negative_int("residual", self.residual, owner=self, hint=" (full-precision recent tokens)")
        validation.non_negative_int("n_sink", self.n_sink, owner=self,
                                    hint=" (first tokens kept in full precision)")

    def value_channels(self, head_dim: int) -> int:
        """Channels per value group: ``group_size``, or the whole head when the head is smaller."""
        channels = min(self.group_size, head_dim)
        if head_dim % channels or head_dim * self.bits % 8:
            raise CompressorError(
                f"Quant(bits={self.bits}, group_size={self.group_size}) needs head_dim ({head_dim}) to be a "
                f"multiple of the value group ({channels}) and of {8 // self.bits} codes per byte."
            )
        return channels

    # -- hooks ---------------------------------------------------------------------------------------------
    def prefill(self, layer, q, k, v, ctx):
        b, h, _, d = k.shape
        g, packed, n_value_groups = self.group_size, d * self.bits // 8, d // self.value_channels(d)

        def empty(*shape, dtype=k.dtype):
            return k.new_zeros(b, h, 0, *shape, dtype=dtype)

        tokens = TokenStore(k, v, ctx.positions.to(torch.int32))
        is_sink = tokens.valid & (tokens.positions < self.n_sink)
        sinks = compact(TokenStore(k, v, tokens.positions.masked_fill(~is_sink, SENTINEL)))
        codes = empty(g, packed, dtype=torch.uint8)
        state = QuantState(
            codes,
            empty(d),
            empty(d),
            codes,
            empty(g, n_value_groups),
            empty(g, n_value_groups),
            empty(g, dtype=torch.int32),
            TokenStore(k[:, :, :0], v[:, :, :0], tokens.positions[:, :, :0]),
            sinks,
        )
        return self._append(state, TokenStore(k, v, tokens.positions.masked_fill(is_sink, SENTINEL)))

    def append(self, layer, state: QuantState, k, v, ctx):
        return self._append(state, store_of_new(k, v, ctx))

    def _append(self, state: QuantState, tokens: TokenStore) -> QuantState:
        # Real tokens first, in position order, per row and KV head; padding slots (SENTINEL) last.
        window = compact(state.residual.cat(tokens))
        if window.positions.shape[-1] < self.residual + self.group_size:  # no row can flush: skip the counting
            state.residual = window
            return state
        count = window.valid.sum(-1)  # [B, H]
        flush = (count - self.residual).clamp(min=0) // self.group_size  # whole groups to quantize, [B, H]
        n_new = int(flush.max())
        if n_new == 0:
            state.residual = window
            return state
        b, h, _, d = window.keys.shape
        device = window.keys.device
        g = self.group_size
        # The oldest n_new groups' worth of slots; a row flushing fewer groups marks the rest unused here
        # (those tokens stay in its window below).
        keys = window.keys[:, :, : n_new * g].reshape(b, h, n_new, g, d)
        values = window.values[:, :, : n_new * g].reshape(b, h, n_new, g, d)
        used = torch.arange(n_new, device=device).view(1, 1, -1) < flush.unsqueeze(-1)  # [B, H, n_new]
        positions = window.positions[:, :, : n_new * g].reshape(b, h, n_new, g)
        positions = positions.masked_fill(~used.unsqueeze(-1), SENTINEL)
        kc, ks, kz = quant_ref.quantize_keys(keys, self.bits)
        vc, vs, vz = quant_ref.quantize_values(values, self.bits, self.value_channels(d))
        new = [kc, ks, kz, vc, vs, vz, positions]
        groups = [torch.cat([old, t], dim=2) for old, t in zip(state.group_tensors(), new)]
        groups = _compact_groups(groups)
        # Drop the flushed slots from the window: shift each row left by its own flushed count.
        length = window.positions.shape[-1]
        index = torch.arange(length, device=device).view(1, 1, -1) + (flush * g).unsqueeze(-1)
        window = compact(window.gather(index.clamp(max=length - 1), index < length))
        return QuantState(*groups, residual=window, sinks=state.sinks)

    def checkpoint(self, state: QuantState) -> QuantState:
        # append() never writes into existing tensors (it concatenates and gathers), it only rebinds fields.
        return dataclasses.replace(state, residual=dataclasses.replace(state.residual))

    def materialize(self, state: QuantState):
        dtype = state.residual.keys.dtype
        keys = quant_ref.dequantize_keys(state.key_codes, state.key_scale, state.key_zero, self.bits, dtype)
        values = quant_ref.dequantize_values(
            state.value_codes, state.value_scale, state.value_zero, self.bits, dtype
        )
        sinks, window = state.sinks, state.residual
        return (
            torch.cat([sinks.keys, keys.flatten(2, 3), window.keys], dim=2),
            torch.cat([sinks.values, values.flatten(2, 3), window.values], dim=2),
            torch.cat([sinks.positions, state.positions.flatten(2), window.positions], dim=2),
        )

    def attend(self, layer, state: QuantState, q, ctx):
        """Blockwise dequantize-attention (see :mod:`kvcomp.kernels.quant_cpu` for what is materialized at a
        time): equal to dense attention over :meth:`materialize`'s K/V."""
        r, s = state.residual, state.sinks  # the full-precision part: sinks first (read in place), the window
        return kernels.quant_attention(
            q,
            ctx.query_positions,
            state.key_codes,
            state.key_scale,
            state.key_zero,
            state.value_codes,
            state.value_scale,
            state.value_zero,
            state.positions,
            r.keys,
            r.values,
            r.positions,
            self.bits,
            ctx.scaling,
            block_tokens=_DECODE_BLOCK,
            sentinel=SENTINEL,
            window=ctx.spec.window,
            softcap=ctx.spec.softcap,
            sinks=ctx.spec.sinks,
            head=(s.keys, s.values, s.positions) if s.positions.shape[-1] else None,
        )

    def nbytes(self, state: QuantState) -> dict[str, int]:
        return {"device": sum(t.numel() * t.element_size() for t in state.tensors()), "host": 0, "disk": 0}

    def stored_tokens(self, state: QuantState) -> torch.Tensor:
        return state.quantized_tokens + state.residual_tokens + state.sink_tokens



def _compact_groups(groups: list[torch.Tensor]) -> list[torch.Tensor]:
    """Move each row's used groups (positions < SENTINEL) first, keeping their order, and drop group slots no
    row uses. ``groups``: QuantState's group tensors, positions last, all indexed ``[B, H, N, ...]``."""
    used = groups[-1][..., 0] < SENTINEL  # [B, H, N]
    if bool(used.all()):
        return groups
    n = used.shape[-1]
    width = int(used.sum(-1).max())
    order = torch.where(used, torch.arange(n, device=used.device), n + torch.arange(n, device=used.device))
    index = order.argsort(dim=-1)[..., :width]  # [B, H, width]
    return [take_slots(t, index) for t in groups]
