"""The kvpress side-by-side's record format and reader (the peer's own venv is not part of the test suite)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from experiments.peers import records
from experiments.peers.compare import compare, means, side_by_side
from experiments.report import collect

FIXTURE = Path(__file__).parent / "fixtures" / "peers"
RUN = FIXTURE / "ruler_niah_single_1" / "L4096" / "agnostic" / "kvpress-tova-0.75"


def test_peer_records_read_back_checked_and_summarized():
    rows, summary = records.read_run(RUN)
    assert [r["score"] for r in rows] == [100.0, 0.0]
    assert summary["score"] == 50.0 and summary["exact_match_rate"] == 0.5 and summary["mean_first_divergence"] == 1
    assert summary == {**records.summarize(rows, "ruler/niah_single_1", 4096), "run_dir": summary["run_dir"]}
    bad = dict(rows[0], score=140.0)
    with pytest.raises(ValueError, match="not in 0..100"):
        records.check_record(bad)
    with pytest.raises(ValueError, match="lacks"):
        records.check_record({k: v for k, v in rows[0].items() if k != "memory_factor"})
    assert records.fidelity([1, 2, 3], [1, 2]) == {"exact_match": False, "first_divergence": 2, "length_change": 1,
                                                    "agreement": 1.0}


def test_kvcomp_report_reads_peer_runs_beside_its_own(tmp_path):
    peers = tmp_path / "peers"
    shutil.copytree(FIXTURE, peers)
    grid = tmp_path / "grid" / "ruler_niah_single_1" / "L4096" / "agnostic" / "tova-0.75"
    grid.mkdir(parents=True)
    ours = {"n": 2, "mode": "query_agnostic", "compressor": {"name": "tova", "params": {"compression_ratio": 0.75}},
            "task": "ruler/niah_single_1", "length": 4096, "score": 100.0, "memory_factor": 3.97,
            "exact_match_rate": 1.0, "prefill_seconds": 5.0, "decode_seconds": 1.0}
    (grid / "summary.json").write_text(json.dumps(ours))
    df = collect([tmp_path / "grid", peers])
    assert set(df["label"]) == {"tova (agnostic)", "kvpress:tova (agnostic)"}
    table = side_by_side(df)
    assert len(table) == 1
    row = table.iloc[0]
    assert (row.score_kvcomp, row.score_kvpress, row.memory_factor_kvpress, row.seconds_kvpress) == (100.0, 50.0, 4.0, 8.0)
    written = compare(tmp_path / "grid", peers, tmp_path / "report")
    assert "| ruler/niah_single_1 | 4096 | query_agnostic | tova | 0.75 |" in written["side_by_side_md"].read_text()
    two = pd.concat([table, table.assign(task="ruler/fwe", score_kvcomp=0.0, seconds_kvpress=4.0)])
    mean = means(two).iloc[0]
    assert (mean.tasks, mean.score_kvcomp, mean.score_kvpress, mean.seconds_kvpress) == (2, 50.0, 50.0, 6.0)
    # A sweep run in parts (another grid directory, here with a configuration kvpress does not have): one table.
    other = tmp_path / "grid2" / "ruler_niah_single_1" / "L4096" / "agnostic" / "keydiff-0.75"
    other.mkdir(parents=True)
    (other / "summary.json").write_text(json.dumps({**ours, "compressor": {"name": "keydiff", "params": {
        "compression_ratio": 0.75}}}))
    written = compare([tmp_path / "grid", tmp_path / "grid2"], peers, tmp_path / "report2")
    assert "| keydiff | 0.75 |" in written["markdown"].read_text()
    assert pd.read_csv(written["side_by_side_csv"])["method"].tolist() == ["tova"]


def test_peer_shards_merge_into_the_run_one_process_writes(tmp_path):
    rows, summary = records.read_run(RUN)
    relative = RUN.relative_to(FIXTURE)
    for i, row in enumerate(rows):  # one sample per shard, the later one in shard 0
        records.write_run(records.shard_dir(tmp_path, 1 - i, 2) / relative, [row])
    assert records.merge_shards(tmp_path) == 1
    merged, merged_summary = records.read_run(tmp_path / relative)
    assert merged == sorted(rows, key=lambda r: r["id"])
    assert {**merged_summary, "run_dir": None} == {**summary, "run_dir": None}
    from experiments.shard import SHARD_MARKER
    assert records.SHARD_MARKER == SHARD_MARKER  # the report skips the shards: each sample counted once
    assert collect(tmp_path)["n"].tolist() == [2]
    records.write_run(records.shard_dir(tmp_path, 2, 3) / relative, [rows[0]])  # a sample twice: refused
    with pytest.raises(ValueError, match="in two shards"):
        records.merge_shards(tmp_path)


def test_a_run_repeated_in_two_grids_is_reported_once(tmp_path):
    """The uncompressed reference of a sweep run as two grids over the same samples is one row (and one side of
    every side-by-side match); a run that shares the label but not the results is a different measurement."""
    summary = {"n": 2, "mode": "query_agnostic", "compressor": {"name": "none", "params": {}},
               "task": "ruler/niah_single_1", "length": 4096, "score": 50.0, "memory_factor": 1.0,
               "model": "m", "dtype": "float32"}
    results = [{"id": "s0", "score": 100.0, "exact_match": True}, {"id": "s1", "score": 0.0, "exact_match": True}]

    def run(root, rows):
        d = root / "ruler_niah_single_1" / "L4096" / "agnostic" / "none"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps(summary))
        (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    run(tmp_path / "a", results)
    run(tmp_path / "b", results)
    with pytest.warns(UserWarning, match="repeats .*reported once"):
        df = collect([tmp_path / "a", tmp_path / "b"])
    assert len(df) == 1 and df.iloc[0]["run_dir"].startswith(str((tmp_path / "a").resolve()))
    run(tmp_path / "c", [results[0], {**results[1], "score": 100.0}])
    assert len(collect([tmp_path / "a", tmp_path / "c"])) == 2


def test_export_reads_a_sharded_grid_once(tmp_path):
    """A sharded grid holds its samples twice (the merge and the shards); the export takes the merged ones, and a
    grid of shards alone is refused with the merge to run."""
    from experiments.peers.export import grid_sample_sets

    grid = tmp_path / "grid"
    for part in ("", "shards/0-of-2/", "shards/1-of-2/"):
        d = grid / f"{part}ruler_niah_single_1" / "L4096" / "agnostic"
        d.mkdir(parents=True)
        (d / "reference.jsonl").write_text("")
    for i in (0, 1):
        (grid / "shards" / f"{i}-of-2" / "shard.json").write_text("{}")
    assert [s[:3] for s in grid_sample_sets(grid)] == [("ruler/niah_single_1", 4096, "agnostic")]
    (grid / "ruler_niah_single_1" / "L4096" / "agnostic" / "reference.jsonl").unlink()
    with pytest.raises(ValueError, match="merge them first"):
        grid_sample_sets(grid)
