"""DuoAttention-style heads: streaming heads keep sinks and a recent window, retrieval heads their selection.

Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads", ICLR 2025,
https://arxiv.org/abs/2410.10819

The head pattern comes from a calibration artifact made with kvcomp's own synthetic passkey prompts
(:mod:`kvcomp.head_calibration`, ``kvcomp calibrate heads``; versioned, checked against the model): the
``streaming_fraction`` of all KV heads whose attention output changes least when restricted to the first
``n_sink`` and the last ``recent`` tokens become streaming heads (``heads="alternating"`` makes every other head
streaming, a calibration-free ablation). A layer keeps ``H_kv * kept_tokens(n)`` tokens per row: the streaming
heads' sinks and window, and the rest shared equally by its retrieval heads, chosen by ``scorer``. Heads keep
different counts, stored ragged (:class:`kvcomp.ragged.RaggedStore`); while decoding, streaming heads slide
their window (bounded), retrieval heads keep growing unless the scorer evicts while decoding (or a
``decode_evict`` wrapper does). kvpress's DuoAttentionPress masks keys and frees no memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcomp import head_calibration, validation
from kvcomp.allocation import ScorerWrapper
from kvcomp.compressor import Capabilities, CompressorError
from kvcomp.ragged import RaggedStore


@dataclass
class DuoAttention(ScorerWrapper):
    streaming_fraction: float = 0.5
    n_sink: int = 4
    recent: int = 64
    heads: str = "calibrated"
    artifact: str | None = None  # None: the model's default path (kvcomp.head_calibration)

    capabilities: ClassVar[Capabilities] = Capabilities(decode_time=True, needs_calibration=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.fraction("streaming_fraction", self.streaming_fraction, owner=self,
                            hint=" (share of KV heads made streaming heads)")
        validation.non_negative_int("n_sink", self.n_sink, owner=self)
        validation.positive_int("recent", self.recent, owner=self, hint=" (window of the streaming heads)")
        validation.choice("heads", self.heads, ("calibrated", "alternating"), owner=self)
        validation.path_or_none("artifact", self.artifact, owner=self)
        self._streaming: torch.Tensor | None = None  # [L, H_kv] bool
        self._streaming_rows: list[list[bool]] | None = None  # the same on the host
        self._pattern: head_calibration.HeadPattern | None = None

    def wrapped_capabilities(self, inner):
        return dataclasses.replace(inner, lossy=True, decode_time=True, needs_calibration=self.heads == "calibrated")

    def params(self):
        return {**super().params(), "calibration": self._pattern.digest if self._pattern else None}

    def bind(self, model) -> None:
        super().bind(model)
        self._streaming_rows = None
        config = model.config.get_text_config(decoder=True)
        n_layers = config.num_hidden_layers
        n_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if self.heads == "alternating":
            self._streaming = (torch.arange(n_layers * n_heads) % 2 == 0).view(n_layers, n_heads)
            return
        path = self.artifact or head_calibration.default_artifact_path(model)
        if self.artifact is None and not path.is_file() and self.budget is None and self.compression_ratio == 0:
            self._streaming = torch.zeros(n_layers, n_heads, dtype=torch.bool)  # nothing is evicted at ratio 0
            return
        self._pattern = head_calibration.load_artifact(path)
        self._pattern.check_model(model)
        self._streaming = self._pattern.streaming(self.streaming_fraction)

    def _streaming_heads(self, layer: int | slice, device) -> torch.Tensor:
        if self._streaming is None:
            raise CompressorError("DuoAttention reads its head pattern in bind(); use it through CompressedCache.")
        return self._streaming[layer].to(device)

    def _streaming_list(self, layer: int) -> list[bool]:
        """The layer's streaming heads on the host (read once per pattern)."""
        if self._streaming_rows is None:
            self._streaming_rows = self._streaming_heads(slice(None), "cpu").tolist()
        return self._streaming_rows[layer]

    def _window(self, positions, next_pos):
        return (positions >= (next_pos - self.recent).view(-1, *[1] * (positions.dim() - 1))) | (positions < self.n_sink)

    def select(self, store, scores, budget, ctx):
        stream = self._streaming_heads(ctx.layer, scores.device).view(1, -1, 1)  # [1, H_kv, 1]
        valid = store.valid
        b, h, _ = valid.shape
        stream_keep = valid & stream & self._window(store.positions.long(), ctx.next_positions())
        n_retrieval = int((~stream).sum())
        keep = stream_keep
        if n_retrieval:
            share = ((budget * h - stream_keep.sum((1, 2))) // n_retrieval).clamp(min=0)  # [B] per retrieval head
            width = int(share.max().clamp(max=scores.shape[-1]))
            if width:
                ranked = scores.float().masked_fill(~valid, float("-inf")).topk(width, dim=-1)
                chosen = (torch.arange(width, device=scores.device).view(1, 1, -1) < share.view(-1, 1, 1))
                chosen = chosen & (ranked.values > float("-inf"))
                picked = torch.zeros_like(valid).scatter(2, ranked.indices, chosen)
                keep = keep | (picked & ~stream)
        return RaggedStore.from_dense(store, keep)

    def over_budget(self, stored, budget) -> bool:
        return bool((stored.sum(1) > budget * stored.shape[1]).any())

    def evict(self, store, ctx):
        # Retrieval heads are evicted while decoding only when the scorer does so; streaming heads slide below.
        return super().evict(store, ctx) if self.inner.capabilities.decode_time else store

    def after_attend(self, layer, state, ctx):
        state = super().after_attend(layer, state, ctx)
        if not isinstance(state, RaggedStore):
            return state  # nothing was evicted (ratio 0): no head streams
        # A streaming head's segment is in position order (sinks, then the window), so the tokens that left the
        # window are one span after the sinks: the first one out and how many (one read per layer for all).
        h = state.shape[1]
        streaming = self._streaming_list(layer)
        next_positions = ctx.next_positions()
        segments, found = [], []
        layout = state.layout()
        for s, (start, count) in enumerate(zip(layout.starts, layout.lengths)):
            if streaming[s % h] and count:
                out = ~self._window(state.positions[start:start + count].long(), next_positions[s // h])
                segments.append(s)
                found += [out.to(torch.int64).argmax(), out.sum()]
        if not segments:
            return state
        spans = torch.stack(found).view(-1, 2).tolist()
        return state.drop_spans({s: (first, n_out) for s, (first, n_out) in zip(segments, spans)})
