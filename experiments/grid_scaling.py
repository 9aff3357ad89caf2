"""Wall time of the sharded grid against one process, on this machine, and where the difference goes.

    python -m experiments.grid_scaling --lengths 4096 --samples 4 \
        --tasks niah_single_1 niah_single_2 niah_multikey_1 --out runs/grid-scaling

Runs the same ``kvcomp grid`` as separate commands, one after the other, each into ``<out>/<leg>``:

* ``single``: one process, ``--threads-per-worker 1`` (and ``OMP_NUM_THREADS=1``);
* ``local``: ``--launcher local --workers N`` (plain processes: what the machine allows without Ray);
* ``ray``: ``--launcher ray --workers N`` (a local Ray cluster started by the command).

Then ``kvcomp grid diff`` of every leg against ``single`` (records identical, timing fields aside). Each leg's
wall time is the whole command's (model loads, Ray's start, the merge); every shard's wall and CPU seconds come
from its ``shard.json``, the single process's CPU seconds from the OS. The speed-up over ``single`` splits into

    single wall / leg wall = (single CPU / slowest shard's CPU)      work per shard: balance and contention
                           x (slowest shard's CPU / its wall)        the share of a core the shard got
                           x (slowest shard's wall / leg wall)       start-up and merge
                           / (single CPU / single wall)              the single process's own core share

Arguments this script does not know go to every ``kvcomp grid`` command (``--compressors snapkv --ratios 0.5``).
``timing.json`` holds it all; a leg already in it is not rerun (delete the entry, or the file, to rerun).
The machine should be otherwise idle: the load average before and during each leg is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

LEGS = ("single", "local", "ray")
TIMING_FILE = "timing.json"


def grid_command(args, leg: str, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "experiments.cli", "grid", "--model", args.model, "--lengths",
           *map(str, args.lengths), "--samples", str(args.samples), "--threads-per-worker", str(args.threads),
           "--out", str(out)]  # fmt: skip
    if args.tasks:
        cmd += ["--tasks", *args.tasks]
    cmd += args.grid_args
    if leg != "single":
        cmd += ["--launcher", leg, "--workers", str(args.workers)]
    return cmd


class LoadSampler(threading.Thread):
    """The 1-minute load average every ``every`` seconds while a leg runs."""

    def __init__(self, every: float = 10.0):
        super().__init__(daemon=True)
        self.every, self.samples, self._done = every, [], threading.Event()

    def run(self):
        while not self._done.wait(self.every):
            self.samples.append(round(os.getloadavg()[0], 2))

    def stop(self) -> list[float]:
        self._done.set()
        self.join()
        return self.samples


def shard_times(out: Path) -> list[dict]:
    shards = sorted((out / "shards").glob("*-of-*/shard.json"))
    rows = [json.loads(p.read_text()) for p in shards]
    return [{"shard": r["shard"], "wall_seconds": round(r["wall_seconds"], 1), "cpu_seconds": round(r["cpu_seconds"], 1)}
            for r in rows]


def run_leg(args, leg: str, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if leg == "single" else dict(os.environ)
    cmd = grid_command(args, leg, out)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = round(os.getloadavg()[0], 2)
    sampler = LoadSampler()
    sampler.start()
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env)
    wall = time.perf_counter() - started
    load = sampler.stop()
    if proc.returncode:
        raise SystemExit(f"grid_scaling: leg {leg!r} failed (exit {proc.returncode}): {' '.join(cmd)}; "
                         f"rerun the same command to resume it")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = {"command": " ".join(["kvcomp", *cmd[3:]]), "wall_seconds": round(wall, 1),
           "load_before": load_before, "load_during": [min(load, default=None), max(load, default=None)]}
    if leg == "single":
        row["cpu_seconds"] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1)
    else:
        row["shards"] = shard_times(out)
    return row


def breakdown(single: dict, leg: dict) -> dict:
    slowest = max(leg["shards"], key=lambda s: s["wall_seconds"])
    return {
        "speedup": round(single["wall_seconds"] / leg["wall_seconds"], 3),
        "work_per_shard": round(single["cpu_seconds"] / slowest["cpu_seconds"], 3),
        "core_share": round(slowest["cpu_seconds"] / slowest["wall_seconds"], 3),
        "startup_and_merge": round(slowest["wall_seconds"] / leg["wall_seconds"], 3),
        "single_core_share": round(single["cpu_seconds"] / single["wall_seconds"], 3),
        "cpu_inflation": round(sum(s["cpu_seconds"] for s in leg["shards"]) / single["cpu_seconds"], 3),
    }


def identical(a: Path, b: Path) -> bool:
    cmd = [sys.executable, "-m", "experiments.cli", "grid", "diff", str(a), str(b)]
    return subprocess.run(cmd).returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.grid_scaling", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tasks", nargs="+", default=None, help="default: the grid's (the 11 RULER tasks)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    parser.add_argument("--legs", nargs="+", choices=LEGS, default=list(LEGS))
    parser.add_argument("--out", type=Path, default=Path("runs/grid-scaling"))
    args, args.grid_args = parser.parse_known_args(argv)
    if "single" not in args.legs:
        parser.error("--legs must include single: every other leg is compared with it")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / TIMING_FILE
    timing = json.loads(path.read_text()) if path.exists() else {"cores": os.cpu_count(), "legs": {}}
    for leg in args.legs:
        if leg in timing["legs"]:
            print(f"grid_scaling: {leg} already measured ({timing['legs'][leg]['wall_seconds']} s), skipped")
            continue
        timing["legs"][leg] = run_leg(args, leg, args.out / leg)
        path.write_text(json.dumps(timing, indent=2) + "\n")
    single = timing["legs"]["single"]
    for leg in (x for x in args.legs if x != "single"):
        row = timing["legs"][leg]
        row["identical_to_single"] = identical(args.out / "single", args.out / leg)
        row.update(breakdown(single, row))
    path.write_text(json.dumps(timing, indent=2) + "\n")
    print(json.dumps(timing, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
