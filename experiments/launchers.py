"""Start the shards of a sharded ``kvcomp grid`` on an existing engine and wait for them, showing progress.

``local``: one ``python -m experiments.shard`` process per shard (output in its ``worker.log``);
``joblib``: joblib's loky process pool; ``ray``: one Ray task per shard, on the cluster at ``ray_address``
(``auto``: the one ``ray start`` runs here) or, without an address, on a local cluster started for the run;
``submitit``: one job per shard through submitit, on Slurm where ``sbatch`` exists, else as local processes
(``submitit_cluster="local"`` forces that; its files go to ``shards/.submitit``).

The output directory must be on a file system every worker sees (as for Hydra's submitit launcher): the
shards write their files there, and the progress bar counts their records. A failed shard does not stop the
others; once all are done, :class:`ShardsFailed` names the failed ones, their error and how to resume.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from experiments.shard import (
    LOG_FILE,
    SAMPLES_FILE,
    GridSpec,
    Shard,
    ensure_manifest,
    read_json,
    run_shard_safely,
    shard_dir,
    shards_root,
)

LAUNCHERS = ("local", "joblib", "ray", "submitit")


class ShardsFailed(RuntimeError):
    """Some shards raised; the others' work is kept, and rerunning resumes every shard."""


@dataclass
class LaunchOptions:
    """How to run the shards. ``threads``: torch threads per worker; ``device``: ``cpu``, ``cuda`` (several
    visible GPUs: one per shard), ``cuda:N`` or ``auto``; ``gpus_per_worker``: Ray's and Slurm's GPU request."""

    launcher: str
    workers: int
    threads: int = 1
    device: str = "cpu"
    gpus_per_worker: float = 0
    ray_address: str | None = None
    submitit_cluster: str | None = None  # None: Slurm when available, else local processes
    submitit_params: dict[str, Any] = field(default_factory=dict)
    poll_seconds: float = 2.0

    def __post_init__(self):
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"Unknown launcher {self.launcher!r}; use one of {list(LAUNCHERS)}.")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}.")
        if self.threads < 1:
            raise ValueError(f"threads per worker must be >= 1, got {self.threads}.")


def _args(out_dir: Path, spec: GridSpec, shard: Shard, options: LaunchOptions) -> tuple:
    return (str(out_dir), spec.to_dict(), shard.index, shard.count, options.device, options.threads)


class _Local:
    def __init__(self, out_dir: Path, spec: GridSpec, shards: list[Shard], options: LaunchOptions):
        self.procs = []
        for shard in shards:
            log_path = shard_dir(out_dir, shard) / LOG_FILE
            log_path.parent.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "OMP_NUM_THREADS": str(options.threads), "MKL_NUM_THREADS": str(options.threads)}
            cmd = [sys.executable, "-m", "experiments.shard", str(out_dir), str(shard.index), str(shard.count),
                   "--device", options.device, "--threads", str(options.threads)]
            with log_path.open("a") as log:
                self.procs.append((shard, log_path, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                                     env=env)))

    def done(self) -> bool:
        return all(p.poll() is not None for _, _, p in self.procs)

    def results(self) -> list[dict]:
        out = []
        for shard, log, p in self.procs:
            if p.wait() == 0:
                out.append({"shard": shard.index})
            else:
                tail = log.read_text(errors="replace").splitlines()[-15:]
                out.append({"shard": shard.index, "error": f"exit code {p.returncode}; {log}:\n" + "\n".join(tail)})
        return out

    def close(self) -> None:
        for _, _, p in self.procs:
            if p.poll() is None:
                p.terminate()


class _Joblib:
    def __init__(self, out_dir: Path, spec: GridSpec, shards: list[Shard], options: LaunchOptions):
        from joblib import Parallel, delayed

        jobs = [delayed(run_shard_safely)(*_args(out_dir, spec, s, options)) for s in shards]
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.future = self.pool.submit(Parallel(n_jobs=len(shards), backend="loky"), jobs)

    def done(self) -> bool:
        return self.future.done()

    def results(self) -> list[dict]:
        return self.future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=False)


class _Ray:
    def __init__(self, out_dir: Path, spec: GridSpec, shards: list[Shard], options: LaunchOptions):
        import ray

        self.ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            if options.ray_address:
                ray.init(address=options.ray_address, log_to_driver=False)
            else:  # a local cluster with room for every worker
                ray.init(num_cpus=max(os.cpu_count() or 1, options.workers * options.threads),
                         include_dashboard=False, log_to_driver=False)
        task = ray.remote(num_cpus=options.threads, num_gpus=options.gpus_per_worker, max_retries=0)
        self.refs = [task(run_shard_safely).remote(*_args(out_dir, spec, s, options)) for s in shards]

    def done(self) -> bool:
        ready, _ = self.ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def results(self) -> list[dict]:
        return self.ray.get(self.refs)

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


class _Submitit:
    def __init__(self, out_dir: Path, spec: GridSpec, shards: list[Shard], options: LaunchOptions):
        import submitit

        executor = submitit.AutoExecutor(folder=shards_root(out_dir) / ".submitit", cluster=options.submitit_cluster)
        params = {"name": "kvcomp-grid", "timeout_min": 24 * 60, "cpus_per_task": options.threads}
        if options.gpus_per_worker:
            params["gpus_per_node"] = int(options.gpus_per_worker)
        executor.update_parameters(**{**params, **options.submitit_params})
        with executor.batch():  # one Slurm array
            self.jobs = [executor.submit(run_shard_safely, *_args(out_dir, spec, s, options)) for s in shards]
        self.shards = shards

    def done(self) -> bool:
        return all(job.done() for job in self.jobs)

    def results(self) -> list[dict]:
        out = []
        for shard, job in zip(self.shards, self.jobs):
            try:
                out.append(job.result())
            except Exception as err:  # noqa: BLE001 - the job itself died (killed, timed out)
                out.append({"shard": shard.index, "error": f"submitit job {job.job_id}: {err}"})
        return out

    def close(self) -> None:
        pass


ENGINES = {"local": _Local, "joblib": _Joblib, "ray": _Ray, "submitit": _Submitit}


def records_done(out_dir: Path) -> int:
    """Records the shards under ``out_dir`` have written so far (complete lines of their results files)."""
    total = 0
    for path in shards_root(out_dir).glob("*/**/results.jsonl"):
        try:
            total += path.read_bytes().count(b"\n")
        except FileNotFoundError:
            pass
    return total


def records_expected(out_dir: Path, spec: GridSpec, count: int) -> int:
    """Records the grid will hold: exact once every shard has listed its samples, else the grid's size."""
    cells = len(spec.modes) * len(spec.labels())
    listed = [shard_dir(out_dir, Shard(i, count)) / SAMPLES_FILE for i in range(count)]
    if all(p.is_file() for p in listed):
        return cells * sum(len(entry["ids"]) for entry in read_json(listed[0]))
    return cells * len(spec.tasks) * len(spec.lengths) * spec.samples


def launch(out_dir: str | os.PathLike, spec: GridSpec, options: LaunchOptions, progress: bool = True) -> list[dict]:
    """Run every shard of ``spec`` over ``options.workers`` workers into ``out_dir/shards`` and wait."""
    out_dir = Path(out_dir)
    ensure_manifest(out_dir, spec, options.workers)
    shards = [Shard(i, options.workers) for i in range(options.workers)]
    engine = ENGINES[options.launcher](out_dir, spec, shards, options)
    bar = tqdm(total=records_expected(out_dir, spec, options.workers), initial=records_done(out_dir),
               desc=f"kvcomp grid, {options.workers} {options.launcher} workers x {options.threads} threads",
               unit="record", disable=not progress)
    try:
        while not engine.done():
            time.sleep(options.poll_seconds)
            total, done = records_expected(out_dir, spec, options.workers), records_done(out_dir)
            if (total, done) != (bar.total, bar.n):  # a log file gets a line per new record, not per poll
                bar.total, bar.n = total, done
                bar.refresh()
        results = engine.results()
        bar.total = bar.n = records_done(out_dir)
        bar.refresh()
    finally:
        bar.close()
        engine.close()
    failed = [r for r in results if "error" in r]
    if failed:
        detail = "\n\n".join(f"shard {r['shard']}/{options.workers}:\n{r['error']}" for r in failed)
        raise ShardsFailed(
            f"{len(failed)} of {options.workers} shards failed; the others' records are kept in {shards_root(out_dir)}. "
            f"Rerun the same command to resume.\n\n{detail}"
        )
    return results
