"""PyramidKV: budgets that fall linearly with depth, the same total as a uniform budget.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", 2024,
https://arxiv.org/abs/2406.02069

Wraps any scorer. With ``c = window + kept`` (``kept``: the uniform budget of ``compression_ratio`` or
``budget``) the first layer keeps ``max = 2 (c - window) - min`` and the last ``min = (c - window) / beta``
tokens per KV head, linearly in between, so the layers keep as much in total as the uniform budget; when
that pyramid does not fit the prompt it falls back to the uniform budget (kvpress's PyramidKVPress and
KVCache-Factory's formula). ``window`` is the observation window of the original (SnapKV's; kvpress uses 64):
with 64, a 4K prompt at ratio 0.75 fails the fit (``min < window``) and gets the uniform budget, so the
default here is 0 (the pyramid itself; the scorer keeps whatever window it protects).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcomp import host, validation
from kvcomp.allocation import ScorerWrapper


def pyramid_budget(n: int, kept: int, layer: int, n_layers: int, window: int, beta: float) -> int:
    """Tokens per KV head of ``layer`` for a prompt of ``n`` tokens and a uniform budget ``kept``."""
    capacity = window + kept
    low = (capacity - window) / beta
    high = (capacity - window) * 2 - low
    if high >= n - window:
        high = n - window
        low = (capacity - window) * 2 - high
    if n_layers < 2 or not (n >= high >= low >= window):
        return kept
    return round(high - layer * (high - low) / (n_layers - 1))


@dataclass
class PyramidKV(ScorerWrapper):
    beta: float = 20.0
    window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.finite_float("beta", self.beta, 1.0, owner=self, hint=" (pyramid steepness)")
        validation.non_negative_int("window", self.window, owner=self, hint=" (observation window of the formula)")
        self._n_layers: int | None = None

    def bind(self, model) -> None:
        super().bind(model)
        self._n_layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)

    def layer_budget(self, seen, ctx):
        kept = self.kept_tokens(seen)
        if self._n_layers is None:
            return kept
        out = [min(n, max(1, pyramid_budget(n, k, ctx.layer, self._n_layers, self.window, self.beta)))
               for n, k in zip(host.values(seen), host.values(kept))]
        return host.tensor(out, seen.device)
