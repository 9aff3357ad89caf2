"""experiments.grid_scaling: the same grid as one process and as local shards, timed, compared, resumed."""

import json

from experiments.grid_scaling import main

GRID = ["--model", "tiny", "--lengths", "512", "--samples", "2", "--tasks", "niah_single_1",
        "--compressors", "snapkv", "--ratios", "0.5", "--modes", "aware", "--max-new-tokens", "4"]


def test_legs_are_timed_compared_and_not_rerun(tmp_path, capsys):
    out = tmp_path / "scaling"
    assert main([*GRID, "--legs", "single", "local", "--out", str(out)]) == 0
    timing = json.loads((out / "timing.json").read_text())
    single, local = timing["legs"]["single"], timing["legs"]["local"]
    assert "--launcher local --workers 2" in local["command"] and "--launcher" not in single["command"]
    assert local["identical_to_single"] is True  # `kvcomp grid diff` of the two runs
    assert [s["shard"] for s in local["shards"]] == [0, 1]
    assert all(0 < s["wall_seconds"] < local["wall_seconds"] for s in local["shards"])
    assert 0 < single["cpu_seconds"]
    slowest = max(local["shards"], key=lambda s: s["wall_seconds"])
    assert local["speedup"] == round(single["wall_seconds"] / local["wall_seconds"], 3)
    product = local["work_per_shard"] * local["core_share"] * local["startup_and_merge"] / local["single_core_share"]
    assert abs(product / local["speedup"] - 1) < 0.03  # the three factors multiply to the speed-up
    assert local["startup_and_merge"] == round(slowest["wall_seconds"] / local["wall_seconds"], 3)
    assert (out / "single" / "ruler_niah_single_1" / "L512" / "aware" / "snapkv-0.5" / "results.jsonl").is_file()
    capsys.readouterr()
    # A second call measures nothing again: the legs in timing.json are kept.
    assert main([*GRID, "--legs", "single", "local", "--out", str(out)]) == 0
    assert "single already measured" in capsys.readouterr().out
    assert json.loads((out / "timing.json").read_text())["legs"]["single"] == single
