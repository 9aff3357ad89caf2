"""Run a compressor over a benchmark task: one JSONL record per sample, resumable, with fidelity to full KV.

    >>> from eval.runner import load_samples, run, summarize
    >>> task = load_samples("ruler/niah_single_1", tokenizer, length=4096, num_samples=20)
    >>> records = list(run(model, tokenizer, task, "snapkv", query_aware=False,
    ...                    out_path=Path("out/snapkv.jsonl"), compression_ratio=0.5))
    >>> summarize(records)["score"]

Tasks are named ``ruler/<task>`` (generated locally at ``length`` tokens), ``longbench/<task>`` and
``longbench_e/<task>`` (read from a local copy of the data; ``length`` middle-truncates the prompt).

A record holds the prediction and its score, the context length in tokens, prefill/decode seconds, resident
bytes per tier, ``memory_factor``, mean kept tokens, the mode (``query_aware`` and ``mode``), the compressor
with its parameters, the dtype, and the fidelity of the output to an uncompressed run of the same sample
(``exact_match``, ``first_divergence``, ``length_change``, ``agreement`` over generated token ids).

Fidelity needs an uncompressed generation of each sample. It is run once and cached in a sidecar file
(``reference.jsonl`` beside ``out_path`` by default), keyed by sample id, a hash of the prompt, the model, the
dtype, the mode and ``max_new_tokens``, so a sweep over compressors and ratios computes it once. A baseline
run (``compressor=None``) is its own reference and fills the cache.

Resume: each record is appended to ``out_path`` and flushed as soon as it exists; a rerun skips the sample
ids already there, so an interrupted evaluation continues where it stopped. A file written with another
compressor, parameters, mode, model or dtype is refused (:class:`RunConfigMismatch`) rather than mixed. One
process writes an output directory at a time (a second is refused, naming the holder, instead of appending
every record again), and no file kvcomp writes or truncates is followed through a symbolic link
(:mod:`kvcomp.files`).

With ``batch_size > 1`` samples are generated as one left-padded batch: the timing, resident bytes,
full bytes and ``memory_factor`` of a record are those of its batch (``batch_size`` says how many rows);
``kept_tokens`` and fidelity are per sample.

``lossless=True`` (or a :class:`kvcomp.lossless.Lossless`) drafts with the compressor and verifies with the
full KV: fidelity must then be exact, and each record carries ``lossless_stats`` (rounds, accepted-length
histogram, verification passes, bytes brought in from the slow tier, draft/verify/transfer seconds; per batch,
like the timings). Resident bytes then include the full KV, under the tier that holds it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvcomp import files, shared_prefill
from kvcomp.compressor import Compressor
from kvcomp.generation import (
    add_full_kv_bytes,
    cache_stats,
    generate_ids,
    lossless_config,
    prompt_template,
    resolve_compressor,
    split_prompt,
    stop_token_ids,
    template_overhead,
)
from kvcomp.lossless import Lossless
from kvcomp.memory import PeakMemory
from kvcomp.metrics import fidelity
from kvcomp.registry import name_of
from kvcomp.validation import UsageError, check_context_length, positive_int

RULER_DEFAULT_SAMPLES = 100
REFERENCE_FILE = "reference.jsonl"
# The fields of a record that must agree between runs appending to the same file.
CONFIG_FIELDS = ("compressor", "query_aware", "model", "dtype", "lossless")


class RunConfigMismatch(ValueError):
    """``out_path`` already holds records of a different run configuration."""


# ---------------------------------------------------------------------------------------------------------
# tasks


@dataclass(frozen=True)
class Sample:
    """One evaluation item, split so the context can be compressed before the question is seen.

    The chat template (when ``chat_template``) renders ``context + question`` as the user turn, then
    ``answer_prefix`` opens the assistant turn (see :func:`kvcomp.generation.split_prompt`).
    ``length_tokens`` is the task's own length measure (RULER: ``context + question + answer_prefix``
    without template; LongBench: ``context + question``); records report the tokens actually prefilled.
    """

    id: str
    task: str
    context: str
    question: str
    answer_prefix: str
    references: list[str]
    max_new_tokens: int
    chat_template: bool
    length_tokens: int
    metadata: dict[str, Any] = field(default_factory=dict)  # small, JSON-able; copied into records


@dataclass
class Task:
    """A named list of samples and the task's scorer (``score(prediction, sample) -> 0..100``)."""

    name: str
    samples: list[Sample]
    scorer: Callable[[str, Sample], float]
    config: dict[str, Any] = field(default_factory=dict)  # how the samples were made (length, seed, ...)

    def score(self, prediction: str, sample: Sample) -> float:
        return float(self.scorer(prediction, sample))

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)


def _count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


def chat_template_overhead(tokenizer, chat_template: bool = True) -> int:
    """Tokens the prompt template adds (the chat template around an empty user message, or the plain
    template's BOS); see :func:`kvcomp.generation.template_overhead`."""
    return template_overhead(tokenizer, chat_template)


def _load_ruler(
    name: str,
    tokenizer,
    length: int | None,
    num_samples: int | None,
    seed: int,
    chat_template: bool,
    options: dict[str, Any],
) -> Task:
    from eval.ruler import generate_samples, score

    if length is None:
        raise ValueError(f"{name}: RULER samples are generated at a token length; pass length= (e.g. 4096).")
    num_samples = RULER_DEFAULT_SAMPLES if num_samples is None else num_samples
    options = dict(options)
    chat_template = prompt_template(tokenizer, chat_template) == "chat"  # a base model gets the plain template
    if "reserve_tokens" not in options:
        options["reserve_tokens"] = chat_template_overhead(tokenizer, chat_template)  # it must fit in `length` too
    task = name.split("/", 1)[1]
    raw = generate_samples(task, tokenizer, length=length, num_samples=num_samples, seed=seed, **options)
    samples = [
        Sample(
            id=f"{name}/L{length}/s{seed}/{s.index}",
            task=name,
            context=s.context,
            question=s.question,
            answer_prefix=s.answer_prefix,
            references=list(s.outputs),
            max_new_tokens=s.max_new_tokens,
            chat_template=chat_template,
            length_tokens=s.length_tokens,
            metadata={"index": s.index, "seed": seed, "length": length},
        )
        for s in raw
    ]
    return Task(
        name,
        samples,
        lambda pred, s: score(task, pred, s.references),
        {
            "length": length,
            "seed": seed,
            "num_samples": num_samples,
            "chat_template": chat_template,
            **{k: str(v) for k, v in options.items()},
        },
    )


def _load_longbench(
    name: str,
    tokenizer,
    length: int | None,
    num_samples: int | None,
    chat_template: bool | None,
    data_dir,
    options: dict[str, Any],
) -> Task:
    from eval.longbench import get_task, load_task, score_prediction, truncate_sample

    family, task = name.split("/", 1)
    spec = get_task(task)
    use_template = spec.use_chat_template if chat_template is None else chat_template
    use_template = prompt_template(tokenizer, use_template) == "chat"
    raw = load_task(
        task, data_dir=data_dir, longbench_e=family == "longbench_e", max_samples=num_samples, **options
    )
    if length is not None:
        # pred.py's middle truncation, leaving room for the answer and the chat template.
        budget = length - spec.max_new_tokens - chat_template_overhead(tokenizer, use_template)
        raw = [truncate_sample(s, tokenizer, budget, add_special_tokens=False) for s in raw]
    classes = {}
    samples = []
    for s in raw:
        sid = f"{name}/L{length or 'full'}/{s._id}"
        classes[sid] = s.all_classes
        samples.append(
            Sample(
                id=sid,
                task=name,
                context=s.context_part,
                question=s.question_part,
                answer_prefix="",
                references=list(s.answers),
                max_new_tokens=spec.max_new_tokens,
                chat_template=use_template,
                length_tokens=_count_tokens(tokenizer, s.prompt),
                metadata={"_id": s._id, "length": s.length, "language": s.language},
            )
        )
    if len({s.id for s in samples}) != len(samples):
        raise ValueError(f"{name}: the data has repeated _id values; sample ids must be unique to resume.")

    def scorer(pred: str, s: Sample) -> float:
        return score_prediction(task, pred, s.references, classes[s.id])

    return Task(
        name,
        samples,
        scorer,
        {
            "length": length,
            "num_samples": num_samples,
            "chat_template": use_template,
            "data_dir": str(data_dir),
        },
    )


def load_samples(
    task: str,
    tokenizer,
    length: int | None = None,
    num_samples: int | None = None,
    seed: int = 0,
    data_dir: str | os.PathLike | None = None,
    chat_template: bool | None = None,
    **options,
) -> Task:
    """Load (or generate) the samples of ``task`` and its scorer.

    ``task``: ``ruler/<task>`` (one of the 13 RULER tasks), ``longbench/<task>`` or ``longbench_e/<task>``.
    ``length``: RULER's total length in tokens (prompt + generation, chat template included when used);
    for LongBench the prompt is middle-truncated to fit ``length`` (None: no truncation).
    ``num_samples``: RULER default 100; LongBench default all (the first ``num_samples`` of the file).
    ``seed``: RULER's generation seed (LongBench has a fixed order). ``data_dir``: the LongBench files.
    ``chat_template``: wrap the prompt in the tokenizer's chat template (default: True for RULER, the
    official per-task choice for LongBench). ``options`` go to :func:`eval.ruler.generate_samples` or
    :func:`eval.longbench.load_task`.
    """
    family = task.split("/", 1)[0]
    positive_int("num_samples", num_samples, none=True, owner=task, error=UsageError, hint=" (None: all)")
    positive_int("length", length, none=True, owner=task, error=UsageError, hint=" tokens")
    if "/" not in task or family not in ("ruler", "longbench", "longbench_e"):
        raise ValueError(
            f"Unknown task {task!r}: name it 'ruler/<task>', 'longbench/<task>' or 'longbench_e/<task>'."
        )
    if family == "ruler":
        if data_dir is not None:
            raise ValueError(
                "data_dir is for LongBench; RULER QA data files are options (squad_file=, hotpotqa_file=)."
            )
        return _load_ruler(
            task,
            tokenizer,
            length,
            num_samples,
            seed,
            True if chat_template is None else chat_template,
            options,
        )
    return _load_longbench(task, tokenizer, length, num_samples, chat_template, data_dir, options)


# ---------------------------------------------------------------------------------------------------------
# records, references, resume


def _jsonable(value: Any) -> Any:
    if isinstance(value, Compressor):
        return describe_compressor(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def describe_compressor(compressor: Compressor | None) -> dict[str, Any]:
    """``{"name": ..., "params": {...}}``; ``{"name": "none", "params": {}}`` for the uncompressed baseline."""
    if compressor is None:
        return {"name": "none", "params": {}}
    return {"name": name_of(compressor), "params": _jsonable(compressor.params())}


def model_id(model) -> str:
    """The model's name or path plus a short hash of its config (the tiny test model has no name)."""
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    digest = hashlib.sha1(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:10]
    return f"{name}#{digest}"


def _prompt_hash(s: Sample) -> str:
    blob = json.dumps([s.context, s.question, s.answer_prefix, s.chat_template])
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _reference_key(s: Sample, model: str, dtype: str, query_aware: bool) -> str:
    return json.dumps([s.id, _prompt_hash(s), model, dtype, query_aware, s.max_new_tokens])


def _read_jsonl(path: Path, repair: bool = False) -> list[dict]:
    """Complete JSON lines of ``path``; a partial last line (an interrupted write) is dropped, and with
    ``repair`` cut off the file so later appends start on a fresh line."""
    if repair:  # a file this run will append to: never through a link (the repair would truncate its target)
        files.check_not_link(path)
    if not path.exists():
        return []
    data = files.read_bytes(path) if repair else path.read_bytes()
    good_end = data.rfind(b"\n") + 1
    if good_end < len(data):
        warnings.warn(f"{path}: dropping an incomplete last line (interrupted write).", stacklevel=3)
        if repair:
            files.truncate(path, good_end)
    records = []
    for lineno, line in enumerate(data[:good_end].decode().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({err}).") from None
    return records


def load_records(path: str | os.PathLike) -> list[dict]:
    """All records of a run's output file."""
    return _read_jsonl(Path(path))


def task_records(path: str | os.PathLike, task_samples: Task) -> list[dict]:
    """The records of ``path`` for the samples of ``task_samples`` (a resumed directory may hold more, from an
    earlier run asked for more samples; a summary of this run describes the samples it was asked for)."""
    ids = {s.id for s in task_samples.samples}
    return [r for r in load_records(path) if r.get("id") in ids]


def _append(path: Path, rows: Iterable[dict]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    # One write per call in append mode: concurrent writers of the sidecar do not interleave lines.
    files.append_text(path, text)


def _check_config(path: Path, existing: list[dict], config: dict[str, Any]) -> None:
    for record in existing:
        theirs = {k: record.get(k) for k in CONFIG_FIELDS}
        if theirs != config:
            diff = {k: (theirs[k], config[k]) for k in CONFIG_FIELDS if theirs[k] != config[k]}
            raise RunConfigMismatch(
                f"{path} holds records of another configuration (record {record.get('id')!r}); "
                f"differences (file, now): {diff}. Write to another out_path, or delete the file to start over."
            )


class ReferenceStore:
    """Uncompressed generations, keyed by sample, prompt hash, model, dtype, mode and max_new_tokens."""

    def __init__(self, path: Path | None):
        self.path = path
        self.rows: dict[str, dict] = {}
        if path is not None:
            for row in _read_jsonl(path, repair=True):
                self.rows[row["key"]] = row

    def get(self, key: str) -> dict | None:
        return self.rows.get(key)

    def add(self, rows: list[dict]) -> None:
        for row in rows:
            self.rows[row["key"]] = row
        if self.path is not None and rows:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _append(self.path, rows)


# ---------------------------------------------------------------------------------------------------------
# running


@dataclass
class _Batch:
    texts: list[str]
    token_ids: list[list[int]]
    prompt_tokens: list[int]
    kept_tokens: list[float]  # per row, mean over layers and KV heads
    prefill_seconds: float
    decode_seconds: float
    resident_bytes: dict[str, int]
    full_bytes: int
    lossless: dict[str, Any] | None = None
    stored_bytes: int | None = None  # what a saved context keeps (Compressor.stored_nbytes); None: the resident


def _generate(
    model,
    tokenizer,
    samples: Sequence[Sample],
    compressor: Compressor | None,
    query_aware: bool,
    stop_ids: set[int],
    lossless: Lossless | None = None,
) -> _Batch:
    parts = [
        split_prompt(tokenizer, s.context, s.question, s.answer_prefix, s.chat_template) for s in samples
    ]
    if compressor is not None:
        compressor.check(len(parts))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows, stats = generate_ids(
        model, parts, compressor, samples[0].max_new_tokens, query_aware, pad_id, stop_ids, lossless
    )
    return _batch_result(tokenizer, parts, rows, stats, compressor)


def _batch_result(tokenizer, parts, rows: list[list[int]], stats: dict, compressor: Compressor | None) -> _Batch:
    cache = stats["cache"]
    resident, full, _ = cache_stats(cache)
    if "lossless" in stats:
        resident = add_full_kv_bytes(resident, stats["lossless"])
    if compressor is None:
        per_row = [
            float(len(p.context_ids) + len(p.question_ids) + stats["generated_steps"] - 1) for p in parts
        ]
    else:
        kept = torch.stack([k.float() for k in cache.kept_tokens()])  # [layers, B, H_kv]
        per_row = kept.mean(dim=(0, 2)).tolist()
    return _Batch(
        texts=[tokenizer.decode(r, skip_special_tokens=True) for r in rows],
        token_ids=rows,
        prompt_tokens=[len(p.context_ids) + len(p.question_ids) for p in parts],
        kept_tokens=per_row,
        prefill_seconds=stats["prefill_seconds"],
        decode_seconds=stats["decode_seconds"],
        resident_bytes=resident,
        full_bytes=full,
        lossless=stats["lossless"].as_dict() if "lossless" in stats else None,
        stored_bytes=cache.stored_bytes() if compressor is not None and "lossless" not in stats else None,
    )


def _batches(samples: Sequence[Sample], batch_size: int) -> Iterator[list[Sample]]:
    # One batch shares max_new_tokens; consecutive samples with the same cap are grouped.
    batch: list[Sample] = []
    for s in samples:
        if batch and (len(batch) == batch_size or s.max_new_tokens != batch[0].max_new_tokens):
            yield batch
            batch = []
        batch.append(s)
    if batch:
        yield batch


def run(
    model,
    tokenizer,
    task_samples: Task,
    compressor: Compressor | str | None,
    *,
    query_aware: bool,
    out_path: str | os.PathLike | None = None,
    batch_size: int = 1,
    reference: str | os.PathLike | None = "auto",
    model_name: str | None = None,
    progress: bool = True,
    lossless: bool | Lossless = False,
    **compressor_params,
) -> Iterator[dict]:
    """Generate every sample of ``task_samples`` with ``compressor`` and yield one record per sample.

    ``compressor``: a Compressor, a registered name (hyper-parameters as keyword arguments) or None (the
    uncompressed baseline). ``query_aware``: compress the whole prompt with the question (True) or the
    context before the question is seen (False). ``out_path``: JSONL file that records are appended to;
    samples already in it are skipped (only new records are yielded; :func:`load_records` reads them all).
    Arguments and an existing ``out_path`` are checked when ``run`` is called; the samples run as the returned
    iterator is consumed.
    ``reference``: ``"auto"`` (``reference.jsonl`` beside ``out_path``, in memory without one), a path to
    the reference cache, or None to skip fidelity. ``model_name`` overrides :func:`model_id` in records and
    reference keys.
    """
    if not isinstance(query_aware, bool):
        raise TypeError(f"query_aware must be True or False, got {query_aware!r}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if compressor_params and not isinstance(compressor, str):
        raise TypeError(
            f"Hyper-parameters {sorted(compressor_params)} go with a compressor name, not {compressor!r}."
        )
    compressor = resolve_compressor(compressor, **compressor_params)
    if compressor is not None:
        compressor.check(batch_size)
    lossless = lossless_config(lossless)
    if lossless is not None and compressor is None:
        raise ValueError("lossless=True drafts with a compressor; the uncompressed baseline needs none.")
    out_path = Path(out_path) if out_path is not None else None
    config = _run_config(model, compressor, query_aware, model_name, lossless)

    _check_context(model, task_samples)
    ids = [s.id for s in task_samples.samples]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{task_samples.name}: sample ids are not unique.")

    done: set[str] = set()
    # One process per run directory, held until the records are written (the returned iterator is exhausted,
    # closed or dropped): a second one would append every record again.
    lock = None if out_path is None else files.lock_run_dir(out_path.parent, out_path.name)
    try:
        if out_path is not None:
            existing = _read_jsonl(out_path, repair=True)
            _check_config(out_path, existing, config)
            done = {r["id"] for r in existing}
        if reference is None:
            references = None
        elif reference == "auto":
            references = ReferenceStore(out_path.parent / REFERENCE_FILE if out_path is not None else None)
        else:
            references = ReferenceStore(Path(reference))
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    todo = [s for s in task_samples.samples if s.id not in done]
    stop_ids = stop_token_ids(model, tokenizer)
    mode = "query_aware" if query_aware else "query_agnostic"
    # Everything above runs at call time, so a bad configuration fails before the first sample.
    return _produce(
        model,
        tokenizer,
        task_samples,
        todo,
        compressor,
        query_aware,
        batch_size,
        out_path,
        references,
        config,
        stop_ids,
        mode,
        progress,
        lossless,
        lock,
    )


def _run_config(model, compressor: Compressor | None, query_aware: bool, model_name: str | None,
                lossless: Lossless | None = None) -> dict[str, Any]:
    if compressor is not None:  # loads what the method needs (a KVTC artifact) now, and into its params
        compressor.bind(model)
    return {
        "compressor": describe_compressor(compressor),
        "query_aware": query_aware,
        "model": model_name or model_id(model),
        "dtype": str(model.dtype).removeprefix("torch."),
        "lossless": None if lossless is None else _jsonable(lossless),
    }


def _check_context(model, task_samples: Task) -> None:
    if not task_samples.samples:
        raise UsageError(f"{task_samples.name}: the task has no samples (num_samples={task_samples.config.get('num_samples')!r}"
                         "); ask for at least one.")
    needed = max(s.length_tokens + s.max_new_tokens for s in task_samples.samples)
    check_context_length(model, needed, f"{task_samples.name}: samples",
                         "pass a smaller length= or use a model with a longer context.")


def _produce(
    model,
    tokenizer,
    task_samples: Task,
    todo: list[Sample],
    compressor: Compressor | None,
    query_aware: bool,
    batch_size: int,
    out_path: Path | None,
    references: ReferenceStore | None,
    config: dict,
    stop_ids: set[int],
    mode: str,
    progress: bool,
    lossless: Lossless | None = None,
    lock: files.RunLock | None = None,
) -> Iterator[dict]:
    bar = tqdm(
        total=len(task_samples.samples),
        initial=len(task_samples.samples) - len(todo),
        desc=f"{task_samples.name} {config['compressor']['name']} ({mode})",
        disable=not progress,
    )
    try:
        for batch in _batches(todo, batch_size):
            out = _generate(model, tokenizer, batch, compressor, query_aware, stop_ids, lossless)
            ref_ids = _reference_ids(model, tokenizer, batch, out, compressor, references, config, stop_ids)
            records = _records(task_samples, batch, out, config, mode, ref_ids)
            if out_path is not None:
                _append(out_path, records)
            for record in records:
                bar.update(1)
                yield record
    finally:
        bar.close()
        if lock is not None:
            lock.release()


def run_grid(
    model,
    tokenizer,
    task_samples: Task,
    compressors: dict[str, Compressor | str | None],
    *,
    query_aware: bool,
    out_dir: str | os.PathLike,
    model_name: str | None = None,
    progress: bool = True,
    store=None,
) -> dict[str, dict[str, Any]]:
    """Run every compressor of ``compressors`` (label -> Compressor, registered name or None) over the task
    with ONE prefill per sample shared by all of them (:mod:`kvcomp.shared_prefill`: the prefill runs on
    the full KV whatever the compressor, so each compressor only adds its compression and decoding).

    Writes ``out_dir/<label>/results.jsonl`` (the records of :func:`run`, plus ``compress_seconds`` and
    ``shared_prefill_seconds``) and ``summary.json`` per label (over the samples of ``task_samples``), the
    layout ``kvcomp report`` reads, and the uncompressed generations to ``out_dir/reference.jsonl`` for fidelity.
    Resumable: samples whose records exist for a label are not redone. Returns the summary per label. Batch
    size 1. One process at a time per ``out_dir`` (:func:`kvcomp.files.lock_run_dir`).

    ``store`` (a :func:`kvcomp.store.open_store` URL or Store): each sample's prefill, compressed by each
    compressor, is kept there (:func:`kvcomp.contexts.continue_stored`) and reused by later runs, in any process
    or machine that reaches the store: a sample whose every configuration is stored is not prefilled at all.
    Outputs and records are the same as without a store (``from_store``/``recomputed`` say which happened)."""
    if not isinstance(query_aware, bool):
        raise TypeError(f"query_aware must be True or False, got {query_aware!r}.")
    out_dir = Path(out_dir)
    resolved = {label: resolve_compressor(c) for label, c in compressors.items()}
    for compressor in resolved.values():
        if compressor is not None:
            compressor.check(1)
    _check_context(model, task_samples)
    # One process per output directory: a second one would append every record again.
    with files.lock_run_dir(out_dir, f"{task_samples.name} ({len(resolved)} configurations)"):
        return _run_grid(model, tokenizer, task_samples, resolved, query_aware, out_dir, model_name, progress, store)


def _run_grid(model, tokenizer, task_samples: Task, resolved: dict[str, Compressor | None], query_aware: bool,
              out_dir: Path, model_name: str | None, progress: bool, store=None) -> dict[str, dict[str, Any]]:
    configs, paths, done = {}, {}, {}
    for label, compressor in resolved.items():
        configs[label] = _run_config(model, compressor, query_aware, model_name)
        paths[label] = files.make_dirs(out_dir / label, out_dir) / "results.jsonl"
        files.check_not_link(paths[label].parent / "summary.json")  # written last: refuse before the work
        existing = _read_jsonl(paths[label], repair=True)
        _check_config(paths[label], existing, configs[label])
        done[label] = {r["id"] for r in existing}
    references = ReferenceStore(out_dir / REFERENCE_FILE)
    reference_model = model_name or model_id(model)
    dtype = str(model.dtype).removeprefix("torch.")
    stop_ids = stop_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    mode = "query_aware" if query_aware else "query_agnostic"
    device = str(model.device)

    for s in tqdm(task_samples.samples, desc=f"{task_samples.name} x {len(resolved)} compressors ({mode})",
                  disable=not progress):
        key = _reference_key(s, reference_model, dtype, query_aware)
        labels = [label for label in resolved if s.id not in done[label]]
        if not labels and references.get(key) is not None:
            continue
        parts = [split_prompt(tokenizer, s.context, s.question, s.answer_prefix, s.chat_template)]
        continue_from, pre, prefilled = _continuation(model, parts, query_aware, pad_id, store, s.chat_template)
        if store is None:
            prefilled()  # always needed: run (and measure) it before the configurations' own peaks
        measured = {}
        uncompressed = None
        if references.get(key) is None:
            uncompressed, measured["none"] = _measured(continue_from, None, s.max_new_tokens, stop_ids, pre, device)
            ids = uncompressed[0]
            references.add([{"key": key, "id": s.id, "token_ids": ids[0],
                             "text": tokenizer.decode(ids[0], skip_special_tokens=True)}])
        ref_ids = [references.get(key)["token_ids"]]
        for label in labels:
            if resolved[label] is None and uncompressed is not None:
                # An uncompressed label runs exactly the decode the reference just ran: keep it, do not redo it.
                (rows, stats), rise = uncompressed, measured["none"]
            else:
                (rows, stats), rise = _measured(continue_from, resolved[label], s.max_new_tokens, stop_ids, pre,
                                                device)
            out = _batch_result(tokenizer, parts, rows, stats, resolved[label])
            record = _records(task_samples, [s], out, configs[label], mode, ref_ids)[0]
            record.update(compress_seconds=stats["compress_seconds"],
                          shared_prefill_seconds=stats["shared_prefill_seconds"], peak_rise_mb=rise,
                          shared_prefill_peak_rise_mb=pre[0].peak_rise_mb if pre else None)
            if store is not None:
                record.update(from_store=not stats["recomputed"], context_key=stats["context_key"])
            _append(paths[label], [record])
        pre.clear()  # the prefill's records (hundreds of MB at 4K): gone before the next sample's

    return {label: write_summary(path.parent, task_samples.name, task_samples.config.get("length"), task_samples)
            for label, path in paths.items()}


def _measured(continue_from, compressor, max_new_tokens: int, stop_ids, pre: list, device: str):
    """``(continue_from(...), peak rise in MiB)``: the peak rise of process memory while a configuration builds its
    cache from the shared prefill and decodes; None where the call ran the shared prefill itself (a store miss):
    that peak is the prefill's, recorded apart."""
    had_prefill = bool(pre)
    with PeakMemory(device) as peak:
        result = continue_from(compressor, max_new_tokens, stop_ids)
    return result, peak.rise_mb if had_prefill or not pre else None


def write_summary(run_dir: str | os.PathLike, task: str, length: int | None,
                  task_samples: Task | None = None) -> dict[str, Any]:
    """Write ``run_dir/summary.json`` from ``run_dir/results.jsonl`` as :func:`run_grid` does for each label
    (the sharded grid's merge writes its files with it too); returns the summary. With ``task_samples``, over
    those samples only (a resumed directory may hold more, from an earlier, larger run)."""
    run_dir = Path(run_dir)
    path = run_dir / "results.jsonl"
    records = task_records(path, task_samples) if task_samples is not None else load_records(path)
    summary = {**summarize(records), "task": task, "length": length, "run_dir": str(run_dir)}
    files.write_text(run_dir / "summary.json", json.dumps(_jsonable(summary), indent=2) + "\n")
    return summary


def _continuation(model, parts, query_aware: bool, pad_id: int, store, chat_template: bool):
    """``(continue_from(compressor, max_new_tokens, stop_ids), holder, prefilled)`` for one sample: from ONE shared
    prefill, or through ``store`` (the prefill runs only if some configuration is not stored; ``holder`` keeps it,
    ``prefilled()`` runs it now, its peak memory rise in its ``peak_rise_mb``)."""
    holder: list = []

    def prefilled():
        if not holder:
            with PeakMemory(str(model.device)) as peak:
                pre = shared_prefill.prefill(model, parts, query_aware, pad_id)
            pre.peak_rise_mb = peak.rise_mb
            holder.append(pre)
        return holder[0]

    if store is None:
        return ((lambda c, n, stops: shared_prefill.continue_from(model, prefilled(), c, n, pad_id, stops)), holder,
                prefilled)
    from kvcomp.contexts import continue_stored

    return (lambda c, n, stops: continue_stored(model, parts, query_aware, c, store, prefilled, n, pad_id, stops,
                                                chat_template)), holder, prefilled


def _records(task_samples: Task, batch: list[Sample], out: _Batch, config: dict, mode: str,
             ref_ids: list[list[int]] | None) -> list[dict]:
    records = []
    for i, s in enumerate(batch):
        record = {
            "id": s.id,
            "task": s.task,
            "prediction": out.texts[i],
            "references": s.references,
            "score": task_samples.score(out.texts[i], s),
            "context_length": out.prompt_tokens[i],
            "length_tokens": s.length_tokens,
            "generated_tokens": len(out.token_ids[i]),
            "max_new_tokens": s.max_new_tokens,
            "prefill_seconds": out.prefill_seconds,
            "decode_seconds": out.decode_seconds,
            "resident_bytes": out.resident_bytes,
            "full_bytes": out.full_bytes,
            "memory_factor": out.full_bytes / out.resident_bytes["device"]
            if out.resident_bytes.get("device")
            else math.inf,
            # KVTC: its entropy-coded form; every other method stores what it holds (the memory_factor).
            "stored_factor": out.full_bytes / out.stored_bytes if out.stored_bytes else None,
            "kept_tokens": out.kept_tokens[i],
            "batch_size": len(batch),
            "template": "chat" if s.chat_template else "plain",
            "lossless_stats": out.lossless,
            "mode": mode,
            **config,
            "exact_match": None,
            "first_divergence": None,
            "length_change": None,
            "agreement": None,
            "metadata": s.metadata,
        }
        if ref_ids is not None:
            record.update(fidelity(out.token_ids[i], ref_ids[i]).as_dict())
        records.append(record)
    return records


def _reference_ids(
    model,
    tokenizer,
    batch: list[Sample],
    out: _Batch,
    compressor: Compressor | None,
    references: ReferenceStore | None,
    config: dict,
    stop_ids: set[int],
) -> list[list[int]] | None:
    """Uncompressed output ids of each sample of the batch, from the cache or generated (and cached) now."""
    if references is None:
        return None
    keys = [_reference_key(s, config["model"], config["dtype"], config["query_aware"]) for s in batch]
    if compressor is None:  # this run is the reference
        fresh = {i: (out.token_ids[i], out.texts[i]) for i in range(len(batch))}
    else:
        missing = [i for i, k in enumerate(keys) if references.get(k) is None]
        fresh = {}
        if missing:
            ref = _generate(
                model, tokenizer, [batch[i] for i in missing], None, config["query_aware"], stop_ids
            )
            fresh = {i: (ref.token_ids[j], ref.texts[j]) for j, i in enumerate(missing)}
    new_rows = [
        {"key": keys[i], "id": batch[i].id, "token_ids": ids, "text": text}
        for i, (ids, text) in fresh.items()
        if references.get(keys[i]) is None
    ]
    references.add(new_rows)
    return [references.get(k)["token_ids"] for k in keys]


# ---------------------------------------------------------------------------------------------------------
# summaries


def _mean(values: Iterable[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _label(records: Sequence[dict], key: str) -> Any:
    values = {json.dumps(r.get(key), sort_keys=True) for r in records}
    return json.loads(values.pop()) if len(values) == 1 else "mixed"


def summarize(records: Iterable[dict]) -> dict[str, Any]:
    """Aggregate records: mean score, mean memory_factor, exact-match rate, mean first divergence among the
    diverged outputs, mean seconds, n; labelled with the mode, compressor, model and dtype ("mixed" when
    the records disagree). Fidelity fields are None when no record has them."""
    records = list(records)
    if not records:
        return {"n": 0}
    with_fidelity = [r for r in records if r.get("exact_match") is not None]
    diverged = [r for r in with_fidelity if not r["exact_match"]]
    return {
        "n": len(records),
        "mode": _label(records, "mode"),
        "query_aware": _label(records, "query_aware"),
        "compressor": _label(records, "compressor"),
        "model": _label(records, "model"),
        "dtype": _label(records, "dtype"),
        "tasks": sorted({r["task"] for r in records}),
        "score": _mean(r["score"] for r in records),
        "memory_factor": _mean(r["memory_factor"] for r in records),
        "stored_factor": _mean(r.get("stored_factor") or r["memory_factor"] for r in records),
        "kept_tokens": _mean(r.get("kept_tokens") for r in records),
        "context_length": _mean(r.get("context_length") for r in records),
        "exact_match_rate": (len(with_fidelity) - len(diverged)) / len(with_fidelity)
        if with_fidelity
        else None,
        "n_fidelity": len(with_fidelity),
        "n_diverged": len(diverged),
        "mean_first_divergence": _mean(r["first_divergence"] for r in diverged),
        "agreement": _mean(r.get("agreement") for r in with_fidelity),
        "prefill_seconds": _mean(r["prefill_seconds"] for r in records),
        "decode_seconds": _mean(r["decode_seconds"] for r in records),
        "peak_rise_mb": _mean(r.get("peak_rise_mb") for r in records),
        "lossless": _label(records, "lossless"),
        "mean_tokens_per_round": _mean(
            (r.get("lossless_stats") or {}).get("mean_tokens_per_round") for r in records
        ),
    }


def summarize_by(records: Iterable[dict], key: str = "task") -> dict[str, dict[str, Any]]:
    """:func:`summarize` per value of ``key`` (e.g. ``"task"``)."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(str(r.get(key)), []).append(r)
    return {k: summarize(v) for k, v in sorted(groups.items())}
