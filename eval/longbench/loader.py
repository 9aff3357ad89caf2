"""Load LongBench / LongBench-E samples and build their prompts as the official pred.py.

Data layout (the official ``data.zip``, unzipped): one JSON-lines file per dataset,
``<task>.jsonl`` for LongBench and ``<task>_e.jsonl`` for LongBench-E, each line with the
fields ``input``, ``context``, ``answers``, ``length``, ``dataset``, ``language``,
``all_classes`` and ``_id``. ``data_dir`` may hold the files directly or the unzipped
``data/`` folder.

Nothing is downloaded unless ``allow_download=True``; then ``data.zip`` of the Hugging Face
dataset ``THUDM/LongBench`` is fetched with ``huggingface_hub`` and unzipped into
``data_dir`` (or the default cache folder). The hub repository's loading script is not used:
recent ``datasets`` releases no longer run dataset scripts.
"""

from __future__ import annotations

import json
import os
import warnings
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .tasks import LONGBENCH_E_TASKS, TASKS, base_task_name, get_task, render_prompt, split_prompt

__all__ = [
    "DATA_ENV_VAR",
    "HUB_REPO_ID",
    "LongBenchDataError",
    "LongBenchSample",
    "apply_chat_template_split",
    "default_data_dir",
    "download_longbench",
    "load_longbench",
    "load_task",
    "truncate_middle",
    "truncate_prompt_middle",
    "truncate_sample",
]

HUB_REPO_ID = "THUDM/LongBench"
HUB_DATA_FILE = "data.zip"
DATA_ENV_VAR = "KVCOMP_LONGBENCH_DIR"


class LongBenchDataError(FileNotFoundError):
    """The LongBench data files are not where they were looked for."""


@dataclass(frozen=True)
class LongBenchSample:
    """One LongBench sample with its rendered prompt.

    ``context_part + question_part == prompt`` holds exactly: ``context_part`` ends with
    the (long) context, ``question_part`` holds the question and the instructions after it.
    """

    task: str  # base task name, e.g. "qasper" also for LongBench-E
    context: str
    input: str  # the question / query ("" for tasks without one)
    answers: list[str]
    all_classes: list[str] | None
    length: int  # words (English) or characters (Chinese), as stored in the data
    _id: str
    prompt: str
    context_part: str
    question_part: str
    language: str | None = None
    dataset: str | None = None  # the file's dataset name, e.g. "qasper_e"
    longbench_e: bool = False

    @property
    def question(self) -> str:
        """Alias of :attr:`input`."""
        return self.input

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_data_dir() -> Path:
    """``$KVCOMP_LONGBENCH_DIR`` or ``~/.cache/kvcomp/longbench``."""
    env = os.environ.get(DATA_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvcomp" / "longbench"


def _file_name(task: str, longbench_e: bool) -> tuple[str, str]:
    """(base task, dataset file stem); accepts "qasper_e" as well as longbench_e=True."""
    base = base_task_name(task)
    if task != base:  # "<task>_e" given
        longbench_e = True
    if longbench_e:
        if base not in LONGBENCH_E_TASKS:
            raise KeyError(
                f"LongBench task {base!r} has no LongBench-E variant; those are: {', '.join(LONGBENCH_E_TASKS)}"
            )
        return base, f"{base}_e"
    return base, base


def _find_file(data_dir: Path, stem: str) -> Path | None:
    for candidate in (data_dir / f"{stem}.jsonl", data_dir / "data" / f"{stem}.jsonl"):
        if candidate.is_file():
            return candidate
    return None


def _missing_data_message(data_dir: Path, stem: str) -> str:
    return (
        f"LongBench data file {stem}.jsonl not found in {data_dir} (nor in {data_dir / 'data'}). "
        f"Expected the official layout: <data_dir>/<task>.jsonl for LongBench and "
        f"<data_dir>/<task>_e.jsonl for LongBench-E. Get them by unzipping data.zip of the "
        f"Hugging Face dataset {HUB_REPO_ID} (https://huggingface.co/datasets/{HUB_REPO_ID}/"
        f"resolve/main/{HUB_DATA_FILE}) into that folder, point data_dir (or ${DATA_ENV_VAR}) "
        f"at it, or call load_task(..., allow_download=True) to fetch it."
    )


def download_longbench(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Fetch ``data.zip`` of ``THUDM/LongBench`` from the hub and unzip it into ``data_dir``.

    Returns the folder holding the ``.jsonl`` files (``<data_dir>/data``). Network access.
    """
    from huggingface_hub import hf_hub_download

    target = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    target.mkdir(parents=True, exist_ok=True)
    archive = hf_hub_download(repo_id=HUB_REPO_ID, filename=HUB_DATA_FILE, repo_type="dataset")
    with zipfile.ZipFile(archive) as zf:
        root = target.resolve()
        for member in zf.namelist():  # refuse paths that would escape the target folder
            if not (root / member).resolve().is_relative_to(root):
                raise ValueError(f"unsafe path {member!r} in {archive}")
        zf.extractall(target)
    return target / "data" if (target / "data").is_dir() else target


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({exc})") from exc
    return records


def _make_sample(base: str, record: dict[str, Any], longbench_e: bool) -> LongBenchSample:
    context = record.get("context") or ""
    question = record.get("input") or ""
    answers = record.get("answers")
    if answers is None:
        answers = []
    elif isinstance(answers, str):
        answers = [answers]
    prompt = render_prompt(base, context, question)
    context_part, question_part = split_prompt(base, context, question)
    assert context_part + question_part == prompt
    all_classes = record.get("all_classes")
    return LongBenchSample(
        task=base,
        context=context,
        input=question,
        answers=[str(a) for a in answers],
        all_classes=list(all_classes) if all_classes else None,
        length=int(record.get("length") or 0),
        _id=str(record.get("_id", "")),
        prompt=prompt,
        context_part=context_part,
        question_part=question_part,
        language=record.get("language"),
        dataset=record.get("dataset"),
        longbench_e=longbench_e,
    )


def load_task(
    task: str,
    data_dir: str | os.PathLike[str] | None = None,
    longbench_e: bool = False,
    allow_download: bool = False,
    max_samples: int | None = None,
) -> list[LongBenchSample]:
    """Load one LongBench task (or its LongBench-E variant) with rendered prompts.

    ``task`` is a v1 task name (``"qasper"``) or a LongBench-E name (``"qasper_e"``, same as
    ``longbench_e=True``). ``data_dir`` defaults to :func:`default_data_dir`. Raises
    :class:`LongBenchDataError` naming the expected file when the data is missing and
    ``allow_download`` is false. ``max_samples`` keeps the first samples of the file.
    """
    base, stem = _file_name(task, longbench_e)
    is_e = stem != base
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    path = _find_file(root, stem)
    if path is None and allow_download:
        download_longbench(root)
        path = _find_file(root, stem)
    if path is None:
        raise LongBenchDataError(_missing_data_message(root, stem))
    records = _read_jsonl(path)
    if max_samples is not None:
        records = records[:max_samples]
    return [_make_sample(base, r, is_e) for r in records]


def load_longbench(
    tasks: Iterable[str] | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    longbench_e: bool = False,
    allow_download: bool = False,
    max_samples: int | None = None,
) -> dict[str, list[LongBenchSample]]:
    """Load several tasks: ``{task: samples}``; all 21 (or the 13 LongBench-E) by default."""
    if tasks is None:
        tasks = LONGBENCH_E_TASKS if longbench_e else TASKS
    return {
        t: load_task(
            t, data_dir, longbench_e=longbench_e, allow_download=allow_download, max_samples=max_samples
        )
        for t in tasks
    }


# ---------------------------------------------------------------------------------------
# middle truncation (pred.py) and chat wrapping


def truncate_middle(token_ids: Sequence[int] | Any, max_len: int) -> Any:
    """Keep the first ``max_len // 2`` and the last ``max_len // 2`` tokens if too long.

    As pred.py: a sequence longer than ``max_len`` becomes ``ids[:half] + ids[-half:]`` with
    ``half = max_len // 2`` (so ``max_len - 1`` tokens for an odd ``max_len``); a shorter one
    is returned unchanged. Works on lists, tuples and 1-d tensors / arrays.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    if len(token_ids) <= max_len:
        return token_ids
    half = max_len // 2
    head, tail = token_ids[:half], token_ids[-half:]
    if isinstance(token_ids, list | tuple):
        return type(token_ids)(list(head) + list(tail))
    import torch

    if isinstance(token_ids, torch.Tensor):
        return torch.cat([head, tail])
    import numpy as np

    return np.concatenate([head, tail])


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    ids = tokenizer(text, truncation=False, add_special_tokens=add_special_tokens)["input_ids"]
    return list(ids)


def _truncate_text(
    prompt: str, tokenizer: Any, max_length: int, add_special_tokens: bool
) -> tuple[str, str, str] | None:
    """(new prompt, head text, tail text), or None if the prompt fits."""
    ids = _encode(tokenizer, prompt, add_special_tokens)
    if len(ids) <= max_length:
        return None
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    half = max_length // 2
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[-half:], skip_special_tokens=True)
    return head + tail, head, tail


def truncate_prompt_middle(
    prompt: str, tokenizer: Any, max_length: int, add_special_tokens: bool = True
) -> str:
    """pred.py's prompt truncation: if the prompt has more than ``max_length`` tokens, keep
    the text of its first and last ``max_length // 2`` tokens.

    The prompt is tokenized as ``tokenizer(prompt, truncation=False)`` (special tokens such
    as BOS included, as in pred.py; ``add_special_tokens=False`` as pred.py does for
    chatglm3), and both halves are decoded with ``skip_special_tokens=True`` and joined.
    """
    result = _truncate_text(prompt, tokenizer, max_length, add_special_tokens)
    return prompt if result is None else result[0]


def truncate_sample(
    sample: LongBenchSample, tokenizer: Any, max_length: int, add_special_tokens: bool = True
) -> LongBenchSample:
    """The sample with its prompt middle-truncated (:func:`truncate_prompt_middle`) and the
    context/question split recomputed so that ``context_part + question_part == prompt``.

    The question part is kept as it was when the truncated prompt still ends with it (the
    usual case: the question is in the kept tail and decoding round-trips). Otherwise the
    split is put where the tail starts, so that nothing of the question can land in the
    context part, and a warning is issued.
    """
    result = _truncate_text(sample.prompt, tokenizer, max_length, add_special_tokens)
    if result is None:
        return sample
    prompt, head, _tail = result
    if sample.question_part and prompt.endswith(sample.question_part):
        cut = len(prompt) - len(sample.question_part)
    else:
        warnings.warn(
            f"{sample.task} sample {sample._id}: the truncated prompt does not end with the "
            "question part; splitting where the kept tail starts",
            stacklevel=2,
        )
        cut = len(head)
    return replace(sample, prompt=prompt, context_part=prompt[:cut], question_part=prompt[cut:])


def apply_chat_template_split(
    task: str,
    context_part: str,
    question_part: str,
    tokenizer: Any,
    **template_kwargs: Any,
) -> tuple[str, str]:
    """Wrap ``context_part + question_part`` in the tokenizer's chat template, as one user
    message with the generation prompt, keeping the split: returns
    ``(chat_prefix + context_part, question_part + chat_suffix)``.

    For the tasks that pred.py leaves without chat format (trec, triviaqa, samsum, lsht,
    lcc, repobench-p) or a tokenizer without a chat template, the parts come back as they
    are. pred.py truncates before it wraps; do the same (:func:`truncate_sample` first).
    Note that pred.py used hand-written per-model formats; the tokenizer's own template is
    this framework's stand-in for them.
    """
    if not get_task(task).use_chat_template or not getattr(tokenizer, "chat_template", None):
        return context_part, question_part
    prompt = context_part + question_part
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    # Some templates strip the message; locate the stripped prompt then.
    start, end = 0, len(prompt)
    pos = rendered.find(prompt)
    if pos < 0:
        stripped = prompt.strip()
        pos = rendered.find(stripped) if stripped else -1
        if pos < 0:
            raise ValueError("the chat template does not contain the prompt text; cannot keep the split")
        start = len(prompt) - len(prompt.lstrip())
        end = start + len(stripped)
    cut = min(max(len(context_part), start), end)
    body_end = pos + (end - start)
    return rendered[:pos] + prompt[start:cut], prompt[cut:end] + rendered[body_end:]
