"""The needle-in-a-haystack demo: no compression vs each compressor at 2x and 4x on the embedded model.

Runs RULER's niah_single_1 (noise haystack, one 7-digit needle) in query-agnostic and query-aware mode
through :func:`eval.runner.run_grid`: each sample is prefilled once per mode and every compressor builds its
cache from that prefill (identical output to a prefill per compressor, several times faster). Every
configuration is a resumable run directory under ``out_dir/L<length>/<mode>/``; the table is also written as
``summary-L<length>.csv``. ``prefill_s`` is the shared prefill plus the compressor's own compression time.
"""

from __future__ import annotations

import csv
from pathlib import Path

from eval.runner import load_samples, run_grid
from kvcomp import files
from kvcomp.registry import create
from kvcomp.validation import UsageError, positive_int

COMPRESSORS = ("streaming_llm", "h2o", "snapkv")
MODES = {"agnostic": False, "aware": True}
COLUMNS = ["compressor", "ratio", "mode", "accuracy", "memory_factor", "exact_match", "first_divergence",
           "prefill_s", "decode_s", "n"]


def run_demo(model, tokenizer, *, samples: int = 3, length: int = 2048, ratios=(0.5, 0.75),
             compressors=COMPRESSORS, modes=("agnostic", "aware"), out_dir: str | Path = "runs/demo",
             max_new_tokens: int = 16, task: str = "ruler/niah_single_1", progress: bool = True) -> list[dict]:
    for name, value in (("samples", samples), ("length", length), ("max_new_tokens", max_new_tokens)):
        positive_int(name, value, owner="kvcomp demo", error=UsageError)
    out_dir = Path(out_dir)
    with files.lock_run_dir(out_dir, "kvcomp demo"):
        return _run_demo(model, tokenizer, samples, length, ratios, compressors, modes, out_dir, max_new_tokens,
                         task, progress)


def _run_demo(model, tokenizer, samples, length, ratios, compressors, modes, out_dir: Path, max_new_tokens, task,
              progress) -> list[dict]:
    files.check_not_link(out_dir / f"summary-L{length}.csv")  # written last: refuse before the work
    bench = load_samples(task, tokenizer, length=length, num_samples=samples, seed=0,
                         tokens_to_generate=max_new_tokens)
    configs = [(None, 0.0)] + [(c, r) for c in compressors for r in ratios]
    grid = {f"{name or 'none'}-{ratio}": name and create(name, compression_ratio=ratio) for name, ratio in configs}
    rows = []
    for mode in modes:
        summaries = run_grid(model, tokenizer, bench, grid, query_aware=MODES[mode],
                             out_dir=files.make_dirs(out_dir / f"L{length}" / mode, out_dir), progress=progress)
        for (name, ratio), s in zip(configs, summaries.values()):
            rows.append({
                "compressor": name or "none", "ratio": ratio, "mode": s["mode"],
                "accuracy": s["score"], "memory_factor": s["memory_factor"],
                "exact_match": s["exact_match_rate"], "first_divergence": s["mean_first_divergence"],
                "prefill_s": s["prefill_seconds"], "decode_s": s["decode_seconds"], "n": s["n"],
            })
    with files.open_output(out_dir / f"summary-L{length}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("compressor", "mode") else "right")

    def fmt(v):
        if v is None:
            return "-"
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    for r in rows:
        table.add_row(*(fmt(r[c]) for c in COLUMNS))
    console = Console()
    if not console.is_terminal:  # a log file or pipe: do not squeeze the table into 80 columns
        console = Console(width=150)
    console.print(table)
