"""Many compressors x tasks x lengths x query modes, one prefill per sample: ``kvcomp grid``.

Every configuration of the grid shares the prefill of a sample (:func:`eval.runner.run_grid`), so a table of
13 configurations costs one prefill and 13 short decodes per sample instead of 13 prefills. Layout under
``out_dir``::

    <task>/L<length>/<mode>/<label>/results.jsonl, summary.json   (one run directory per configuration)
    <task>/L<length>/<mode>/reference.jsonl                       (uncompressed outputs, for fidelity)
    report/report.csv, report.md, *.png                           (kvcomp report over all of them)
    report/scores.md, scores.csv                                  (score [memory_factor] per task and config)

Rerunning the same command resumes; tasks whose data is not available offline (RULER's QA tasks without a
local SQuAD/HotpotQA file) are skipped with the reason printed.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from eval.ruler import TASKS as RULER_TASKS
from eval.ruler import TaskDataUnavailable
from eval.runner import load_samples, run_grid
from experiments.bench import parse_spec
from experiments.report import make_report
from kvcomp import files
from kvcomp.registry import create
from kvcomp.validation import UsageError, positive_int

MODES = {"agnostic": False, "aware": True}
# RULER's tasks that need no external data (qa_1/qa_2 read SQuAD/HotpotQA).
OFFLINE_RULER = [t for t in RULER_TASKS if not t.startswith("qa")]


def spec_label(spec: str) -> str:
    """A run-directory label for a ``name:key=value,...`` spec: ``quant:bits=4`` -> ``quant-bits4``."""
    name, params = parse_spec(spec)
    return "-".join([name, *(f"{k}{v}" for k, v in params.items())])


def run_table(model, tokenizer, *, tasks, lengths, samples: int, compressors, ratios, modes, out_dir,
              params: dict | None = None, max_new_tokens: int | None = None, seed: int = 0,
              progress: bool = True, configs: tuple[str, ...] = (), store: str | None = None) -> dict[str, Path]:
    """Run the grid into ``out_dir`` and write the report; returns the report's files.

    ``compressors`` x ``ratios`` (with ``params`` for each), plus ``configs``: compressors given as
    ``name:key=value,...`` specs (``quant:bits=4``, ``kvtc:compression_factor=8``), each its own column.
    ``store``: a store URL where each sample's compressed prefills are kept and reused across runs and machines
    (:func:`eval.runner.run_grid`)."""
    positive_int("samples", samples, owner="kvcomp grid", error=UsageError)
    for length in lengths:
        positive_int("length", length, owner="kvcomp grid", error=UsageError)
    out_dir = Path(out_dir)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"Unknown mode(s) {unknown}; use {list(MODES)}.")
    with files.lock_run_dir(out_dir, "kvcomp grid"):
        return _run_table(model, tokenizer, tasks, lengths, samples, compressors, ratios, modes, out_dir, params,
                          max_new_tokens, seed, progress, configs, store)


def _run_table(model, tokenizer, tasks, lengths, samples, compressors, ratios, modes, out_dir: Path, params,
               max_new_tokens, seed, progress, configs=(), store=None) -> dict[str, Path]:
    grid = {"none": None}
    for name in compressors:
        for ratio in ratios:
            grid[f"{name}-{ratio}"] = create(name, compression_ratio=ratio, **(params or {}))
    for spec in configs:
        name, spec_params = parse_spec(spec)
        grid[spec_label(spec)] = create(name, **spec_params)
    for length in lengths:
        for task in tasks:
            name = task if "/" in task else f"ruler/{task}"
            try:
                bench = load_samples(name, tokenizer, length=length, num_samples=samples, seed=seed,
                                     **({"tokens_to_generate": max_new_tokens} if max_new_tokens else {}))
            except TaskDataUnavailable as err:
                print(f"kvcomp grid: skipping {name}: {err}")
                continue
            for mode in modes:
                run_dir = files.make_dirs(out_dir / name.replace("/", "_") / f"L{length}" / mode, out_dir)
                run_grid(model, tokenizer, bench, grid, query_aware=MODES[mode], out_dir=run_dir, progress=progress,
                         store=store)
    written = make_report([out_dir], files.make_dirs(out_dir / "report", out_dir))
    written.update(score_table(out_dir / "report"))
    return written


def score_table(report_dir: Path) -> dict[str, Path]:
    """``scores.md``/``scores.csv``: one row per task and length, one column per configuration and mode,
    cells ``score [memory_factor]`` (exact-match rate with the uncompressed output in ``exact.csv``)."""
    df = pd.read_csv(report_dir / "report.csv")
    df["config"] = [
        "none" if c == "none" else f"{c} {r:g}" if pd.notna(r) else Path(d).name  # a spec's own label
        for c, r, d in zip(df["compressor"], df["compression_ratio"], df["run_dir"])
    ]
    df["config"] = df["config"] + " (" + df["mode"].str.replace("query_", "") + ")"
    df["cell"] = [f"{s:.0f} [{m:.2f}]" for s, m in zip(df["score"], df["memory_factor"])]
    order = sorted(df["config"].unique(), key=lambda c: (not c.startswith("none"), c))
    cells = df.pivot_table(index=["task", "length"], columns="config", values="cell", aggfunc="first")[order]
    scores = df.pivot_table(index=["task", "length"], columns="config", values="score")[order]
    exact = df.pivot_table(index=["task", "length"], columns="config", values="exact_match_rate")[order]
    scores.loc[("mean", ""), :] = scores.mean()
    paths = {"scores_csv": report_dir / "scores.csv", "scores_md": report_dir / "scores.md",
             "exact_csv": report_dir / "exact.csv"}
    with files.open_output(paths["scores_csv"], "w", newline="") as f:
        scores.round(1).to_csv(f)
    with files.open_output(paths["exact_csv"], "w", newline="") as f:
        exact.round(3).to_csv(f)
    files.write_text(
        paths["scores_md"],
        "Score (x100) [measured memory_factor]; 'mean' row: mean score over tasks and lengths.\n\n"
        + _markdown(cells) + "\n" + _markdown(scores.round(1)),
    )
    return paths


def _markdown(df: pd.DataFrame) -> str:
    index = " | ".join(map(str, df.index.names))
    lines = [f"| {index} | " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * (df.index.nlevels + df.shape[1])]
    for key, row in df.iterrows():
        key = key if isinstance(key, tuple) else (key,)
        lines.append("| " + " | ".join(map(str, key)) + " | " + " | ".join("-" if pd.isna(v) else str(v) for v in row) + " |")
    return "\n".join(lines) + "\n"
