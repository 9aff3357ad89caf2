"""kvpress's evaluation layout: export kvcomp's runs to it (``kvcomp export``) and read its directories,
kvpress's own or exported, so ``kvcomp report`` tabulates results of both tools together.

kvpress (NVIDIA/kvpress, ``evaluation/evaluate.py``) writes one directory per evaluation::

    <dataset>__<data_dir>__<model, "/" as "--">__<press_name>__<compression_ratio:.2f>[__query_aware]/
        config.yaml       its EvaluationConfig (yaml, in field order)
        predictions.csv   the dataset's rows without the context: question, answer_prefix, answer, task,
                          max_new_tokens, predicted_answer, compression_ratio
        metrics.json      its scorer's output; RULER: {"<task>": {"string_match": <0..100, 2 decimals>}}

For RULER, ``dataset`` is ``ruler`` and ``data_dir`` the length in tokens (``ruler__4096__...``): one
directory holds every task of one length, model, press, ratio and mode; the uncompressed run is
``no_press`` at ``0.00``. kvpress writes the ``answer`` lists as numpy prints them (``['a' 'b']``).

The export writes the same files; ``question`` and ``answer_prefix`` are empty (kvcomp's records do not keep
the prompt; kvpress's scorer does not read them), and ``predictions.csv`` has kvcomp's columns besides
(``id``, ``score``, ``exact_match``, ``memory_factor``, ``context_length``), with ``kvcomp.json`` holding the
compressor, its parameters and the full model id: kvpress ignores both, and the reader uses them. A
compressor without a ``compression_ratio`` (quant, kvtc) is named by ``1 - 1 / memory_factor``, the share of
the cache's bytes removed. Only RULER exports and reads so far.

Read back, a kvpress directory gives one run per task. kvpress's own have ``source = "kvpress"``, ids
``kvpress/ruler/<length>/<task>/<row>`` (its rows are in dataset order, so its runs pair with each other, not
with kvcomp's, whose samples are generated otherwise), per-sample scores from RULER's metric
after kvpress's cleaning of the prediction, and ``memory_factor = 1 / (1 - compression_ratio)``: kvpress
measures no memory (and its head-wise presses free none), so that is its nominal factor.
"""

from __future__ import annotations

import ast
import csv
import json
import math
import os
import re
from pathlib import Path
from typing import Any

PREDICTIONS = "predictions.csv"
METRICS = "metrics.json"
CONFIG = "config.yaml"
SIDECAR = "kvcomp.json"
# kvpress's predictions.csv columns for RULER, then kvcomp's.
KVPRESS_COLUMNS = ["question", "answer_prefix", "answer", "task", "max_new_tokens", "predicted_answer",
                   "compression_ratio"]
KVCOMP_COLUMNS = ["id", "score", "exact_match", "memory_factor", "context_length"]
_CONTROL = re.compile(r"[\x00-\x1f]")  # kvpress's RULER scorer removes these from predictions
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


class KvpressFormatError(ValueError):
    """A run cannot be written in kvpress's layout, or a directory is not one."""


def is_kvpress_dir(path: Path) -> bool:
    return (path / PREDICTIONS).is_file() and (path / METRICS).is_file() and (path / CONFIG).is_file()


def find_kvpress_dirs(paths) -> list[Path]:
    found = set()
    for p in map(Path, paths):
        if is_kvpress_dir(p):
            found.add(p.resolve())
        found.update(m.parent.resolve() for m in p.rglob(METRICS) if is_kvpress_dir(m.parent))
    return sorted(found)


def parse_answers(text: str) -> list[str]:
    """The ``answer`` cell: a Python list (``['a', 'b']``) or a numpy array as kvpress writes it (``['a' 'b']``)."""
    return [ast.literal_eval(s) for s in _STRING.findall(text)]


def _model_name(model_id: str) -> str:
    name = model_id.split("#", 1)[0]
    return Path(name).name if os.path.isabs(name) or name.startswith(".") else name


def _ratio(compressor: dict, memory_factor: float) -> float:
    if compressor["name"] == "none":
        return 0.0
    ratio = compressor["params"].get("compression_ratio")
    if ratio is not None:
        return float(ratio)
    return 1.0 - 1.0 / memory_factor if memory_factor and math.isfinite(memory_factor) else math.nan


def dir_name(dataset: str, data_dir: str, model: str, press: str, ratio: float, query_aware: bool) -> str:
    """kvpress's directory name (``EvaluationConfig.get_results_dir`` without its optional parts)."""
    parts = [dataset, data_dir, model.replace("/", "--"), press, f"{ratio:.2f}"]
    if query_aware:
        parts.append("query_aware")
    return "__".join(p for p in parts if p)


def export_kvpress(paths, out_dir: str | os.PathLike) -> list[Path]:
    """Write the kvcomp runs under ``paths`` in kvpress's layout under ``out_dir``; returns the directories."""
    from eval.runner import load_records
    from experiments.report import find_runs

    out_dir = Path(out_dir)
    groups: dict[str, dict[str, Any]] = {}
    for run_dir in find_runs(paths):
        records = load_records(run_dir / "results.jsonl")
        if not records:
            continue
        first = records[0]
        family, _, task = first["task"].partition("/")
        if family != "ruler":
            raise KvpressFormatError(f"{run_dir}: only RULER runs export to kvpress's layout, not {first['task']!r}.")
        length = first["metadata"]["length"]
        mean_factor = sum(r["memory_factor"] for r in records) / len(records)
        ratio = _ratio(first["compressor"], mean_factor)
        press = "no_press" if first["compressor"]["name"] == "none" else first["compressor"]["name"]
        name = dir_name("ruler", str(length), _model_name(first["model"]), press, ratio, first["query_aware"])
        key = {k: first[k] for k in ("compressor", "model", "dtype", "query_aware", "lossless")}
        group = groups.setdefault(name, {"key": key, "tasks": {}, "ratio": ratio, "press": press,
                                         "length": length, "seed": first["metadata"].get("seed")})
        if group["key"] != key or task in group["tasks"]:
            raise KvpressFormatError(
                f"Two runs map to the kvpress directory {name} ({run_dir} and another with "
                f"{group['key']['compressor']}): export them to separate --out directories."
            )
        group["tasks"][task] = records
    written = []
    for name, group in groups.items():
        written.append(_write_dir(out_dir / name, group, out_dir))
    return written


def _write_dir(path: Path, group: dict, out_dir: Path) -> Path:
    import yaml

    path.mkdir(parents=True, exist_ok=True)
    key = group["key"]
    rows, metrics, tasks = [], {}, {}
    for task, records in group["tasks"].items():
        for r in records:
            rows.append({
                "question": "", "answer_prefix": "", "answer": str(list(r["references"])), "task": task,
                "max_new_tokens": r["max_new_tokens"], "predicted_answer": r["prediction"],
                "compression_ratio": group["ratio"], "id": r["id"], "score": r["score"],
                "exact_match": r.get("exact_match"), "memory_factor": r["memory_factor"],
                "context_length": r["context_length"],
            })  # fmt: skip
        metrics[task] = {"string_match": round(sum(r["score"] for r in records) / len(records), 2)}
        tasks[task] = len(records)
    with (path / PREDICTIONS).open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=KVPRESS_COLUMNS + KVCOMP_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (path / METRICS).write_text(json.dumps(metrics, indent=4))
    config = {
        "dataset": "ruler", "data_dir": str(group["length"]), "model": _model_name(key["model"]), "device": None,
        "press_name": group["press"], "compression_ratio": group["ratio"], "key_channel_compression_ratio": None,
        "fraction": 1.0, "max_new_tokens": None, "max_context_length": None, "query_aware": key["query_aware"],
        "needle_depth": None, "compression_interval": None, "target_size": None, "hidden_states_buffer_size": None,
        "output_dir": str(out_dir), "log_level": "INFO", "model_kwargs": {"dtype": key["dtype"]},
        "press_init_command": f"kvcomp {json.dumps(key['compressor'])}", "seed": group["seed"], "fp8": False,
    }  # fmt: skip
    (path / CONFIG).write_text(yaml.dump(config, default_flow_style=False, indent=2, sort_keys=False))
    (path / SIDECAR).write_text(json.dumps({"source": "kvcomp", **key, "tasks": tasks}, indent=2) + "\n")
    return path


def _float(text: str | None) -> float | None:
    return None if text in (None, "", "None") else float(text)


def read_kvpress_dir(path: str | os.PathLike) -> list[tuple[dict[str, Any], dict[str, dict]]]:
    """The runs of a kvpress directory: ``[(row, samples)]``, one per task; ``row`` has the columns of
    :data:`experiments.report.COLUMNS`, ``samples`` maps sample id to ``{"score", "exact_match"}``."""
    import yaml

    from eval.ruler import score as ruler_score

    path = Path(path)
    if not is_kvpress_dir(path):
        raise KvpressFormatError(f"{path}: not a kvpress evaluation directory ({CONFIG}, {PREDICTIONS}, {METRICS}).")
    config = yaml.safe_load((path / CONFIG).read_text()) or {}
    if config.get("dataset") != "ruler":
        raise KvpressFormatError(f"{path}: kvcomp reads kvpress's RULER results only, not {config.get('dataset')!r}.")
    sidecar = json.loads((path / SIDECAR).read_text()) if (path / SIDECAR).is_file() else None
    query_aware = bool(config.get("query_aware", config.get("compress_questions", False)))
    press = config.get("press_name", "?")
    ratio = float(config.get("compression_ratio") or 0.0)
    with (path / PREDICTIONS).open(newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    by_task: dict[str, list[dict]] = {}
    for row in table:
        by_task.setdefault(row["task"], []).append(row)
    mode = "query_aware" if query_aware else "query_agnostic"
    # kvpress's rows are its dataset's, in order (a fraction < 1 samples them with its seed): the same
    # dataset, length, fraction and seed are the same samples, so its presses pair with its no_press run.
    fraction = float(config.get("fraction") or 1.0)
    sample_prefix = f"kvpress/ruler/{config['data_dir']}" + (
        f"/fraction{fraction:g}-seed{config.get('seed')}" if fraction < 1 else "")
    out = []
    for task, rows in by_task.items():
        samples = {}
        for i, row in enumerate(rows):
            sid = row.get("id") or f"{sample_prefix}/{task}/{i}"
            if sidecar is not None:
                exact = row.get("exact_match")
                samples[sid] = {"score": float(row["score"]), "exact_match": None if exact in ("", None) else
                                exact == "True", "memory_factor": float(row["memory_factor"])}
            else:
                prediction = _CONTROL.sub("", (row["predicted_answer"] or "").strip()).strip()
                samples[sid] = {"score": ruler_score(task, prediction, parse_answers(row["answer"])),
                                "exact_match": None}
        scores = [s["score"] for s in samples.values()]
        exact = [s["exact_match"] for s in samples.values() if s["exact_match"] is not None]
        if sidecar is not None:
            name, source, model = sidecar["compressor"]["name"], "kvcomp", sidecar["model"]
            factors = [s["memory_factor"] for s in samples.values()]
            memory_factor = sum(factors) / len(factors)
            params = sidecar["compressor"]["params"]
        else:
            name, source, model = ("none" if press == "no_press" else press), "kvpress", config.get("model")
            memory_factor = 1.0 / (1.0 - ratio) if ratio < 1 else math.inf
            params = {}
        short = "aware" if query_aware else "agnostic"
        label = f"{name} ({short})" if source == "kvcomp" else f"kvpress {name} ({short})"
        if source == "kvcomp" and isinstance(sidecar.get("lossless"), dict):
            label = f"{name} lossless ({short})"
        out.append(({
            "task": f"ruler/{task}", "length": int(config["data_dir"]), "compressor": name,
            "compression_ratio": 0.0 if name == "none" else
            (params.get("compression_ratio") if source == "kvcomp" else ratio),
            "budget": params.get("budget"), "mode": mode, "label": label, "n": len(samples),
            "score": sum(scores) / len(scores), "memory_factor": memory_factor,
            "exact_match_rate": sum(exact) / len(exact) if exact else None,
            "model": model, "dtype": (config.get("model_kwargs") or {}).get("dtype"), "run_dir": str(path),
            "source": source,
        }, samples))  # fmt: skip
    return out
