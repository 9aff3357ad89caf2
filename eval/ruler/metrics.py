"""RULER's two metrics, per sample, on a 0..100 scale.

Both are case-insensitive substring tests of each gold reference against the model's prediction:

* ``string_match_all``: the share of references found in the prediction (NIAH, VT, CWE, FWE);
* ``string_match_part``: 100 when at least one reference is found, else 0 (QA, where the references are
  alternative phrasings of one answer).

RULER averages the per-sample values over a task and rounds the mean to two decimals; :func:`score` returns
the unrounded per-sample value. Before matching, the prediction is stripped and its ASCII control
characters are turned into newlines, as RULER's evaluator does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .tasks import METRICS, STRING_MATCH_ALL, STRING_MATCH_PART, TASKS

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_prediction(prediction: str) -> str:
    """Strip the prediction and replace control characters by newlines (RULER's post-processing)."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _hits(prediction: str, outputs: Sequence[str]) -> list[bool]:
    if isinstance(outputs, str):
        raise TypeError("outputs must be a list of reference strings, not one string")
    if len(outputs) == 0:
        raise ValueError("outputs must hold at least one reference")
    pred = postprocess_prediction(prediction).lower()
    return [ref.lower() in pred for ref in outputs]


def string_match_all(prediction: str, outputs: Sequence[str]) -> float:
    """100 x the fraction of references that occur (case-insensitively) in the prediction."""
    hits = _hits(prediction, outputs)
    return 100.0 * sum(hits) / len(hits)


def string_match_part(prediction: str, outputs: Sequence[str]) -> float:
    """100 if any reference occurs (case-insensitively) in the prediction, else 0."""
    return 100.0 if any(_hits(prediction, outputs)) else 0.0


_METRIC_FNS = {STRING_MATCH_ALL: string_match_all, STRING_MATCH_PART: string_match_part}
assert set(_METRIC_FNS) == set(METRICS)


def metric_for(task_or_metric: str) -> str:
    """The metric name for a task name, or the name itself when it already is a metric."""
    if task_or_metric in _METRIC_FNS:
        return task_or_metric
    if task_or_metric in TASKS:
        return TASKS[task_or_metric].metric
    raise KeyError(
        f"unknown RULER task or metric {task_or_metric!r}; tasks: {sorted(TASKS)}; metrics: {METRICS}"
    )


def score(task_or_metric: str, prediction: str, outputs: list[str]) -> float:
    """Score one prediction against its gold answers, 0..100, with the task's RULER metric.

    ``task_or_metric`` is a task name (``"niah_single_1"``, ``"qa_2"``, ...) or a metric name
    (``"string_match_all"`` / ``"string_match_part"``).
    """
    return _METRIC_FNS[metric_for(task_or_metric)](prediction, outputs)
