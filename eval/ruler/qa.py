"""QA data for ``qa_1`` (SQuAD v2 dev) and ``qa_2`` (HotpotQA dev, distractor setting).

RULER's QA tasks take real questions and hide their gold paragraphs among many other paragraphs of the
same dataset. Nothing is faked here: without the dataset file the generator raises
:class:`TaskDataUnavailable`, whose message says which file to provide and how.

Where the file comes from, first match wins:

1. the option ``squad_file=`` (qa_1) / ``hotpotqa_file=`` (qa_2) of ``generate_samples``;
2. the environment variable ``KVCOMP_SQUAD_FILE`` / ``KVCOMP_HOTPOTQA_FILE``;
3. with ``allow_download=True`` only: the Hugging Face ``datasets`` library (``rajpurkar/squad_v2`` split
   ``validation``; ``hotpotqa/hotpot_qa`` config ``distractor`` split ``validation``).

File formats: SQuAD's official ``dev-v2.0.json`` (``{"data": [{"paragraphs": [{"context", "qas": [...]}]}]}``;
v1.1 files work too) and HotpotQA's official ``hotpot_dev_distractor_v1.json`` (a list of
``{"question", "answer", "context": [[title, [sentences]]], "supporting_facts": [[title, i]]}``).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path


class TaskDataUnavailable(Exception):
    """A task needs a dataset file that was not given (or could not be read); the message says which."""


@dataclass(frozen=True)
class QAItem:
    question: str
    answers: tuple[str, ...]
    gold: tuple[int, ...]  # indices into QAData.docs that must be in the context
    related: tuple[int, ...]  # preferred distractors (same article / the question's own distractors)


@dataclass(frozen=True)
class QAData:
    docs: tuple[str, ...]
    items: tuple[QAItem, ...]
    source: str


_SOURCES = {
    "squad": dict(
        option="squad_file",
        env="KVCOMP_SQUAD_FILE",
        file="dev-v2.0.json",
        what="the SQuAD v2.0 dev set",
        url="https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json",
        hub=("rajpurkar/squad_v2", None),
    ),
    "hotpotqa": dict(
        option="hotpotqa_file",
        env="KVCOMP_HOTPOTQA_FILE",
        file="hotpot_dev_distractor_v1.json",
        what="the HotpotQA dev set (distractor setting)",
        url="http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json",
        hub=("hotpotqa/hotpot_qa", "distractor"),
    ),
}


def _missing_message(task: str, dataset: str, detail: str) -> str:
    s = _SOURCES[dataset]
    return (
        f"RULER task {task!r} needs {s['what']}, file {s['file']!r} ({detail}). "
        f"Download it once from {s['url']} and pass {s['option']}='/path/to/{s['file']}' to "
        f"generate_samples, or set the environment variable {s['env']}; "
        f"or pass allow_download=True to fetch it with the `datasets` library."
    )


def _build(
    docs_in_order: list[str], raw_items: list[tuple[str, list[str], list[str], list[str]]], source: str
):
    docs = sorted(set(docs_in_order))
    index = {d: i for i, d in enumerate(docs)}
    items = []
    for question, answers, gold, related in raw_items:
        g = tuple(dict.fromkeys(index[d] for d in gold))
        r = tuple(i for i in dict.fromkeys(index[d] for d in related) if i not in g)
        items.append(QAItem(question, tuple(answers), g, r))
    if not items:
        raise ValueError(f"{source}: no usable questions")
    return QAData(tuple(docs), tuple(items), source)


def parse_squad(data: dict, source: str = "squad") -> QAData:
    """Answerable SQuAD questions; gold = their paragraph, related = the other paragraphs of the article."""
    all_docs, raw = [], []
    for article in data["data"]:
        paragraphs = [p["context"] for p in article["paragraphs"]]
        all_docs.extend(paragraphs)
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                answers = list(dict.fromkeys(a["text"] for a in qa.get("answers", [])))
                if qa.get("is_impossible", False) or not answers:
                    continue
                raw.append(
                    (qa["question"], answers, [p["context"]], [c for c in paragraphs if c != p["context"]])
                )
    return _build(all_docs, raw, source)


def parse_hotpotqa(data: list, source: str = "hotpotqa") -> QAData:
    """HotpotQA questions; documents are ``"title\\nsentences"``. Gold = the supporting paragraphs (all ten
    when ``supporting_facts`` is absent), related = the question's other (distractor) paragraphs, so the
    context holds all ten of the question's paragraphs whenever it has room for them, as in RULER."""
    all_docs, raw = [], []
    for item in data:
        paras = [(title, f"{title}\n{''.join(sents)}") for title, sents in item["context"]]
        all_docs.extend(doc for _, doc in paras)
        support = {title for title, *_ in item.get("supporting_facts", [])}
        gold = [doc for title, doc in paras if title in support] or [doc for _, doc in paras]
        related = [doc for _, doc in paras if doc not in gold]
        raw.append((item["question"], [item["answer"]], gold, related))
    return _build(all_docs, raw, source)


@functools.lru_cache(maxsize=4)
def _load_file(dataset: str, path: str) -> QAData:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return parse_squad(data, path) if dataset == "squad" else parse_hotpotqa(data, path)


def _load_hub(dataset: str) -> QAData:  # pragma: no cover - needs network; never used by the tests
    try:
        import datasets
    except ImportError as e:
        raise TaskDataUnavailable(
            "allow_download=True needs the `datasets` package (pip install datasets)"
        ) from e
    name, config = _SOURCES[dataset]["hub"]
    ds = datasets.load_dataset(name, config, split="validation")
    if dataset == "squad":
        articles: dict[str, dict[str, list]] = {}
        for row in ds:
            paras = articles.setdefault(row["title"], {})
            paras.setdefault(row["context"], []).append(
                {"question": row["question"], "answers": [{"text": t} for t in row["answers"]["text"]]}
            )
        data = {
            "data": [
                {"paragraphs": [{"context": c, "qas": qas} for c, qas in paras.items()]}
                for paras in articles.values()
            ]
        }
        return parse_squad(data, f"hub:{name}")
    rows = [
        {
            "question": row["question"],
            "answer": row["answer"],
            "context": [
                list(x) for x in zip(row["context"]["title"], row["context"]["sentences"], strict=True)
            ],
            "supporting_facts": [
                list(x)
                for x in zip(
                    row["supporting_facts"]["title"], row["supporting_facts"]["sent_id"], strict=True
                )
            ],
        }
        for row in ds
    ]
    return parse_hotpotqa(rows, f"hub:{name}/{config}")


def load_qa_data(
    task: str, dataset: str, path: str | os.PathLike | None, allow_download: bool = False
) -> QAData:
    """Load the QA data for ``task`` or raise :class:`TaskDataUnavailable` (see the module docstring)."""
    source = _SOURCES[dataset]
    if path is None:
        path = os.environ.get(source["env"]) or None
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise TaskDataUnavailable(_missing_message(task, dataset, f"no such file: {p}"))
        try:
            return _load_file(dataset, str(p.resolve()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TaskDataUnavailable(_missing_message(task, dataset, f"could not read {p}: {e!r}")) from e
    if allow_download:
        return _load_hub(dataset)
    raise TaskDataUnavailable(_missing_message(task, dataset, "not given"))
