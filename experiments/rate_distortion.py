"""Rate-distortion of the representation methods: quant (KIVI) at 8/4/2 bits and KVTC at target factors
4/8/12/16 (and 12 with a 64-token window), against the uncompressed cache, on RULER needle tasks.

    python -m experiments.rate_distortion --length 4096 --samples 20 --out runs/rate_distortion

Each task runs through :func:`eval.runner.run_grid`: one prefill per sample shared by every method, one
resumable run directory per method under ``--out/L<length>/<task>/<mode>/``, and the uncompressed reference
shared, so fidelity (exact match, agreement, first divergence) is computed once.
``rate_distortion-L<length>-<mode>.csv`` holds one row per task and method plus an ``all`` row per method
(every record of the method pooled): score, measured memory_factor (the live cache) and stored_factor (what a
saved context keeps: KVTC's entropy-coded blocks, for the others the same), fidelity, and seconds per sample:
``prefill_s`` (the shared prefill plus the method's own compression), ``compress_s`` (compression alone) and
``decode_s``. A quant point is bits or ``bits:n_sink`` (``4:0``: the first tokens quantized too, KIVI as
published; the default keeps 4 attention sinks in full precision). A KVTC point is a target factor or ``factor:window`` (its full-precision recent window; the
default is KVTC's 128, which at 4K tokens alone caps memory_factor near 25). KVTC uses ``--artifact``, else the model's default artifact, calibrating it
first when it does not exist or is of an older version (``--calibration-tokens`` tokens of the default offline text).
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from compressors.kvtc import KVTC
from compressors.quant import Quant
from eval.runner import load_records, load_samples, run_grid, summarize
from kvcomp import kvtc_calibration as calibration
from kvcomp import load_model

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3")
QUANT_BITS = (8, 4, 2)
KVTC_FACTORS = (4, 8, 12, 16, "12:64")  # 12:64: factor 12 with a 64-token window, ~8.5x measured at 4K
COLUMNS = ["task", "method", "setting", "score", "memory_factor", "stored_factor", "exact_match", "agreement",
           "first_divergence", "prefill_s", "compress_s", "decode_s", "n", "context_tokens"]


def configs(artifact: str, quant_bits=QUANT_BITS, kvtc_factors=KVTC_FACTORS):
    yield "none", "-", None
    for spec in quant_bits:
        bits, n_sink = parse_quant(spec)
        if n_sink is None:
            yield "quant", f"bits={bits}", Quant(bits=bits)
        else:
            yield "quant", f"bits={bits},n_sink={n_sink}", Quant(bits=bits, n_sink=n_sink)
    for spec in kvtc_factors:
        factor, window = parse_kvtc(spec)
        if window is None:
            yield "kvtc", f"factor={factor}", KVTC(compression_factor=float(factor), artifact=artifact)
        else:
            yield "kvtc", f"factor={factor},window={window}", KVTC(compression_factor=float(factor), window=window,
                                                                   artifact=artifact)


def parse_quant(spec) -> tuple[int, int | None]:
    """A quant point: bits (``4``) or ``bits:n_sink`` (``4:0``: no full-precision attention sinks, KIVI as
    published)."""
    text = str(spec)
    bits_text, _, sink_text = text.partition(":")
    try:
        return int(bits_text), (int(sink_text) if sink_text else None)
    except ValueError:
        raise ValueError(f"quant point {text!r}: expected bits (4) or bits:n_sink (4:0).") from None


def parse_kvtc(spec) -> tuple[float | int, int | None]:
    """A KVTC point: a target factor (``8``) or ``factor:window`` (``10:64``, full-precision recent tokens)."""
    text = str(spec)
    factor_text, _, window_text = text.partition(":")
    try:
        factor = float(factor_text)
        window = int(window_text) if window_text else None
    except ValueError:
        raise ValueError(f"KVTC point {text!r}: expected a target factor (8) or factor:window (10:64).") from None
    return (int(factor) if factor.is_integer() else factor), window


def ensure_artifact(model, tokenizer, artifact: str | None, tokens: int) -> str:
    path = Path(artifact) if artifact else calibration.default_artifact_path(model)
    if not path.is_file() or (not artifact and not calibration.is_current(path)):  # the default one is ours to renew
        t0 = time.perf_counter()
        calibration.calibrate(model, tokenizer, path, tokens=tokens)
        print(f"calibrated KVTC on {tokens} tokens in {time.perf_counter() - t0:.0f} s -> {path}", flush=True)
    calibration.load_artifact(path, model)
    return str(path)


def _row(task: str, method: str, setting: str, records: list[dict]) -> dict:
    s = summarize(records)
    compress = [r["compress_seconds"] for r in records if r.get("compress_seconds") is not None]
    return {"task": task, "method": method, "setting": setting, "score": s["score"],
            "memory_factor": s["memory_factor"], "stored_factor": s["stored_factor"],
            "exact_match": s["exact_match_rate"], "agreement": s["agreement"],
            "first_divergence": s["mean_first_divergence"], "prefill_s": s["prefill_seconds"],
            "compress_s": sum(compress) / len(compress) if compress else None,
            "decode_s": s["decode_seconds"], "n": s["n"], "context_tokens": s["context_length"]}


def rate_distortion(model, tokenizer, *, tasks=TASKS, length: int = 4096, samples: int = 20,
                    out_dir: str | Path = "runs/rate_distortion", artifact: str | None = None,
                    calibration_tokens: int = 8192, query_aware: bool = False, quant_bits=QUANT_BITS,
                    kvtc_factors=KVTC_FACTORS, progress: bool = True) -> list[dict]:
    out_dir = Path(out_dir) / f"L{length}"
    artifact = ensure_artifact(model, tokenizer, artifact, calibration_tokens)
    mode = "aware" if query_aware else "agnostic"
    rows, pooled = [], {}
    for task in tasks:
        bench = load_samples(f"ruler/{task}", tokenizer, length=length, num_samples=samples, seed=0)
        grid = {}
        for method, setting, compressor in configs(artifact, quant_bits, kvtc_factors):
            label = method if compressor is None else f"{method}-{setting.replace('=', '').replace(',', '-')}"
            grid[label] = (method, setting, compressor)
        run_dir = out_dir / task / mode
        run_grid(model, tokenizer, bench, {label: c for label, (_, _, c) in grid.items()}, query_aware=query_aware,
                 out_dir=run_dir, progress=progress)
        for label, (method, setting, _) in grid.items():
            records = load_records(run_dir / label / "results.jsonl")
            rows.append(_row(task, method, setting, records))
            pooled.setdefault((method, setting), []).extend(records)
            print({k: rows[-1][k] for k in ("task", "method", "setting", "score", "memory_factor", "agreement")},
                  flush=True)
    rows += [_row("all", m, s, recs) for (m, s), recs in pooled.items()]
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"rate_distortion-L{length}-{mode}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.rate_distortion", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF id or path, 'tiny'; default: the embedded model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tasks", nargs="+", default=list(TASKS))
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--out", default="runs/rate_distortion")
    p.add_argument("--artifact", default=None, help="KVTC artifact; default: the model's (calibrated if missing)")
    p.add_argument("--calibration-tokens", type=int, default=8192)
    p.add_argument("--quant-bits", nargs="*", default=list(QUANT_BITS),
                   help="bits, each optionally with its attention sinks kept in full precision: 8 4 2 4:0")
    p.add_argument("--kvtc-factors", nargs="*", default=list(KVTC_FACTORS),
                   help="target factors, each optionally with its recent window: 4 8 12 16 12:64")
    p.add_argument("--query-aware", action="store_true")
    args = p.parse_args(argv)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    rows = rate_distortion(model, tokenizer, tasks=args.tasks, length=args.length, samples=args.samples,
                           out_dir=args.out, artifact=args.artifact, calibration_tokens=args.calibration_tokens,
                           query_aware=args.query_aware, quant_bits=args.quant_bits,
                           kvtc_factors=args.kvtc_factors)
    for r in rows:
        print(",".join("" if r[c] is None else (f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]))
                       for c in COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
