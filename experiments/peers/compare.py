"""kvcomp and kvpress side by side: ``python -m experiments.peers.compare GRID [GRID ...] PEERS --out DIR``.

Reads kvcomp's grid runs and the peer runs (:mod:`experiments.peers.records`) with ``kvcomp report``'s reader,
writes the full report of both (``report.csv``, ``report.md``, plots) and ``side_by_side.md``/``.csv``: one row per
task, length, mode and (method, ratio) present on both sides, with score, exact match with each side's own
uncompressed output, measured memory_factor and seconds per sample (prefill + decode), then the same
averaged over tasks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from experiments.report import collect, make_report
from kvcomp import files

# kvcomp method (as the report names it: non-default parameters in brackets) -> kvpress press name, where the two
# implement the same method. kvpress's allocators wrap Expected Attention (kvcomp's default scorer) except
# PyramidKV, whose budgets kvpress puts on SnapKV; CriticalAdaKV is AdaKV over CriticalKV; KVzip with one
# ratio per layer (heads sharing it) is kvpress's layerwise=True.
SHARED = {"none": "none", "streaming_llm": "streaming_llm", "knorm": "knorm", "keydiff": "keydiff", "tova": "tova",
          "snapkv": "snapkv", "expected_attention": "expected_attention", "kvzip": "kvzip",
          "kvzip[level=layer]": "kvzip_layer", "adakv": "adakv",
          "criticalkv": "criticalkv", "adakv[scorer=criticalkv]": "criticaladakv",
          "pyramidkv[scorer=snapkv]": "pyramidkv"}


def side_by_side(df: pd.DataFrame) -> pd.DataFrame:
    """Rows present for both kvcomp and kvpress, matched on task, length, mode, method and ratio."""
    df = df.copy()
    df["seconds"] = df["prefill_seconds"].fillna(0) + df["decode_seconds"].fillna(0)
    df["ratio"] = df["compression_ratio"].fillna(0.0).round(4)
    is_peer = df["compressor"].astype(str).str.startswith("kvpress:")
    ours = df[~is_peer & df["compressor"].isin(list(SHARED))].copy()
    ours["method"] = ours["compressor"]
    peers = df[is_peer].copy()
    peers["method"] = peers["compressor"].str.removeprefix("kvpress:").map({v: k for k, v in SHARED.items()})
    keys = ["task", "length", "mode", "method", "ratio"]
    columns = ["score", "exact_match_rate", "memory_factor", "seconds"]
    merged = ours[keys + columns].merge(peers[keys + columns], on=keys, suffixes=("_kvcomp", "_kvpress"))
    return merged.sort_values(keys).reset_index(drop=True)


def means(table: pd.DataFrame) -> pd.DataFrame:
    """:func:`side_by_side`'s rows averaged over tasks, per length, mode, method and ratio (every task weighs the
    same; ``tasks`` counts them)."""
    keys = ["length", "mode", "method", "ratio"]
    out = table.groupby(keys, sort=True).mean(numeric_only=True).reset_index()
    out.insert(len(keys), "tasks", table.groupby(keys, sort=True).size().to_numpy())
    return out


def _markdown(df: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


def compare(grid: Path | list[Path], peers: Path, out: Path) -> dict[str, Path]:
    """``grid``: one grid run directory, or several (a sweep run in parts, e.g. each query mode on its own)."""
    grids = [Path(g) for g in grid] if isinstance(grid, (list, tuple)) else [Path(grid)]
    out = files.make_dirs(Path(out), Path(out).parent)
    written = make_report([*grids, peers], out)
    table = side_by_side(collect([*grids, peers]))
    written["side_by_side_csv"] = out / "side_by_side.csv"
    written["side_by_side_md"] = out / "side_by_side.md"
    with files.open_output(written["side_by_side_csv"], "w", newline="") as f:
        table.to_csv(f, index=False)
    files.write_text(written["side_by_side_md"],
                     "kvcomp vs kvpress on the same samples: score (x100), exact match with each side's own "
                     "uncompressed output, measured memory_factor, seconds per sample.\n\n" + _markdown(table)
                     + "\nMean over tasks:\n\n" + _markdown(means(table)))
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", nargs="+", help="kvcomp grid run directories (one or more)")
    parser.add_argument("peers", help="the peer runs (kvpress_run.py --out)")
    parser.add_argument("--out", default="reports/side-by-side")
    args = parser.parse_args(argv)
    for kind, path in compare([Path(g) for g in args.grid], Path(args.peers), Path(args.out)).items():
        print(f"{kind:20s} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
