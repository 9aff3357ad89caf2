"""Where a stored KVTC context's bytes go, and what a better entropy coder could still save.

    python -m experiments.kvtc_bytes --lengths 4096 8192 --samples 2 --factors 8 16 --out runs/kvtc_bytes

For each RULER sample (its context alone, prefilled through :class:`kvcomp.CompressedCache`) and each target
factor, the stored form of every layer (:meth:`compressors.kvtc.KVTC.stored_form`) is split into

* ``dense``: the full-precision sinks and recent window (K, V and positions, in the run's dtype),
* ``blocks``: the zstd-coded blocks of the quantized codes (headers and positions included),
* ``other``: the per-row counters,

and the codes of the blocks are measured against three ideal adaptive coders (bytes): ``order0`` (each
component coded with its own adaptive histogram over the context), ``prev_token`` (one adaptive histogram per
value of the same component of the previous token) and ``prev_component`` (per value of the previous component of
the same token). Each is the exact code length of an adaptive arithmetic coder with the Krichevsky-Trofimov
estimator (counts start at 1/2 over the component's alphabet: 3, 15 or 255 levels), which depends only on the
final counts; it includes the cost of learning the histograms, so a context with many rare values is not
flattered the way a plug-in conditional entropy would be. The last two say whether context modelling could reach
well below ``order0``. ``ratio_*``: the 16-bit full KV of the context over each total (``dense + other`` plus
the blocks as stored, or plus an ideal coder's bytes).

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


def adaptive_bits(x: np.ndarray, alphabet: int, context: np.ndarray | None = None) -> float:
    """Bits an adaptive arithmetic coder with the Krichevsky-Trofimov estimator spends on the symbols ``x``
    (1-D ints in ``[0, alphabet)``), with one histogram per value of ``context`` (1-D non-negative ints, or None:
    one histogram). The sequential cost depends only on the final counts ``n_cx``:
    ``sum_c log2(G(N_c + A / 2) / G(A / 2)) - sum_cx log2(G(n_cx + 1 / 2) / G(1 / 2))``, ``A`` the alphabet."""
    from scipy.special import gammaln

    x = x.astype(np.int64)
    context = np.zeros_like(x) if context is None else context.astype(np.int64)
    joint = np.bincount(context * alphabet + x)
    per_context = np.bincount(context)
    joint, per_context = joint[joint > 0], per_context[per_context > 0]
    half = alphabet / 2
    nats = (gammaln(per_context + half) - gammaln(half)).sum() - (gammaln(joint + 0.5) - gammaln(0.5)).sum()
    return float(nats / np.log(2))


def code_bits(codes: np.ndarray, alphabets: list[int]) -> dict[str, float]:
    """Bits of the ``[T, c]`` codes of one KV head and kind (component ``j`` in ``[0, alphabets[j])``) under each
    ideal coder of :data:`CODERS`. The first token (no previous one) and the first component (no previous one)
    are coded with one histogram."""
    out = dict.fromkeys(CODERS, 0.0)
    for j, alphabet in enumerate(alphabets):
        x = codes[:, j]
        out["order0"] += adaptive_bits(x, alphabet)
        out["prev_token"] += adaptive_bits(x[1:], alphabet, x[:-1]) + adaptive_bits(x[:1], alphabet)
        out["prev_component"] += adaptive_bits(x, alphabet, codes[:, j - 1]) if j else adaptive_bits(x, alphabet)
    return out


def breakdown(compressor, cache) -> dict[str, float]:
    """Bytes of every layer's stored KVTC state, split as in the module docstring, and the ideal coders' bytes."""
    from kvcomp import transform_coding as tc
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
        segments = compressor.codec(layer.layer_idx, state.window.keys.dtype)["segments"]
        for h, kinds in enumerate(compressor.component_codes(state)):
            for kind, codes in enumerate(kinds):
                alphabets = [2 * tc.max_level(b) + 1 for k, b, c in segments[h] if k == kind for _ in range(c)]
                for b in range(codes.shape[0]):
                    bits = code_bits(codes[b].cpu().numpy()[real[b, h]], alphabets)
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
    factors = [float(f) for f in factors]
    progress = tqdm(total=len(lengths) * len(tasks) * samples * len(factors), desc="kvtc bytes")
    for length in lengths:
        for task in tasks:
            for sample in load_samples(task, tokenizer, length=length, num_samples=samples, seed=seed).samples:
                ids = split_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix,
                                   sample.chat_template).context_ids
                for factor in factors:
                    progress.update()
                    if (length, sample.id, factor) in done:
                        continue
                    compressor = KVTC(compression_factor=factor, artifact=artifact)
                    cache = CompressedCache(model, compressor)
                    with torch.inference_mode():
                        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
                    row = {"length": length, "task": task, "sample": sample.id, "factor": factor,
                           "tokens": len(ids), "full_kv_16bit": full_kv_16bit(model, len(ids)),
                           **breakdown(compressor, cache)}
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
    progress.close()
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
