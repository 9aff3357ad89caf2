"""Where a stored KVTC context's bytes go, and what a better entropy coder could still save.

    python -m experiments.kvtc_bytes --lengths 4096 8192 --samples 2 --factors 8 16 --out runs/kvtc_bytes

For each RULER sample (its context alone, prefilled through :class:`kvcomp.CompressedCache`) and each target
factor, the stored form of every layer (:meth:`compressors.kvtc.KVTC.stored_form`) is split into

* ``dense``: the full-precision sinks and recent window (K, V and positions, in the run's dtype),
* ``blocks``: the zstd-coded blocks of the quantized codes (headers and positions included),
* ``other``: the per-row counters,

and the codes of the blocks are measured against three ideal coders (plug-in entropies over the context's coded
tokens, in bytes): ``order0`` (each component coded with its own histogram over the context: what a per-component
arithmetic coder could reach at best), ``prev_token`` (conditioned on the same component of the previous token)
and ``prev_component`` (conditioned on the previous component of the same token). The last two say whether
context modelling could reach well below ``order0``. Plug-in conditional entropies are biased low by about
``(levels**2 - 1) / (2 N ln 2)`` bits a code (under 0.02 bit for 15 levels at 8K tokens), so they flatter those
coders slightly. ``ratio_*``: the 16-bit full KV of the context over each total (``dense + other`` plus the
blocks as stored, or plus an ideal coder's bytes).

Rows are appended to ``<out>/kvtc_bytes.jsonl`` as they are measured (a rerun with the same ``--out`` resumes);
``kvtc_bytes.csv`` holds every row and ``summary.csv`` the means per length and factor.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

import numpy as np
import torch

from kvcomp import load_model

ROWS = "kvtc_bytes.jsonl"
CODERS = ("order0", "prev_token", "prev_component")


def entropy_bits(x: np.ndarray) -> float:
    """Plug-in entropy of the symbols ``x`` (1-D, small non-negative ints), times their number: bits in all."""
    counts = np.bincount(x)
    p = counts[counts > 0] / x.size
    return float(-(p * np.log2(p)).sum() * x.size)


def conditional_entropy_bits(x: np.ndarray, context: np.ndarray) -> float:
    """Plug-in ``H(x | context) * len(x)`` in bits (``x``, ``context``: 1-D uint8 arrays of one length)."""
    return entropy_bits(x.astype(np.int64) * 256 + context) - entropy_bits(context.astype(np.int64))


def code_entropies(codes: np.ndarray) -> dict[str, float]:
    """Bits of the ``[T, c]`` codes of one KV head and kind under each ideal coder of :data:`CODERS`. The first
    token (no previous one) and the first component (no previous one) count at their order-0 rate."""
    out = dict.fromkeys(CODERS, 0.0)
    for j in range(codes.shape[1]):
        x = codes[:, j]
        order0 = entropy_bits(x)
        out["order0"] += order0
        out["prev_token"] += conditional_entropy_bits(x[1:], x[:-1]) + order0 / max(len(x), 1)
        out["prev_component"] += conditional_entropy_bits(x, codes[:, j - 1]) if j else order0
    return out


def breakdown(compressor, cache) -> dict[str, float]:
    """Bytes of every layer's stored KVTC state, split as in the module docstring, and the ideal coders' bytes."""
    from kvcomp.ops import SENTINEL

    row = {"dense": 0, "blocks": 0, "other": 0, "coded_tokens": 0, **{c: 0.0 for c in CODERS}}
    for layer in cache.layers:
        state = layer.state
        dense = state.sinks.nbytes() + state.window.nbytes()
        stored = compressor.stored_form(layer.layer_idx, state)
        row["dense"] += dense
        row["blocks"] += stored.coded_bytes()
        row["other"] += compressor.nbytes(stored)["device"] - dense - stored.coded_bytes()
        real = (state.positions < SENTINEL).cpu().numpy()  # [B, H, T]
        row["coded_tokens"] += int(real.sum())
        for h, kinds in enumerate(compressor.component_codes(state)):
            for codes in kinds:
                for b in range(codes.shape[0]):
                    bits = code_entropies(codes[b].cpu().numpy()[real[b, h]])
                    for name in CODERS:
                        row[name] += bits[name] / 8
    return row


def measure(model, tokenizer, *, lengths, tasks, samples: int, factors, out_dir, artifact=None, seed: int = 0,
            calibration_tokens: int = 8192) -> list[dict]:
    from tqdm import tqdm

    from compressors.kvtc import KVTC
    from eval.runner import _read_jsonl, load_samples
    from experiments.rate_distortion import ensure_artifact
    from experiments.store_bench import full_kv_16bit
    from kvcomp import CompressedCache
    from kvcomp.generation import split_prompt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ROWS
    rows = _read_jsonl(path, repair=True)
    done = {(r["length"], r["sample"], r["factor"]) for r in rows}
    artifact = ensure_artifact(model, tokenizer, artifact, tokens=calibration_tokens)
    todo = [(length, task, float(f)) for length in lengths for task in tasks for f in factors]
    for length, task, factor in tqdm(todo, desc="kvtc bytes"):
        for sample in load_samples(task, tokenizer, length=length, num_samples=samples, seed=seed).samples:
            if (length, sample.id, factor) in done:
                continue
            ids = split_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix,
                               sample.chat_template).context_ids
            compressor = KVTC(compression_factor=factor, artifact=artifact)
            cache = CompressedCache(model, compressor)
            with torch.inference_mode():
                model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
            row = {"length": length, "task": task, "sample": sample.id, "factor": factor, "tokens": len(ids),
                   "full_kv_16bit": full_kv_16bit(model, len(ids)), **breakdown(compressor, cache)}
            fixed = row["dense"] + row["other"]
            row["ratio_stored"] = row["full_kv_16bit"] / (fixed + row["blocks"])
            for name in CODERS:
                row[f"ratio_{name}"] = row["full_kv_16bit"] / (fixed + row[name])
            row["blocks_over_order0"] = row["blocks"] / row["order0"]
            row["dense_share"] = row["dense"] / (fixed + row["blocks"])
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
            done.add((length, sample.id, factor))
    _write(out, rows)
    return rows


def _write(out: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(out / "kvtc_bytes.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    numeric = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and k not in ("length", "factor")]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["length"], r["factor"]), []).append(r)
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["length", "factor", "n", *numeric])
        writer.writeheader()
        for (length, factor), group in sorted(groups.items()):
            writer.writerow({"length": length, "factor": factor, "n": len(group),
                             **{k: round(statistics.mean(r[k] for r in group), 4) for k in numeric}})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.kvtc_bytes", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF id or path, 'tiny'; default: the embedded model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192])
    p.add_argument("--tasks", nargs="+", default=["ruler/niah_single_1", "ruler/niah_single_2"])
    p.add_argument("--samples", type=int, default=2, help="per task and length")
    p.add_argument("--factors", nargs="+", type=float, default=[8.0, 16.0])
    p.add_argument("--artifact", default=None, help="KVTC artifact; default: the model's (calibrated if missing)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="runs/kvtc_bytes")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    rows = measure(model, tokenizer, lengths=args.lengths, tasks=args.tasks, samples=args.samples,
                   factors=args.factors, out_dir=args.out, artifact=args.artifact)
    print(Path(args.out, "summary.csv").read_text() if rows else "no rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
