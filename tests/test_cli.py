"""The `kvcomp` command, run in-process."""

import json

from experiments.cli import main


def test_list_shows_every_registered_compressor(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("streaming_llm", "h2o", "snapkv", "quant"):
        assert f"\n{name} " in "\n" + out
    assert "compression_ratio=0.0" in out and "bits=4" in out


def test_generate_reports_stats(capsys, tmp_path):
    context = tmp_path / "ctx.txt"
    context.write_text("The grass is green. The sky is blue. " * 20)
    code = main(["generate", "--model", "tiny", "--compressor", "snapkv", "--compression-ratio", "0.75",
                 "--context-file", str(context), "--question", "\nWhat color?", "--query-aware",
                 "--max-new-tokens", "4"])
    assert code == 0
    stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert stats["compressor"] == "snapkv" and stats["query_aware"] is True
    assert stats["memory_factor"] > 3.0


def test_generate_with_other_parameters(capsys):
    code = main(["generate", "--model", "tiny", "--compressor", "quant", "--param", "bits=2", "--param",
                 "residual=0", "--context", "Some context. " * 40, "--max-new-tokens", "2"])
    assert code == 0
    stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert stats["memory_factor"] > 3.0


def test_bad_compressor_is_a_clear_error(capsys):
    assert main(["generate", "--compressor", "snapvk", "--context", "x"]) == 2
    err = capsys.readouterr().err
    assert "Unknown compressor 'snapvk'" in err and "snapkv" in err


def test_bad_parameter_is_a_clear_error(capsys):
    assert main(["generate", "--compressor", "quant", "--compression-ratio", "0.5", "--context", "x"]) == 2
    assert "Its parameters are: bits, group_size, residual" in capsys.readouterr().err


def test_grid_writes_run_dirs_and_a_score_table(capsys, tmp_path):
    args = ["grid", "--model", "tiny", "--tasks", "niah_single_1", "fwe", "--lengths", "1024", "--samples", "2",
            "--compressors", "snapkv", "--ratios", "0.5", "0.75", "--modes", "aware", "--max-new-tokens", "4",
            "--out", str(tmp_path)]
    assert main(args) == 0
    runs = sorted(p.parent.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("summary.json"))
    assert runs == [f"ruler_{t}/L1024/aware/{c}" for t in ("fwe", "niah_single_1")
                    for c in ("none", "snapkv-0.5", "snapkv-0.75")]
    for run in runs:
        assert json.loads((tmp_path / run / "summary.json").read_text())["n"] == 2
    table = (tmp_path / "report" / "scores.md").read_text()
    assert "| ruler/fwe | 1024 |" in table and "snapkv 0.75 (aware)" in table and "| mean |" in table
    assert "snapkv 0.75 (aware)" in capsys.readouterr().out
    # Rerunning resumes: nothing left to do, the same records.
    before = (tmp_path / "ruler_fwe/L1024/aware/snapkv-0.5/results.jsonl").read_text()
    assert main(args) == 0
    assert (tmp_path / "ruler_fwe/L1024/aware/snapkv-0.5/results.jsonl").read_text() == before


def test_grid_with_only_configs_runs_only_those(tmp_path):
    """--configs alone lists the columns (before: the three default compressors were added silently)."""
    args = ["grid", "--model", "tiny", "--tasks", "niah_single_1", "--lengths", "512", "--samples", "1",
            "--configs", "snapkv:compression_ratio=0.5", "--modes", "agnostic", "--max-new-tokens", "2",
            "--out", str(tmp_path)]
    assert main(args) == 0
    runs = sorted(p.parent.name for p in tmp_path.rglob("summary.json"))
    assert runs == ["none", "snapkv-compression_ratio0.5"]


def test_grid_unknown_compressor_fails_before_loading(capsys):
    assert main(["grid", "--compressors", "snapvk"]) == 2
    assert "Unknown compressor 'snapvk'" in capsys.readouterr().err
