"""Benchmark of retrieval with offload (FreeKV-style and SpeCache-style) against the uncompressed cache.

For each RULER task and sample: the uncompressed run, then each retrieval configuration with the full KV on
disk and a fast-tier budget of ``--budget`` of the full KV (default 1/8). Reported per task and
configuration: score and the uncompressed score, exact match with the uncompressed output, memory_factor
(fast tier), bytes moved from the slow tier per decoded token (all layers), prefetch hit rate (share of the
attended units the prefetch supplied), correction rate (KV head-steps needing a synchronous fetch), recall of
the speculative selection, time waited on fetches, and decode tokens/s. ``-nooverlap`` configurations make the same selections with each fetch done only when
needed, so their tokens/s against the overlapped ones is what overlap buys.

    python -m experiments.retrieval_bench --length 4096 --samples 20 --out runs/retrieval_bench

One prefill per sample is shared by every configuration (:mod:`kvcomp.shared_prefill`); ``prefill_s`` is
that prefill plus the configuration's own compression (offload) and question block. Writes ``records.jsonl``
(one row per sample and configuration, appended as it runs; a rerun skips rows already there),
``summary.csv`` and ``summary.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

from compressors.freekv import FreeKV
from compressors.specache import SpeCache
from eval.runner import load_samples
from kvcomp import load_model, shared_prefill
from kvcomp.generation import cache_stats, split_prompt, stop_token_ids
from kvcomp.metrics import fidelity
from kvcomp.retrieval import retrieval_stats

TASKS = ("ruler/niah_single_1", "ruler/niah_multikey_1")
CONFIGS = ("freekv", "freekv-nooverlap", "specache", "specache-nooverlap")
SUMMARY_COLUMNS = ["task", "config", "n", "score", "score_uncompressed", "score_delta", "exact_match",
                   "memory_factor", "bytes_per_token", "hit_rate", "correction_rate", "recall", "wait_s_per_token",
                   "decode_tokens_per_s", "decode_tokens_per_s_uncompressed", "prefill_s"]


def make_compressor(config: str, budget: float, tier: str, offload_dir: str | None):
    name, _, variant = config.partition("-")
    cls = {"freekv": FreeKV, "specache": SpeCache}[name]
    return cls(budget_fraction=budget, tier=tier, offload_dir=offload_dir, overlap=variant != "nooverlap",
               speculative=variant != "exact")


def run_sample(model, tokenizer, task, sample, pre, compressor, stop_ids) -> dict:
    """Decode one configuration from the sample's shared prefill ``pre`` (:mod:`kvcomp.shared_prefill`)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows, stats = shared_prefill.continue_from(model, pre, compressor, sample.max_new_tokens, pad, stop_ids)
    cache = stats["cache"]
    resident, full, _ = cache_stats(cache)
    text = tokenizer.decode(rows[0], skip_special_tokens=True)
    steps = stats["generated_steps"]
    record = {
        "id": sample.id, "task": task.name, "prompt_tokens": pre.prompt_tokens[0],
        "prediction": text, "token_ids": rows[0], "score": task.score(text, sample),
        "prefill_s": stats["prefill_seconds"], "compress_s": stats["compress_seconds"], "decode_s": stats["decode_seconds"], "steps": steps,
        # The first token comes from the prefill; decode_s covers the steps - 1 forwards after it.
        "decode_tokens_per_s": (steps - 1) / stats["decode_seconds"] if steps > 1 else None,
        "resident_bytes": resident, "full_bytes": full,
        "memory_factor": full / resident["device"] if resident.get("device") else None,
    }
    if compressor is not None:
        record["retrieval"] = retrieval_stats(cache)
    del cache, stats
    return record


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(records: list[dict]) -> list[dict]:
    base = {(r["task"], r["id"]): r for r in records if r["config"] == "none"}
    rows = []
    for (task, config) in sorted({(r["task"], r["config"]) for r in records}):
        rs = [r for r in records if r["task"] == task and r["config"] == config]
        ref = [base.get((task, r["id"])) for r in rs]
        score = _mean(r["score"] for r in rs)
        score_ref = _mean(b["score"] for b in ref if b)
        ret = [r.get("retrieval") or {} for r in rs]
        rows.append({
            "task": task, "config": config, "n": len(rs), "score": score, "score_uncompressed": score_ref,
            "score_delta": None if score is None or score_ref is None else score - score_ref,
            "exact_match": _mean(float(fidelity(r["token_ids"], b["token_ids"]).exact_match) for r, b in zip(rs, ref)
                                 if b),
            "memory_factor": _mean(r["memory_factor"] for r in rs),
            "bytes_per_token": _mean(x.get("bytes_per_token") for x in ret),
            "hit_rate": _mean(x.get("hit_rate") for x in ret),
            "correction_rate": _mean(x.get("correction_rate") for x in ret),
            "recall": _mean(x.get("recall") for x in ret),
            "wait_s_per_token": _mean(x.get("wait_seconds_per_token") for x in ret),
            "decode_tokens_per_s": _mean(r["decode_tokens_per_s"] for r in rs),
            "decode_tokens_per_s_uncompressed": _mean(b["decode_tokens_per_s"] for b in ref if b),
            "prefill_s": _mean(r["prefill_s"] for r in rs),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="None: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--tasks", nargs="+", default=list(TASKS))
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--budget", type=float, default=0.125, help="fast-tier bytes / full-KV bytes")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS),
                   help="freekv|specache, optionally -nooverlap (no background fetch) or -exact (no speculation)")
    p.add_argument("--tier", default="disk")
    p.add_argument("--offload-dir", default=None)
    p.add_argument("--timing-samples", type=int, default=None,
                   help="run the -nooverlap configurations (timing only: same outputs) on the first N samples")
    p.add_argument("--out", default="runs/retrieval_bench")
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = {(r["config"], r["id"]) for r in records}
    model, tokenizer = load_model(args.model)
    stop_ids = stop_token_ids(model, tokenizer)
    configs = ["none", *args.configs]
    t0 = time.perf_counter()
    for task_name in args.tasks:
        task = load_samples(task_name, tokenizer, length=args.length, num_samples=args.samples, seed=0)
        for i, sample in enumerate(task):
            todo = [c for c in configs if (c, sample.id) not in done and not (
                c.endswith("-nooverlap") and args.timing_samples is not None and i >= args.timing_samples)]
            if not todo:
                continue
            # One prefill per sample, shared by every configuration (prefill attention is on the full KV).
            parts = split_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix,
                                 sample.chat_template)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            pre = shared_prefill.prefill(model, [parts], False, pad)
            for config in todo:
                compressor = None if config == "none" else make_compressor(config, args.budget, args.tier,
                                                                         args.offload_dir)
                record = {"config": config, "budget": args.budget, "tier": args.tier, "length": args.length,
                          "correction": getattr(compressor, "correction", None),
                          **run_sample(model, tokenizer, task, sample, pre, compressor, stop_ids)}
                records.append(record)
                with path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                r = record.get("retrieval") or {}
                print(f"[{time.perf_counter() - t0:7.0f}s] {task_name} {sample.id.rsplit('/', 1)[-1]} {config:20s} "
                      f"score={record['score']:.0f} mf={record['memory_factor'] or 0:.2f} "
                      f"tok/s={record['decode_tokens_per_s'] or 0:.2f} B/tok={r.get('bytes_per_token', 0):.0f} "
                      f"hit={r.get('hit_rate', float('nan')):.2f}", flush=True)
    rows = summarize(records)
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, SUMMARY_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "summary.json").write_text(json.dumps(rows, indent=2))
    for row in rows:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
