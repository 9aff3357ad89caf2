"""One table from several reports: ``python -m experiments.tabulate REPORT.csv [...] --out DIR``.

``kvcomp report`` needs the run directories; the committed results keep only its ``report.csv``. This reads
those (one per length, mode or model, say) and writes ``DIR/summary.csv`` and ``DIR/summary.md``: per length,
mode and configuration (the report's label without its mode, plus the ratio), the mean over the tasks of the score, the measured
``memory_factor``, the exact-match rate with the uncompressed output and the seconds per sample (shared
prefill and this configuration's decoding), each mean weighted by the task's sample count, and the number of samples token-identical to the uncompressed
output (for a ratio-0 run: all of them, or exactness is broken).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from kvcomp import files

KEYS = ["length", "mode", "configuration"]
MEANS = ["score", "memory_factor", "exact_match_rate", "prefill_seconds", "decode_seconds"]


def load(paths: list[str | Path]) -> pd.DataFrame:
    frames = []
    for p in paths:
        df = pd.read_csv(p)
        missing = {"task", "n", "label", "compressor", "compression_ratio", "length", "mode", *MEANS} - set(df.columns)
        if missing:
            raise ValueError(f"{p}: not a kvcomp report.csv (no column {', '.join(sorted(missing))}).")
        frames.append(df.assign(configuration=[_configuration(r) for r in df.itertuples()]))
    df = pd.concat(frames, ignore_index=True)
    repeated = df.duplicated(["task", *KEYS], keep=False)
    if repeated.any():
        first = df[repeated].iloc[0]
        raise ValueError(f"{first['configuration']} at {first['length']} ({first['mode']}, {first['task']}) is in more "
                         "than one report: give each run once.")
    return df


def _configuration(r) -> str:
    name = r.label.split(" (")[0]
    return name if pd.isna(r.compression_ratio) or r.compressor == "none" else f"{name} {r.compression_ratio:g}"


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Mean over tasks (weighted by ``n``) per length, mode and configuration."""
    rows = []
    for key, group in df.groupby(KEYS, sort=True, dropna=False):
        weights = group["n"]
        row = dict(zip(KEYS, key), tasks=len(group), samples=int(weights.sum()))
        for col in MEANS:
            row[col] = float((group[col] * weights).sum() / weights.sum())
        row["exact_samples"] = int(round((group["exact_match_rate"] * weights).sum()))
        rows.append(row)
    return pd.DataFrame(rows)


def to_markdown(summary: pd.DataFrame) -> str:
    lines = ["| length | mode | configuration | samples | score | memory_factor | exact match | prefill s | decode s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary.itertuples():
        lines.append(f"| {r.length} | {r.mode.removeprefix('query_')} | {r.configuration} | {r.samples} | "
                     f"{r.score:.1f} | {r.memory_factor:.2f} | {r.exact_samples}/{r.samples} | "
                     f"{r.prefill_seconds:.0f} | {r.decode_seconds:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> pd.DataFrame:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="report.csv files written by kvcomp report")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    summary = summarize(load(args.reports))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files.write_text(out / "summary.csv", summary.to_csv(index=False))
    files.write_text(out / "summary.md", to_markdown(summary))
    print(to_markdown(summary))
    return summary


if __name__ == "__main__":
    main()
