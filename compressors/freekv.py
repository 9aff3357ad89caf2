"""FreeKV: offloaded KV with Quest-style page digests, speculative retrieval and a correction.

Liu et al., "FreeKV: Boosting KV Cache Retrieval for Efficient LLM Inference", 2025,
https://arxiv.org/abs/2505.13109; page digests and their upper bound from Tang et al., "Quest: Query-Aware
Sparsity for Efficient Long-Context LLM Inference", ICML 2024, https://arxiv.org/abs/2406.10774

The full KV lives in a slower tier (see :mod:`kvcomp.retrieval` for the tiers, the sinks and recent window,
the budget and the speculative prefetch with its cosine correction). Resident summary: per page of
``page_size`` tokens, the per-channel minimum and maximum of the keys, ``key_min``/``key_max``
``[B, H_kv, P, D]`` in the model dtype — ``2 * D * itemsize`` bytes per page and KV head, 1/``page_size``
of the keys. A page's score for query ``q`` is Quest's upper bound of ``q . k`` over its keys,
``sum_d max(q_d * min_d, q_d * max_d)``, maximized over the KV head's query group
(:func:`kvcomp.kernels.page_scores`: C on the CPU, Triton on CUDA); each step the top-k pages per KV head are
fetched whole and attention runs over sinks + fetched pages + recent window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp import kernels, validation
from kvcomp.retrieval import Retrieval, RetrievalState


@dataclass
class PageDigest:
    key_min: torch.Tensor  # [B, H_kv, P, D]
    key_max: torch.Tensor


@dataclass
class FreeKV(Retrieval):
    page_size: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.positive_int("page_size", self.page_size, owner=self, hint=" (tokens per page)")

    @property
    def chunk(self) -> int:  # pages are summarized whole
        return self.page_size

    @property
    def unit(self) -> int:  # and fetched whole
        return self.page_size

    def summarize(self, k, v, previous: PageDigest | None) -> PageDigest:
        b, h, n, d = k.shape
        pages = k.reshape(b, h, n // self.page_size, self.page_size, d)
        key_min, key_max = pages.amin(3), pages.amax(3)
        if previous is not None:
            key_min = torch.cat([previous.key_min, key_min], dim=2)
            key_max = torch.cat([previous.key_max, key_max], dim=2)
        return PageDigest(key_min, key_max)

    def summary_tensors(self, summary: PageDigest | None) -> list[torch.Tensor]:
        return [] if summary is None else [summary.key_min, summary.key_max]

    def score(self, state: RetrievalState, qg: torch.Tensor, scaling: float) -> torch.Tensor:
        # qg: [B, H, G, D]; digests [B, H, P, D] -> [B, H, P] float32: Quest's bound, maximized over the group
        b, h, g, d = qg.shape
        digest = state.summary
        return kernels.page_scores(qg.reshape(b, h * g, 1, d), digest.key_max, digest.key_min, "max")
