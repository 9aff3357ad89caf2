"""Speculative decoding's token rules, shared by every drafter: how a token is chosen from logits, and which
drafted tokens a verification accepts.

* :class:`Sampling`: temperature, top-k, top-p, applied identically to draft and target distributions;
* :func:`choose`: the next token from logits (greedy, or a draw), with the draft distribution when sampling;
* :func:`accept`: given the target's logits after each drafted token, the accepted prefix length per row and the
  token the target emits after it: greedy (the longest prefix equal to the target's argmax, plus its next
  token) or the standard rejection rule (:func:`speculative_sample`), which keeps the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvcomp import validation


@dataclass
class Sampling:
    """Temperature, then top-k, then top-p (transformers' order), applied identically to draft and target."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        validation.finite_float("temperature", self.temperature, 0.0, low_open=True, owner=self,
                                hint=" (use greedy decoding for 0)")
        validation.non_negative_int("top_k", self.top_k, high=None, owner=self, hint=" (0: no top-k)")
        validation.fraction("top_p", self.top_p, low_open=True, owner=self)
        validation.non_negative_int("seed", self.seed, high=2**63 - 1, owner=self)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits -> probabilities (float64, so p/q ratios are not rounding noise)."""
        if self.top_k and self.top_k < logits.shape[-1]:
            # Only the top k can survive: warp those and scatter them back (a few passes over V, not ten).
            top, index = logits.topk(self.top_k, dim=-1)
            top = top.to(torch.float64) / self.temperature
            if self.top_p < 1.0:
                top_probs = top.softmax(-1)  # sorted descending already
                top = top.masked_fill((top_probs.cumsum(-1) - top_probs) >= self.top_p, float("-inf"))
            out = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
            return out.scatter_(-1, index, top.softmax(-1))
        logits = logits.to(torch.float64) / self.temperature
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (sorted_probs.cumsum(-1) - sorted_probs) >= self.top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits.softmax(-1)


def choose(
    scores: torch.Tensor, sampling: Sampling | None, gen: torch.Generator | None
) -> tuple[torch.Tensor, Any]:
    """Next token per row from ``[B, V]`` logits, and the draft distribution (sampling) or None."""
    if sampling is None:
        return scores.argmax(-1), None
    probs = sampling.probs(scores)
    return draw(probs, gen), probs


def accept(logits: torch.Tensor, drafts: torch.Tensor, sampling: Sampling | None, q_probs: list[torch.Tensor],
           gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted drafted tokens ``[B]`` and the token each row emits after them ``[B]``, from the target's logits
    ``[B, gamma + 1, V]`` (after the token before the drafts, then after each draft) and ``drafts`` ``[B, gamma]``."""
    gamma = drafts.shape[1]
    if sampling is None:
        target = logits.argmax(-1)  # [B, gamma + 1]
        accepted = (drafts == target[:, :gamma]).long().cumprod(dim=1).sum(1)
        return accepted, target.gather(1, accepted.view(-1, 1)).squeeze(1)
    return speculative_sample(sampling.probs(logits), q_probs, drafts, gen)


def speculative_sample(
    p: torch.Tensor, q_probs: list[torch.Tensor], drafts: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard rule (Leviathan et al., 2023; Chen et al., 2023), per row.

    p: ``[B, gamma + 1, V]`` target probabilities; q_probs: gamma ``[B, V]`` draft probabilities; drafts:
    ``[B, gamma]``. Returns accepted counts ``[B]`` and the token each row emits after its accepted prefix.
    """
    batch, n, _ = p.shape
    gamma = n - 1
    if gamma == 0:
        return torch.zeros(batch, dtype=torch.long, device=p.device), draw(p[:, 0], gen)
    q = torch.stack(q_probs, dim=1)  # [B, gamma, V]
    p_d = p[:, :gamma].gather(2, drafts.unsqueeze(-1)).squeeze(-1)
    q_d = q.gather(2, drafts.unsqueeze(-1)).squeeze(-1)
    r = torch.rand(batch, gamma, generator=gen, device=p.device, dtype=p.dtype)
    ok = r * q_d < p_d  # r < p/q, without dividing
    accepted = ok.long().cumprod(dim=1).sum(1)
    at = accepted.clamp(max=gamma - 1).view(-1, 1, 1).expand(-1, 1, p.shape[-1])
    residual = (p[:, :gamma].gather(1, at) - q.gather(1, at)).clamp(min=0).squeeze(1)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-300), p[:, :gamma].gather(1, at).squeeze(1))
    dist = torch.where((accepted == gamma).view(-1, 1), p[:, gamma], residual)
    return accepted, draw(dist, gen)


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``[B, V]`` probabilities (inverse CDF; torch.multinomial is ~50x slower in float64)."""
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=gen, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)
