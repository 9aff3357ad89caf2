"""RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?")
for kvcomp: a generator for the 13 synthetic tasks, sized in the model's own tokens, and their metrics.

    >>> from eval.ruler import TASKS, generate_samples, score
    >>> s = generate_samples("niah_single_1", tokenizer, length=4096, num_samples=10, seed=0)[0]
    >>> s.prompt == s.context + s.question    # compress s.context, then ask s.question
    True
    >>> score("niah_single_1", model_answer, s.outputs)   # 0..100

Tasks: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery, vt, cwe, fwe, qa_1, qa_2.
Everything is generated offline; ``qa_1``/``qa_2`` need a local SQuAD / HotpotQA file and raise
:class:`TaskDataUnavailable` (with instructions) without one. See :mod:`eval.ruler.generate` for the
sample layout, the length rule, seeding and options.
"""

from .generate import DEPTHS, NEEDLE, RulerSample, WhitespaceTokenizer, generate_samples
from .metrics import metric_for, score, string_match_all, string_match_part
from .qa import TaskDataUnavailable
from .tasks import METRICS, TASKS, TaskSpec

__all__ = [
    "DEPTHS",
    "METRICS",
    "NEEDLE",
    "TASKS",
    "RulerSample",
    "TaskDataUnavailable",
    "TaskSpec",
    "WhitespaceTokenizer",
    "generate_samples",
    "metric_for",
    "score",
    "string_match_all",
    "string_match_part",
]
