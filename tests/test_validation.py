"""Bad settings fail where they are given, naming the field, the value and the accepted range (issue 18, item 4).

One table of bad values per compressor (a field of kvcomp's own compressors without a row fails the coverage
test), one generic rule for every registered compressor (booleans are not numbers in any numeric field), and
the helpers of kvcomp.validation on their own.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import numpy as np
import pytest
import torch

import kvcomp
from compressors.adakv import AdaKV
from compressors.criticalkv import CriticalKV
from compressors.decode_evict import DecodeEvict
from compressors.duo_attention import DuoAttention
from compressors.expected_attention import ExpectedAttention
from compressors.freekv import FreeKV
from compressors.h2o import H2O
from compressors.inertiakv import InertiaKV
from compressors.keydiff import KeyDiff
from compressors.knorm import KNorm
from compressors.kvtc import KVTC
from compressors.kvzip import KVzip
from compressors.pyramidkv import PyramidKV
from compressors.quant import Quant
from compressors.snapkv import SnapKV
from compressors.specache import SpeCache
from compressors.streaming_llm import StreamingLLM
from compressors.tova import TOVA
from kvcomp import validation
from kvcomp.compressor import CompressorError
from kvcomp.lossless import Lossless, Sampling

NAN, INF = float("nan"), float("inf")
SELECTION = {"compression_ratio": [False, True, 1.0, -0.1, NAN, "0.5"],
             "budget": [True, False, 0, -1, 2.5, 1e20, 10**20]}
RETRIEVAL = {"budget_fraction": [5.0, 1.01, INF, NAN, 0, -0.1, True],
             "top_k": [True, -1, 1.5, 10**20],
             "n_sink": [True, -1, 2.0],
             "window": [True, -1, 10**20],
             "tier": ["ssd", True, None],
             "speculative": ["no", 1, 0.0],
             "overlap": ["yes", 0],
             "tau": [True, 1.5, -1.5, NAN, "0.8"],
             "correction": ["x", True],
             "offload_dir": [5, "", True]}
WRAPPED = {**SELECTION, "scorer": [5, True, None, "nonexistent", "quant", "kvzip"]}
DECODE = {**WRAPPED, "target_size": [0, True, 1.5, -3], "interval": [0, True, 2.0]}
BAD: dict[type, dict[str, list]] = {
    KNorm: SELECTION,
    KeyDiff: SELECTION,
    TOVA: {**SELECTION, "aggregate": ["mean", 1, True]},
    ExpectedAttention: {**SELECTION, "n_future": [0, True, 1.5], "n_sink": [True, -1, 2.0],
                        "use_covariance": ["yes", 1, None], "use_vnorm": ["no", 0], "epsilon": [True, -1.0, NAN, "0"]},
    KVzip: {**SELECTION, "level": ["pair", 1], "n_sink": [True, -1], "chunk_size": [0, True, 1.5],
            "overlap": [-1, True], "prompt": [5, None], "continue_prompt": [5, True], "chat_template": ["yes", 1]},
    AdaKV: {**WRAPPED, "floor": [True, 1.5, -0.1, NAN]},
    PyramidKV: {**WRAPPED, "beta": [True, 0.5, NAN, "20"], "window": [True, -1, 1.5]},
    CriticalKV: {**WRAPPED, "epsilon": [True, -1.0, INF], "first_stage_ratio": [True, 1.5, -0.1]},
    DuoAttention: {**WRAPPED, "streaming_fraction": [True, 1.5, -0.1], "n_sink": [True, -1], "recent": [0, True],
                   "heads": ["all", 1], "artifact": [5, "", True]},
    DecodeEvict: DECODE,
    InertiaKV: {**DECODE, "beta": [True, 1.0, -0.1, NAN], "mode": ["full", 1], "refresh": [0, True],
                "window": [-1, True]},
    StreamingLLM: {**SELECTION, "n_sink": [True, -1, 1.5, 10**20]},
    H2O: {**SELECTION, "recent_fraction": [True, 1.5, -0.1, NAN, "0.5"]},
    SnapKV: {**SELECTION, "window": [True, 0, -1, 2.0], "kernel_size": [True, 0, 2, 10**20],
             "pooling": ["mean", 1], "max_window": [0, True, -1, 1.5]},
    Quant: {"bits": [True, 3, 4.0], "group_size": [True, 0, 2**40], "residual": [-1, True],
            "n_sink": [True, -1]},
    KVTC: {"compression_factor": [INF, NAN, True, 0.5, "8"], "artifact": [5, "", True],
           "n_sink": [True, -1], "window": [True, -1], "block_size": [0, 513, True], "group_size": [0, True],
           "keys": ["rope", True]},
    FreeKV: {**RETRIEVAL, "page_size": [True, 0, 1.5]},
    SpeCache: {**RETRIEVAL, "bits": [True, 3], "group_size": [True, 0], "value_group": [True, 0, 2.0],
               "correction": ["x", True]},
    Lossless: {"gamma": [True, 0, 1.5], "max_gamma": [True, 2.5, 10**20], "adaptive": ["yes", 1],
               "tier": ["ssd", True], "tier_options": ["disk", None]},
    Sampling: {"temperature": [True, INF, NAN, 0, -1.0], "top_k": [-5, True, 1.5], "top_p": [True, 0, 1.5, NAN],
               "seed": [True, 1.5]},
}
CASES = [pytest.param(cls, name, value, id=f"{cls.__name__}-{name}={value!r}")
         for cls, fields in BAD.items() for name, values in fields.items() for value in values]


def _shown(value) -> str:
    return "nan" if isinstance(value, float) and math.isnan(value) else repr(value)


@pytest.mark.parametrize("cls, name, value", CASES)
def test_a_bad_value_is_refused_naming_field_value_and_range(cls, name, value):
    with pytest.raises(CompressorError) as err:
        cls(**{name: value})
    message = str(err.value)
    assert f"{name} must be" in message and _shown(value) in message, message


def test_every_field_of_kvcomps_compressors_has_bad_values_in_the_table():
    classes = [c for c in kvcomp.available().values() if c.__module__.startswith(("compressors.", "kvcomp."))]
    assert set(classes) <= set(BAD), "add the new compressor to BAD"
    for cls in [*classes, Lossless, Sampling]:
        missing = {f.name for f in dataclasses.fields(cls)} - set(BAD[cls])
        assert not missing, f"{cls.__name__}: no bad values for {sorted(missing)}"


def _numeric_fields(cls):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        args = set(typing.get_args(hints[f.name])) or {hints[f.name]}
        if args & {int, float} and bool not in args:
            yield f.name


@pytest.mark.parametrize("name", sorted(kvcomp.available()))
def test_booleans_are_not_numbers_in_any_registered_compressor(name):
    cls = kvcomp.available()[name]
    fields = list(_numeric_fields(cls))
    assert fields or not dataclasses.fields(cls)
    for field in fields:
        for value in (True, False):
            with pytest.raises(CompressorError, match=f"{field} must be"):
                cls(**{field: value})


@pytest.mark.parametrize("make", [
    lambda: SnapKV(compression_ratio=0, budget=np.int64(5), window=8, max_window=1),
    lambda: StreamingLLM(budget=2**30 - 1, n_sink=0),
    lambda: H2O(compression_ratio=0.5, recent_fraction=1),
    lambda: FreeKV(budget_fraction=1, tau=-1, n_sink=0, window=0, offload_dir="/tmp"),
    lambda: FreeKV(budget_fraction=None, top_k=0),
    lambda: SpeCache(budget_fraction=0.25, value_group=16, speculative=False, overlap=False),
    lambda: KVTC(compression_factor=1, block_size=512),
    lambda: Quant(bits=2, residual=0, n_sink=0),
    lambda: AdaKV(scorer=PyramidKV(scorer="tova"), floor=1, compression_ratio=0.5),
    lambda: DecodeEvict(scorer=AdaKV(scorer="knorm"), target_size=8, interval=3),
    lambda: InertiaKV(scorer="h2o", mode="score_free", beta=0, window=0),
    lambda: KVzip(level="head", n_sink=0, overlap=0, prompt="", chat_template=False),
    lambda: Lossless(gamma=1, max_gamma=1, tier="disk", tier_options={"directory": "/tmp"}),
    lambda: Sampling(temperature=0.7, top_k=0, top_p=1, seed=3),
])
def test_good_values_are_accepted(make):
    make()


def test_helpers_return_the_value_and_name_the_owner():
    assert validation.positive_int("n", np.int32(3)) == 3 and type(validation.positive_int("n", 3)) is int
    assert validation.positive_int("n", None, none=True) is None
    assert validation.fraction("f", 1) == 1.0 and validation.finite_float("x", -2.5) == -2.5
    assert validation.choice("c", "a", ("a", "b")) == "a"
    with pytest.raises(CompressorError, match=r"^SnapKV: window must be a positive integer .*or None; got True \(a bool"):
        validation.positive_int("window", True, none=True, owner=SnapKV())
    with pytest.raises(CompressorError, match=r"f must be in \(0, 1\]; got 0"):
        validation.fraction("f", 0, low_open=True)
    with pytest.raises(validation.UsageError, match="samples must be a positive integer"):
        validation.positive_int("samples", 0, error=validation.UsageError)
    with pytest.raises(CompressorError, match="one of 1, 2"):
        validation.choice("bits", True, (1, 2))


# -- kvcomp.generate and custom_generate (items 3 and 4) ------------------------------------------------------
@pytest.mark.parametrize("value", [-3, 0, True, 2.0])
def test_generate_refuses_a_bad_max_new_tokens(tiny, value):
    model, tokenizer = tiny
    with pytest.raises(validation.UsageError, match=f"max_new_tokens must be a positive integer.*got {value!r}"):
        kvcomp.generate(model, tokenizer, "Some context.", "\nQ?", max_new_tokens=value)


def test_generate_refuses_an_empty_prompt(tiny):
    model, tokenizer = tiny
    with pytest.raises(validation.UsageError, match="prompt is empty"):
        kvcomp.generate(model, tokenizer, "", "", chat_template=False, max_new_tokens=2)
    with pytest.raises(validation.UsageError, match="prompt 2 of 2 is empty"):
        kvcomp.generate(model, tokenizer, ["Some context.", ""], ["\nQ?", ""], chat_template=False, max_new_tokens=2)


def test_generate_refuses_a_context_longer_than_the_model_with_the_runners_rule(tiny):
    model, tokenizer = tiny
    context = "The grass is green. " * 30  # ~150 tokens
    limit = model.config.max_position_embeddings
    try:
        model.config.max_position_embeddings = 100
        for compressor in (None, SnapKV(compression_ratio=0.5)):
            with pytest.raises(validation.ContextTooLong, match="model's context is 100 tokens"):
                kvcomp.generate(model, tokenizer, context, "\nQ?", compressor=compressor, max_new_tokens=4)
        model.config.max_position_embeddings = 150 + 200
        kvcomp.generate(model, tokenizer, context, "\nQ?", max_new_tokens=4)  # fits
    finally:
        model.config.max_position_embeddings = limit


def test_generate_warns_that_sampling_settings_without_do_sample_are_ignored(tiny):
    model, tokenizer = tiny
    with pytest.warns(UserWarning, match=r"do_sample=False.*temperature=0\.5.*top_p=0\.9.*ignored"):
        kvcomp.generate(model, tokenizer, "Some context.", "\nQ?", max_new_tokens=2, temperature=0.5, top_p=0.9)


def test_custom_generate_refuses_beams_and_warns_about_ignored_sampling_flags(tiny):
    from kvcomp.lossless import custom_generate

    model, tokenizer = tiny
    ids = tokenizer("The grass is green. " * 8, return_tensors="pt")["input_ids"]
    common = dict(custom_generate=custom_generate, compressor=SnapKV(compression_ratio=0.5), max_new_tokens=3,
                  pad_token_id=2, attention_mask=torch.ones_like(ids))
    with pytest.raises(CompressorError, match="not by beam search; got num_beams=2"):
        model.generate(ids, num_beams=2, **common)
    for flag, value in (("top_p", 0.5), ("temperature", 0.5), ("top_k", 5)):
        with pytest.warns(UserWarning, match=f"do_sample=False.*{flag}={value}.*ignored"):
            greedy = model.generate(ids, **{flag: value}, **common)
        assert torch.equal(greedy, model.generate(ids, **common))  # greedy, as the warning says


# -- the command line: each bad input is one clear line and exit status 2, never a traceback -------------------
def _cli(capsys, *argv) -> str:
    from experiments.cli import main

    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("kvcomp"), err
    return err


def test_cli_refuses_a_bad_max_new_tokens(capsys):
    err = _cli(capsys, "generate", "--model", "tiny", "--context", "Some context.", "--max-new-tokens", "-3")
    assert "max_new_tokens must be a positive integer" in err and "-3" in err


@pytest.mark.parametrize("kind", ["missing", "directory", "latin-1"])
def test_cli_context_file_errors_are_clear(capsys, tmp_path, kind):
    path = tmp_path / "ctx.txt"
    if kind == "directory":
        path.mkdir()
    elif kind == "latin-1":
        path.write_bytes("Caf\xe9 cr\xe8me. ".encode("latin-1") * 5)
    err = _cli(capsys, "generate", "--model", "tiny", "--context-file", str(path))
    expected = {"missing": "no such file", "directory": "is a directory", "latin-1": "is not UTF-8 text"}[kind]
    assert str(path) in err and expected in err, err


def test_cli_demo_refuses_zero_samples(capsys, tmp_path):
    err = _cli(capsys, "demo", "--model", "tiny", "--samples", "0", "--out", str(tmp_path))
    assert "samples must be a positive integer" in err and "got 0" in err
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_cli_calibrate_refuses_zero_tokens(capsys, tmp_path):
    err = _cli(capsys, "calibrate", "kvtc", "--model", "tiny", "--tokens", "0", "--out", str(tmp_path / "a.safetensors"))
    assert "tokens must be a positive integer" in err and "got 0" in err
    err = _cli(capsys, "calibrate", "kvtc", "--model", "tiny", "--tokens", "12", "--seq-len", "12",
               "--out", str(tmp_path / "a.safetensors"))
    assert "at least 16" in err and "--tokens" in err  # PCA of a 16-dim head needs 16 tokens past the sinks
    assert not (tmp_path / "a.safetensors").exists()


def test_a_mistyped_model_name_says_so_without_any_network_attempt(capsys, monkeypatch):
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(validation.UsageError) as err:
        kvcomp.load_model("tyni")
    message = str(err.value)
    assert "'tyni'" in message and "'tiny'" in message and "'embedded'" in message and "hf download tyni" in message
    err = _cli(capsys, "generate", "--model", "tyni", "--compressor", "none", "--context", "x")
    assert "Did you mean 'tiny'" in err


def test_load_samples_and_the_runner_refuse_zero_samples(tiny):
    from eval.runner import Task, load_samples, run

    model, tokenizer = tiny
    with pytest.raises(validation.UsageError, match="num_samples must be a positive integer"):
        load_samples("ruler/niah_single_1", tokenizer, length=256, num_samples=0)
    with pytest.raises(validation.UsageError, match="has no samples"):
        run(model, tokenizer, Task("empty", [], lambda p, s: 0.0), None, query_aware=False)


def test_experiments_run_refuses_zero_samples_in_one_line(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(repo)}
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "model=tiny", "task.num_samples=0",
                           "task.length=256", f"hydra.run.dir={tmp_path}"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "num_samples must be a positive integer" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "config.yaml").exists()  # refused before the run directory was written
