"""One shard of a sharded ``kvcomp grid``: a worker that runs every configuration of the grid on its share of
the samples, with one prefill per sample, into its own directory.

The unit of work is one sample of one task, length and mode (its prefill is shared by every configuration).
How the units are split is the grid's ``assign`` (:data:`ASSIGNMENTS`):

* ``round-robin`` (the default): shard ``i`` of ``n`` (0-based) takes samples ``i, i + n, i + 2n, ...`` of every
  task, length and mode, whatever the other shards do.
* ``queue``: every worker walks the units in the same order and takes each one nobody has claimed yet, so a
  worker that starts late (a Slurm job queued behind others) or whose samples decode longer takes fewer. A claim
  is a file under ``shards/claims/`` made atomically (a hard link: the first shard to make it owns the unit, on
  any file system the workers share); a rerun shard completes the units it claimed (resuming them) and takes
  those still unclaimed. Measured at 4K on 2 cores it balanced the two shards (2% apart instead of 9%) but
  used 7% more CPU than round-robin, so it is not the default (``experiments/results/grid-scaling-embedded-L4096``).

Layout under the grid's ``out_dir``::

    shards/grid.json                       the grid (:class:`GridSpec`) every shard must share
    shards/<i>-of-<n>/shard.json           the worker: model id, dtype, device, threads, host, versions, status,
                                           wall and CPU seconds
    shards/<i>-of-<n>/samples.json         per task and length, the ids and digests of ALL its samples, in order
    shards/<i>-of-<n>/<task>/L<len>/<mode>/<label>/results.jsonl ...   a grid directory over the shard's samples
    shards/<i>-of-<n>/worker.log           the worker's output (local launcher)
    shards/claims/<task>/L<len>/<mode>/<k> the shard that took sample k (queue assignment)

A shard resumes like any grid directory: rerunning it skips the records it already has.
:mod:`experiments.merge` turns complete shards into the files one process writes.

``python -m experiments.shard OUT_DIR INDEX COUNT [--device D] [--threads T]`` runs one shard of the grid
described by ``OUT_DIR/shards/grid.json`` (the local launcher starts its workers this way).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import resource
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHARDS_DIR = "shards"
MANIFEST = "grid.json"
SHARD_MARKER = "shard.json"
SAMPLES_FILE = "samples.json"
LOG_FILE = "worker.log"
CLAIMS_DIR = "claims"
ASSIGNMENTS = ("queue", "round-robin")


class GridMismatch(ValueError):
    """A shard (or an existing ``shards/grid.json``) belongs to another grid configuration."""


@dataclass(frozen=True)
class GridSpec:
    """What a grid computes; every shard of one grid must have the same (the merge checks it)."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int
    compressors: tuple[str, ...]
    ratios: tuple[float, ...]
    modes: tuple[str, ...]
    params: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int | None = None
    seed: int = 0
    model: str | None = None  # None: the embedded model
    dtype: str = "float32"
    configs: tuple[str, ...] = ()  # compressors with their own parameters ("quant:bits=4"), one column each
    store: str | None = None  # where each sample's compressed prefills are kept and reused (``kvcomp grid --store``)
    assign: str = "round-robin"  # how the shards split the samples (:data:`ASSIGNMENTS`, the module docstring)

    def __post_init__(self):
        for name in ("tasks", "lengths", "compressors", "ratios", "modes", "configs"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}.")
        if self.assign not in ASSIGNMENTS:
            raise ValueError(f"assign must be one of {ASSIGNMENTS}, got {self.assign!r}.")

    def labels(self) -> list[str]:
        """The grid's configuration labels, as :func:`experiments.grid.build_grid` names them."""
        from experiments.grid import grid_labels

        return grid_labels(self.compressors, self.ratios, self.configs)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GridSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise GridMismatch(f"Unknown grid fields {unknown}: written by another kvcomp version?")
        return cls(**data)


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (0-based, as Slurm array task ids usually are)."""

    index: int
    count: int

    def __post_init__(self):
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(
                f"Shard {self.index}/{self.count} does not exist: shards are numbered from 0, "
                f"0/{max(self.count, 1)} .. {max(self.count, 1) - 1}/{max(self.count, 1)}."
            )

    @classmethod
    def parse(cls, text: str) -> Shard:
        index, sep, count = text.partition("/")
        if not sep or not index.strip().isdigit() or not count.strip().isdigit():
            raise ValueError(f"--shard takes INDEX/COUNT (0-based, e.g. 0/4), got {text!r}.")
        return cls(int(index), int(count))

    @property
    def name(self) -> str:
        return f"{self.index}-of-{self.count}"


def shards_root(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / SHARDS_DIR


def inside_shard(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether ``path`` (below ``root``) lies in a shard directory of a sharded grid: a directory between
    ``root`` (excluded) and ``path`` holds :data:`SHARD_MARKER`. Readers of a grid take its merged files and skip
    these, which hold the same samples again."""
    root = Path(root)
    return any((root / d / SHARD_MARKER).is_file() for d in Path(path).relative_to(root).parents if str(d) != ".")


def shard_dir(out_dir: str | os.PathLike, shard: Shard) -> Path:
    return shards_root(out_dir) / shard.name


def _write_json(path: Path, data: Any) -> None:
    # Atomic: a reader (the merge, the progress poll, another shard) never sees half a file.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def read_manifest(out_dir: str | os.PathLike) -> tuple[GridSpec, int]:
    """The grid and the shard count recorded in ``out_dir/shards/grid.json``."""
    path = shards_root(out_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {out_dir} holds no sharded grid. Run `kvcomp grid ... --launcher local|joblib|"
            f"ray|submitit` or `kvcomp grid ... --shard I/N` into it first."
        )
    data = read_json(path)
    return GridSpec.from_dict(data["grid"]), int(data["shards"])


def ensure_manifest(out_dir: str | os.PathLike, spec: GridSpec, count: int) -> None:
    """Record the grid and shard count, or check them against the ones already recorded."""
    path = shards_root(out_dir) / MANIFEST
    if path.is_file():
        theirs, their_count = read_manifest(out_dir)
        # Compared as JSON, which is how the recorded one was written (a tuple parameter reads back as a list).
        mine, ours = json.loads(json.dumps(spec.to_dict())), theirs.to_dict()
        diff = {k: (ours[k], mine[k]) for k in mine if mine[k] != ours[k]}
        if their_count != count:
            diff["shards"] = (their_count, count)
        if diff:
            raise GridMismatch(
                f"{path} records another sharded grid; differences (recorded, now): {diff}. Rerun with the "
                f"recorded arguments to resume it, or give another --out."
            )
        return
    _write_json(path, {"grid": spec.to_dict(), "shards": count})


def sample_digest(sample) -> str:
    """A hash of what a sample asks, so shards that generated different samples under one id disagree."""
    blob = json.dumps([sample.id, sample.context, sample.question, sample.answer_prefix, sample.references,
                       sample.max_new_tokens, sample.chat_template])
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def pick_device(device: str, shard: Shard) -> str:
    """``auto``: CUDA when there is one; ``cuda`` with several visible GPUs: one per shard, round-robin
    (under Ray or Slurm only the GPU given to the worker is visible, so it is that one)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and torch.cuda.device_count() > 1:
        device = f"cuda:{shard.index % torch.cuda.device_count()}"
    return device


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("kvcomp", "torch", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def claim(out_dir: str | os.PathLike, unit: Path, shard: Shard) -> int:
    """The index of the shard that owns ``unit`` (a path below ``shards/claims/``): the first to claim it, this
    one if nobody had. Atomic across processes and machines: the claim is written to a private file first and
    hard-linked into place, which fails if the name exists, so a reader never sees a half-written claim."""
    from kvcomp import files

    root = shards_root(out_dir)
    path = root / CLAIMS_DIR / unit
    if not path.exists():
        files.make_dirs(path.parent, root)
        mine = path.with_name(f".{path.name}.{shard.index}.{os.getpid()}")
        files.write_text(mine, str(shard.index))
        try:
            os.link(mine, path)
        except FileExistsError:
            pass  # another shard was first
        finally:
            mine.unlink()
    return int(path.read_text())


def _owner(out_dir, spec: GridSpec, shard: Shard, rel: Path, k: int) -> int:
    """The shard that runs sample ``k`` of the task/length/mode directory ``rel`` (see :data:`ASSIGNMENTS`)."""
    if spec.assign == "round-robin":
        return k % shard.count
    return claim(out_dir, rel / str(k), shard)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_shard(out_dir: str | os.PathLike, spec: GridSpec, shard: Shard, *, device: str = "cpu",
              threads: int | None = 1, progress: bool = False) -> dict[str, Any]:
    """Run shard ``shard`` of the grid ``spec`` into ``out_dir/shards/<i>-of-<n>/``; returns its ``shard.json``.

    ``threads``: torch's intra-op threads in this worker (None: torch's default). Resumes what is there.
    """
    import torch
    from tqdm.auto import tqdm

    from eval.runner import model_id, run_grid, write_summary
    from experiments.grid import MODES, build_grid, cell_dir, check_modes, grid_tasks
    from kvcomp import load_model

    if threads is not None:
        torch.set_num_threads(threads)
    check_modes(spec.modes)
    ensure_manifest(out_dir, spec, shard.count)
    device = pick_device(device, shard)
    root = shard_dir(out_dir, shard)
    started, cpu_started = time.time(), _cpu_seconds()
    grid = build_grid(spec.compressors, spec.ratios, spec.params, spec.configs)
    model, tokenizer = load_model(spec.model, dtype=spec.dtype, device=device)
    status = {
        "shard": shard.index, "shards": shard.count, "status": "running", "model": model_id(model),
        "dtype": str(model.dtype).removeprefix("torch."), "device": device, "threads": torch.get_num_threads(),
        "host": socket.gethostname(), "pid": os.getpid(), "versions": _versions(), "started": started,
    }  # fmt: skip
    _write_json(root / SHARD_MARKER, status)
    benches = list(grid_tasks(tokenizer, tasks=spec.tasks, lengths=spec.lengths, samples=spec.samples,
                              seed=spec.seed, max_new_tokens=spec.max_new_tokens))
    _write_json(root / SAMPLES_FILE, [
        {"task": name, "length": length, "ids": [s.id for s in bench.samples],
         "digests": [sample_digest(s) for s in bench.samples]}
        for name, length, bench in benches
    ])  # fmt: skip
    units = [(name, length, bench, mode, k) for name, length, bench in benches for mode in spec.modes
             for k in range(len(bench.samples))]
    held: dict[Path, tuple] = {}  # task/length/mode directory -> (task, length, task samples, the ones run here)
    for name, length, bench, mode, k in tqdm(units, desc=f"shard {shard.index}/{shard.count}", disable=not progress):
        rel = cell_dir(Path(), name, length, mode)
        if _owner(out_dir, spec, shard, rel, k) != shard.index:
            continue
        one = dataclasses.replace(bench, samples=[bench.samples[k]])
        run_grid(model, tokenizer, one, grid, query_aware=MODES[mode], out_dir=root / rel, progress=False,
                 store=spec.store)
        held.setdefault(rel, (name, length, bench, []))[3].append(bench.samples[k])
    for rel, (name, length, bench, mine) in held.items():  # each summary over every sample this shard ran there
        for label in grid:
            write_summary(root / rel / label, name, length, dataclasses.replace(bench, samples=mine))
    # this worker's CPU time over the same span as the wall time (a shared machine's wall time lies)
    status.update(status="complete", finished=time.time(), wall_seconds=time.time() - started,
                  cpu_seconds=_cpu_seconds() - cpu_started)
    _write_json(root / SHARD_MARKER, status)
    return status


def run_shard_safely(out_dir: str, spec_dict: dict, index: int, count: int, device: str,
                     threads: int | None) -> dict[str, Any]:
    """:func:`run_shard` for a launcher: an error comes back as ``{"error": traceback}`` so that one failed
    shard does not cancel the others (their work is kept and resumes)."""
    try:
        return run_shard(out_dir, GridSpec.from_dict(spec_dict), Shard(index, count), device=device,
                         threads=threads)
    except Exception:  # noqa: BLE001 - reported with its traceback by the launcher
        error = traceback.format_exc()
        marker = shard_dir(out_dir, Shard(index, count)) / SHARD_MARKER
        if marker.is_file():
            _write_json(marker, {**read_json(marker), "status": "failed", "error": error})
        return {"shard": index, "shards": count, "error": error}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.shard", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("index", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    spec, count = read_manifest(args.out_dir)
    if count != args.count:
        raise SystemExit(f"{args.out_dir} is a grid of {count} shards, not {args.count}.")
    status = run_shard_safely(args.out_dir, spec.to_dict(), args.index, args.count, args.device, args.threads)
    if "error" in status:
        print(status["error"], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
