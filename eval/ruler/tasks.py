"""The 13 RULER task definitions: templates, answer prefixes, generation caps, metrics and arguments.

The instruction texts, answer prefixes, generation caps and task arguments are those of NVIDIA RULER
(``scripts/data/synthetic/constants.py`` and ``scripts/synthetic.yaml``); they are benchmark facts and
are kept verbatim so that scores stay comparable. The only change is that the common-words question
takes ``{num_cw}`` where RULER hard-codes ``10`` (identical text for the default ``num_cw=10``).

Every template holds one ``{context}`` field (the haystack) and, after it, one ``{query}`` field.
:meth:`TaskSpec.split_template` cuts a template right after ``{context}``: the first piece renders
to :attr:`RulerSample.context`, the second to :attr:`RulerSample.question`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

STRING_MATCH_ALL = "string_match_all"
STRING_MATCH_PART = "string_match_part"

_NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
_NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"

_VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
_VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
    "are assigned the value {query}, they are: "
)

_CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the {num_cw} most common words in the above list?"
)
_CWE_ANSWER_PREFIX = " Answer: The top {num_cw} words that appear most often in the list are:"

_FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. {context}\n"
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
_FWE_ANSWER_PREFIX = (
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)

_QA_INSTRUCTION = "Answer the question based on the given documents. Only give me the answer and do not output any other words."
_QA_TEMPLATE = (
    f"{_QA_INSTRUCTION}\n\nThe following are given documents.\n\n{{context}}\n\n"
    f"{_QA_INSTRUCTION}\n\nQuestion: {{query}}"
)
_QA_ANSWER_PREFIX = " Answer:"


@dataclass(frozen=True)
class TaskSpec:
    """One RULER task.

    ``kind`` names the generator family (``niah``, ``variable_tracking``, ``common_words_extraction``,
    ``freq_words_extraction``, ``qa``); ``args`` are the task's complexity arguments from RULER's
    ``synthetic.yaml``; ``metric`` is ``string_match_all`` or ``string_match_part``;
    ``tokens_to_generate`` is the generation cap that RULER reserves inside the requested length.
    """

    name: str
    kind: str
    metric: str
    tokens_to_generate: int
    template: str
    answer_prefix: str
    args: Mapping[str, Any]

    def split_template(self) -> tuple[str, str]:
        """Return ``(context_template, question_template)``, cut right after ``{context}``."""
        cut = self.template.index("{context}") + len("{context}")
        return self.template[:cut], self.template[cut:]


def _spec(name: str, kind: str, **args: Any) -> TaskSpec:
    table = {
        "niah": (STRING_MATCH_ALL, 128, _NIAH_TEMPLATE, _NIAH_ANSWER_PREFIX),
        "variable_tracking": (STRING_MATCH_ALL, 30, _VT_TEMPLATE, _VT_ANSWER_PREFIX),
        "common_words_extraction": (STRING_MATCH_ALL, 120, _CWE_TEMPLATE, _CWE_ANSWER_PREFIX),
        "freq_words_extraction": (STRING_MATCH_ALL, 50, _FWE_TEMPLATE, _FWE_ANSWER_PREFIX),
        "qa": (STRING_MATCH_PART, 32, _QA_TEMPLATE, _QA_ANSWER_PREFIX),
    }
    metric, cap, template, prefix = table[kind]
    return TaskSpec(name, kind, metric, cap, template, prefix, MappingProxyType(dict(args)))


def _niah(name: str, haystack: str, key: str, value: str, k: int = 1, v: int = 1, q: int = 1) -> TaskSpec:
    return _spec(
        name,
        "niah",
        type_haystack=haystack,
        type_needle_k=key,
        type_needle_v=value,
        num_needle_k=k,
        num_needle_v=v,
        num_needle_q=q,
    )


TASKS: dict[str, TaskSpec] = {
    s.name: s
    for s in (
        _niah("niah_single_1", "noise", "words", "numbers"),
        _niah("niah_single_2", "essay", "words", "numbers"),
        _niah("niah_single_3", "essay", "words", "uuids"),
        _niah("niah_multikey_1", "essay", "words", "numbers", k=4),
        _niah("niah_multikey_2", "needle", "words", "numbers"),
        _niah("niah_multikey_3", "needle", "uuids", "uuids"),
        _niah("niah_multivalue", "essay", "words", "numbers", v=4),
        _niah("niah_multiquery", "essay", "words", "numbers", q=4),
        _spec("vt", "variable_tracking", type_haystack="noise", num_chains=1, num_hops=4),
        _spec("cwe", "common_words_extraction", freq_cw=30, freq_ucw=3, num_cw=10),
        _spec("fwe", "freq_words_extraction", alpha=2.0, coded_wordlen=6, vocab_size=-1),
        _spec("qa_1", "qa", dataset="squad"),
        _spec("qa_2", "qa", dataset="hotpotqa"),
    )
}
"""The 13 RULER tasks by name, in RULER's order."""

METRICS = (STRING_MATCH_ALL, STRING_MATCH_PART)
