"""Many compressors x tasks x lengths x query modes, one prefill per sample: ``kvcomp grid``.

Every configuration of the grid shares the prefill of a sample (:func:`eval.runner.run_grid`), so a table of
13 configurations costs one prefill and 13 short decodes per sample instead of 13 prefills. Layout under
``out_dir`` (the same whether one process ran it or shards did, :mod:`experiments.merge`)::

    <task>/L<length>/<mode>/<label>/results.jsonl, summary.json   (one run directory per configuration)
    <task>/L<length>/<mode>/reference.jsonl                       (uncompressed outputs, for fidelity)
    report/report.csv, report.md, *.png                           (kvcomp report over all of them)
    report/scores.md, scores.csv                                  (score [memory_factor] per task and config)

Sharded (``kvcomp grid --launcher ...`` or ``--shard I/N``), the shards work under ``out_dir/shards/``
(:mod:`experiments.shard`, :mod:`experiments.launchers`) and their merge writes the files above. Rerunning the
same command resumes; tasks whose data is not available offline (RULER's QA tasks without a
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


def grid_labels(compressors, ratios, configs=()) -> list[str]:
    """The grid's configuration labels, in the order :func:`build_grid` builds them."""
    return ["none", *(f"{name}-{ratio}" for name in compressors for ratio in ratios), *map(spec_label, configs)]


def build_grid(compressors, ratios, params: dict | None = None, configs=()) -> dict:
    """label -> compressor of the grid: ``none`` (uncompressed), ``<name>-<ratio>`` for each pair (with
    ``params``), and one column per ``configs`` spec (``quant:bits=4``: a compressor with its own parameters)."""
    grid = {"none": None}
    for name in compressors:
        for ratio in ratios:
            grid[f"{name}-{ratio}"] = create(name, compression_ratio=ratio, **(params or {}))
    for spec in configs:
        name, spec_params = parse_spec(spec)
        grid[spec_label(spec)] = create(name, **spec_params)
    assert list(grid) == grid_labels(compressors, ratios, configs)
    return grid


def check_modes(modes) -> None:
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"Unknown mode(s) {unknown}; use {list(MODES)}.")


def cell_dir(out_dir: Path, task_name: str, length: int, mode: str) -> Path:
    """Where the runs of one task, length and mode go: ``<task>/L<length>/<mode>`` under ``out_dir``."""
    return Path(out_dir) / task_name.replace("/", "_") / f"L{length}" / mode


def grid_tasks(tokenizer, *, tasks, lengths, samples: int, seed: int = 0, max_new_tokens: int | None = None):
    """``(task name, length, Task)`` of every task and length of the grid, in the order the grid runs them;
    tasks whose data is not available offline are skipped with the reason printed."""
    for length in lengths:
        for task in tasks:
            name = task if "/" in task else f"ruler/{task}"
            try:
                bench = load_samples(name, tokenizer, length=length, num_samples=samples, seed=seed,
                                     **({"tokens_to_generate": max_new_tokens} if max_new_tokens else {}))
            except TaskDataUnavailable as err:
                print(f"kvcomp grid: skipping {name}: {err}")
                continue
            yield name, length, bench


def run_table(model, tokenizer, *, tasks, lengths, samples: int, compressors, ratios, modes, out_dir,
              params: dict | None = None, max_new_tokens: int | None = None, seed: int = 0,
              progress: bool = True, configs: tuple[str, ...] = (), store: str | None = None) -> dict[str, Path]:
    """Run the grid into ``out_dir`` and write the report; returns the report's files.

    ``store``: a store URL (``redis://host:port/db`` or a directory) where each sample's compressed prefills are
    kept and reused across runs and machines (:func:`eval.runner.run_grid`)."""
    positive_int("samples", samples, owner="kvcomp grid", error=UsageError)
    for length in lengths:
        positive_int("length", length, owner="kvcomp grid", error=UsageError)
    out_dir = Path(out_dir)
    check_modes(modes)
    grid = build_grid(compressors, ratios, params, configs)
    with files.lock_run_dir(out_dir, "kvcomp grid"):
        for name, length, bench in grid_tasks(tokenizer, tasks=tasks, lengths=lengths, samples=samples, seed=seed,
                                              max_new_tokens=max_new_tokens):
            for mode in modes:
                run_dir = files.make_dirs(cell_dir(out_dir, name, length, mode), out_dir)  # no symlinks on the way
                run_grid(model, tokenizer, bench, grid, query_aware=MODES[mode], out_dir=run_dir, progress=progress,
                         store=store)
        return write_reports(out_dir)


def write_reports(out_dir: Path) -> dict[str, Path]:
    """``kvcomp report`` over the grid's runs into ``out_dir/report``, plus the score table."""
    written = make_report([out_dir], files.make_dirs(Path(out_dir) / "report", out_dir))
    written.update(score_table(Path(out_dir) / "report"))
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
    # '*': differs from the uncompressed run on the same samples at 95% (exact sign test, report.md has p).
    marks = ["*" if str(v) == "True" else "" for v in df.get("vs_none_significant", [None] * len(df))]
    df["cell"] = [f"{s:.0f}{mark} [{m:.2f}]" for s, mark, m in zip(df["score"], marks, df["memory_factor"])]
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
        "Score (x100) [measured memory_factor]; 'mean' row: mean score over tasks and lengths. * : the score "
        "differs from the uncompressed run's on the same samples at 95% (exact sign test over the samples where "
        "they differ); unmarked: not significant. Intervals and p-values: report.md.\n\n"
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
