"""Merge the shards of a sharded ``kvcomp grid`` into the files one process writes: ``kvcomp grid merge DIR``.

Checks first, writes after: every shard of ``shards/grid.json`` is complete; all ran the same model and
dtype and generated the same samples (ids and prompt digests); every record of a configuration has that
configuration (compressor, parameters, mode, model, dtype); every sample of every task, length, mode and
configuration is there exactly once. Then, for each configuration, ``results.jsonl`` holds the shards'
records (their lines as written) in the sample order of a single-process run, ``summary.json`` is
:func:`eval.runner.write_summary` of them, each ``reference.jsonl`` holds the uncompressed outputs in sample
order, and the report is rewritten. Nothing is removed: the shards stay (they are what a rerun resumes), and
a target file holding a record the shards do not have, or a different one, stops the merge with its name.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from eval.runner import CONFIG_FIELDS, REFERENCE_FILE, write_summary
from experiments.shard import (
    CLAIMS_DIR,
    SAMPLES_FILE,
    SHARD_MARKER,
    SHARDS_DIR,
    GridSpec,
    Shard,
    read_json,
    read_manifest,
    shard_dir,
    shards_root,
)
from kvcomp import files

RESULTS_FILE = "results.jsonl"
# Fields of a record that measure time or peak memory: they differ between any two runs of the same thing.
TIMING_FIELDS = ("prefill_seconds", "decode_seconds", "compress_seconds", "shared_prefill_seconds", "peak_rise_mb",
                 "shared_prefill_peak_rise_mb")


class ShardMergeError(ValueError):
    """The shards cannot be merged as they are (incomplete, from different grids, or conflicting)."""


def _lines(path: Path) -> list[tuple[dict, str]]:
    """``(record, line)`` of each complete JSON line (a partial last line is an interrupted shard)."""
    if not path.is_file():
        return []
    data = path.read_text(encoding="utf-8")
    complete = data[: data.rfind("\n") + 1]
    return [(json.loads(line), line) for line in complete.splitlines() if line.strip()]


def _without_timing(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING_FIELDS}


def _write_lines(path: Path, lines: list[str], root: Path) -> None:
    files.make_dirs(path.parent, root)  # no symlinked directory on the way
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    files.write_text(tmp, "".join(line + "\n" for line in lines))
    os.replace(tmp, path)  # atomic; replaces a link at ``path`` rather than writing through it


def _check_shards(out_dir: Path, spec: GridSpec, count: int) -> tuple[list[Path], list[dict]]:
    """The shard directories, after checking they are complete and agree; and the samples they share."""
    shards = [Shard(i, count) for i in range(count)]
    others = sorted(p.name for p in shards_root(out_dir).iterdir()
                    if p.is_dir() and p.name not in {s.name for s in shards} | {CLAIMS_DIR}
                    and not p.name.startswith("."))
    if others:
        raise ShardMergeError(
            f"{shards_root(out_dir)} holds shard directories {others} besides the {count} shards of its grid.json: "
            f"they come from another shard count. Move them away (nothing is deleted for you) and merge again."
        )
    problems, statuses = [], []
    for shard in shards:
        marker = shard_dir(out_dir, shard) / SHARD_MARKER
        status = read_json(marker) if marker.is_file() else {"status": "not started"}
        statuses.append(status)
        if status.get("status") != "complete":
            problems.append(f"shard {shard.index}/{count}: {status.get('status')}")
    if problems:
        raise ShardMergeError(
            f"Not every shard of {out_dir} is complete ({'; '.join(problems)}). Run the missing ones with "
            f"`kvcomp grid <the same arguments> --out {out_dir} --shard I/{count}` (each resumes what it has), "
            f"then `kvcomp grid merge {out_dir}`."
        )
    for key in ("model", "dtype"):
        values = {s[key] for s in statuses}
        if len(values) > 1:
            raise ShardMergeError(f"The shards of {out_dir} ran different {key}s: {sorted(values)}.")
    samples = [read_json(shard_dir(out_dir, s) / SAMPLES_FILE) for s in shards]
    for shard, theirs in zip(shards[1:], samples[1:]):
        if theirs != samples[0]:
            raise ShardMergeError(
                f"Shard {shard.index}/{count} generated other samples than shard 0/{count} (ids or prompts "
                f"differ): the shards do not share one grid. Rerun the shards from one kvcomp version."
            )
    versions = {json.dumps(s.get("versions"), sort_keys=True) for s in statuses}
    if len(versions) > 1:
        print(f"kvcomp grid merge: the shards ran different versions: {sorted(versions)}")
    return [shard_dir(out_dir, s) for s in shards], samples[0]


def _merge_results(rel: Path, dirs: list[Path], ids: list[str], out_dir: Path) -> list[str]:
    by_id: dict[str, tuple[dict, str]] = {}
    config = None
    for d in dirs:
        for record, line in _lines(d / rel / RESULTS_FILE):
            theirs = {k: record.get(k) for k in CONFIG_FIELDS}
            config = config or theirs
            if theirs != config:
                raise ShardMergeError(f"{d / rel / RESULTS_FILE}: record {record['id']!r} has another "
                                      f"configuration than the other shards' ({theirs} vs {config}).")
            if record["id"] in by_id:
                raise ShardMergeError(f"Sample {record['id']!r} of {rel} is in two shards.")
            by_id[record["id"]] = (record, line)
    unknown = sorted(set(by_id) - set(ids))
    missing = [i for i in ids if i not in by_id]
    if unknown or missing:
        raise ShardMergeError(
            f"{rel}: the shards hold {len(by_id)} records for {len(ids)} samples (missing: {missing[:3]}"
            f"{'...' if len(missing) > 3 else ''}; not samples of this grid: {unknown[:3]}). Rerun the shard "
            f"that lacks them (it resumes), then merge again."
        )
    target = out_dir / rel / RESULTS_FILE
    for record, _ in _lines(target):  # what is there already must be what the shards have
        mine = by_id.get(record["id"])
        if mine is None or _without_timing(mine[0]) != _without_timing(record):
            raise ShardMergeError(
                f"{target} already holds a record ({record['id']!r}) that the shards do not have, or a different "
                f"one; merging would replace it. Move {target.parent} away or merge a grid with another --out."
            )
    return [by_id[i][1] for i in ids]


def _merge_references(rel: Path, dirs: list[Path], ids: list[str], out_dir: Path) -> list[str]:
    rows: dict[str, tuple[dict, str]] = {}
    for d in dirs:
        for row, line in _lines(d / rel / REFERENCE_FILE):
            rows.setdefault(row["key"], (row, line))
    order = {sid: i for i, sid in enumerate(ids)}
    target = out_dir / rel / REFERENCE_FILE
    for row, line in _lines(target):  # keep rows from elsewhere (another run into the same directory)
        rows.setdefault(row["key"], (row, line))
    ranked = sorted(rows.values(), key=lambda r: (order.get(r[0]["id"], len(order)), r[0]["key"]))
    return [line for _, line in ranked]


def merge_shards(out_dir: str | os.PathLike, report: bool = True) -> dict[str, Any]:
    """Merge ``out_dir/shards/*`` into ``out_dir`` (see the module docstring); returns what it wrote:
    ``{"runs": [run dirs], "records": n, "files": report files}``."""
    from experiments.grid import cell_dir, write_reports

    out_dir = Path(out_dir)
    spec, count = read_manifest(out_dir)
    dirs, samples = _check_shards(out_dir, spec, count)
    plan = []  # check everything before writing anything
    for entry in samples:
        for mode in spec.modes:
            mode_rel = cell_dir(Path(), entry["task"], entry["length"], mode)
            for label in spec.labels():
                lines = _merge_results(mode_rel / label, dirs, entry["ids"], out_dir)
                plan.append((mode_rel / label, lines, entry))
            plan.append((mode_rel, _merge_references(mode_rel, dirs, entry["ids"], out_dir), None))
    runs, records = [], 0
    # The same locks a single-process grid takes (the whole grid, and each task/length/mode directory), so no
    # other process writes there meanwhile and the merged directory holds exactly the files one process writes.
    with contextlib.ExitStack() as locks:
        locks.enter_context(files.lock_run_dir(out_dir, "kvcomp grid merge"))
        for rel, lines, entry in plan:
            if entry is None:
                locks.enter_context(files.lock_run_dir(out_dir / rel, "kvcomp grid merge"))
                _write_lines(out_dir / rel / REFERENCE_FILE, lines, out_dir)
                continue
            _write_lines(out_dir / rel / RESULTS_FILE, lines, out_dir)
            write_summary(out_dir / rel, entry["task"], entry["length"])
            runs.append(out_dir / rel)
            records += len(lines)
        written = write_reports(out_dir) if report and runs else {}
    return {"runs": runs, "records": records, "files": written}


def compare_grids(a: str | os.PathLike, b: str | os.PathLike) -> dict[str, Any]:
    """Records of two grid directories side by side (timing fields aside; shards and reports not read):
    ``{"files": n, "records": n, "identical": n, "differ": [relative paths]}``. ``kvcomp grid diff A B``."""
    a, b = Path(a), Path(b)

    def files(root: Path) -> set[str]:
        return {p.relative_to(root).as_posix() for p in root.rglob("*.jsonl")
                if SHARDS_DIR not in p.relative_to(root).parts}

    fa, fb = files(a), files(b)
    out = {"files": len(fa | fb), "records": 0, "identical": 0,
           "differ": sorted(fa ^ fb)}  # a file only one side has differs
    for rel in sorted(fa & fb):
        ra, rb = [r for r, _ in _lines(a / rel)], [r for r, _ in _lines(b / rel)]
        same = sum(_without_timing(x) == _without_timing(y) for x, y in zip(ra, rb))
        out["records"] += max(len(ra), len(rb))
        out["identical"] += same
        if same != len(ra) or len(ra) != len(rb):
            out["differ"].append(rel)
    return out
