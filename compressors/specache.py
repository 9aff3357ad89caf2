"""SpeCache: a low-bit KIVI copy of the whole KV resident, the top tokens fetched back at full precision.

Jie et al., "SpeCache: Speculative Key-Value Caching for Efficient Generation of LLMs", ICML 2025,
https://arxiv.org/abs/2503.16163; the low-bit copy is KIVI's (Liu et al., ICML 2024,
https://arxiv.org/abs/2402.02750), computed by :mod:`kvcomp.kernels.quant_ref`.

The full KV lives in a slower tier (see :mod:`kvcomp.retrieval` for the tiers, sinks and recent window, the
budget, and the prefetch with its correction). Resident summary: a ``bits``-bit copy (1, 2 or 4; default 2)
of every key and value between the sinks and the window — keys per channel over groups of ``group_size``
tokens, values per token over groups of ``value_group`` channels (default: the whole head), codes packed
``8 // bits`` to a byte, scales and zero points in the model dtype. Per token and KV head that is
``2 * D * bits / 8 + 2 * D * s / group_size + 2 * (D / value_group) * s`` bytes (``s`` the dtype size).

Per token and KV head at D = 64 in float32 (the CPU default), 2 bits with ``group_size`` 64 cost 48 bytes
against 512 (9.4%, leaving about 3% of a 1/8 budget for sinks, window and fetched tokens); 1 bit costs 32
(6.25%) but attending to the other tokens' 1-bit copies derails SmolLM2-135M (a 1K needle sample: wrong
answer with 1 bit, right with 2 bits, at budget_fraction 0.25). In bfloat16 the 2-bit codes alone are 1/8 of
the full KV, so a 1/8 budget there needs ``bits=1``.

Each decode step the low-bit keys score every token (``q . k_hat``, maximized over the query group); the
top-k tokens per KV head are fetched at full precision and replace their low-bit versions: one softmax runs
over sinks + fetched tokens + window at full precision and over every other token's low-bit copy (the
scoring logits are reused for the low-bit part). Both passes read the packed codes and dequantize in
registers: on the CPU in float32 the C kernels of :mod:`kvcomp.kernels.cpu_native` (scoring:
``quant_key_logits``; attention: ``quant_attention`` given those logits), on CUDA the Triton kernels
(``quant_key_scores``, then ``quant_attention``; 2, 4 or 8 bits). The attention kernel is the quant
compressor's: the low-bit copy is its quantized part (the fetched tokens' slots masked as empty) and sinks,
fetched tokens and window its full-precision residual. Otherwise (1 bit on CUDA, bfloat16 on the CPU) torch
dequantizes the keys and values once per step (``[B, H, L, D]`` transients).

What is implemented of the speculation, precisely: the paper decodes a *speculative next token* alongside
each output token (two positions per forward, the second attending over the low-bit cache) and uses its
queries to choose the next step's tokens. Here, inside one forward of the model, the next step's tokens are
chosen with the current step's query (the query of the token just decoded stands in for the speculative
token's), fetched in the background, and corrected synchronously for KV heads whose query moved (cosine
similarity below ``tau``), exactly as the FreeKV variant. Decoding a second speculative position per step
needs a custom generation loop and is not implemented.

Correction. The previous token's query is a weaker guess than the paper's speculative token: on SmolLM2-135M
at 4K tokens it holds about 60% of the tokens the step's own query selects, and acting on the cosine rule
alone lost needles in RULER niah_multikey_1 that exact retrieval finds. Since the low-bit copy scores every
token each step anyway, SpeCache defaults to ``correction="missed"``: the prefetched tokens the step's own
top-k wants are kept and only the missed ones are fetched synchronously, so the output is that of exact
retrieval and the prefetch hides the part of the transfer it guessed (``recall``); ``correction="cosine"``
gives the FreeKV rule.

When to speculate. With ``correction="missed"`` the prefetch cannot change the output, only hide transfer
time, so by default (``speculative=None``) SpeCache prefetches where a fetch crosses a bus or a network (the
tiers of a CUDA device, a store) and fetches synchronously where the full KV is in this CPU's memory or page
cache: there a fetch is a memory gather on the cores the step computes on, and speculating does more of them
(the prefetched units, then the missed ones, merged in order). Measured on SmolLM2-135M (float32, 2 threads,
disk tier; ``experiments/results/bench-retrieval-ea-embedded``): 117 ms per token synchronous against 150
speculative at 8K, 66 against 73 at 2K. ``speculative=True`` prefetches everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp import kernels, validation
from kvcomp.compressor import SENTINEL, CompressorError
from kvcomp.kernels import cpu_native, quant_ref
from kvcomp.ops import softcap, softmax, visible
from kvcomp.retrieval import Retrieval, RetrievalState

SPECACHE_BITS = (1, 2, 4)


@dataclass
class LowBitCopy:
    """``N`` groups of ``G`` tokens: key_codes/value_codes ``[B, H, N, G, D * bits / 8]`` uint8,
    key_scale/key_zero ``[B, H, N, D]``, value_scale/value_zero ``[B, H, N, G, D / C]``."""

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.key_codes, self.key_scale, self.key_zero, self.value_codes, self.value_scale, self.value_zero]


@dataclass
class SpeCache(Retrieval):
    bits: int = 2  # 1 bit loses the needle on SmolLM2-135M (module docstring)
    group_size: int = 64
    value_group: int | None = None  # value channels per scale; None: the whole head
    correction: str = "missed"  # see the module docstring
    speculative: bool | None = None  # None: prefetch only where it can hide a transfer (module docstring)

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.choice("bits", self.bits, SPECACHE_BITS, owner=self)
        validation.positive_int("group_size", self.group_size, owner=self, hint=" (tokens per key group)")
        validation.positive_int("value_group", self.value_group, none=True, owner=self,
                                hint=" (value channels per scale; None: the whole head)")

    @property
    def chunk(self) -> int:  # tokens enter the low-bit copy a key group at a time
        return self.group_size

    def _channels(self, d: int) -> int:
        c = self.value_group or d
        if d % c or d * self.bits % 8:
            raise CompressorError(f"SpeCache(bits={self.bits}, value_group={c}) does not divide head_dim {d} into bytes.")
        return c

    def summarize(self, k, v, previous: LowBitCopy | None) -> LowBitCopy:
        b, h, n, d = k.shape
        shape = (b, h, n // self.group_size, self.group_size, d)
        kc, ks, kz = quant_ref.quantize_keys(k.reshape(shape), self.bits)
        vc, vs, vz = quant_ref.quantize_values(v.reshape(shape), self.bits, self._channels(d))
        new = LowBitCopy(kc, ks, kz, vc, vs, vz)
        if previous is None:
            return new
        return LowBitCopy(*(torch.cat([a, c], dim=2) for a, c in zip(previous.tensors(), new.tensors())))

    def summary_tensors(self, summary: LowBitCopy | None) -> list[torch.Tensor]:
        return [] if summary is None else summary.tensors()

    def _path(self, q: torch.Tensor, s: LowBitCopy) -> str:
        """Which kernels this step runs: ``"native"`` (the C kernels: float32 on the CPU), ``"triton"`` (CUDA,
        2, 4 or 8 bits) or ``"torch"`` (dequantize, then attend)."""
        if cpu_native.supports(q, s.value_scale, self.bits, s.key_scale):
            return "native"
        if kernels.backend_for(q) == "triton" and self.bits in quant_ref.BITS:
            return "triton"
        return "torch"

    def score(self, state: RetrievalState, qg: torch.Tensor, scaling: float) -> torch.Tensor:
        # qg: [B, H, G, D] -> [B, H, L] over the low-bit keys, read packed by the fused kernels; the native and
        # torch paths keep the scaled logits [B, H, G, L] for this step's attention.
        s, q = state.summary, qg.reshape(qg.shape[0], -1, 1, qg.shape[-1])
        path = self._path(q, s)
        if path == "triton":
            state.scratch = None
            return kernels.quant_key_scores(q, s.key_codes, s.key_scale, s.key_zero, self.bits, scaling, "max")
        if path == "native":
            logits = cpu_native.quant_key_logits(q, s.key_codes, s.key_scale, s.key_zero, self.bits, scaling)
        else:
            cdt = torch.promote_types(qg.dtype, torch.float32)
            keys = quant_ref.dequantize_keys(s.key_codes, s.key_scale, s.key_zero, self.bits, cdt).flatten(2, 3)
            logits = torch.matmul(qg.to(cdt), keys.transpose(-1, -2)) * scaling  # [B, H, G, L]
        state.scratch = logits
        return logits.amax(2)

    def attend_decode(self, state, q, ctx, keys, values, positions, units, complete=False):
        """One softmax over the full-precision tokens (sinks, fetched, window) and the low-bit copies of the
        others: the fused quantized-attention kernel (C on the CPU, reusing this step's scoring logits; Triton on
        CUDA) with the full-precision tokens as its residual, or torch, which dequantizes the values once."""
        b, h = keys.shape[:2]
        s, logits_low = state.summary, state.scratch
        state.scratch = None
        if s is None:
            return super().attend_decode(state, q, ctx, keys, values, positions, units, complete)
        n_low = s.key_codes.shape[2] * s.key_codes.shape[3]
        spec, path = ctx.spec, self._path(q, s)
        # Fetched tokens replace their low-bit copies: their low-bit positions become empty slots (SENTINEL,
        # never visible under kvcomp.ops.visible); -1 units go to a spare slot. int32 for the native kernel.
        dtype = torch.int32 if path == "native" else torch.long
        low_pos = torch.empty(b, h, n_low + 1, dtype=dtype, device=q.device)
        low_pos[..., :n_low] = torch.arange(state.start_pos + state.n_sink, state.start_pos + state.boundary,
                                            dtype=dtype, device=q.device)
        low_pos = low_pos.scatter_(2, units.masked_fill(units < 0, n_low), SENTINEL)[..., :n_low]
        k_fp = torch.cat([state.sink_k, keys, state.recent_k], dim=2)
        v_fp = torch.cat([state.sink_v, values, state.recent_v], dim=2)
        pos_fp = torch.cat([self._positions(state, 0, state.n_sink, q), positions,
                            self._positions(state, state.boundary, state.length, q)], dim=2)
        if path != "torch":
            fused = cpu_native.quant_attention if path == "native" else kernels.quant_attention
            extra = {"key_logits": logits_low} if path == "native" else {}
            return fused(
                q, ctx.query_positions, s.key_codes, s.key_scale, s.key_zero, s.value_codes, s.value_scale,
                s.value_zero, low_pos.reshape(s.key_codes.shape[:4]), k_fp, v_fp, pos_fp, self.bits, ctx.scaling,
                sentinel=SENTINEL, window=spec.window, softcap=spec.softcap, sinks=spec.sinks, **extra,
            ).to(q.dtype)
        hq, d = q.shape[1], q.shape[-1]
        qg = q.reshape(b, h, hq // h, d)
        if logits_low is None:  # nothing was scored this step (no unit fits the budget)
            self.score(state, qg, ctx.scaling)
            logits_low, state.scratch = state.scratch, None
        cdt = torch.promote_types(q.dtype, torch.float32)
        logits_fp = torch.matmul(qg.to(cdt), k_fp.to(cdt).transpose(-1, -2)) * ctx.scaling  # [B, H, G, F]
        logits = softcap(torch.cat([logits_low, logits_fp], dim=-1), spec.softcap)
        pos = torch.cat([low_pos, pos_fp], dim=-1).unsqueeze(2)
        hidden = ~visible(ctx.query_positions.view(b, 1, 1, 1), pos, spec.window).expand_as(logits)
        probs = softmax(logits.masked_fill(hidden, float("-inf")), spec.grouped_sinks(h, 1, q.device))
        v_low = quant_ref.dequantize_values(s.value_codes, s.value_scale, s.value_zero, self.bits, cdt).flatten(2, 3)
        out = torch.matmul(probs[..., :n_low], v_low) + torch.matmul(probs[..., n_low:], v_fp.to(cdt))
        return out.reshape(b, hq, 1, d).to(q.dtype)
