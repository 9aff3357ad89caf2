"""How sure a score is: bootstrap confidence intervals over samples and paired tests between configurations.

* :func:`bootstrap_ci`: the percentile bootstrap interval of a mean (``scipy.stats.bootstrap``,
  :data:`N_RESAMPLES` resamples, seeded, so a report is reproducible). Percentile rather than BCa: BCa is
  undefined when every sample scores the same (common here: 10/10 needles found), the percentile interval is
  then the point itself.
* :func:`paired_test`: two configurations on the same samples. The decision is the exact two-sided sign test
  (``scipy.stats.binomtest``) over the samples where they differ: the number of samples where ``a`` beats
  ``b`` is Binomial(n_differing, 1/2) if neither is better. For 0/100 scores it is the exact McNemar test.
  It makes no assumption on the scores' distribution and is exact at 10 samples, where a bootstrap test is
  too optimistic (4 of 10 samples better and none worse is p = 0.125 here, while 0 lies outside the
  bootstrap interval of the mean difference). The paired bootstrap interval of the mean difference is
  given beside it, as the size of the effect.

Tests are not corrected for multiple comparisons: of 100 comparisons without any real difference about 5
come out significant at 95%.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

N_RESAMPLES = 10_000
CONFIDENCE = 0.95
SEED = 0


def bootstrap_ci(values: Sequence[float], *, confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES,
                 seed: int = SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values``; ``(nan, nan)`` for fewer than 2 values."""
    from scipy.stats import DegenerateDataWarning, bootstrap

    x = np.asarray([v for v in values if v is not None], dtype=float)
    if len(x) < 2:
        return math.nan, math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateDataWarning)
        result = bootstrap((x,), np.mean, n_resamples=n_resamples, confidence_level=confidence,
                           method="percentile", rng=np.random.default_rng(seed))
    low, high = result.confidence_interval
    return float(low), float(high)


@dataclass(frozen=True)
class PairedComparison:
    """``a`` against ``b`` on ``n`` paired samples: ``diff`` = mean(a - b) with its bootstrap interval,
    ``wins``/``losses``/``ties`` = samples where a > b / a < b / a == b, ``p_value`` of the exact sign test."""

    n: int
    diff: float
    ci_low: float
    ci_high: float
    wins: int
    losses: int
    ties: int
    p_value: float
    significant: bool


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test: p-value of ``wins`` against ``losses`` if each is equally likely."""
    from scipy.stats import binomtest

    if wins + losses == 0:
        return 1.0
    return float(binomtest(wins, wins + losses, 0.5).pvalue)


def paired_test(a: Sequence[float], b: Sequence[float], *, confidence: float = CONFIDENCE,
                n_resamples: int = N_RESAMPLES, seed: int = SEED) -> PairedComparison:
    """Compare two configurations' scores on the same samples (``a[i]`` and ``b[i]`` are one sample)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"paired_test needs one score of each per sample, got {len(x)} and {len(y)}.")
    d = x - y
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    p = sign_test(wins, losses)
    low, high = bootstrap_ci(d, confidence=confidence, n_resamples=n_resamples, seed=seed)
    return PairedComparison(n=len(d), diff=float(d.mean()) if len(d) else math.nan, ci_low=low, ci_high=high,
                            wins=wins, losses=losses, ties=len(d) - wins - losses, p_value=p,
                            significant=p < 1 - confidence)
