"""InertiaKV: decode-time eviction by a moving average of any scorer's scores, refreshed fully, lazily or once.

InertiaKV (arXiv 2609.03515). Scores change little from one decode step to the next, so eviction can follow
their exponential moving average ``a <- beta * a + (1 - beta) * s`` (``s``: the scorer's decode-time score of the
stored tokens; a token entering the cache starts at its first score) instead of the latest score alone, and
need not re-score at every step:

* ``mode="refresh"``: re-score and update the average at every step (the full-refresh reference);
* ``mode="lazy"`` (InertiaKV-Lazy): re-score every ``refresh`` steps; in between, tokens that arrived since the
  last refresh are kept and the others are evicted by their last average;
* ``mode="score_free"``: score the whole cache once, at the first decode step, and freeze that order: the best
  ``target - window`` tokens are kept for the rest of the generation (they never change), and the remaining
  slots hold the newest ``window`` (and, as the budget grows, more) tokens.

The average lives with the layer (``store.aux``, 4 bytes per stored token, in its bytes); the step counter and
the frozen flag in ``store.extra``. Budgets as in :class:`compressors.decode_evict.DecodeEvict`
(``target_size`` or the compression ratio; allocators as scorer keep their head-wise allocation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compressors.decode_evict import DecodeEvict
from kvcomp import host, validation
from kvcomp.compressor import CompressorError
from kvcomp.ragged import RaggedStore


@dataclass
class InertiaKV(DecodeEvict):
    interval: int = 1  # the average decides at every step which token goes (it is cheap between refreshes)
    beta: float = 0.9
    mode: str = "lazy"
    refresh: int = 16
    window: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.fraction("beta", self.beta, high_open=True, owner=self, hint=" (weight of the past in the average)")
        validation.choice("mode", self.mode, ("refresh", "lazy", "score_free"), owner=self)
        validation.positive_int("refresh", self.refresh, owner=self, hint=" (decode steps between re-scorings)")
        validation.non_negative_int("window", self.window, owner=self, hint=" (recent slots in score_free mode)")
        if not self.has_decode_score():
            raise CompressorError(f"InertiaKV averages decode-time scores; {type(self.inner).__name__} has none "
                                  "(use decode_evict, which ranks by its prefill scores).")
        self.keeps_prefill_scores = False

    def _average(self, view, ctx) -> torch.Tensor:
        current = self.decode_score(view, ctx).float()
        old = view.aux
        return torch.where(torch.isnan(old), current, self.beta * old + (1 - self.beta) * current)

    def evict(self, store, ctx):
        extra = dict(store.extra or {})
        step = host.values(extra["inertia_step"])[0] if "inertia_step" in extra else 0
        extra["inertia_step"] = host.tensor([step + 1], "cpu")  # known on the host: read only after a clone
        budget = self.decode_budget(ctx)
        view = store.padded()
        view = view.replace(extra=extra)  # a new store object: the state given (and any snapshot of it) is untouched
        # ...but it shows the same tensors: one that append() just built (no snapshot shows it) still evicts
        # in place (selection.drop_lowest), not by a copy of the whole layer per step.
        view._owned = view.keys is store.keys and getattr(store, "_owned", False)
        if view.aux is None:
            view.aux = torch.full(view.positions.shape, float("nan"), device=view.positions.device)
        if self.mode == "score_free":
            if "inertia_frozen" not in extra:  # the one scoring: the best target - window tokens are frozen
                extra["inertia_frozen"] = torch.ones(1, dtype=torch.bool)
                frozen = self.select(view, self.decode_score(view, ctx), host.clamp(host.offset(budget, -self.window), 0),
                                     ctx)
                view.aux = torch.where(kept_slots(view, frozen), float("inf"), float("nan"))
            order = torch.where(view.aux == float("inf"), float("inf"), view.positions.float())
        elif self.mode == "refresh" or step % self.refresh == 0:
            view.aux = self._average(view, ctx)
            order = view.aux
        else:
            order = torch.where(torch.isnan(view.aux), float("inf"), view.aux)  # not scored yet: kept until then
        if self.over_budget(view.stored_tokens(), host.offset(budget, self.interval - 1)):
            return self.select(view, order, budget, ctx)
        return RaggedStore.from_dense(view) if isinstance(store, RaggedStore) else view


def kept_slots(view, kept) -> torch.Tensor:
    """``[B, H, L]`` bool: the slots of ``view`` whose token ``kept`` (a selection from it) holds; positions are
    unique and sorted in each row and KV head, so one batched search finds them."""
    kept_positions = kept.padded().positions.contiguous()
    if kept_positions.shape[-1] == 0:
        return torch.zeros_like(view.valid)
    at = torch.searchsorted(kept_positions, view.positions.contiguous()).clamp(max=kept_positions.shape[-1] - 1)
    return (kept_positions.gather(2, at) == view.positions) & view.valid
