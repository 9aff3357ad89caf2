"""Compress once, ask many: stored bytes, time to first token from a store, lossless decoding from Redis.

    python -m experiments.store_bench --lengths 4096 8192 --samples 10 --out experiments/results/store-embedded

For each RULER sample of ``--tasks`` (``niah_single_1`` and ``niah_single_2`` by default) at each length, the context is prefilled once
(:mod:`kvcomp.shared_prefill`, query-agnostic) and, for every method of ``--methods`` (default: none, SnapKV
0.75, quant 4-bit, KVTC factor 8 and 16):

* ``fresh``: the in-process compressed cache answers (time to first token = the context's prefill, the
  compression and the question block, what a process without a store pays for every question);
* each store (``dir``: a directory store under ``--out``; ``redis``: a local redis-server started here on
  127.0.0.1, or ``--redis URL``): the compressed state is saved (``kvcomp.contexts.save_prefilled``), then loaded
  back and asked the question (time to first token = load + checks + decode once + question block + the first
  token); the answer is compared token for token with ``fresh``. ``stored bytes`` is the entry (states, prompt
  ids, mask and last logits), ``ratio`` the 16-bit full KV of the context over it.

Lossless (``--drafters``, default quant 4-bit): the drafter's state and the full KV are saved to Redis; then
``lossless`` (draft with the stored compressed state, verify with the full KV read from Redis every round)
against ``uncompressed`` (greedy decoding reading the full KV from the same Redis for every token), both from
the loaded context, ``--lossless-tokens`` tokens each (EOS does not stop them), exact match against in-process
uncompressed decoding. Tokens/s count all tokens after the context is loaded (question block included).
``--overlap`` on: both read the full KV while the model computes (lossless: while drafting; both: the next
layers while verification runs the earlier ones); off: each layer when verification needs it; both (default):
a pair of rows per sample (on a CPU the reading thread competes with the model for the cores).

Rows are appended to ``<out>/store_bench.jsonl`` (one per sample, method and store) and ``lossless.jsonl`` as
they are measured, so an interrupted run resumes with the same ``--out``; at the end ``store_bench.csv``,
``lossless.csv`` and ``summary.json`` are written from them. The directory store is removed at the end
(``--keep-store`` keeps it) and the Redis server stopped.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROWS_FILE, LOSSLESS_FILE = "store_bench.jsonl", "lossless.jsonl"
DEFAULT_METHODS = ["none", "snapkv:compression_ratio=0.75", "quant:bits=4", "kvtc:compression_factor=8",
                   "kvtc:compression_factor=16"]


def _make(spec: str, artifact: str | None):
    from experiments.bench import parse_spec
    from kvcomp.registry import create

    if spec == "none":
        return None
    name, params = parse_spec(spec)
    if name == "kvtc" and artifact and "artifact" not in params:
        params["artifact"] = artifact
    return create(name, **params)


def full_kv_16bit(model, tokens: int) -> int:
    """Bytes of a 16-bit full KV of ``tokens`` tokens as transformers' cache holds it (sliding layers: window-1)."""
    from kvcomp.attention import layer_specs

    cfg = model.config.get_text_config(decoder=True)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    held = [tokens if s.window is None else min(tokens, s.window - 1) for s in layer_specs(model)]
    return sum(held) * heads * head_dim * 2 * 2


def run(args) -> dict:
    from eval.runner import _read_jsonl, load_samples
    from kvcomp import files, load_model, tiers
    from kvcomp.contexts import load_context, model_fingerprint, save_prefilled
    from kvcomp.generation import generate, split_prompt, stop_token_ids
    from kvcomp.redis_store import LocalServer
    from kvcomp.shared_prefill import continue_from, prefill
    from kvcomp.store import open_store

    torch.set_num_threads(args.threads or torch.get_num_threads())
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Rows are appended as they are measured; a rerun with the same --out skips what is there (resume).
    rows_path, lossless_path = out / ROWS_FILE, out / LOSSLESS_FILE
    rows, lossless_rows = _read_jsonl(rows_path, repair=True), _read_jsonl(lossless_path, repair=True)
    done = {(r["length"], r["sample"], r["method"], r["store"]) for r in rows}
    done_lossless = {(r["length"], r["sample"], r["drafter"], r["overlap"]) for r in lossless_rows}
    overlaps = {"on": [True], "off": [False], "both": [True, False]}[args.overlap] if args.drafters else []
    artifact = None
    if any(m.startswith("kvtc") for m in args.methods + args.drafters):
        from experiments.rate_distortion import ensure_artifact

        artifact = ensure_artifact(model, tokenizer, args.artifact, tokens=8192)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stops = stop_token_ids(model, tokenizer)
    model_fingerprint(model)  # computed once per process, as a serving process would at start
    dir_root = Path(tempfile.mkdtemp(prefix="store-", dir=out))
    server = None

    def cleanup() -> None:  # the benchmark's own Redis and its stored plaintext K/V go at the end, or on SIGTERM
        if server is not None:
            server.stop()
        if not args.keep_store:
            shutil.rmtree(dir_root, ignore_errors=True)

    tiers.on_sigterm_cleanup(("store-bench", str(dir_root)), cleanup)
    try:
        server = None if args.redis else LocalServer(dir_root / "redis")
        stores = {"dir": open_store(str(dir_root / "entries")), "redis": open_store(args.redis or server.url)}
        for length in args.lengths:
            for task_name in args.tasks:
                task = load_samples(task_name, tokenizer, length=length, num_samples=args.samples, seed=args.seed)
                for sample in task.samples:
                    todo = [m for m in args.methods if any((length, sample.id, m, s) not in done for s in stores)]
                    todo_lossless = [(d, o) for d in args.drafters for o in overlaps
                                     if (length, sample.id, d, o) not in done_lossless]
                    if not todo and not todo_lossless:
                        continue
                    parts = [split_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix,
                                          sample.chat_template)]
                    pre = prefill(model, parts, query_aware=False, pad_id=pad_id)
                    tokens = len(parts[0].context_ids)
                    full16 = full_kv_16bit(model, tokens)
                    template = {"chat_template": sample.chat_template, "system_prompt": None,
                                "template": parts[0].template}
                    for spec in todo:
                        ids, stats = continue_from(model, pre, _make(spec, artifact), sample.max_new_tokens,
                                                   pad_id, stops)
                        fresh_text = tokenizer.decode(ids[0], skip_special_tokens=True)
                        base = dict(length=length, task=task_name, sample=sample.id, tokens=tokens, method=spec,
                                    full_kv_16bit=full16, ttft_fresh=stats["prefill_seconds"],
                                    score=task.score(fresh_text, sample))
                        for store_name, store in stores.items():
                            if (length, sample.id, spec, store_name) in done:
                                continue
                            t0 = time.perf_counter()
                            saved = save_prefilled(model, pre, _make(spec, artifact), store, template=template)
                            write_s = time.perf_counter() - t0
                            entry = store.manifest(saved.key).nbytes
                            t0 = time.perf_counter()
                            ctx = load_context(model, saved.key, store)
                            first = generate(model, tokenizer, question=sample.question, context=ctx,
                                             answer_prefix=sample.answer_prefix, max_new_tokens=1)
                            ttft = time.perf_counter() - t0
                            answer = generate(model, tokenizer, question=sample.question, context=ctx,
                                              answer_prefix=sample.answer_prefix,
                                              max_new_tokens=sample.max_new_tokens)
                            row = {**base, "store": store_name, "state_bytes": saved.state_bytes,
                                   "stored_bytes": entry, "ratio_16bit": full16 / entry,
                                   "ratio_16bit_states": full16 / saved.state_bytes,
                                   "write_seconds": write_s, "load_seconds": ctx.load_seconds,
                                   "ttft_store": ttft, "ttft_speedup": base["ttft_fresh"] / ttft,
                                   "identical": answer.token_ids == ids and first.token_ids[0] == ids[0][:1]}
                            rows.append(row)
                            files.append_text(rows_path, json.dumps(row) + "\n")
                            print(_line(row), flush=True)
                            store.delete(saved.key)
                    for drafter, overlap in todo_lossless:
                        row = _lossless(args, model, tokenizer, pre, sample, stores["redis"], artifact, template,
                                        length, tokens, pad_id, drafter, overlap)
                        lossless_rows.append(row)
                        files.append_text(lossless_path, json.dumps(row) + "\n")
                    del pre
    finally:
        tiers.drop_cleanup(("store-bench", str(dir_root)))
        cleanup()
    summary = summarize(rows, lossless_rows, args)
    if rows:
        _write_csv(out / "store_bench.csv", rows)
    if lossless_rows:
        _write_csv(out / "lossless.csv", lossless_rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _lossless(args, model, tokenizer, pre, sample, store, artifact, template, length, tokens, pad_id, spec: str,
              overlap: bool) -> dict:
    """Lossless decoding with ``spec`` drafting against uncompressed decoding, both with the full KV read from
    ``store`` (``overlap``: reads stream in while drafting / earlier layers compute, else each layer is read when
    verification needs it)."""
    from kvcomp.contexts import load_context, question_ids, save_prefilled
    from kvcomp.generation import _left_pad
    from kvcomp.lossless import Lossless, full_kv_decode, lossless_decode
    from kvcomp.shared_prefill import continue_from

    n = args.lossless_tokens
    reference, _ = continue_from(model, pre, None, n, pad_id, set())  # in-process uncompressed, no EOS stop
    saved = save_prefilled(model, pre, _make(spec, artifact), store, full_kv=True, template=template)
    try:
        ctx = load_context(model, saved.key, store)
        block = [_left_pad([question_ids(tokenizer, ctx, sample.question, sample.answer_prefix)], pad_id)]
        config = Lossless(gamma=args.gamma, tier="store", tier_options={"store": store, "overlap": overlap})
        ids, stats = full_kv_decode(model, block, config, n, set(), context=ctx)
        base_s = stats["prefill_seconds"] + stats["decode_seconds"]
        base_exact = ids == reference
        ids, stats = lossless_decode(model, block, None, config, n, set(), context=ctx)
    finally:
        store.delete(saved.key)
    s = stats["lossless"]
    lossless_s = stats["prefill_seconds"] + stats["decode_seconds"]
    row = dict(length=length, sample=sample.id, tokens=tokens, drafter=spec, overlap=overlap, new_tokens=n,
               full_kv_bytes=saved.full_kv_bytes, state_bytes=saved.state_bytes,
               uncompressed_tok_s=n / base_s, lossless_tok_s=n / lossless_s, speedup=base_s / lossless_s,
               exact=ids == reference, uncompressed_exact=base_exact, mean_accepted=s.mean_accepted,
               rounds=s.rounds, bytes_in=s.bytes_in, transfer_seconds=s.transfer_seconds,
               read_seconds=s.read_seconds, draft_seconds=s.draft_seconds, verify_seconds=s.verify_seconds)
    print(_line(row), flush=True)
    return row


def _line(row: dict) -> str:
    return "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def summarize(rows: list[dict], lossless_rows: list[dict], args) -> dict:
    def mean(xs):
        return statistics.fmean(xs) if xs else float("nan")

    table = {}
    for r in rows:
        table.setdefault((r["length"], r.get("task"), r["method"], r["store"]), []).append(r)
    stored = []
    for (length, task, method, store), rs in table.items():
        stored.append(dict(length=length, task=task, method=method, store=store, n=len(rs),
                           stored_bytes=mean([r["stored_bytes"] for r in rs]),
                           ratio_16bit=mean([r["ratio_16bit"] for r in rs]),
                           ratio_16bit_states=mean([r["ratio_16bit_states"] for r in rs]),
                           ttft_fresh=mean([r["ttft_fresh"] for r in rs]), ttft_store=mean([r["ttft_store"] for r in rs]),
                           ttft_speedup=mean([r["ttft_speedup"] for r in rs]),
                           identical=mean([float(r["identical"]) for r in rs]), score=mean([r["score"] for r in rs])))
    lossless = {}
    for r in lossless_rows:
        lossless.setdefault((r["length"], r["drafter"], r.get("overlap", True)), []).append(r)
    ll = [dict(length=length, drafter=d, overlap=overlap, n=len(rs), uncompressed_tok_s=mean([r["uncompressed_tok_s"] for r in rs]),
               lossless_tok_s=mean([r["lossless_tok_s"] for r in rs]), speedup=mean([r["speedup"] for r in rs]),
               exact=mean([float(r["exact"]) for r in rs]), mean_accepted=mean([r["mean_accepted"] for r in rs]))
          for (length, d, overlap), rs in lossless.items()]
    return {"command": vars(args), "machine": platform.platform(), "torch_threads": torch.get_num_threads(),
            "stored": stored, "lossless": ll}


def print_summary(summary: dict) -> None:
    print("\nlength task method store | stored MB  x16-bit (states only) | TTFT fresh s  store s  speedup | identical score")
    for r in summary["stored"]:
        print(f"{r['length']:>6} {str(r['task']).split('/')[-1]:<14} {r['method']:<28} {r['store']:<5} | {r['stored_bytes'] / 1e6:8.2f} "
              f"{r['ratio_16bit']:7.1f}x ({r['ratio_16bit_states']:5.1f}x) | {r['ttft_fresh']:8.2f} "
              f"{r['ttft_store']:8.3f} {r['ttft_speedup']:7.1f}x | {r['identical']:.2f} {r['score']:.0f}")
    for r in summary["lossless"]:
        print(f"lossless {r['length']} {r['drafter']} overlap={r['overlap']}: {r['lossless_tok_s']:.2f} tok/s vs uncompressed from Redis "
              f"{r['uncompressed_tok_s']:.2f} tok/s = {r['speedup']:.2f}x, exact {r['exact']:.2f}, "
              f"{r['mean_accepted']:.2f} accepted/round")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tasks", nargs="+", default=["ruler/niah_single_1", "ruler/niah_single_2"])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096])
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", nargs="*", default=DEFAULT_METHODS, help="stored methods (none given: lossless only)")
    p.add_argument("--drafters", nargs="*", default=["quant:bits=4"], help="lossless drafters (none: skip)")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--overlap", choices=["on", "off", "both"], default="both",
                   help="lossless: read the full KV while drafting (on), only when verification needs it (off)")
    p.add_argument("--lossless-tokens", type=int, default=32)
    p.add_argument("--artifact", default=None, help="KVTC calibration artifact (default: the model's, made if missing)")
    p.add_argument("--redis", default=None, help="an existing Redis URL (default: start redis-server here)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--keep-store", action="store_true")
    p.add_argument("--out", default="runs/store_bench")
    args = p.parse_args(argv)
    summary = run(args)
    print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
