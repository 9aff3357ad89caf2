"""Hydra app: one evaluation run per config, sweeps with ``-m``.

    python -m experiments.run compressor=snapkv compressor.compression_ratio=0.75 \
        task=ruler/niah_single_1 task.length=4096
    python -m experiments.run -m compressor=streaming_llm,h2o,snapkv compressor.compression_ratio=0.5,0.75

A run directory holds ``config.yaml`` (the resolved config; Hydra's own copy is in ``.hydra/``),
``run_meta.json`` (git commit, package versions, machine, device, dtype, times), ``results.jsonl`` (one
record per sample, from :func:`eval.runner.run`; a rerun in the same directory resumes) and
``summary.json`` (:func:`eval.runner.summarize`). The uncompressed reference generations that fidelity
compares against live in one file shared by the sweep (``<sweep dir>/reference.jsonl`` unless
``reference_path`` says otherwise); a lock makes the first job compute them and the others reuse them.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import platform
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from experiments.schema import register_configs
from kvcomp import files

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
PACKAGES = ("kvcomp", "torch", "transformers", "hydra-core", "omegaconf", "numpy", "wandb")

register_configs()


def git_state(path: Path | None = None) -> dict[str, Any]:
    """Commit, branch and dirty flag of the checkout that holds the kvcomp sources (None outside git)."""
    path = path or Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": git("rev-parse", "HEAD"),
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "dirty": None if status is None else bool(status),
    }


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def machine_info(device: str) -> dict[str, Any]:
    import torch

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with files.open_output(path, "a") as f:  # not "w": never truncate, nor follow a link
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def reference_path(cfg: DictConfig, run_dir: Path) -> Path | None:
    if not cfg.fidelity:
        return None
    if cfg.reference_path:
        return Path(cfg.reference_path).absolute()
    hc = HydraConfig.get()
    base = Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else run_dir
    return base.absolute() / "reference.jsonl"


def build_compressor(cfg: DictConfig):
    """The compressor the config names (None for the baseline), built from its dataclass."""
    from hydra.errors import InstantiationException

    from kvcomp import available

    available()  # loads the registry, which names the classes (a launcher's worker may not have yet)
    if cfg.compressor is None or cfg.compressor.get("_target_") is None:
        return None
    try:
        return hydra.utils.instantiate(cfg.compressor)
    except InstantiationException as err:
        raise SystemExit(
            f"experiments.run: cannot build the compressor {cfg.compressor._target_}: {err}"
        ) from None


def evaluate(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Run ``cfg`` into ``run_dir``; returns the summary. Usable without Hydra's app (give a composed cfg)."""
    from kvcomp.validation import UsageError, positive_int

    started = time.time()
    compressor = build_compressor(cfg)  # fails before the model loads
    positive_int("task.num_samples", cfg.task.num_samples, none=True, error=UsageError, hint=" (None: all)")
    # One process per run directory (a second would append every record again); run() below re-enters it.
    with files.lock_run_dir(run_dir, "experiments.run"):
        return _evaluate(cfg, run_dir, compressor, started)


def _evaluate(cfg: DictConfig, run_dir: Path, compressor, started: float) -> dict[str, Any]:
    from eval.runner import load_samples, run, summarize, task_records
    from kvcomp import load_model

    for name in ("summary.json", "run_meta.json"):  # written last: refuse a link before the work
        files.check_not_link(run_dir / name)
    files.write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    ref_path = reference_path(cfg, run_dir)
    meta = {
        "git": git_state(),
        "versions": package_versions(),
        "machine": machine_info(cfg.model.device),
        "dtype": cfg.model.dtype,
        "argv": sys.argv,
        "overrides": _overrides(),
        "reference_path": str(ref_path) if ref_path else None,
        "start_time": dt.datetime.fromtimestamp(started, dt.timezone.utc).isoformat(),
    }
    _write_json(run_dir / "run_meta.json", meta)

    model, tokenizer = load_model(cfg.model.name, dtype=cfg.model.dtype, device=cfg.model.device)
    t = cfg.task
    options = dict(t.options)
    if t.max_new_tokens is not None:
        options["tokens_to_generate"] = t.max_new_tokens
    task = load_samples(
        t.name,
        tokenizer,
        length=t.length,
        num_samples=t.num_samples,
        seed=t.seed,
        data_dir=t.data_dir,
        chat_template=t.chat_template,
        **options,
    )
    out_path = run_dir / "results.jsonl"
    common = dict(query_aware=cfg.query_aware, batch_size=cfg.batch_size, progress=cfg.progress)
    if ref_path is not None and compressor is not None:
        # The first job of a sweep generates the uncompressed references; the others wait, then reuse them.
        with _file_lock(ref_path.with_name(ref_path.name + ".lock")):
            for _ in run(model, tokenizer, task, None, out_path=None, reference=ref_path, **common):
                pass
    lossless = False
    if cfg.lossless:
        from kvcomp.lossless import Lossless

        lossless = Lossless(gamma=cfg.gamma, adaptive=cfg.adaptive_gamma, max_gamma=max(cfg.gamma, 12),
                            tier=cfg.kv_tier)
    for _ in run(model, tokenizer, task, compressor, out_path=out_path, reference=ref_path, lossless=lossless,
                 **common):
        pass
    records = task_records(out_path, task)  # the samples asked for (the directory may hold more)
    summary = {**summarize(records), "task": t.name, "length": t.length, "run_dir": str(run_dir)}
    _write_json(run_dir / "summary.json", summary)

    ended = time.time()
    meta.update(
        end_time=dt.datetime.fromtimestamp(ended, dt.timezone.utc).isoformat(), wall_seconds=ended - started
    )
    meta["machine"]["torch_threads"] = machine_info(cfg.model.device)["torch_threads"]
    _write_json(run_dir / "run_meta.json", meta)
    if cfg.logger.name == "wandb":
        log_wandb(cfg, run_dir, records, summary)
    elif cfg.logger.name != "jsonl":
        raise SystemExit(f"experiments.run: unknown logger {cfg.logger.name!r} (jsonl or wandb).")
    return summary


def log_wandb(cfg: DictConfig, run_dir: Path, records: list[dict], summary: dict) -> None:
    """Config, a per-sample table and the summary as a wandb run in ``<run_dir>/wandb`` (offline by default)."""
    os.environ.setdefault("WANDB_DIR", str(run_dir))
    if cfg.logger.mode == "offline":
        os.environ["WANDB_MODE"] = "offline"
    import wandb

    try:
        group = cfg.logger.group or Path(HydraConfig.get().sweep.dir).name
    except ValueError:  # no Hydra app around (evaluate() called directly)
        group = cfg.logger.group
    columns = [
        "id", "task", "mode", "score", "memory_factor", "exact_match", "first_divergence", "agreement",
        "context_length", "kept_tokens", "prefill_seconds", "decode_seconds", "prediction", "references",
    ]  # fmt: skip
    table = wandb.Table(columns=columns)
    for r in records:
        table.add_data(*[json.dumps(r[c]) if c == "references" else r.get(c) for c in columns])
    run = wandb.init(
        project=cfg.logger.project,
        entity=cfg.logger.entity,
        mode=cfg.logger.mode,
        dir=str(run_dir),
        group=group,
        tags=list(cfg.logger.tags),
        name=run_dir.name,
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    run.log({"samples": table})
    run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str)) or v is None})
    run.finish()
    # Wait for W&B's service to write everything out: once, in a full test run, finish() returned while the
    # offline transaction log held only its header. The next run starts a new service.
    wandb.teardown()


def _overrides() -> list[str]:
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []


def _write_json(path: Path, data: dict) -> None:
    files.write_text(path, json.dumps(data, indent=2, default=str) + "\n")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    from kvcomp.validation import CLEAR_ERRORS

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        summary = evaluate(cfg, run_dir)
    except CLEAR_ERRORS as err:  # its message says what to change: one line, not a traceback
        raise SystemExit(f"experiments.run: {err}") from None
    print(
        f"{cfg.task.name} {summary['compressor']['name']} {summary['mode']}: score {summary['score']:.1f}, "
        f"memory_factor {summary['memory_factor']:.2f}, exact_match_rate {summary['exact_match_rate']} "
        f"-> {run_dir}"
    )
    return summary


if __name__ == "__main__":
    main()
