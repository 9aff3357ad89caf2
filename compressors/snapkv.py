"""SnapKV: keep the tokens the last queries of the prompt attend to.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
https://arxiv.org/abs/2404.14469

The observation window is the last ``window`` queries of the compressed prompt. Their attention over the
earlier tokens is averaged over the window, smoothed by 1-D pooling along the tokens (``kernel_size``,
avg or max) so kept tokens come with their neighbours, and aggregated over each KV head's query group;
each KV head keeps its own top tokens, plus the window itself.

``window=None`` (the default) observes the question when the caller marks it (``question_length``, as
``kvcomp.generate`` does in query-aware mode) and the last 16 tokens otherwise. The window's size decides
whether SnapKV works at all on small models: a window full of context queries outvotes the question
(FINDINGS.md: kvpress's default 64 finds 0/4 needles on SmolLM2-135M where 16 finds 4/4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvcomp import validation
from kvcomp.compressor import Capabilities, CompressorError
from kvcomp.ops import attention_probs, visible
from kvcomp.selection import TokenSelection

DEFAULT_WINDOW = 16


@dataclass
class SnapKV(TokenSelection):
    window: int | None = None
    kernel_size: int = 21  # pooling width; see the module docstring
    pooling: str = "avg"
    max_window: int = 64  # cap on a question-derived window

    capabilities: ClassVar[Capabilities] = Capabilities(query_aware=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.positive_int("window", self.window, none=True, owner=self, hint=" (observed queries)")
        validation.positive_int("kernel_size", self.kernel_size, owner=self, hint=" (odd pooling width)")
        if self.kernel_size % 2 == 0:
            raise CompressorError(f"SnapKV: kernel_size must be a positive odd integer, got {self.kernel_size!r}.")
        validation.choice("pooling", self.pooling, ("avg", "max"), owner=self)
        validation.positive_int("max_window", self.max_window, owner=self, hint=" (cap on a question-derived window)")

    def observation_window(self, n: int, question_length: torch.Tensor | None, batch: int) -> torch.Tensor:
        """``[B]`` number of final queries observed in each row."""
        if self.window is not None:
            return torch.full((batch,), min(self.window, n))
        if question_length is not None:
            return question_length.clamp(1, min(self.max_window, n))
        return torch.full((batch,), min(DEFAULT_WINDOW, n))

    def score(self, q, k, v, ctx):
        # q: [B, H_q, n_q, D]; k: [B, H_kv, n, D] (n < n_q after an earlier Compose stage) -> scores [B, H_kv, n]
        b, hq, n_q, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        g = hq // hkv
        w = self.observation_window(n_q, ctx.question_length, b).to(q.device)  # [B]
        width = int(w.max())
        q_obs = q[:, :, -width:].reshape(b, hkv, g * width, d)
        q_pos = ctx.query_positions[:, -width:]
        allowed = visible(q_pos[:, None, None, :, None], ctx.positions[:, :, None, None, :], ctx.spec.window)
        allowed = allowed.expand(b, hkv, g, width, n).reshape(b, hkv, g * width, n)
        probs = attention_probs(q_obs, k, allowed, ctx.spec, ctx.spec.grouped_sinks(hkv, width, q.device))
        probs = probs.nan_to_num(0.0).view(b, hkv, g, width, n)
        observed = (torch.arange(width, device=q.device) >= (width - w).view(-1, 1)).float()  # [B, width]
        probs = probs * observed.view(b, 1, 1, width, 1)
        scores = probs.sum(dim=(2, 3)) / (g * w).view(b, 1, 1)
        pad = self.kernel_size // 2
        flat = scores.reshape(b * hkv, 1, n)
        if self.pooling == "avg":
            # Mean over the real neighbours only, so a left-padded row scores like the same prompt alone.
            real = ctx.valid.reshape(b * hkv, 1, n).float()
            total = F.avg_pool1d(flat * real, self.kernel_size, stride=1, padding=pad)
            count = F.avg_pool1d(real, self.kernel_size, stride=1, padding=pad).clamp_min(1e-9)
            scores = (total / count).view(b, hkv, n)
        else:
            scores = F.max_pool1d(flat, self.kernel_size, stride=1, padding=pad).view(b, hkv, n)
        # The observation window itself is always kept.
        in_window = ctx.positions >= (ctx.seen - w).view(-1, 1, 1)
        return scores.masked_fill(in_window & ctx.valid, float("inf"))
