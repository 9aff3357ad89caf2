"""Prefill and decode time of kvcomp grid repetitions and a kvpress run over the same samples, per method:
``PYTHONPATH=. python experiments/results/peers-timing-embedded-L4096-2samples-inplace/per_token.py KVPRESS GRID...``
(summed over the samples every run has: mean prefill s, mean decode s, decode ms per generated token)."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from eval.runner import load_records


def method(record) -> str:
    name = record["compressor"]["name"].removeprefix("kvpress:")
    params = record["compressor"].get("params") or {}
    if params.get("level") == "layer" or name == "kvzip_layer":
        name = "kvzip_layer"
    return name


def collect(root: Path) -> dict[str, dict[str, tuple[float, float, int]]]:
    """method -> sample id -> (prefill s, decode s, generated tokens)."""
    out: dict[str, dict[str, tuple[float, float, int]]] = defaultdict(dict)
    for path in sorted(root.rglob("results.jsonl")):
        if "shards" in path.parts:
            continue
        for r in load_records(path):
            tokens = r.get("generated_tokens", len(r.get("token_ids") or []))
            out[method(r)][r["id"]] = (r["prefill_seconds"], r["decode_seconds"], tokens)
    return out


def main(argv: list[str]) -> None:
    runs = {Path(p).name: collect(Path(p)) for p in argv}
    methods = sorted(set.intersection(*(set(r) for r in runs.values())))
    print("| method | run | samples | prefill s | decode s | decode ms/token |")
    print("|---|---|---|---|---|---|")
    for m in methods:
        ids = sorted(set.intersection(*(set(r[m]) for r in runs.values())))
        for name, run in runs.items():
            rows = [run[m][i] for i in ids]
            pre = sum(r[0] for r in rows) / len(rows)
            dec = sum(r[1] for r in rows) / len(rows)
            per_token = 1000 * sum(r[1] for r in rows) / sum(r[2] for r in rows)
            print(f"| {m} | {name} | {len(ids)} | {pre:.2f} | {dec:.2f} | {per_token:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
