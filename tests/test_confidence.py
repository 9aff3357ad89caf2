"""Confidence intervals and paired tests of `kvcomp report`, on hand-computed cases."""

import math

import numpy as np
import pandas as pd
import pytest

from experiments.confidence import add_confidence
from experiments.stats import bootstrap_ci, paired_test, sign_test


def test_bootstrap_interval_on_known_cases():
    # Ten samples, half found: the bootstrap mean is 10 x Binomial(10, 1/2), whose 2.5% and 97.5% quantiles
    # are 2 and 8 (P(X <= 1) = 11/1024 < 0.025 < P(X <= 2) = 56/1024), so the interval is [20, 80].
    assert bootstrap_ci([0] * 5 + [100] * 5) == (20.0, 80.0)
    # Two samples 0 and 100: resampled means 0, 50, 100 with probabilities 1/4, 1/2, 1/4.
    assert bootstrap_ci([0, 100]) == (0.0, 100.0)
    assert bootstrap_ci([100] * 10) == (100.0, 100.0)  # every sample the same: the point itself
    assert all(math.isnan(v) for v in bootstrap_ci([100]))  # one sample: no interval
    # Seeded: the same interval every time; it tightens with more samples.
    x = np.random.default_rng(1).uniform(0, 100, 40).tolist()
    assert bootstrap_ci(x) == bootstrap_ci(x)
    lo, hi = bootstrap_ci(x)
    lo4, hi4 = bootstrap_ci(x * 4)
    assert lo < np.mean(x) < hi and hi4 - lo4 < (hi - lo) * 0.7


def test_paired_test_on_known_cases():
    same = [100, 0, 100, 50, 0, 100, 100, 0, 100, 100]
    c = paired_test(same, same)
    assert (c.n, c.diff, c.wins, c.losses, c.ties, c.p_value, c.significant) == (10, 0.0, 0, 0, 10, 1.0, False)
    assert (c.ci_low, c.ci_high) == (0.0, 0.0)
    c = paired_test([100] * 10, [0] * 10)  # all found vs none found, n = 10: p = 2 / 2**10
    assert c.p_value == pytest.approx(2 / 1024) and c.significant and c.diff == 100.0
    assert paired_test([0] * 10, [100] * 10).p_value == pytest.approx(2 / 1024)
    # 4 samples better, 6 tied: the sign test says p = 2 / 2**4 = 0.125, not significant, although 0 lies
    # outside the bootstrap interval of the mean difference (why the decision is the exact test).
    c = paired_test([100] * 4 + [0] * 6, [0] * 10)
    assert c.p_value == pytest.approx(0.125) and not c.significant and c.ci_low > 0
    # 9 better and 1 worse: p = 2 * 11 / 1024.
    assert sign_test(9, 1) == pytest.approx(22 / 1024) and sign_test(0, 0) == 1.0
    with pytest.raises(ValueError, match="one score of each per sample"):
        paired_test([1, 2], [1])


def _runs():
    df = pd.DataFrame([
        {"source": "kvcomp", "model": "m", "task": "t", "length": 1, "mode": "query_aware", "compressor": c,
         "compression_ratio": r, "label": f"{c} (aware)", "score": s}
        for c, r, s in [("none", 0.0, 100.0), ("snapkv", 0.5, 90.0), ("h2o", 0.5, 10.0), ("snapkv", 0.75, 60.0)]
    ])  # fmt: skip
    ids = [f"s{i}" for i in range(10)]
    scores = {"none": [100] * 10, "snapkv0.5": [100] * 9 + [0], "h2o": [100] + [0] * 9,
              "snapkv0.75": [100] * 6 + [0] * 4}
    samples = [{i: {"score": v, "exact_match": v == 100} for i, v in zip(ids, scores[k])}
               for k in ("none", "snapkv0.5", "h2o", "snapkv0.75")]
    return df, samples


def test_every_run_is_compared_with_uncompressed_and_the_best_other_method():
    df, samples = _runs()
    out = add_confidence(df, samples).set_index(["compressor", "compression_ratio"])
    snap, h2o, none = out.loc[("snapkv", 0.5)], out.loc[("h2o", 0.5)], out.loc[("none", 0.0)]
    assert (snap.score_ci_low, snap.score_ci_high) == bootstrap_ci([100] * 9 + [0])
    # snapkv 0.5 vs none: 1 sample worse, p = 1.0; h2o vs none: 9 worse, 1 tied, p = 2 / 2**9.
    assert snap.vs_none_n == 10 and snap.vs_none_diff == -10 and snap.vs_none_p == 1.0
    assert not snap.vs_none_significant
    assert h2o.vs_none_p == pytest.approx(2 / 512) and h2o.vs_none_significant
    # The best other method: for h2o, snapkv 0.5 (the best run of another method); for snapkv runs, h2o
    # (the same method at another ratio does not count); for the uncompressed run, the best compressed one.
    # h2o vs snapkv 0.5: 8 samples worse, 2 tied: p = 2 / 2**8.
    assert h2o.best_other == "snapkv 0.5" and h2o.vs_best_diff == -80 and h2o.vs_best_p == pytest.approx(2 / 256)
    assert snap.best_other == "h2o 0.5" and out.loc[("snapkv", 0.75)].best_other == "h2o 0.5"
    assert none.best_other == "snapkv 0.5" and math.isnan(none.vs_none_p)
    assert (out.exact_match_ci_low.loc[("none", 0.0)], out.exact_match_ci_high.loc[("none", 0.0)]) == (1.0, 1.0)


def test_runs_are_paired_on_shared_samples_within_one_group_only():
    df, samples = _runs()
    other = df.iloc[[1]].assign(model="another")  # another model: not compared with this one's runs
    partial = {k: v for k, v in list(samples[0].items())[:4]}  # a baseline that has 4 of the 10 samples
    out = add_confidence(pd.concat([df, other]), [partial, *samples[1:], samples[1]])
    assert out.iloc[1].vs_none_n == 4  # matched by sample id
    assert math.isnan(out.iloc[4].vs_none_p) and pd.isna(out.iloc[4].best_other)


def test_markdown_marks_significance_and_plots_draw_intervals(tmp_path):
    from matplotlib.figure import Figure

    from experiments.report import _curves, to_markdown

    df, samples = _runs()
    out = add_confidence(df.assign(n=10, memory_factor=[1.0, 2.0, 2.0, 4.0]), samples)
    for col in ("exact_match_rate", "mean_first_divergence", "agreement", "kept_tokens", "context_length",
                "prefill_seconds", "decode_seconds", "budget", "dtype", "run_dir"):
        out[col] = None
    text = to_markdown(out)
    assert "95% percentile bootstrap" in text and "| score 95% CI | vs none | vs best other |" in text
    h2o_row = next(line for line in text.splitlines() if "| h2o |" in line)
    assert "-90.0 (p=0.0039)*" in h2o_row and "-80.0 vs snapkv 0.5 (p=0.0078)*" in h2o_row
    snap_row = next(line for line in text.splitlines() if "| snapkv | 0.5 |" in line)
    assert "-10.0 (p=1) n.s." in snap_row
    ax = Figure().subplots()
    _curves(ax, out, "score", {label: "C0" for label in out.label})
    assert len(ax.containers) == 3  # one set of error bars per curve (none, snapkv, h2o)
