"""kvcomp bench on the tiny model: rows, ratios against none, and the files it writes."""

import csv
import json

import pytest
import torch

from experiments.bench import (
    BenchConfig,
    build_compressor,
    copy_bandwidth,
    parse_spec,
    read_bandwidth,
    run_bench,
)
from experiments.cli import main


def test_parse_spec():
    assert parse_spec("none") == ("none", {})
    assert parse_spec("quant:bits=2,group_size=16") == ("quant", {"bits": 2, "group_size": 16})
    with pytest.raises(ValueError, match="key=value"):
        parse_spec("snapkv:0.5")


def test_defaults_fill_ratio_and_bits():
    config = BenchConfig(compression_ratio=0.5, quant_bits=2)
    label, compressor = build_compressor("snapkv", config)
    assert compressor.compression_ratio == 0.5 and label == "snapkv(compression_ratio=0.5)"
    _, compressor = build_compressor("quant", config)
    assert compressor.bits == 2
    _, compressor = build_compressor("snapkv:budget=8", config)
    assert compressor.budget == 8 and compressor.compression_ratio == 0.0
    assert build_compressor("none", config) == ("none", None)


def test_copy_and_read_bandwidth_are_plausible():
    assert 1e8 < copy_bandwidth("cpu", megabytes=16, repeats=2) < 1e13
    assert 1e8 < read_bandwidth("cpu", megabytes=16, repeats=2) < 1e13


def test_bench_on_tiny_model_writes_table_csv_and_plot(tiny, tmp_path):
    model, tokenizer = tiny
    config = BenchConfig(contexts=[48, 96], compressors=["snapkv", "quant:bits=4,group_size=16,residual=16"],
                         decode_steps=3, out=str(tmp_path))
    rows = run_bench(config, model=model, tokenizer=tokenizer, log=lambda *_: None)
    assert [(r["context"], r["compressor"].split("(")[0]) for r in rows] == [
        (c, name) for c in (48, 96) for name in ("none", "none-kvcomp", "snapkv", "quant")]
    for row in rows:
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["peak_rss_mb"] > 0
        assert row["peak_rise_mb"] >= 0
        assert row["roofline_ms"] > 0 and row["step_bytes"] > row["kv_bytes"]
    none, kvcomp_none, snap, quant = rows[4:]
    assert none["decode_speedup"] == 1.0 and none["memory_factor"] == 1.0
    # Both uncompressed baselines are reported, and every row has its ratios against each.
    assert kvcomp_none["decode_speedup_kvcomp"] == 1.0 and kvcomp_none["prefill_slowdown_kvcomp"] == 1.0
    assert all(r["decode_speedup_kvcomp"] > 0 and r["prefill_slowdown_kvcomp"] > 0 for r in rows)
    # kvcomp's uncompressed store: the same K/V plus an int32 position per token and KV head, and the headroom
    # its growable buffers keep for decode steps.
    assert 0.8 < kvcomp_none["memory_factor"] <= 1.0
    # layers x (K, V) x KV heads x (prompt + decoded tokens) x D x float32
    assert none["kv_bytes"] == 2 * 2 * 2 * (96 + 3) * 16 * 4
    assert snap["memory_factor"] > 3  # a quarter of the prompt plus the decoded tokens
    assert quant["memory_factor"] > 1.5
    with open(tmp_path / "bench.csv") as f:
        assert len(list(csv.DictReader(f))) == 8
    meta = json.loads((tmp_path / "bench.json").read_text())["meta"]
    assert meta["copy_bandwidth_bytes_s"] > 0 and meta["read_bandwidth_bytes_s"] > 0 and meta["weight_bytes"] > 0
    assert rows[0]["roofline_ms"] == pytest.approx(1000 * rows[0]["step_bytes"] / meta["read_bandwidth_bytes_s"])
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    model.set_attn_implementation("kvcomp")  # the session fixture is shared


def test_cli_bench_rejects_unknown_compressor_before_loading(capsys):
    assert main(["bench", "--compressors", "nope", "--contexts", "16"]) == 2
    assert "nope" in capsys.readouterr().err


def test_offloaded_full_kv_is_not_counted_as_resident(tiny, tmp_path):
    # FreeKV keeps every token on the slow tier: the fast tier (what memory_factor counts) holds a fraction.
    model, tokenizer = tiny
    config = BenchConfig(contexts=[256], compressors=["freekv:page_size=8,window=8,budget_fraction=0.25"],
                         decode_steps=2, out=str(tmp_path))
    none, _, freekv = run_bench(config, model=model, tokenizer=tokenizer, log=lambda *_: None)
    assert freekv["kv_slow_tier_bytes"] >= none["kv_bytes"] > 0
    assert freekv["kv_bytes"] < none["kv_bytes"] / 2 and freekv["memory_factor"] > 2
    model.set_attn_implementation("kvcomp")


def test_timed_steps_run_before_the_malloc_threshold_is_fixed(tiny, tmp_path, monkeypatch):
    # The fixed mmap threshold makes allocating steps fault their pages in: it is set only for the memory pass,
    # after every timed step, and each (context, compressor) gets its peaks from that pass.
    import experiments.bench as bench

    model, tokenizer = tiny
    state = {"fixed": False, "timed": 0, "measured": 0}
    decode_one = bench.steps.decode_one

    def counting_decode_one(*args, **kwargs):
        state["measured" if state["fixed"] else "timed"] += 1
        return decode_one(*args, **kwargs)

    monkeypatch.setattr(bench, "fixed_malloc_threshold", lambda: state.update(fixed=True) or True)
    monkeypatch.setattr(bench.steps, "decode_one", counting_decode_one)
    config = BenchConfig(contexts=[32, 64], compressors=["snapkv"], decode_steps=4, out=str(tmp_path))
    rows = run_bench(config, model=model, tokenizer=tokenizer, log=lambda *_: None)
    runs = 2 * 3  # contexts x (none, none-kvcomp, snapkv)
    assert state["timed"] == 3 + runs * 4  # warm-up, then the timed pass
    assert state["measured"] == 3 + runs * 4  # warm-up, then each compressor alone
    for row in rows:
        assert row["peak_rise_mb"] >= 0 and row["peak_rss_mb"] > 0 and row["decode_peak_rise_mb"] >= 0
    assert json.loads((tmp_path / "bench.json").read_text())["meta"]["malloc_mmap_threshold_fixed"] is True

    state.update(fixed=False, timed=0, measured=0)
    config = BenchConfig(contexts=[32], compressors=["snapkv"], decode_steps=2, out=str(tmp_path), memory=False)
    rows = run_bench(config, model=model, tokenizer=tokenizer, log=lambda *_: None)
    assert not state["fixed"] and state["measured"] == 0 and state["timed"] == 3 + 3 * 2
    assert all("peak_rise_mb" not in row and "decode_peak_rise_mb" not in row for row in rows)
    with open(tmp_path / "bench.csv") as f:
        assert len(list(csv.DictReader(f))) == 3
    model.set_attn_implementation("kvcomp")


def test_the_memory_pass_of_a_model_loaded_by_name_runs_in_a_fresh_process(tmp_path):
    # The peaks come from a new process whose malloc threshold is fixed from its start (no heap history from
    # the timed pass); its rows join the timed ones by context and label.
    config = BenchConfig(model="tiny", contexts=[48], compressors=["snapkv"], decode_steps=2, out=str(tmp_path))
    rows = run_bench(config, log=lambda *_: None)
    assert [r["compressor"].split("(")[0] for r in rows] == ["none", "none-kvcomp", "snapkv"]
    for row in rows:
        assert row["peak_rss_mb"] > 0 and row["peak_rise_mb"] >= 0 and row["decode_peak_rise_mb"] >= 0
    assert json.loads((tmp_path / "bench.json").read_text())["meta"]["malloc_mmap_threshold_fixed"] == "fresh process"


def test_bench_native_linear_runs_every_row_through_the_kernel(tiny, tmp_path, monkeypatch):
    """--native-linear: every row (both baselines included) decodes with the native linear layers; the model's
    own forward is back after the run."""
    from kvcomp.kernels import cpu_native

    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    model, tokenizer = tiny
    kernel, calls = cpu_native.linear, []
    monkeypatch.setattr(cpu_native, "linear", lambda *a: calls.append(1) or kernel(*a))
    config = BenchConfig(contexts=[32], compressors=["snapkv"], decode_steps=2, memory=False, native_linear=True,
                         out=str(tmp_path))
    rows = run_bench(config, model=model, tokenizer=tokenizer, log=lambda *_: None)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(rows) == 3 and all(r["decode_tok_s"] > 0 for r in rows)
    assert len(calls) >= 3 * 2 * len(linears)  # three rows, two timed steps each (and the warm-up's)
    assert json.loads((tmp_path / "bench.json").read_text())["meta"]["config"]["native_linear"] is True
    assert not any("forward" in vars(m) for m in linears)
    model.set_attn_implementation("kvcomp")  # the session fixture is shared


def test_prefill_rounds_pair_each_round_with_the_baselines(tiny, tmp_path, monkeypatch):
    """--prefill-rounds 3: every compressor prefills three times, each round starting one compressor further
    along; prefill_s is the median of its rounds and each slowdown the median of the per-round ratios, with the
    extreme rounds beside it."""
    from experiments import bench

    model, tokenizer = tiny
    order, clock = [], iter(range(1, 1000))
    real = bench.prefill

    def timed(model, ids, compressor, device, measure=False):
        order.append("none" if compressor is None else type(compressor).__name__)
        run = real(model, ids, compressor, device, measure)
        if ids.shape[1] == 40:  # the timed pass (not the warm-up): distinct, known times
            run["prefill_s"] = float(next(clock))
            run["prefill_tok_s"] = 40 / run["prefill_s"]
        return run

    monkeypatch.setattr(bench, "prefill", timed)
    config = BenchConfig(contexts=[40], compressors=["snapkv"], decode_steps=2, memory=False, prefill_rounds=3,
                         out=str(tmp_path))
    rows = run_bench(config, model=model, tokenizer=tokenizer, log=lambda *_: None)
    assert order[3:] == ["none", "WindowStore", "SnapKV", "WindowStore", "SnapKV", "none",  # after the warm-up
                         "SnapKV", "none", "WindowStore"]
    none, own, snap = rows
    assert snap["prefill_rounds_s"] == [3.0, 5.0, 7.0] and snap["prefill_s"] == 5.0
    assert none["prefill_rounds_s"] == [1.0, 6.0, 8.0] and snap["prefill_tok_s"] == 40 / 5.0
    ratios = sorted([3 / 1, 5 / 6, 7 / 8])
    assert snap["prefill_slowdown"] == pytest.approx(ratios[1])
    assert (snap["prefill_slowdown_low"], snap["prefill_slowdown_high"]) == pytest.approx((ratios[0], ratios[2]))
    assert none["prefill_slowdown"] == none["prefill_slowdown_low"] == none["prefill_slowdown_high"] == 1.0
    assert own["prefill_slowdown_kvcomp"] == 1.0 and all(r["decode_tok_s"] > 0 for r in rows)
    with pytest.raises(ValueError, match="prefill_rounds"):
        BenchConfig(prefill_rounds=0)
    model.set_attn_implementation("kvcomp")  # the session fixture is shared


def test_step_sections_times_the_named_parts_and_puts_them_back(tiny, capsys):
    """experiments.step_sections (the results' sections.py scripts): a wrapped method's or function's time per
    call over real decode steps, names a class lacks skipped, and every original back afterwards."""
    from compressors.snapkv import SnapKV
    from experiments.step_sections import time_sections
    from kvcomp import selection

    compact, store_of_new = selection.compact, vars(selection)["store_of_new"]
    own = {name: vars(SnapKV).get(name) for name in ("attend", "append")}
    found = time_sections("snapkv", 40, methods=["attend", "append", "no_such_method"],
                          functions=[(selection, "compact"), (selection, "store_of_new")], steps=2, warm=1,
                          model="tiny")
    assert found["step"] > 0 and found["SnapKV.attend"] > 0 and found["SnapKV.append"] > 0
    assert found["kvcomp.selection.compact"] > 0 and not any("no_such_method" in key for key in found)
    assert {name: vars(SnapKV).get(name) for name in ("attend", "append")} == own  # the wrappers are gone
    assert selection.compact is compact and selection.store_of_new is store_of_new
    assert "SnapKV.attend" in capsys.readouterr().out


def test_prefill_hooks_time_each_compressors_hook_against_dynamic_cache(capsys):
    """experiments.step_sections.prefill_hooks: the compressor's prefill hook is timed inside real prefills (none
    for DynamicCache), its share is of the same round's DynamicCache prefill, and the hook is put back."""
    from compressors.snapkv import SnapKV
    from experiments.step_sections import prefill_hooks
    from kvcomp.selection import TokenSelection

    found = prefill_hooks(["snapkv", "none-kvcomp"], 40, rounds=2, model="tiny")
    assert set(found) == {"none", "snapkv(compression_ratio=0.75)", "none-kvcomp"}
    assert found["none"]["hook_s"] == 0 and found["none"]["hook_share"] == 0
    snap = found["snapkv(compression_ratio=0.75)"]
    assert 0 < snap["hook_s"] < snap["prefill_s"]
    assert 0 < snap["hook_share"] < 1 and found["none-kvcomp"]["hook_s"] > 0
    assert "prefill" not in vars(SnapKV) and SnapKV.prefill is TokenSelection.prefill  # inherited again
    assert "hook / DynamicCache prefill" in capsys.readouterr().out
