"""The official LongBench metrics (``LongBench/metrics.py`` and ``LongBench/eval.py``).

Scales: the per-metric functions (``qa_f1_score`` ... ``code_sim_score``) return a score in
``[0, 1]``, as the official ones do. :func:`score_prediction` returns the per-sample score
in ``[0, 100]``; :func:`score_task` and :func:`score_by_length` return the official
reported numbers, ``round(100 * mean, 2)``.

Packages: ROUGE-L comes from ``rouge`` (the package the official eval uses; its ROUGE-L is
a summary-level LCS over sentences split at ".", case-sensitive, on whitespace tokens, which
``rouge-score`` does not reproduce), Chinese tokenization from ``jieba`` and the fuzzy
ratio of the code tasks from ``rapidfuzz``. They are imported on first use.

Faithfully reproduced quirks of the official code:

* ``rouge`` 1.0.1 reconstructs the LCS recursively; on a very long "sentence" (about a
  thousand tokens without a ".", e.g. long Chinese summaries) it raises ``RecursionError``,
  which the official bare ``except`` turns into a score of 0. We do the same.
* ``classification_score`` removes items from the list it iterates over, so a match that
  directly follows a removed one is never examined; reproduced.
* fuzzywuzzy's ``fuzz.ratio`` rounds to an integer percentage; so do we. With
  ``backend="rapidfuzz"`` (default) the ratio is the Indel/Levenshtein ratio, identical to
  fuzzywuzzy with python-Levenshtein installed and to ``thefuzz``; ``backend="difflib"``
  gives pure-python fuzzywuzzy's ``difflib.SequenceMatcher`` ratio (what the official
  ``requirements.txt`` installs without the speedup), which differs on a few percent of
  line pairs, by a point or so.
"""

from __future__ import annotations

import difflib
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .tasks import FIRST_LINE_TASKS, LENGTH_BUCKETS, METRIC_NAMES, base_task_name, length_bucket

__all__ = [
    "METRICS",
    "classification_score",
    "code_sim_score",
    "count_score",
    "first_line",
    "normalize_answer",
    "normalize_zh_answer",
    "postprocess_prediction",
    "qa_f1_score",
    "qa_f1_zh_score",
    "retrieval_score",
    "retrieval_zh_score",
    "rouge_score",
    "rouge_zh_score",
    "score_by_length",
    "score_prediction",
    "score_samples",
    "score_task",
    "token_f1",
]


def _require(module: str, pip_name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"the LongBench metrics need the {pip_name!r} package: pip install {pip_name}"
        ) from exc


def _jieba_cut(text: str) -> list[str]:
    jieba = _require("jieba", "jieba")
    return list(jieba.cut(text, cut_all=False))


# ---------------------------------------------------------------------------------------
# normalization


_EN_PUNCTUATION = frozenset(string.punctuation)
_ZH_PUNCTUATION = frozenset(
    string.punctuation
    + "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """SQuAD-style: lower case, drop ASCII punctuation, drop articles, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _EN_PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """Lower case, drop ASCII and Chinese punctuation, remove all whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _ZH_PUNCTUATION)
    return "".join(s.split())


# ---------------------------------------------------------------------------------------
# metrics, each (prediction, ground_truth, **kwargs) -> float in [0, 1]


def token_f1(prediction_tokens: Sequence[str], ground_truth_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 between two token lists (0 if nothing in common)."""
    num_same = sum((Counter(prediction_tokens) & Counter(ground_truth_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """English QA F1 on :func:`normalize_answer`-ed whitespace tokens."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Chinese QA F1 on jieba tokens, each normalized, empty ones dropped."""

    def tokens(text: str) -> list[str]:
        return [t for t in (normalize_zh_answer(tok) for tok in _jieba_cut(text)) if t]

    return token_f1(tokens(prediction), tokens(ground_truth))


def rouge_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L F of the ``rouge`` package; 0 when it fails (empty text, recursion depth)."""
    rouge = _require("rouge", "rouge")
    try:
        scores = rouge.Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # the official code uses a bare except: every failure scores 0
        return 0.0
    return float(scores["rouge-l"]["f"])


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L on jieba tokens joined by spaces."""
    return rouge_score(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


def classification_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """1/k if the true class is among the k class names found in the prediction, else 0.

    A found class name that is a strict substring of the true class is discarded (with the
    official iteration quirk, see the module docstring). Needs ``all_classes``.
    """
    all_classes = kwargs.get("all_classes")
    if not all_classes:
        raise ValueError("classification_score needs all_classes (the task's class names)")
    matches = [name for name in all_classes if name in prediction]
    # Official: ``for term in matches: if ...: matches.remove(term)`` -- removing while
    # iterating skips the element after each removed one. Emulated with an explicit index.
    i = 0
    while i < len(matches):
        term = matches[i]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
        i += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _fraction_of_numbers_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == target) / len(numbers)


def count_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Fraction of the numbers in the prediction that equal the true count."""
    return _fraction_of_numbers_equal(prediction, str(ground_truth))


def _retrieval(prediction: str, ground_truth: str, pattern: str) -> float:
    found = re.findall(pattern, ground_truth)
    if not found:
        raise ValueError(f"retrieval answer {ground_truth!r} does not match {pattern!r}")
    return _fraction_of_numbers_equal(prediction, found[0])


def retrieval_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Fraction of the numbers in the prediction equal to N of the answer "Paragraph N"."""
    return _retrieval(prediction, ground_truth, r"Paragraph (\d+)")


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Fraction of the numbers in the prediction equal to N of the answer "段落N"."""
    return _retrieval(prediction, ground_truth, r"段落(\d+)")


def _fuzz_ratio(a: str, b: str, backend: str) -> int:
    """fuzzywuzzy ``fuzz.ratio``: integer percentage, 100 if equal, 0 if one is empty."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    if backend == "rapidfuzz":
        fuzz = _require("rapidfuzz.fuzz", "rapidfuzz")
        ratio = fuzz.ratio(a, b)
    elif backend == "difflib":
        ratio = 100 * difflib.SequenceMatcher(None, a, b).ratio()
    else:
        raise ValueError(f"unknown fuzzy-ratio backend {backend!r} (rapidfuzz or difflib)")
    return int(round(ratio))


def code_sim_score(prediction: str, ground_truth: str, backend: str = "rapidfuzz", **kwargs: Any) -> float:
    """Fuzzy ratio / 100 between the first code line of the prediction and the true line.

    The first line (after leading newlines) that contains none of "`", "#", "//" is used;
    an empty string if there is none.
    """
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return _fuzz_ratio(line, ground_truth, backend) / 100


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1_score,
    "qa_f1_zh": qa_f1_zh_score,
    "rouge": rouge_score,
    "rouge_zh": rouge_zh_score,
    "classification": classification_score,
    "retrieval": retrieval_score,
    "retrieval_zh": retrieval_zh_score,
    "count": count_score,
    "code_sim": code_sim_score,
}


# ---------------------------------------------------------------------------------------
# per-sample and per-task scoring, as eval.py


def first_line(prediction: str) -> str:
    """``prediction.lstrip("\\n").split("\\n")[0]``."""
    return prediction.lstrip("\n").split("\n")[0]


def postprocess_prediction(task: str, prediction: str) -> str:
    """Cut the prediction at its first line for trec, triviaqa, samsum and lsht."""
    return first_line(prediction) if base_task_name(task) in FIRST_LINE_TASKS else prediction


def _raw_score(
    task: str,
    prediction: str,
    answers: str | Iterable[str],
    all_classes: Sequence[str] | None = None,
    **metric_kwargs: Any,
) -> float:
    name = base_task_name(task)
    metric = METRICS[METRIC_NAMES[name]]
    if isinstance(answers, str):
        answers = [answers]
    prediction = postprocess_prediction(name, prediction)
    score = 0.0
    for answer in answers:
        score = max(score, metric(prediction, answer, all_classes=all_classes, **metric_kwargs))
    return score


def score_prediction(
    task: str,
    prediction: str,
    answers: str | Iterable[str],
    all_classes: Sequence[str] | None = None,
    **metric_kwargs: Any,
) -> float:
    """Score of one prediction in ``[0, 100]``: the task's metric, max over the answers.

    ``task`` may be a LongBench-E name (``qasper_e``). The prediction is cut at its first
    line for :data:`~eval.longbench.tasks.FIRST_LINE_TASKS`. ``metric_kwargs`` go to the
    metric (e.g. ``backend="difflib"`` for the code tasks).
    """
    return 100.0 * _raw_score(task, prediction, answers, all_classes, **metric_kwargs)


def _per_sample_classes(
    all_classes: Sequence[str] | Sequence[Sequence[str] | None] | None, n: int
) -> list[Sequence[str] | None]:
    if all_classes is None or len(all_classes) == 0 or isinstance(all_classes[0], str):
        return [all_classes] * n  # type: ignore[list-item]  # one list shared by all samples
    if len(all_classes) != n:
        raise ValueError(f"got {len(all_classes)} per-sample all_classes for {n} predictions")
    return list(all_classes)  # type: ignore[arg-type]


def _check_lengths(predictions: Sequence[str], answers: Sequence[Any]) -> None:
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answer lists")
    if not predictions:
        raise ValueError("no predictions to score")


def score_task(
    task: str,
    predictions: Sequence[str],
    answers: Sequence[str | Sequence[str]],
    all_classes: Sequence[str] | Sequence[Sequence[str] | None] | None = None,
    **metric_kwargs: Any,
) -> float:
    """The official task score: ``round(100 * mean(sample scores), 2)``.

    ``all_classes`` is either one list of class names for all samples (as eval.py uses)
    or one entry per sample.
    """
    _check_lengths(predictions, answers)
    classes = _per_sample_classes(all_classes, len(predictions))
    total = sum(
        _raw_score(task, p, a, c, **metric_kwargs)
        for p, a, c in zip(predictions, answers, classes, strict=True)
    )
    return round(100 * total / len(predictions), 2)


def score_by_length(
    task: str,
    predictions: Sequence[str],
    answers: Sequence[str | Sequence[str]],
    lengths: Sequence[int],
    all_classes: Sequence[str] | Sequence[Sequence[str] | None] | None = None,
    **metric_kwargs: Any,
) -> dict[str, float]:
    """LongBench-E scores per length bucket ``{"0-4k": .., "4-8k": .., "8k+": ..}``.

    Each value is ``round(100 * mean, 2)`` over the samples whose ``length`` falls in the
    bucket; ``nan`` for an empty bucket (the official ``np.mean([])``).
    """
    _check_lengths(predictions, answers)
    if len(lengths) != len(predictions):
        raise ValueError(f"{len(lengths)} lengths for {len(predictions)} predictions")
    classes = _per_sample_classes(all_classes, len(predictions))
    buckets: dict[str, list[float]] = {name: [] for name, _, _ in LENGTH_BUCKETS}
    for p, a, n, c in zip(predictions, answers, lengths, classes, strict=True):
        buckets[length_bucket(n)].append(_raw_score(task, p, a, c, **metric_kwargs))
    return {
        name: (round(100 * sum(scores) / len(scores), 2) if scores else math.nan)
        for name, scores in buckets.items()
    }


def _field(sample: Any, name: str) -> Any:
    return sample[name] if isinstance(sample, dict) else getattr(sample, name)


def score_samples(
    task: str,
    samples: Sequence[Any],
    predictions: Sequence[str],
    by_length: bool = False,
    **metric_kwargs: Any,
) -> float | dict[str, float]:
    """Score predictions against loaded samples (dicts or ``LongBenchSample``).

    Uses each sample's own ``answers``, ``all_classes`` and (``by_length=True``, for
    LongBench-E) ``length``.
    """
    answers = [_field(s, "answers") for s in samples]
    classes = [_field(s, "all_classes") for s in samples]
    if by_length:
        lengths = [_field(s, "length") for s in samples]
        return score_by_length(task, predictions, answers, lengths, classes, **metric_kwargs)
    return score_task(task, predictions, answers, classes, **metric_kwargs)
