"""Per-leg sums and record-by-record decode ratios of the interleaved A/B legs that ``ab.sh`` wrote.

    PYTHONPATH=. python experiments/results/grid-scaling-embedded-L4096/ab_analyse.py   # from the repository root
"""

import json
import statistics
from pathlib import Path

from eval.runner import load_records

ROOT = Path("runs/grid-scaling-ab")
SUMMED = ("decode_seconds", "compress_seconds", "shared_prefill_seconds")


def records(leg: Path) -> dict:
    out = {}
    for f in (leg / "ray").glob("ruler_*/L*/*/*/results.jsonl"):
        for r in load_records(f):
            out[(r["id"], r["mode"], f.parent.name)] = r
    return out


def main() -> None:
    data = {leg.name: records(leg) for leg in sorted(ROOT.iterdir()) if (leg / "ray").is_dir()}
    for name, recs in data.items():
        t = json.loads((ROOT / name / "timing.json").read_text())["legs"].get("ray", {})
        sums = {k: round(sum(r.get(k) or 0 for r in recs.values()), 1) for k in SUMMED}
        shards = [(s["wall_seconds"], s["cpu_seconds"]) for s in t.get("shards", [])]
        print(name, len(recs), "wall", t.get("wall_seconds"), "speedup", t.get("speedup"),
              "cpu_inflation", t.get("cpu_inflation"), "shards", shards, sums)
    base, *others = data
    for name in others:
        ratios = [r["decode_seconds"] / data[base][k]["decode_seconds"] for k, r in data[name].items() if k in data[base]]
        print(f"{name} / {base}: decode median ratio {statistics.median(ratios):.3f} over {len(ratios)}")


if __name__ == "__main__":
    main()
