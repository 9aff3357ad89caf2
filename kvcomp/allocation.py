"""Wrappers around any token-selection scorer: budget allocators and decode-time eviction share this base.

:class:`ScorerWrapper` holds an inner selection method (``scorer``: a registered name or a
:class:`~kvcomp.selection.TokenSelection` instance) and delegates the scoring hooks to it (``score``,
``decode_score``, ``prefill_stats``, ``prefill_extra``, ``observe``, ``attend``), while the wrapper's own budget
(``compression_ratio`` / ``budget``) and its :meth:`layer_budget` / :meth:`select` decide how many tokens each
layer and head keeps. Wrappers nest: ``AdaKV(scorer=CriticalKV(scorer="expected_attention"))`` is CriticalAdaKV,
``AdaKV(scorer=PyramidKV(...))`` keeps PyramidKV's layer budgets with AdaKV's head allocation, and
``DecodeEvict(scorer=AdaKV(...))`` keeps it at a target size while decoding. The inner method gets the wrapper's
budget (its own ``compression_ratio`` is replaced), and the wrapper's capabilities are the inner one's.

:func:`adaptive_keep` is AdaKV's allocation (one top-k over all KV heads of a row, a per-head floor), used by
:class:`compressors.adakv.AdaKV` and by KVzip's layer-level threshold.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcomp.compressor import Capabilities, CompressorError
from kvcomp.selection import TokenSelection


def resolve_scorer(scorer, owner) -> TokenSelection:
    """The inner selection of a wrapper, carrying the wrapper's budget."""
    from kvcomp.registry import create, get

    if isinstance(scorer, str):
        try:
            cls = get(scorer)
        except CompressorError as err:
            raise CompressorError(f"{type(owner).__name__}: scorer must be a registered token-selection method; "
                                  f"{err}") from None
        if not issubclass(cls, TokenSelection):
            raise CompressorError(f"{type(owner).__name__}: scorer must be a token-selection method (e.g. "
                                  f"'expected_attention', 'knorm', 'tova'); got {scorer!r}, which keeps or encodes "
                                  "every token.")
        if getattr(cls, "whole_model_scorer", False):
            raise CompressorError(f"{type(owner).__name__}: scorer must be a layer-by-layer scorer; got {scorer!r}, which "
                                  "scores with extra forward passes of the whole model and allocates its own budgets "
                                  "(use it on its own).")
        inner = create(scorer)
    elif isinstance(scorer, TokenSelection) and not getattr(scorer, "whole_model_scorer", False):
        inner = scorer
    else:
        raise CompressorError(f"{type(owner).__name__}: scorer must be a registered token-selection name or a "
                              f"TokenSelection instance; got {scorer!r}.")
    return dataclasses.replace(inner, compression_ratio=owner.compression_ratio, budget=owner.budget)


def _overrides(obj, name: str) -> bool:
    return getattr(type(obj), name) is not getattr(TokenSelection, name)


@dataclass
class ScorerWrapper(TokenSelection):
    """Base of methods that wrap a scorer (see the module docstring)."""

    scorer: str = "expected_attention"  # a registered name, or (from Python) a TokenSelection instance

    capabilities: ClassVar[Capabilities] = Capabilities()

    def __post_init__(self) -> None:
        super().__post_init__()
        self.inner = resolve_scorer(self.scorer, self)
        self.capabilities = self.wrapped_capabilities(self.inner.capabilities)
        self.evict_after_attention = self.inner.evict_after_attention
        self.transient_scores = self.inner.transient_scores
        if self.inner.sliding_layers != "compress":
            self.sliding_layers = self.inner.sliding_layers

    def wrapped_capabilities(self, inner: Capabilities) -> Capabilities:
        return dataclasses.replace(inner, lossy=True)

    def params(self):
        params = super().params()
        params["scorer"] = self.scorer if isinstance(self.scorer, str) else {
            "name": _name(self.inner), **{k: v for k, v in self.inner.params().items()
                                          if k not in ("compression_ratio", "budget")}}
        return params

    # -- delegated to the scorer ------------------------------------------------------------------------
    def bind(self, model) -> None:
        self.inner.bind(model)

    def enable_decode_scoring(self) -> None:
        self.inner.enable_decode_scoring()

    def score(self, q, k, v, ctx):
        return self.inner.score(q, k, v, ctx)

    def decode_score(self, store, ctx):
        return self.inner.decode_score(store, ctx)

    def prefill_stats(self, q, k, v, ctx):
        return self.inner.prefill_stats(q, k, v, ctx)

    def prefill_extra(self, q, ctx):
        return self.inner.prefill_extra(q, ctx)

    def prefill_score(self, store, q, k, v, ctx, budget):
        return self.inner.prefill_score(store, q, k, v, ctx, budget)

    def observe(self, layer, state, weights, ctx):
        self.inner.observe(layer, state, weights, ctx)

    def attend(self, layer, state, q, ctx):
        return self.inner.attend(layer, state, q, ctx)

    def has_decode_score(self) -> bool:
        inner = self.inner
        return inner.has_decode_score() if isinstance(inner, ScorerWrapper) else _overrides(inner, "decode_score")

    # -- budgets: an inner wrapper's layer budgets (PyramidKV) and allocation stay unless this one has its own ---
    def layer_budget(self, seen, ctx):
        return self.inner.layer_budget(seen, ctx) if isinstance(self.inner, ScorerWrapper) else self.kept_tokens(seen)

    def select(self, store, scores, budget, ctx):
        if isinstance(self.inner, ScorerWrapper):
            return self.inner.select(store, scores, budget, ctx)
        return super().select(store, scores, budget, ctx)

    def over_budget(self, stored, budget) -> bool:
        if isinstance(self.inner, ScorerWrapper):
            return self.inner.over_budget(stored, budget)
        return super().over_budget(stored, budget)


def _name(compressor) -> str:
    from kvcomp.registry import name_of

    return name_of(compressor)


def adaptive_keep(scores: torch.Tensor, valid: torch.Tensor, budget: torch.Tensor, floor: float) -> torch.Tensor:
    """AdaKV's allocation: ``[B, H, L]`` bool, ``H * budget[b]`` tokens per row chosen by one top-k over every
    head of the row, after each head's ``floor(floor * budget[b])`` best tokens (its guaranteed minimum)."""
    b, h, length = scores.shape
    s = scores.float().masked_fill(~valid, float("-inf"))
    guaranteed = torch.tensor([math.floor(floor * int(n) + 1e-6) for n in budget.tolist()], device=s.device)
    width = int(guaranteed.max().clamp(max=length)) if guaranteed.numel() else 0
    keep = torch.zeros_like(valid)
    if width:
        top = s.topk(width, dim=-1)
        first = (torch.arange(width, device=s.device).view(1, 1, -1) < guaranteed.view(-1, 1, 1)) & (top.values > float("-inf"))
        keep.scatter_(2, top.indices, first)
    ranked = s.masked_fill(keep, float("inf")).view(b, h * length)
    total = (budget * h).clamp(max=valid.view(b, -1).sum(-1))
    width = int(total.max()) if total.numel() else 0
    if width:
        top = ranked.topk(width, dim=-1)
        chosen = (torch.arange(width, device=s.device).view(1, -1) < total.view(-1, 1)) & (top.values > float("-inf"))
        flat = torch.zeros(b, h * length, dtype=torch.bool, device=s.device)
        flat.scatter_(1, top.indices, chosen)
        keep = flat.view(b, h, length)
    return keep & valid
