"""Aggregate run directories into a table and plots: ``kvcomp report DIR [DIR...] --out OUT``.

Finds every ``summary.json`` under the given directories (a run directory of ``experiments.run``, a sweep,
a grid, or a tree of them) and every kvpress evaluation directory (:mod:`experiments.kvpress_format`, one
run per task), and writes to ``OUT``:

* ``report.csv`` and ``report.md``: one row per run (task, length, compressor, ratio, mode, score,
  memory_factor, fidelity, seconds per sample), each score with its 95% bootstrap interval over the samples
  and paired tests against the uncompressed run and the best other method (:mod:`experiments.confidence`);
* ``score_vs_memory.png``: score vs memory_factor, one panel per task, one curve per compressor and mode,
  the Pareto front (no other run is both smaller and better) marked, error bars = the 95% intervals;
* ``fidelity_vs_memory.png``: exact-match rate with the uncompressed output vs memory_factor;
* ``time_per_sample.png``: prefill and decode seconds per sample of each run.

The mode (query-aware or query-agnostic) is part of every label: the two are different experiments. Plots
are drawn on matplotlib Figure objects (Agg canvas), without pyplot, so no display or backend is needed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from kvcomp import files

COLUMNS = [
    "task", "length", "compressor", "compression_ratio", "budget", "mode", "label", "n", "score",
    "memory_factor", "exact_match_rate", "mean_first_divergence", "agreement", "kept_tokens",
    "context_length", "prefill_seconds", "decode_seconds", "peak_rise_mb", "model", "dtype", "source", "run_dir",
]  # fmt: skip
MODE_SHORT = {"query_aware": "aware", "query_agnostic": "agnostic"}


def find_runs(paths: Iterable[str | Path]) -> list[Path]:
    """Run directories (those holding ``summary.json``) under ``paths``, sorted, without duplicates.

    The shards of a sharded grid (directories holding ``shard.json``) below a given path are skipped: their
    merge is the grid's runs. A path inside a shard is read as given."""
    from experiments.shard import inside_shard

    runs = set()
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such directory.")
        if (p / "summary.json").is_file():
            runs.add(p.resolve())
        for s in p.rglob("summary.json"):
            if not inside_shard(s.parent, p):
                runs.add(s.parent.resolve())
    return sorted(runs)


def _variant(name: str, params: dict) -> str:
    """``name`` plus the parameters other than the ratio/budget that differ from the method's defaults
    (``adakv[scorer=tova]``), so that two configurations of one method never share a row or a curve."""
    import dataclasses

    import kvcomp

    cls = kvcomp.available().get(name)
    if cls is None or not dataclasses.is_dataclass(cls):
        return name
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    changed = [f"{k}={v}" for k, v in sorted(params.items())
               if k not in ("compression_ratio", "budget") and k in defaults and v != defaults[k]]
    return f"{name}[{','.join(changed)}]" if changed else name


def _row(run_dir: Path) -> dict[str, Any]:
    s = json.loads((run_dir / "summary.json").read_text())
    comp = s.get("compressor") or {}
    if not isinstance(comp, dict):  # "mixed": the run's records disagree; keep it visible
        comp = {"name": str(comp), "params": {}}
    params = comp.get("params") or {}
    name = _variant(comp.get("name", "?"), params)
    ratio = params.get("compression_ratio")
    mode = s.get("mode")
    tasks = s.get("tasks") or []
    if name == "none":
        label = f"none ({MODE_SHORT.get(mode, mode)})"
    else:
        label = f"{name} ({MODE_SHORT.get(mode, mode)})"
    if isinstance(s.get("lossless"), dict):  # lossless decoding drafting with this compressor: its own curve
        label = f"{name} lossless ({MODE_SHORT.get(mode, mode)})"
    return {
        "task": s.get("task") or ",".join(tasks),
        "length": s.get("length"),
        "compressor": name,
        "compression_ratio": 0.0 if name == "none" else ratio,
        "budget": params.get("budget"),
        "mode": mode,
        "label": label,
        **{k: s.get(k) for k in COLUMNS if k in s and k not in ("task", "length", "mode", "compressor")},
        "source": "kvcomp",
        "run_dir": str(run_dir),
    }


def run_samples(run_dir: Path) -> dict[str, dict]:
    """Sample id -> ``{"score", "exact_match"}`` of a run directory's records."""
    from eval.runner import load_records

    return {r["id"]: {"score": r["score"], "exact_match": r.get("exact_match")}
            for r in load_records(run_dir / "results.jsonl")}


def _once(rows: list[dict], samples: list[dict]) -> tuple[list[dict], list[dict]]:
    """The runs with a repeat left out: a run with the same task, length, mode, label, ratio, budget, model and
    dtype as an earlier one, and the same per-sample scores and exact matches on the same sample ids (the
    uncompressed reference that each part of a sweep run as several grids holds), is reported once, with a
    warning naming both. Runs that share a label but not their samples or results stay: they are different
    measurements."""
    import warnings

    first: dict[tuple, int] = {}
    kept: list[int] = []
    for i, row in enumerate(rows):
        key = tuple(row.get(k) for k in ("task", "length", "mode", "label", "compression_ratio", "budget", "model",
                                         "dtype"))
        j = first.setdefault(key, i)
        if j != i and samples[i] and samples[i] == samples[j]:
            warnings.warn(f"{row['run_dir']} repeats {rows[j]['run_dir']} (same configuration, samples and "
                          f"results): reported once", stacklevel=3)
            continue
        kept.append(i)
    return [rows[i] for i in kept], [samples[i] for i in kept]


def collect(paths: Iterable[str | Path] | str | Path, confidence: bool = True) -> pd.DataFrame:
    """One row per run found under ``paths``: kvcomp run directories, and kvpress evaluation directories
    (one row per task, :mod:`experiments.kvpress_format`). Columns: :data:`COLUMNS`, then with
    ``confidence`` the intervals and paired tests of :mod:`experiments.confidence`."""
    from experiments.confidence import add_confidence
    from experiments.kvpress_format import find_kvpress_dirs, read_kvpress_dir

    if isinstance(paths, (str, Path)):
        paths = [paths]
    runs = find_runs(paths)
    rows, samples = _once([_row(d) for d in runs], [run_samples(d) for d in runs])
    for d in find_kvpress_dirs(paths):
        for row, per_sample in read_kvpress_dir(d):
            rows.append(row)
            samples.append(per_sample)
    df = pd.DataFrame(rows, columns=COLUMNS)
    if confidence:
        df = add_confidence(df, samples)
    return df.sort_values(["task", "length", "mode", "compressor", "compression_ratio"], na_position="first")


def load_sample_records(paths: Iterable[str | Path] | str | Path) -> pd.DataFrame:
    """Every per-sample record of the runs under ``paths``, with ``run_dir``, ``compressor_name`` and
    ``compression_ratio`` columns, and the uncompressed ``reference_text`` when the reference file is found."""
    from eval.runner import load_records

    if isinstance(paths, (str, Path)):
        paths = [paths]
    rows = []
    references: dict[tuple, str] = {}
    for run_dir in find_runs(paths):
        meta_path = run_dir / "run_meta.json"
        ref = json.loads(meta_path.read_text()).get("reference_path") if meta_path.is_file() else None
        if ref and Path(ref).is_file():
            for r in load_records(ref):
                sid, _, model, dtype, query_aware, _ = json.loads(r["key"])
                references[(sid, model, dtype, query_aware)] = r["text"]
        for r in load_records(run_dir / "results.jsonl"):
            r = dict(r)
            r["run_dir"] = str(run_dir)
            r["compressor_name"] = r["compressor"]["name"]
            r["compression_ratio"] = r["compressor"]["params"].get("compression_ratio", 0.0)
            r["reference_text"] = references.get((r["id"], r["model"], r["dtype"], r["query_aware"]))
            rows.append(r)
    return pd.DataFrame(rows)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points that no other point beats on both axes (higher is better on both), sorted
    by the first coordinate."""
    front = []
    for i, (x, y) in enumerate(points):
        if any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i):
            continue
        front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def _finite(v) -> bool:
    return v is not None and not (isinstance(v, float) and (math.isnan(v) or math.isinf(v)))


def _panels(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """One panel per task and length: a curve never mixes lengths."""
    key = df.task + df.length.map(lambda v: f" (L={int(v)})" if _finite(v) else "")
    return [(k, df[key == k]) for k in sorted(key.unique())]


# The interval columns (experiments.confidence) drawn as error bars on each plotted value.
INTERVALS = {"score": ("score_ci_low", "score_ci_high"),
             "exact_match_rate": ("exact_match_ci_low", "exact_match_ci_high")}


def _curves(ax, sub: pd.DataFrame, y: str, colors: dict[str, str]) -> None:
    low, high = INTERVALS.get(y, (None, None))
    for label, g in sub.groupby("label", sort=True):
        g = g[g[y].map(_finite) & g.memory_factor.map(_finite)].sort_values("memory_factor")
        if g.empty:
            continue
        style = "*" if label.startswith("none") else "o-"
        ax.plot(
            g.memory_factor,
            g[y],
            style,
            label=label,
            color=colors[label],
            markersize=9 if style == "*" else 5,
        )
        if low in g and high in g:
            ok = g[g[low].map(_finite) & g[high].map(_finite)]
            if not ok.empty:  # 95% bootstrap interval over the samples
                yerr = [(ok[y] - ok[low]).clip(lower=0), (ok[high] - ok[y]).clip(lower=0)]
                ax.errorbar(ok.memory_factor, ok[y], yerr=yerr, fmt="none", ecolor=colors[label], elinewidth=1,
                            capsize=3, alpha=0.7)


def _colors(df: pd.DataFrame) -> dict[str, str]:
    # One colour per compressor and mode across every panel.
    return {label: f"C{i % 10}" for i, label in enumerate(sorted(df.label.unique()))}


PANEL_COLUMNS = 4


def _panel_axes(df: pd.DataFrame):
    """One figure with a panel per task and length; yields ``(fig, [(ax, title, rows), ...])``."""
    from matplotlib.figure import Figure

    panels = _panels(df)
    # At most PANEL_COLUMNS panels a row: a grid of 11 tasks stays readable (one row was 7000 px wide).
    cols = min(len(panels), PANEL_COLUMNS)
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(5.5 * cols, 4.2 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    return fig, [(ax, title, sub) for ax, (title, sub) in zip(axes, panels)]


def _finish_axes(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a panel can be empty (kvpress measures no exact match)
        ax.legend(fontsize=7)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    with files.open_output(path, "wb") as f:
        fig.savefig(f, dpi=120, format="png")
    return path


def plot_score_vs_memory(df: pd.DataFrame, path: Path) -> Path:
    fig, panels = _panel_axes(df)
    for ax, title, sub in panels:
        _curves(ax, sub, "score", _colors(df))
        ok = sub[sub.score.map(_finite) & sub.memory_factor.map(_finite)]
        pts = list(zip(ok.memory_factor, ok.score))
        if pts:
            front = [pts[i] for i in pareto_front(pts)]
            # The best score reachable at memory_factor >= x: a step down just before each front point.
            ax.step([p[0] for p in front], [p[1] for p in front], where="pre", color="black", lw=1, alpha=0.6)
            ax.scatter(
                [p[0] for p in front], [p[1] for p in front], s=120, facecolors="none", edgecolors="black",
                label="Pareto front",
            )  # fmt: skip
        _finish_axes(ax, title, "memory_factor (full KV bytes / resident bytes)", "score")
    return _save(fig, path)


def plot_fidelity_vs_memory(df: pd.DataFrame, path: Path) -> Path:
    fig, panels = _panel_axes(df)
    for ax, title, sub in panels:
        _curves(ax, sub, "exact_match_rate", _colors(df))
        ax.set_ylim(-0.05, 1.05)
        _finish_axes(ax, title, "memory_factor", "exact match with uncompressed output")
    return _save(fig, path)


def plot_time_per_sample(df: pd.DataFrame, path: Path) -> Path:
    from matplotlib.figure import Figure

    d = df.reset_index(drop=True)
    names = [
        f"{r.task.split('/')[-1]} {r.label} r={r.compression_ratio if _finite(r.compression_ratio) else '-'}"
        for r in d.itertuples()
    ]
    prefill = d.prefill_seconds.fillna(0.0).to_numpy()
    decode = d.decode_seconds.fillna(0.0).to_numpy()
    fig = Figure(figsize=(8, 0.35 * len(d) + 1.5))
    ax = fig.subplots()
    ax.barh(names, prefill, label="prefill")
    ax.barh(names, decode, left=prefill, label="decode")
    ax.invert_yaxis()
    ax.set_xlabel("seconds per sample (mean)")
    ax.legend()
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _interval(row, low: str, high: str, digits: int = 0) -> str:
    lo, hi = row.get(low), row.get(high)
    return "-" if not (_finite(lo) and _finite(hi)) else f"[{lo:.{digits}f}, {hi:.{digits}f}]"


def _versus(row, prefix: str, name: str | None = None) -> str:
    """``-20.0 (p=0.031)*`` or ``+5.0 (p=1) n.s.``: the paired difference, its p-value and the mark."""
    from experiments.confidence import significance_mark

    p = row.get(f"{prefix}_p")
    if not _finite(p):
        return "-"
    who = f" vs {name}" if name else ""
    mark = significance_mark(row.get(f"{prefix}_significant"), p)
    return f"{row[f'{prefix}_diff']:+.1f}{who} (p={p:.2g}){mark}"


def to_markdown(df: pd.DataFrame) -> str:
    """One row per run; with the confidence columns (:func:`collect`), the score's interval and the paired
    comparisons against uncompressed and the best other method, marked significant (*) or not (n.s.)."""
    from experiments.confidence import LEGEND

    confidence = "score_ci_low" in df
    cols = [c for c in COLUMNS if c not in ("run_dir", "model", "dtype", "label", "budget", "source")]
    if "source" in df and (df["source"] != "kvcomp").any():
        cols.insert(0, "source")
    if confidence:
        at = cols.index("score") + 1
        cols[at:at] = ["score 95% CI", "vs none", "vs best other"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, row in df.iterrows():
        cells = []
        for c in cols:
            if c == "score 95% CI":
                cells.append(_interval(row, "score_ci_low", "score_ci_high", 1))
            elif c == "vs none":
                cells.append(_versus(row, "vs_none"))
            elif c == "vs best other":
                cells.append(_versus(row, "vs_best", row.get("best_other")))
            else:
                cells.append(_fmt(row.get(c)))  # a column an older table lacks (peak_rise_mb) reads "-"
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    return (LEGEND + "\n\n" + text) if confidence else text


def make_report(paths: Sequence[str | Path], out_dir: str | Path) -> dict[str, Path]:
    """Write the CSV, Markdown table and plots of the runs under ``paths`` into ``out_dir``."""
    df = collect(paths)
    if df.empty:
        raise FileNotFoundError(f"No run directories (summary.json) or kvpress evaluation directories "
                                f"(predictions.csv, metrics.json) under {', '.join(map(str, paths))}.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {"csv": out / "report.csv", "markdown": out / "report.md"}
    with files.open_output(written["csv"], "w", newline="") as f:
        df.to_csv(f, index=False)
    files.write_text(written["markdown"], to_markdown(df))
    written["score_vs_memory"] = plot_score_vs_memory(df, out / "score_vs_memory.png")
    written["fidelity_vs_memory"] = plot_fidelity_vs_memory(df, out / "fidelity_vs_memory.png")
    written["time_per_sample"] = plot_time_per_sample(df, out / "time_per_sample.png")
    return written
