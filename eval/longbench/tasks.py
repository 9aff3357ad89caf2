"""LongBench v1 (21 tasks) and LongBench-E (13 tasks): task specifications.

Every fact in this module is taken from the official THUDM/LongBench repository
(``LongBench/config/dataset2prompt.json``, ``LongBench/config/dataset2maxlen.json``,
``LongBench/pred.py`` and ``LongBench/eval.py``). The prompt templates are data and are
copied verbatim, typos included (e.g. ``asconcisely`` in narrativeqa), because they are
what makes scores comparable with published LongBench numbers.

Per task the official pipeline is:

1. ``prompt = PROMPTS[task].format(**sample)`` (``context`` and ``input`` fields);
2. truncate the middle of the prompt to the model's maximum length in tokens (first half
   and last half kept), see :func:`eval.longbench.loader.truncate_prompt_middle`;
3. wrap it in the model's chat format, except for the tasks in
   :data:`NO_CHAT_TEMPLATE_TASKS`;
4. greedy decoding of at most ``MAX_NEW_TOKENS[task]`` tokens (samsum also stops at a
   newline, :attr:`TaskSpec.stop_on_newline`);
5. score with ``METRIC_NAMES[task]``, the prediction being cut at its first line for the
   tasks in :data:`FIRST_LINE_TASKS`, max over the reference answers, and mean x 100.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CATEGORIES",
    "FIRST_LINE_TASKS",
    "LANGUAGES",
    "LENGTH_BUCKETS",
    "LONGBENCH_E_TASKS",
    "MAX_NEW_TOKENS",
    "METRIC_NAMES",
    "NEWLINE_STOP_TASKS",
    "NO_CHAT_TEMPLATE_TASKS",
    "PROMPTS",
    "TASKS",
    "TaskSpec",
    "base_task_name",
    "get_task",
    "length_bucket",
    "render_prompt",
    "split_prompt",
]

# The 21 LongBench v1 tasks, in the official order of pred.py.
TASKS: tuple[str, ...] = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "multifieldqa_zh",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "dureader",
    "gov_report",
    "qmsum",
    "multi_news",
    "vcsum",
    "trec",
    "triviaqa",
    "samsum",
    "lsht",
    "passage_count",
    "passage_retrieval_en",
    "passage_retrieval_zh",
    "lcc",
    "repobench-p",
)

# The 13 tasks that have a LongBench-E variant (``<task>_e``), in the official order.
LONGBENCH_E_TASKS: tuple[str, ...] = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)

# pred.py: "chat models are better off without build prompts on these tasks".
NO_CHAT_TEMPLATE_TASKS: frozenset[str] = frozenset(
    {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
)

# eval.py: for these tasks the prediction is cut at its first line before scoring:
# ``prediction.lstrip("\n").split("\n")[0]``.
FIRST_LINE_TASKS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})

# pred.py: samsum generation also stops at the newline token (eos_token_id=[eos, "\n"]) and
# uses min_length=context_length + 1 (at least one new token).
NEWLINE_STOP_TASKS: frozenset[str] = frozenset({"samsum"})

# dataset2maxlen.json: maximum number of generated tokens.
MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

# eval.py dataset2metric; names are keys of eval.longbench.metrics.METRICS.
METRIC_NAMES: dict[str, str] = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "dureader": "rouge_zh",
    "gov_report": "rouge",
    "qmsum": "rouge",
    "multi_news": "rouge",
    "vcsum": "rouge_zh",
    "trec": "classification",
    "triviaqa": "qa_f1",
    "samsum": "rouge",
    "lsht": "classification",
    "passage_count": "count",
    "passage_retrieval_en": "retrieval",
    "passage_retrieval_zh": "retrieval_zh",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}

# Task categories of the LongBench paper / README leaderboard.
CATEGORIES: dict[str, str] = {
    "narrativeqa": "single-doc QA",
    "qasper": "single-doc QA",
    "multifieldqa_en": "single-doc QA",
    "multifieldqa_zh": "single-doc QA",
    "hotpotqa": "multi-doc QA",
    "2wikimqa": "multi-doc QA",
    "musique": "multi-doc QA",
    "dureader": "multi-doc QA",
    "gov_report": "summarization",
    "qmsum": "summarization",
    "multi_news": "summarization",
    "vcsum": "summarization",
    "trec": "few-shot learning",
    "triviaqa": "few-shot learning",
    "samsum": "few-shot learning",
    "lsht": "few-shot learning",
    "passage_count": "synthetic",
    "passage_retrieval_en": "synthetic",
    "passage_retrieval_zh": "synthetic",
    "lcc": "code completion",
    "repobench-p": "code completion",
}

# Language of the task ("code" for the two code-completion tasks, which count in both the
# English and the Chinese leaderboard averages).
LANGUAGES: dict[str, str] = {
    task: ("zh" if task in {"multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"} else "en")
    for task in TASKS
}
LANGUAGES["lcc"] = LANGUAGES["repobench-p"] = "code"

# LongBench-E length buckets, eval.py scorer_e: ``length`` (words for English, characters
# for Chinese, as stored in the data) < 4000, < 8000, else. (name, lower bound, upper bound)
LENGTH_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("0-4k", 0, 4000),
    ("4-8k", 4000, 8000),
    ("8k+", 8000, None),
)

# dataset2prompt.json, verbatim. Placeholders: {context} and {input}.
PROMPTS: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
        "Story: {context}\n\n"
        "Now, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
        "Question: {input}\n\n"
        "Answer:"
    ),
    "qasper": (
        'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\n'
        "Article: {context}\n\n"
        ' Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\n'
        "Question: {input}\n\n"
        "Answer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n"
        "{context}\n\n"
        "Now, answer the following question based on the above text, only give me the answer and do not output any other words.\n\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n"
        "{context}\n\n"
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n"
        "问题：{input}\n"
        "回答："
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
        "The following are given passages.\n"
        "{context}\n\n"
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
        "The following are given passages.\n"
        "{context}\n\n"
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
        "The following are given passages.\n"
        "{context}\n\n"
        "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n"
        "文章：{context}\n\n"
        "请基于上述文章回答下面的问题。\n\n"
        "问题：{input}\n"
        "回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n"
        "{context}\n\n"
        "Now, write a one-page summary of the report.\n\n"
        "Summary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\n"
        "Transcript:\n"
        "{context}\n\n"
        "Now, answer the query based on the above meeting transcript in one or more sentences.\n\n"
        "Query: {input}\n"
        "Answer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\n"
        "News:\n"
        "{context}\n\n"
        "Now, write a one-page summary of all the news.\n\n"
        "Summary:"
    ),
    "vcsum": (
        "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结："
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n"
        "{context}\n"
        "{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n"
        "{context}\n\n"
        "{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n"
        "{context}\n\n"
        "{input}"
    ),
    "lsht": ("请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}"),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n"
        "{context}\n\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\n"
        "The final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n"
        "{context}\n\n"
        "The following is an abstract.\n\n"
        "{input}\n\n"
        'Please enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\n'
        "The answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n"
        "{context}\n\n"
        "下面是一个摘要\n\n"
        "{input}\n\n"
        '请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n'
        "答案是："
    ),
    "lcc": ("Please complete the code given below. \n{context}Next line of code:\n"),
    "repobench-p": ("Please complete the code given below. \n{context}{input}Next line of code:\n"),
}


@dataclass(frozen=True)
class TaskSpec:
    """Everything the official pipeline uses for one LongBench task."""

    name: str
    prompt_template: str
    max_new_tokens: int
    metric: str
    category: str
    language: str
    use_chat_template: bool
    first_line_only: bool
    stop_on_newline: bool
    has_longbench_e: bool

    @property
    def e_name(self) -> str:
        """The LongBench-E dataset name (``<task>_e``); only valid if :attr:`has_longbench_e`."""
        if not self.has_longbench_e:
            raise ValueError(f"LongBench task {self.name!r} has no LongBench-E variant")
        return f"{self.name}_e"


def base_task_name(task: str) -> str:
    """``"qasper_e"`` -> ``"qasper"``; checks that the name is a LongBench (-E) task."""
    name = task
    if name not in PROMPTS and name.endswith("_e") and name[:-2] in LONGBENCH_E_TASKS:
        name = name[:-2]
    if name not in PROMPTS:
        raise KeyError(
            f"unknown LongBench task {task!r}; v1 tasks: {', '.join(TASKS)}; "
            f"LongBench-E tasks: {', '.join(t + '_e' for t in LONGBENCH_E_TASKS)}"
        )
    return name


def get_task(task: str) -> TaskSpec:
    """The :class:`TaskSpec` of a task; ``<task>_e`` names give the same spec as ``<task>``."""
    name = base_task_name(task)
    return TaskSpec(
        name=name,
        prompt_template=PROMPTS[name],
        max_new_tokens=MAX_NEW_TOKENS[name],
        metric=METRIC_NAMES[name],
        category=CATEGORIES[name],
        language=LANGUAGES[name],
        use_chat_template=name not in NO_CHAT_TEMPLATE_TASKS,
        first_line_only=name in FIRST_LINE_TASKS,
        stop_on_newline=name in NEWLINE_STOP_TASKS,
        has_longbench_e=name in LONGBENCH_E_TASKS,
    )


def render_prompt(task: str, context: str, input: str = "") -> str:
    """The official prompt: ``PROMPTS[task].format(context=context, input=input)``."""
    return PROMPTS[base_task_name(task)].format(context=context, input=input)


def split_prompt(task: str, context: str, input: str = "") -> tuple[str, str]:
    """Split the rendered prompt into ``(context_part, question_part)``.

    ``context_part`` is the template text up to and including the rendered context;
    ``question_part`` is everything after it (the question, and the instructions that
    follow the context). ``context_part + question_part == render_prompt(...)`` exactly, so
    a KV-cache compressor can prefill and compress ``context_part`` before the question
    is seen.
    """
    template = PROMPTS[base_task_name(task)]
    head, sep, tail = template.partition("{context}")
    if not sep:  # pragma: no cover - every official template has {context}
        raise ValueError(f"template of {task!r} has no {{context}} placeholder")
    fields = {"context": context, "input": input}
    return head.format(**fields) + context, tail.format(**fields)


def length_bucket(length: int) -> str:
    """LongBench-E bucket name of a sample's ``length`` field: ``0-4k``, ``4-8k`` or ``8k+``."""
    for name, _low, high in LENGTH_BUCKETS:
        if high is None or length < high:
            return name
    raise AssertionError("unreachable")  # pragma: no cover
