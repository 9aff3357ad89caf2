"""Lossless decoding benchmark: exact match, accepted length, decode speed against two uncompressed baselines.

    python -m experiments.lossless_bench --lengths 4096 8192 --samples 5 --max-new-tokens 64 \\
        --drafters snapkv:0.75 quant:4 --tier disk --out reports/lossless

For each RULER sample (``niah_single_1`` by default) at each length, with greedy decoding:

* ``resident``: uncompressed decoding, full KV resident (``DynamicCache``), one token per forward;
* ``tiered``: uncompressed decoding with the full KV in ``--tier``, streamed in layer by layer for every token
  (the same reads and prefetch window lossless decoding uses);
* ``lossless/<drafter>``: the drafter's compressed cache drafts ``--gamma`` tokens per round, one forward over
  the full KV in ``--tier`` verifies them.

Decode tokens/s counts the tokens after the first (the first comes from the prefill in every method) over
the decode seconds. ``--max-new-tokens`` tokens are decoded whatever the text says (EOS does not stop a run
unless ``--stop-at-eos``), so every method decodes the same number of tokens. Exact match compares each lossless
output with the resident one, token for token. Writes ``<out>.csv`` (one row per sample and method) and
``<out>.json`` (per length and method: means, speed-ups over both baselines, and the draft/verify/transfer
split that bounds the speed-up).
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import time
from pathlib import Path

import torch

from kvcomp import load_model
from kvcomp.generation import _left_pad, generate_ids, split_prompt, stop_token_ids
from kvcomp.lossless import Lossless, full_kv_decode, lossless_decode

DRAFTERS = {
    "snapkv": lambda x: ("snapkv", {"compression_ratio": float(x)}),
    "quant": lambda x: ("quant", {"bits": int(x)}),
    "streaming_llm": lambda x: ("streaming_llm", {"compression_ratio": float(x)}),
    "h2o": lambda x: ("h2o", {"compression_ratio": float(x)}),
}


def parse_drafter(spec: str):
    from kvcomp.registry import create

    name, _, value = spec.partition(":")
    if name not in DRAFTERS:
        raise SystemExit(f"--drafters: unknown {name!r}; use {', '.join(f'{k}:<value>' for k in DRAFTERS)}.")
    reg, params = DRAFTERS[name](value)
    return spec, lambda: create(reg, **params)


def blocks_of(parts, query_aware: bool, pad_id: int):
    if query_aware:
        rows = [[p.context_ids + p.question_ids for p in parts]]
    else:
        rows = [[p.context_ids for p in parts], [p.question_ids for p in parts]]
        rows = [r for r in rows if any(r)]
    return [_left_pad(r, pad_id) for r in rows]


def run(args) -> dict:
    from eval.runner import load_samples

    torch.set_num_threads(args.threads or torch.get_num_threads())
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stops = stop_token_ids(model, tokenizer) if args.stop_at_eos else set()
    drafters = [parse_drafter(s) for s in args.drafters]
    tier_options = {"window": args.window, "overlap": not args.no_overlap}
    rows: list[dict] = []
    for length in args.lengths:
        task = load_samples(args.task, tokenizer, length=length, num_samples=args.samples, seed=args.seed)
        for sample in task.samples:
            parts = [
                split_prompt(
                    tokenizer, sample.context, sample.question, sample.answer_prefix, sample.chat_template
                )
            ]
            blocks = blocks_of(parts, args.query_aware, pad_id)
            prompt_tokens = sum(b[0].shape[1] for b in blocks)
            base = dict(length=length, sample=sample.id, prompt_tokens=prompt_tokens)

            ids, stats = generate_ids(
                model, parts, None, args.max_new_tokens, args.query_aware, pad_id, stops
            )
            reference = stats["generated_steps"], ids[0]
            rows.append(_row(base, "resident", ids[0], reference[1], stats))
            print(_line(rows[-1]), flush=True)

            cfg = Lossless(
                gamma=args.gamma,
                adaptive=args.adaptive,
                max_gamma=max(args.gamma, args.max_gamma),
                tier=args.tier,
                tier_options=tier_options,
            )
            ids, stats = full_kv_decode(model, blocks, cfg, args.max_new_tokens, stops)
            rows.append(_row(base, f"tiered/{args.tier}", ids[0], reference[1], stats))
            print(_line(rows[-1]), flush=True)

            for spec, make in drafters:
                ids, stats = lossless_decode(model, blocks, make(), cfg, args.max_new_tokens, stops)
                rows.append(_row(base, f"lossless/{spec}", ids[0], reference[1], stats))
                print(_line(rows[-1]), flush=True)
    summary = summarize(rows, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _row(base: dict, method: str, ids: list[int], reference: list[int], stats: dict) -> dict:
    s = stats.get("lossless")
    decoded = max(stats["generated_steps"] - 1, 0)
    return {
        **base,
        "method": method,
        "new_tokens": stats["generated_steps"],
        "exact_match": ids == reference,
        "prefill_seconds": round(stats["prefill_seconds"], 4),
        "decode_seconds": round(stats["decode_seconds"], 4),
        "decode_tokens_per_s": decoded / stats["decode_seconds"] if stats["decode_seconds"] else float("nan"),
        "rounds": s.rounds if s else None,
        "verify_passes": s.verify_passes if s else None,
        "mean_accepted": s.mean_accepted if s and s.rounds else None,
        "tokens_per_round": s.mean_accepted + 1 if s and s.rounds else None,
        "accepted_hist": json.dumps(s.accepted_hist) if s and s.rounds else None,
        "draft_seconds": s.draft_seconds if s else None,
        "verify_seconds": s.verify_seconds if s else None,
        "commit_seconds": s.commit_seconds if s else None,
        "transfer_wait_seconds": s.transfer_seconds if s else None,
        "read_seconds": s.read_seconds if s else None,
        "bytes_in": s.bytes_in if s else None,
        "full_kv_bytes": json.dumps(s.full_kv_bytes) if s else None,
    }


def _line(r: dict) -> str:
    extra = ""
    if r["rounds"]:
        extra = (
            f" acc/round {r['mean_accepted']:.2f} draft {r['draft_seconds']:.2f}s verify {r['verify_seconds']:.2f}s"
            f" wait {r['transfer_wait_seconds']:.2f}s read {r['read_seconds']:.2f}s"
        )
    elif r["read_seconds"] is not None:
        extra = f" verify {r['verify_seconds']:.2f}s wait {r['transfer_wait_seconds']:.2f}s read {r['read_seconds']:.2f}s"
    return (
        f"L={r['length']} {r['method']:<22} exact={r['exact_match']!s:<5} "
        f"{r['decode_tokens_per_s']:.2f} tok/s prefill {r['prefill_seconds']:.1f}s{extra}"
    )


def summarize(rows: list[dict], args) -> dict:
    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["length"], r["method"]), []).append(r)
    results = []
    for (length, method), rs in groups.items():
        speed = mean(r["decode_tokens_per_s"] for r in rs)
        entry = {
            "length": length, "method": method, "n": len(rs),
            "exact_match_rate": mean(float(r["exact_match"]) for r in rs),
            "decode_tokens_per_s": speed,
            "mean_accepted": mean(r["mean_accepted"] for r in rs),
            "tokens_per_round": mean(r["tokens_per_round"] for r in rs),
            "draft_seconds": mean(r["draft_seconds"] for r in rs),
            "verify_seconds": mean(r["verify_seconds"] for r in rs),
            "commit_seconds": mean(r["commit_seconds"] for r in rs),
            "transfer_wait_seconds": mean(r["transfer_wait_seconds"] for r in rs),
            "read_seconds": mean(r["read_seconds"] for r in rs),
            "bytes_in": mean(r["bytes_in"] for r in rs),
            "decode_seconds": mean(r["decode_seconds"] for r in rs),
        }  # fmt: skip
        for base in ("resident", f"tiered/{args.tier}"):
            ref = [x for x in rows if x["length"] == length and x["method"] == base]
            ref_speed = mean(x["decode_tokens_per_s"] for x in ref)
            entry[f"speedup_vs_{base.split('/')[0]}"] = speed / ref_speed if speed and ref_speed else None
        total = sum(entry[k] or 0 for k in ("draft_seconds", "verify_seconds", "commit_seconds"))
        if method.startswith("lossless") and total:
            # Where decode time goes: what bounds the speed-up (the wait is part of verify).
            entry["time_split"] = {
                "draft": entry["draft_seconds"] / total,
                "verify": entry["verify_seconds"] / total,
                "commit": entry["commit_seconds"] / total,
                "transfer_wait_in_verify": (entry["transfer_wait_seconds"] or 0) / total,
            }
        results.append(entry)
    return {
        "config": dict(vars(args)),
        "machine": {
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": results,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--task", default="ruler/niah_single_1")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--stop-at-eos", action="store_true")
    p.add_argument("--query-aware", action="store_true")
    p.add_argument("--drafters", nargs="+", default=["snapkv:0.75", "quant:4"])
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--adaptive", action="store_true")
    p.add_argument("--max-gamma", type=int, default=12)
    p.add_argument("--tier", default="disk", choices=["ram", "host", "disk"])
    p.add_argument("--window", type=int, default=0, help="layers of full KV read ahead (0: all)")
    p.add_argument(
        "--no-overlap", action="store_true", help="read each layer only when verification needs it"
    )
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default="reports/lossless_bench")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
