"""The record format of a peer run (kvpress), readable by ``kvcomp report`` beside kvcomp's own runs.

Standard library only: the peer script imports this module from its own virtual environment (kvpress needs a
transformers that kvcomp does not support), and kvcomp's side reads what it writes. Layout, as ``kvcomp grid``
writes for its own configurations::

    <out>/<task with / as _>/L<length>/<agnostic|aware>/<label>/results.jsonl, summary.json

A record (one per sample) carries what kvcomp's records carry for the report: ``id``, ``task``, ``prediction``,
``score`` (0..100, the task's own metric), ``token_ids``, ``context_length``, ``prefill_seconds``,
``decode_seconds``, ``resident_bytes`` / ``full_bytes`` / ``memory_factor`` (the peer's cache tensors at the end
of generation against an uncompressed cache of the same tokens), ``mode``, ``query_aware``, ``compressor``
(``{"name": "kvpress:<press>", "params": {...}}``), ``model``, ``dtype`` and the fidelity to the peer's own
uncompressed output (``exact_match``, ``first_divergence``, ``length_change``, ``agreement``), plus
``kvcomp_reference_match``: whether that uncompressed output equals kvcomp's (the same model and tokens).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

REQUIRED = ("id", "task", "prediction", "score", "token_ids", "context_length", "prefill_seconds", "decode_seconds",
            "resident_bytes", "full_bytes", "memory_factor", "mode", "query_aware", "compressor", "model", "dtype",
            "exact_match", "first_divergence", "length_change", "agreement")


def fidelity(output_ids: list[int], reference_ids: list[int]) -> dict:
    """kvcomp.metrics.fidelity, as a dict (the same definition)."""
    n = min(len(output_ids), len(reference_ids))
    first = next((i for i in range(n) if output_ids[i] != reference_ids[i]), None)
    if first is None and len(output_ids) != len(reference_ids):
        first = n
    same = sum(a == b for a, b in zip(output_ids, reference_ids))
    agreement = same / len(reference_ids) if reference_ids else float(not output_ids)
    return {"exact_match": first is None, "first_divergence": first, "length_change": len(output_ids) - len(reference_ids),
            "agreement": agreement}


def check_record(record: dict) -> dict:
    """The record, or ValueError naming what is missing or out of range."""
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise ValueError(f"peer record {record.get('id')!r} lacks {missing}")
    if not (0 <= float(record["score"]) <= 100):
        raise ValueError(f"peer record {record['id']!r}: score {record['score']} is not in 0..100")
    if record["mode"] not in ("query_agnostic", "query_aware"):
        raise ValueError(f"peer record {record['id']!r}: mode {record['mode']!r}")
    if not str(record["compressor"].get("name", "")).startswith("kvpress:"):
        raise ValueError(f"peer record {record['id']!r}: compressor name must start with 'kvpress:'")
    return record


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _same(records, key):
    values = {json.dumps(r.get(key), sort_keys=True) for r in records}
    return json.loads(values.pop()) if len(values) == 1 else "mixed"


def summarize(records: list[dict], task: str, length: int) -> dict:
    """The summary ``kvcomp report`` reads (the fields of ``eval.runner.summarize`` it uses)."""
    diverged = [r for r in records if not r["exact_match"]]
    return {
        "n": len(records), "mode": _same(records, "mode"), "query_aware": _same(records, "query_aware"),
        "compressor": _same(records, "compressor"), "model": _same(records, "model"), "dtype": _same(records, "dtype"),
        "tasks": sorted({r["task"] for r in records}), "task": task, "length": length,
        "score": _mean(r["score"] for r in records),
        "memory_factor": _mean(r["memory_factor"] for r in records if math.isfinite(r["memory_factor"])),
        "kept_tokens": _mean(r.get("kept_tokens") for r in records),
        "context_length": _mean(r["context_length"] for r in records),
        "exact_match_rate": (len(records) - len(diverged)) / len(records) if records else None,
        "n_fidelity": len(records), "n_diverged": len(diverged),
        "mean_first_divergence": _mean(r["first_divergence"] for r in diverged),
        "agreement": _mean(r["agreement"] for r in records),
        "prefill_seconds": _mean(r["prefill_seconds"] for r in records),
        "decode_seconds": _mean(r["decode_seconds"] for r in records),
        "kvcomp_reference_match": _mean(float(r["kvcomp_reference_match"]) for r in records
                                        if r.get("kvcomp_reference_match") is not None),
        "peer": "kvpress",
    }


def run_dir(out: Path, task: str, length: int, mode: str, label: str) -> Path:
    short = {"query_agnostic": "agnostic", "query_aware": "aware"}[mode]
    return Path(out) / task.replace("/", "_") / f"L{length}" / short / label


def write_run(directory: Path, records: list[dict]) -> Path:
    """``results.jsonl`` and ``summary.json`` of one peer configuration; returns the summary path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for record in records:
        check_record(record)
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = summarize(records, records[0]["task"], records[0].get("length"))
    summary["run_dir"] = str(directory)
    (directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return directory / "summary.json"


def read_run(directory: Path) -> tuple[list[dict], dict]:
    """The checked records and the summary of one peer configuration."""
    directory = Path(directory)
    records = [check_record(json.loads(line)) for line in (directory / "results.jsonl").read_text().splitlines()
               if line.strip()]
    return records, json.loads((directory / "summary.json").read_text())


# The file that marks a shard directory, as kvcomp's sharded grid marks its own (experiments.shard.SHARD_MARKER):
# `kvcomp report` skips the runs below it, which the merge holds again.
SHARD_MARKER = "shard.json"


def shard_dir(out: Path, index: int, count: int) -> Path:
    """Where shard ``index`` of ``count`` writes its runs (``kvpress_run.py --shard I/N``): created, with its
    :data:`SHARD_MARKER`."""
    directory = Path(out) / "shards" / f"{index}-of-{count}"
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / SHARD_MARKER
    if not marker.is_file():
        marker.write_text(json.dumps({"index": index, "count": count}) + "\n")
    return directory


def merge_shards(out: Path) -> int:
    """Merge the runs of every shard under ``<out>/shards/`` into ``out`` (one run directory per press, task,
    length and mode, the records of all shards in sample order); returns the number of run directories
    written. A sample found in two shards, or shards run with different press settings, is an error: a merge
    never drops or double-counts a record."""
    out = Path(out)
    groups: dict[Path, list[dict]] = {}
    for summary in sorted((out / "shards").glob("*/**/summary.json")):
        shard = summary.relative_to(out / "shards").parts[0]
        relative = summary.parent.relative_to(out / "shards" / shard)
        rows, _ = read_run(summary.parent)
        groups.setdefault(relative, []).extend(rows)
    for relative, rows in groups.items():
        ids = [r["id"] for r in rows]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{relative}: a sample is in two shards ({sorted(i for i in ids if ids.count(i) > 1)[:3]})")
        if len({json.dumps(r["compressor"], sort_keys=True) for r in rows}) != 1:
            raise ValueError(f"{relative}: the shards ran different press settings")
        write_run(out / relative, sorted(rows, key=lambda r: r["id"]))
    return len(groups)
