"""The sharded grid on real engines (a local Ray cluster, submitit's local executor, joblib, local processes):
merged shards hold exactly what one process writes; resume and the merge's refusals."""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from experiments.cli import main
from experiments.grid import run_table
from experiments.launchers import LaunchOptions, launch
from experiments.merge import TIMING_FIELDS, ShardMergeError, compare_grids, merge_shards
from experiments.report import collect
from experiments.shard import (
    CLAIMS_DIR,
    GridMismatch,
    GridSpec,
    Shard,
    claim,
    run_shard,
    shard_dir,
    shards_root,
)

SPEC = GridSpec(tasks=("niah_single_1", "fwe"), lengths=(512,), samples=3, compressors=("snapkv", "streaming_llm"),
                ratios=(0.5,), modes=("agnostic", "aware"), max_new_tokens=4, model="tiny")
CLI_GRID = ["grid", "--model", "tiny", "--tasks", *SPEC.tasks, "--lengths", "512", "--samples", "3",
            "--compressors", *SPEC.compressors, "--ratios", "0.5", "--modes", *SPEC.modes, "--max-new-tokens", "4"]
SUMMARY_TIMING = ("prefill_seconds", "decode_seconds", "peak_rise_mb", "run_dir")


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' setting: the same float reductions, so the same tokens
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The grid run by one process (1 thread, like each worker)."""
    from kvcomp import load_model

    out = tmp_path_factory.mktemp("single")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = load_model("tiny")
        run_table(model, tok, tasks=SPEC.tasks, lengths=SPEC.lengths, samples=SPEC.samples,
                  compressors=SPEC.compressors, ratios=SPEC.ratios, modes=SPEC.modes, out_dir=out,
                  max_new_tokens=SPEC.max_new_tokens, progress=False)
    finally:
        torch.set_num_threads(before)
    return out


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and not p.relative_to(root).as_posix().startswith(("shards/", "report/")))


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_same_as_single(merged: Path, single: Path) -> None:
    files = _files(single)
    assert files == _files(merged) and len(files) == 2 * 2 * (3 * 2 + 1) + 2 * 2 + 1  # tasks x modes x
    # (labels x 2 + ref), and the run-directory locks: one per task/length/mode directory and the grid's
    for rel in files:
        a, b = single / rel, merged / rel
        if rel.endswith(".kvcomp-run.lock"):
            continue  # the holder's pid and start time, by design different
        if rel.endswith("reference.jsonl"):
            assert a.read_bytes() == b.read_bytes(), rel
        elif rel.endswith("results.jsonl"):
            ra, rb = _records(a), _records(b)
            assert len(ra) == 3 and [r["id"] for r in ra] == [r["id"] for r in rb], rel
            strip = [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in ra]
            assert strip == [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rb], rel
        else:  # summary.json
            sa, sb = json.loads(a.read_text()), json.loads(b.read_text())
            assert {k: v for k, v in sa.items() if k not in SUMMARY_TIMING} == \
                   {k: v for k, v in sb.items() if k not in SUMMARY_TIMING}, rel
            assert sb["run_dir"] == str(b.parent) and sb["n"] == 3
    deterministic = ["task", "length", "compressor", "compression_ratio", "mode", "n", "score", "memory_factor",
                     "exact_match_rate", "kept_tokens", "context_length"]
    ca, cb = collect(single), collect(merged)  # the shards are not read as runs of the grid
    assert len(ca) == len(cb) == 12
    assert ca[deterministic].reset_index(drop=True).equals(cb[deterministic].reset_index(drop=True))
    assert (merged / "report" / "scores.md").read_text() == (single / "report" / "scores.md").read_text()


def _worker_pids(out: Path, count: int) -> set[int]:
    return {json.loads((shard_dir(out, Shard(i, count)) / "shard.json").read_text())["pid"] for i in range(count)}


@pytest.mark.parametrize("launcher", ["ray", "submitit"])
def test_sharded_grid_on_a_local_cluster_matches_one_process(launcher, single, tmp_path):
    # ray: a local Ray cluster started for the run; submitit: its local executor (the Slurm code path's twin).
    out = tmp_path / "grid"
    spec = dataclasses.replace(SPEC, assign="queue") if launcher == "ray" else SPEC  # ray: concurrent claims
    options = LaunchOptions(launcher, workers=2, threads=1, submitit_cluster="local", poll_seconds=0.5)
    results = launch(out, spec, options, progress=False)
    assert sorted(r["shard"] for r in results) == [0, 1] and all(r["status"] == "complete" for r in results)
    pids = _worker_pids(out, 2)
    assert len(pids) == 2 and os.getpid() not in pids  # two separate worker processes did the work
    assert all(r["threads"] == 1 and 0 < r["cpu_seconds"] for r in results)
    if spec.assign == "queue":  # each sample ran in the shard that claimed it, and in no other
        owners = [int(p.read_text()) for p in (shards_root(out) / CLAIMS_DIR).rglob("*") if p.is_file()]
        ran = [sum(len(_records(p)) for p in shard_dir(out, Shard(i, 2)).rglob("none/results.jsonl")) for i in (0, 1)]
        assert len(owners) == 12 and ran == [owners.count(0), owners.count(1)]
    merged = merge_shards(out)
    assert merged["records"] == 2 * 2 * 3 * 3  # tasks x modes x labels x samples
    assert_same_as_single(out, single)


@pytest.mark.parametrize("launcher", ["joblib", "local"])
def test_kvcomp_grid_launcher_merges_at_the_end(launcher, single, tmp_path, capsys):
    out = tmp_path / "grid"
    assert main([*CLI_GRID, "--out", str(out), "--launcher", launcher, "--workers", "2",
                 "--threads-per-worker", "1"]) == 0
    assert "merged 36 records of 2 shards into 12 runs" in capsys.readouterr().out
    assert len(_worker_pids(out, 2)) == 2
    assert_same_as_single(out, single)
    assert main(["grid", "diff", str(out), str(single)]) == 0
    assert "48 of 48 records identical" in capsys.readouterr().out  # 36 records + 12 reference rows
    if launcher == "local":
        assert (shard_dir(out, Shard(1, 2)) / "worker.log").is_file()
    # Rerunning resumes every shard (nothing to do) and merges the same records again.
    before = (out / "ruler_fwe/L512/aware/snapkv-0.5/results.jsonl").read_text()
    assert main([*CLI_GRID, "--out", str(out), "--launcher", launcher, "--workers", "2"]) == 0
    assert (out / "ruler_fwe/L512/aware/snapkv-0.5/results.jsonl").read_text() == before


def test_queued_shards_take_what_nobody_has_taken_and_resume_their_own(single, tmp_path, one_thread):
    out = tmp_path / "grid"
    assert claim(out, Path("t/L1/aware/0"), Shard(1, 2)) == 1
    assert claim(out, Path("t/L1/aware/0"), Shard(0, 2)) == 1  # the first claim holds
    shutil.rmtree(out)
    queued = dataclasses.replace(SPEC, assign="queue")
    run_shard(out, queued, Shard(1, 2))  # alone: it takes every sample
    claims = sorted((shards_root(out) / CLAIMS_DIR).rglob("*"))
    owners = [p.read_text() for p in claims if p.is_file()]
    assert len(owners) == 2 * 2 * 3 and set(owners) == {"1"}  # tasks x modes x samples, no temporary file left
    run_shard(out, queued, Shard(0, 2))  # finds nothing left to take
    assert not list(shard_dir(out, Shard(0, 2)).rglob("results.jsonl"))
    with pytest.raises(GridMismatch, match="assign"):  # a fixed split cannot join a queued grid
        run_shard(out, SPEC, Shard(0, 2))

    # Shard 1's last record of one configuration is lost: shard 0 does not take it over (shard 1 claimed it),
    # the merge says it is missing, and shard 1 redoes just that record.
    partial = shard_dir(out, Shard(1, 2)) / "ruler_fwe/L512/agnostic/snapkv-0.5/results.jsonl"
    lines = partial.read_text().splitlines(keepends=True)
    partial.write_text("".join(lines[:-1]))
    run_shard(out, queued, Shard(0, 2))
    assert not list(shard_dir(out, Shard(0, 2)).rglob("results.jsonl"))
    with pytest.raises(ShardMergeError, match=r"snapkv-0.5: the shards hold 2 records for 3 samples"):
        merge_shards(out)
    run_shard(out, queued, Shard(1, 2))
    assert partial.read_text().splitlines(keepends=True)[:-1] == lines[:-1] and len(partial.read_text().splitlines()) == 3
    summary = json.loads((partial.parent / "summary.json").read_text())
    assert summary["n"] == 3  # over every sample the shard ran there, not the last one alone
    merge_shards(out)
    assert_same_as_single(out, single)


def test_shards_run_by_hand_resume_and_the_merge_refuses_what_it_cannot_merge(single, tmp_path, one_thread):
    out = tmp_path / "grid"
    spec = SPEC  # round-robin: a fixed split, shard 1 has samples whatever shard 0 did
    run_shard(out, spec, Shard(0, 2))
    with pytest.raises(ShardMergeError, match=r"shard 1/2: not started.*--shard I/2"):
        merge_shards(out)
    with pytest.raises(GridMismatch, match="samples"):  # another grid into the same directory
        run_shard(out, GridSpec(**{**spec.to_dict(), "samples": 4}), Shard(1, 2))
    with pytest.raises(GridMismatch, match="shards"):
        run_shard(out, spec, Shard(1, 3))
    run_shard(out, spec, Shard(1, 2))
    ids = [r["id"] for r in _records(out / "shards/0-of-2/ruler_fwe/L512/aware/none/results.jsonl")]
    assert ids == [r["id"] for r in _records(single / "ruler_fwe/L512/aware/none/results.jsonl")][0::2]

    # An interrupted shard: its last record of one configuration is lost, and it never said "complete".
    partial = shard_dir(out, Shard(1, 2)) / "ruler_niah_single_1/L512/aware/streaming_llm-0.5/results.jsonl"
    lines = partial.read_text().splitlines(keepends=True)
    partial.write_text("".join(lines[:-1]))
    marker = shard_dir(out, Shard(1, 2)) / "shard.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "status": "running"}))
    with pytest.raises(ShardMergeError, match="shard 1/2: running"):
        merge_shards(out)
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "status": "complete"}))
    with pytest.raises(ShardMergeError, match=r"streaming_llm-0.5: the shards hold 2 records for 3 samples"):
        merge_shards(out)
    kept = (shard_dir(out, Shard(1, 2)) / "ruler_fwe/L512/aware/none/results.jsonl").read_text()
    run_shard(out, spec, Shard(1, 2))  # resumes: only the lost record is redone
    assert partial.read_text().splitlines(keepends=True)[:-1] == lines[:-1] and len(lines) == len(
        partial.read_text().splitlines())
    assert (shard_dir(out, Shard(1, 2)) / "ruler_fwe/L512/aware/none/results.jsonl").read_text() == kept
    merge_shards(out)
    assert_same_as_single(out, single)

    # A merged file edited by hand (or written by another run) is not overwritten silently.
    target = out / "ruler_fwe/L512/agnostic/none/results.jsonl"
    records = _records(target)
    records[1]["prediction"] = "edited"
    target.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ShardMergeError, match="already holds a record"):
        merge_shards(out)
    assert _records(target)[1]["prediction"] == "edited"
    assert compare_grids(out, single)["differ"] == ["ruler_fwe/L512/agnostic/none/results.jsonl"]
    target.unlink()

    # Shards that generated different samples do not share one grid.
    listed = shard_dir(out, Shard(1, 2)) / "samples.json"
    samples = json.loads(listed.read_text())
    samples[0]["digests"][0] = "0" * 16
    listed.write_text(json.dumps(samples))
    with pytest.raises(ShardMergeError, match="generated other samples"):
        merge_shards(out)


def test_shard_arguments_and_merge_errors_are_clear(tmp_path, capsys):
    assert Shard.parse("3/4") == Shard(3, 4)
    with pytest.raises(ValueError, match="numbered from 0"):
        Shard.parse("4/4")
    with pytest.raises(ValueError, match="INDEX/COUNT"):
        Shard.parse("2")
    assert main(["grid", "merge", str(tmp_path)]) == 2
    assert "holds no sharded grid" in capsys.readouterr().err
    assert main([*CLI_GRID, "--out", str(tmp_path), "--shard", "2/2"]) == 2
    assert "numbered from 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Unknown launcher"):
        LaunchOptions("dask", workers=2)
