"""Confidence columns of ``kvcomp report``: an interval for every score, and paired tests of every
configuration against the uncompressed run and against the best other method on the same samples.

Runs are compared within one group: the same source (kvcomp, or kvpress's evaluation layout), model, task,
length and mode. Within a group:

* ``score_ci_low/high``, ``exact_match_ci_low/high``: bootstrap intervals of the mean over the run's samples
  (:func:`experiments.stats.bootstrap_ci`);
* ``vs_none_*``: against the group's uncompressed run (``compressor == "none"``);
* ``vs_best_*``: against ``best_other``, the best-scoring run of another method (another label, not the
  uncompressed run; any ratio), and for the best run itself the runner-up;

each on the samples both runs have (matched by sample id; ``*_n`` says how many): ``*_diff`` the mean score
difference (this run minus the other) with its paired bootstrap interval, ``*_p`` the exact sign test's
p-value, ``*_significant`` whether ``p < 0.05`` (:func:`experiments.stats.paired_test`).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from experiments.stats import CONFIDENCE, paired_test

GROUP = ["source", "model", "task", "length", "mode"]
CI_COLUMNS = [
    "score_ci_low", "score_ci_high", "exact_match_ci_low", "exact_match_ci_high",
    "vs_none_n", "vs_none_diff", "vs_none_ci_low", "vs_none_ci_high", "vs_none_p", "vs_none_significant",
    "best_other", "vs_best_n", "vs_best_diff", "vs_best_ci_low", "vs_best_ci_high", "vs_best_p",
    "vs_best_significant",
]  # fmt: skip


def _compare(prefix: str, mine: dict[str, dict], theirs: dict[str, dict]) -> dict[str, Any]:
    ids = [i for i in mine if i in theirs and mine[i]["score"] is not None and theirs[i]["score"] is not None]
    if not ids:
        return {f"{prefix}_n": 0}
    c = paired_test([mine[i]["score"] for i in ids], [theirs[i]["score"] for i in ids])
    return {f"{prefix}_n": c.n, f"{prefix}_diff": c.diff, f"{prefix}_ci_low": c.ci_low,
            f"{prefix}_ci_high": c.ci_high, f"{prefix}_p": c.p_value, f"{prefix}_significant": c.significant}


def add_confidence(df: pd.DataFrame, samples: list[dict[str, dict]]) -> pd.DataFrame:
    """``df`` (one row per run, :func:`experiments.report.collect`) with :data:`CI_COLUMNS` added;
    ``samples[i]``: the per-sample ``{"score", "exact_match"}`` of row ``i`` (position), keyed by sample id."""
    from experiments.stats import bootstrap_ci

    df = df.reset_index(drop=True)
    rows: list[dict[str, Any]] = [{} for _ in range(len(df))]
    for i, per_sample in enumerate(samples):
        scores = [s["score"] for s in per_sample.values()]
        exact = [float(s["exact_match"]) for s in per_sample.values() if s.get("exact_match") is not None]
        rows[i]["score_ci_low"], rows[i]["score_ci_high"] = bootstrap_ci(scores)
        rows[i]["exact_match_ci_low"], rows[i]["exact_match_ci_high"] = bootstrap_ci(exact)
    keys = df[GROUP].apply(lambda row: "|".join(map(str, row)), axis=1)  # astype(str) keeps NaN in pandas 3
    for _, members in df.groupby(keys, sort=False):
        idx = list(members.index)
        none = [i for i in idx if df.at[i, "compressor"] == "none"]
        ranked = sorted((i for i in idx if df.at[i, "compressor"] != "none"),
                        key=lambda i: (-_score(df.at[i, "score"]), str(df.at[i, "label"]), i))
        for i in idx:
            if none and i not in none:
                rows[i].update(_compare("vs_none", samples[i], samples[none[0]]))
            others = [j for j in ranked if df.at[j, "label"] != df.at[i, "label"]]
            if others:
                best = others[0]
                rows[i]["best_other"] = _describe(df.loc[best])
                rows[i].update(_compare("vs_best", samples[i], samples[best]))
    extra = pd.DataFrame(rows, columns=CI_COLUMNS, index=df.index)
    return pd.concat([df.drop(columns=[c for c in CI_COLUMNS if c in df]), extra], axis=1)


def _score(v) -> float:
    return -math.inf if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _describe(row) -> str:
    ratio = row["compression_ratio"]
    ratio = f" {ratio:g}" if isinstance(ratio, (int, float)) and not math.isnan(ratio) else ""
    return f"{row['compressor']}{ratio}"


def significance_mark(significant, p) -> str:
    """'' when there is nothing to compare, '*' when significant at 95%, ' n.s.' otherwise."""
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return ""
    return "*" if bool(significant) else " n.s."


LEGEND = (
    f"Intervals: {CONFIDENCE:.0%} percentile bootstrap over samples (10,000 resamples, seed 0). "
    "'vs none' and 'vs best other' are paired on the same samples: mean score difference, then the exact "
    "sign test's p-value; * = significant at 95%, n.s. = not significant (no correction for multiple "
    "comparisons)."
)
