"""kvpress's evaluation layout: kvcomp's export reads back as the same runs, kvpress's own directories are
read (its numpy-printed answers, its cleaning, its scores) and tabulated beside kvcomp's."""

import csv
import json
import re

import pytest
import yaml

from experiments.cli import main
from experiments.grid import run_table
from experiments.kvpress_format import (
    KVPRESS_COLUMNS,
    KvpressFormatError,
    dir_name,
    export_kvpress,
    parse_answers,
    read_kvpress_dir,
)
from experiments.report import collect, make_report

# kvpress's EvaluationConfig fields, in order (evaluation/evaluate.py; threshold and head_compression_ratio
# are dropped from config.yaml when unset).
KVPRESS_CONFIG_FIELDS = [
    "dataset", "data_dir", "model", "device", "press_name", "compression_ratio", "key_channel_compression_ratio",
    "fraction", "max_new_tokens", "max_context_length", "query_aware", "needle_depth", "compression_interval",
    "target_size", "hidden_states_buffer_size", "output_dir", "log_level", "model_kwargs", "press_init_command",
    "seed", "fp8",
]  # fmt: skip


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    from kvcomp import load_model

    out = tmp_path_factory.mktemp("grid")
    model, tok = load_model("tiny")
    run_table(model, tok, tasks=["niah_single_1", "fwe"], lengths=[512], samples=3,
              compressors=["snapkv", "streaming_llm"], ratios=[0.5], modes=["agnostic", "aware"], out_dir=out,
              max_new_tokens=4, progress=False)
    return out


def test_directory_names_are_kvpress_names():
    # What kvpress's EvaluationConfig.get_results_dir makes of these settings.
    assert dir_name("ruler", "4096", "meta-llama/Meta-Llama-3.1-8B-Instruct", "knorm", 0.5, False) == \
        "ruler__4096__meta-llama--Meta-Llama-3.1-8B-Instruct__knorm__0.50"
    assert dir_name("ruler", "4096", "Qwen/Qwen3-8B", "snapkv", 0.875, True) == \
        "ruler__4096__Qwen--Qwen3-8B__snapkv__0.88__query_aware"


def test_answer_lists_as_python_and_as_numpy_print_them():
    assert parse_answers("['8143928']") == ["8143928"]
    assert parse_answers("['a', 'b c']") == ["a", "b c"]  # str(list)
    assert parse_answers("['apple' 'pear'\n 'plum']") == ["apple", "pear", "plum"]  # str(numpy array)
    assert parse_answers("[\"it's\" 'x']") == ["it's", "x"]


def _kvpress_string_match_all(predictions_csv):
    """kvpress's RULER scorer (evaluation/benchmarks/ruler/calculate_metrics.py) over a predictions.csv."""
    with open(predictions_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    scores = {}
    for task in sorted({r["task"] for r in rows}):
        preds = [re.sub(r"[\x00-\x1f]", "", r["predicted_answer"].strip()).strip() for r in rows if r["task"] == task]
        refs = [parse_answers(r["answer"]) for r in rows if r["task"] == task]
        score = sum(sum(x.lower() in p.lower() for x in ref) / len(ref) for p, ref in zip(preds, refs)) / len(preds)
        scores[task] = {"string_match": round(score * 100, 2)}
    return scores


def test_export_writes_kvpress_files_and_reads_back_as_the_same_runs(grid, tmp_path, capsys):
    out = tmp_path / "kvpress"
    assert main(["export", str(grid), "--out", str(out)]) == 0
    assert "6 kvpress evaluation directories" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(f"ruler__512__LlamaForCausalLM__{press}{suffix}"
                           for press in ("no_press__0.00", "snapkv__0.50", "streaming_llm__0.50")
                           for suffix in ("", "__query_aware"))
    one = out / "ruler__512__LlamaForCausalLM__snapkv__0.50"
    config = yaml.safe_load((one / "config.yaml").read_text())
    assert list(config) == KVPRESS_CONFIG_FIELDS
    assert (config["dataset"], config["data_dir"], config["press_name"], config["compression_ratio"]) == \
        ("ruler", "512", "snapkv", 0.5)
    with (one / "predictions.csv").open() as f:
        assert next(csv.reader(f))[: len(KVPRESS_COLUMNS)] == KVPRESS_COLUMNS
    # kvpress's own scorer run on our predictions.csv gives our metrics.json.
    assert json.loads((one / "metrics.json").read_text()) == _kvpress_string_match_all(one / "predictions.csv")

    # Read back: the same runs, the same intervals and tests.
    cols = ["task", "length", "compressor", "compression_ratio", "mode", "label", "n", "score", "memory_factor",
            "exact_match_rate", "model", "dtype", "source", "score_ci_low", "score_ci_high", "vs_none_n",
            "vs_none_p", "best_other", "vs_best_p"]
    mine, back = collect(grid), collect(out)
    assert len(mine) == len(back) == 12 and set(back.source) == {"kvcomp"}
    assert mine[cols].reset_index(drop=True).equals(back[cols].reset_index(drop=True))


def _write_kvpress_dir(root, press, ratio, predictions):
    """A directory as kvpress's evaluate.py writes it (column order: a set difference, answers numpy-printed)."""
    path = root / dir_name("ruler", "4096", "meta-llama/Meta-Llama-3.1-8B-Instruct", press, ratio, False)
    path.mkdir(parents=True)
    columns = ["task", "answer_prefix", "predicted_answer", "compression_ratio", "question", "answer", "max_new_tokens"]
    with (path / "predictions.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for task, answer, pred in predictions:
            w.writerow([task, " The special magic number is", pred, ratio, "What is the magic number?", answer, 128])
    (path / "metrics.json").write_text(json.dumps(_kvpress_string_match_all(path / "predictions.csv"), indent=4))
    config = {"dataset": "ruler", "data_dir": "4096", "model": "meta-llama/Meta-Llama-3.1-8B-Instruct",
              "device": "cuda:0", "press_name": press, "compression_ratio": ratio, "fraction": 1.0,
              "query_aware": False, "press_init_command": f"{press}(compression_ratio={ratio})", "seed": 42,
              "model_kwargs": {"attn_implementation": None, "dtype": "auto"}}
    (path / "config.yaml").write_text(yaml.dump(config, sort_keys=False))
    return path


def test_kvpress_directories_are_read_and_tabulated_with_kvcomp_runs(grid, tmp_path):
    root = tmp_path / "results"
    answers = ["['1234567']", "['7654321']", "['1111111']", "['2222222']"]
    _write_kvpress_dir(root, "no_press", 0.0, [("niah_single_1", a, f" {a[2:9]}.\n") for a in answers]
                       + [("niah_multivalue", "['12' '34']", " 12 and 34")])
    knorm = _write_kvpress_dir(root, "knorm", 0.5, [("niah_single_1", answers[0], " 1234567"),
                                                    ("niah_single_1", answers[1], " 765"),
                                                    ("niah_single_1", answers[2], " no idea"),
                                                    ("niah_single_1", answers[3], " 2222222\x00"),
                                                    ("niah_multivalue", "['12' '34']", " 12 only")])
    runs = {row["task"]: (row, samples) for row, samples in read_kvpress_dir(knorm)}
    row, samples = runs["ruler/niah_single_1"]
    assert list(samples.values()) == [{"score": s, "exact_match": None} for s in (100.0, 0.0, 0.0, 100.0)]
    assert row["score"] == json.loads((knorm / "metrics.json").read_text())["niah_single_1"]["string_match"] == 50
    assert (row["source"], row["compressor"], row["compression_ratio"], row["length"], row["memory_factor"]) == \
        ("kvpress", "knorm", 0.5, 4096, 2.0)
    assert runs["ruler/niah_multivalue"][0]["score"] == 50.0  # string_match_all: one of the two values

    files = make_report([grid, root], tmp_path / "report")
    table = collect([grid, root])
    kv = table[table.source == "kvpress"].set_index(["task", "compressor"])
    assert len(table) == 12 + 4 and set(table.source) == {"kvcomp", "kvpress"}
    # kvpress's runs pair with its own no_press run on its samples (2 of 4 lost: p = 0.5), never with kvcomp's.
    assert kv.loc[("ruler/niah_single_1", "knorm")].vs_none_n == 4
    assert kv.loc[("ruler/niah_single_1", "knorm")].vs_none_p == pytest.approx(0.5)
    assert "| source |" in files["markdown"].read_text() and "| kvpress |" in files["markdown"].read_text()


def test_what_cannot_be_exported_or_read_is_a_clear_error(tmp_path):
    run = tmp_path / "runs" / "lb"
    run.mkdir(parents=True)
    record = {"id": "x", "task": "longbench/hotpotqa", "compressor": {"name": "none", "params": {}}, "score": 1.0,
              "memory_factor": 1.0, "metadata": {}, "model": "m", "dtype": "float32", "query_aware": False,
              "lossless": None}
    (run / "results.jsonl").write_text(json.dumps(record) + "\n")
    (run / "summary.json").write_text(json.dumps({"n": 1}))
    with pytest.raises(KvpressFormatError, match="only RULER runs"):
        export_kvpress([tmp_path / "runs"], tmp_path / "out")
    assert main(["export", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 2
    with pytest.raises(KvpressFormatError, match="not a kvpress evaluation directory"):
        read_kvpress_dir(run)
