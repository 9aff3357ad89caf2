"""Stores and saved contexts (issue 21): compress once, ask many, in any process, through a real Redis server.

Every Redis test runs against Debian's redis-server, started here on 127.0.0.1 and a free port and stopped
afterwards (tests/redis_server.py; ``make test`` installs it). Nothing is skipped: without redis-server these
tests fail, saying how to install it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis_server
import torch
from helpers import CONTEXTS, QUESTIONS

import kvcomp
from kvcomp import contexts, directory_store, store
from kvcomp.contexts import load_context, save_context, save_prefilled
from kvcomp.generation import split_prompt
from kvcomp.lossless import Lossless
from kvcomp.shared_prefill import _build_cache, prefill
from kvcomp.store import (
    KeyEvicted,
    KeyMissing,
    StoreFull,
    StoreMismatch,
    StoreTier,
    StoreUnavailable,
    open_store,
)
from kvcomp.tiers import RamTier, Tier
from tests import methods

REPO = Path(__file__).resolve().parent.parent


# -- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def redis_session(tmp_path_factory):
    server = redis_server.start(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_fresh(tmp_path):
    """``make(*options)``: a server of this test alone (to kill it, or to fill it up); stopped afterwards."""
    servers = []

    def make(*extra):
        servers.append(redis_server.start(tmp_path / f"redis{len(servers)}", *extra))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


@pytest.fixture(params=["directory", "redis"])
def any_store(request, tmp_path, redis_session):
    """One store of each backend; the Redis one under a prefix of this test's own."""
    if request.param == "directory":
        return str(tmp_path / "store")
    return f"{redis_session.url}?prefix=t{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory):
    from kvcomp import kvtc_calibration as calibration

    model, tokenizer = tiny
    path = tmp_path_factory.mktemp("kvtc") / "tiny.safetensors"
    return str(calibration.calibrate(model, tokenizer, path, tokens=2048, seq_len=512))


def _make(setting, name, artifact):
    extra = {"artifact": artifact} if name in methods.NEEDS_ARTIFACT else {}
    return setting(name, **extra)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}


def python(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


# -- bit-identical states ---------------------------------------------------------------------------------------
def assert_same(a, b, where="state"):
    """``a`` and ``b`` hold the same bits: tensors (dtype, shape, bytes), bytes, numbers, dataclasses, tiers."""
    if isinstance(a, Tier) or isinstance(b, Tier):
        assert a.layers == b.layers, where
        for layer in a.layers:
            for x, y in zip(a.read(layer), b.read(layer)):
                assert_same(x, y, f"{where}.tier[{layer}]")
        return
    if isinstance(a, kvcomp.tiers.Prefetcher):
        return
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        if a.numel():
            assert torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8)), where
        return
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
        return
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k}]")
        return
    assert type(a) is type(b) and a == b, where


def _close(cache):
    for layer in getattr(cache, "layers", []):
        for obj in contexts._tiers_of(getattr(layer, "state", None)):
            obj.close()


@pytest.mark.parametrize("setting", [methods.lossy, methods.exact], ids=["lossy", "exact"])
@pytest.mark.parametrize("name", methods.names())
def test_every_compressors_state_round_trips_bit_identical(tiny, artifact, any_store, name, setting):
    model, tokenizer = tiny
    parts = [split_prompt(tokenizer, CONTEXTS[1], QUESTIONS[1])]
    pre = prefill(model, parts)
    built = _build_cache(model, pre, _make(setting, name, artifact))
    saved = save_prefilled(model, pre, _make(setting, name, artifact), any_store)
    loaded = load_context(model, saved.key, any_store, convert=False).new_cache(model)
    try:
        for a, b in zip(built.layers, loaded.layers):
            assert_same(a.state, b.state, f"{name} layer {a.layer_idx}")
            assert (a.seen_total, a.kv_shape, a.dtype) == (b.seen_total, b.kv_shape, b.dtype)
            assert torch.equal(a.seen, b.seen) and torch.equal(a.next_position, b.next_position)
            assert type(a.compressor) is type(b.compressor)
        if name not in ("freekv", "specache"):  # retrieval: the in-process tier is RAM, the loaded one the store
            assert built.resident_bytes() == loaded.resident_bytes()
    finally:
        _close(built)
        _close(loaded)


@pytest.mark.parametrize("name", methods.names())
def test_answers_from_a_stored_context_are_token_identical_to_the_in_process_cache(tiny, artifact, any_store, name):
    model, tokenizer = tiny
    saved = save_context(model, tokenizer, CONTEXTS[0], compressor=_make(methods.lossy, name, artifact),
                         store=any_store)
    ctx = load_context(model, saved.key, any_store)
    for question in (QUESTIONS[0], QUESTIONS[2], ""):  # many questions from one load; and none at all
        alone = kvcomp.generate(model, tokenizer, CONTEXTS[0], question,
                                compressor=_make(methods.lossy, name, artifact), max_new_tokens=10)
        stored = kvcomp.generate(model, tokenizer, question=question, context=ctx, max_new_tokens=10)
        assert stored.token_ids == alone.token_ids, (name, question)
        assert stored.compressor == alone.compressor and stored.extra["context_key"] == saved.key
    again = load_context(model, saved.key, any_store, convert=False)
    stored = kvcomp.generate(model, tokenizer, question=QUESTIONS[0], context=again, max_new_tokens=10)
    alone = kvcomp.generate(model, tokenizer, CONTEXTS[0], QUESTIONS[0],
                            compressor=_make(methods.lossy, name, artifact), max_new_tokens=10)
    assert stored.token_ids == alone.token_ids
    if name not in ("freekv", "specache"):  # retrieval: the in-process tier is RAM, the loaded one the store
        assert stored.resident_bytes == alone.resident_bytes  # convert=False: the same form, the same bytes


def test_uncompressed_batched_and_sliding_window_contexts_round_trip(tmp_path):
    """No compressor (transformers' own cache, sliding layers holding their window) and a left-padded batch."""
    from families import build

    from kvcomp.models import load_model

    _, tokenizer = load_model("tiny")
    model = build("gemma3_text")
    url = str(tmp_path / "store")
    for compressor in (None, methods.lossy("snapkv"), methods.lossy("quant")):
        saved = save_context(model, tokenizer, [CONTEXTS[0], CONTEXTS[2]], compressor=compressor, store=url,
                             chat_template=False)
        ctx = load_context(model, saved.key, url)
        alone = kvcomp.generate(model, tokenizer, [CONTEXTS[0], CONTEXTS[2]], QUESTIONS[:2], compressor=compressor,
                                max_new_tokens=8, chat_template=False)
        stored = kvcomp.generate(model, tokenizer, question=QUESTIONS[:2], context=ctx, max_new_tokens=8)
        assert stored.token_ids == alone.token_ids, compressor


# -- lossless decoding with the full KV in the store -----------------------------------------------------------
@pytest.mark.parametrize("name", methods.names())
def test_lossless_decoding_from_redis_is_token_identical_to_uncompressed(tiny, artifact, redis_session, name):
    model, tokenizer = tiny
    url = f"{redis_session.url}?prefix=ll{uuid.uuid4().hex[:8]}:"
    saved = save_context(model, tokenizer, CONTEXTS[1], compressor=_make(methods.lossy, name, artifact),
                         store=url, full_kv=True)
    assert saved.full_kv_bytes > 0
    ctx = load_context(model, saved.key, url)
    for question in (QUESTIONS[1], ""):
        reference = kvcomp.generate(model, tokenizer, CONTEXTS[1], question, max_new_tokens=16)
        for tier in ("store", "resident"):
            config = Lossless(gamma=3, tier=tier, tier_options={"store": url} if tier == "store" else {})
            out = kvcomp.generate(model, tokenizer, question=question, context=ctx, max_new_tokens=16,
                                  lossless=config)
            assert out.token_ids == reference.token_ids, (name, tier, question)
            if tier == "store":  # verification read the full KV from Redis, every round
                assert out.lossless["bytes_in"] >= out.lossless["rounds"] * saved.full_kv_bytes * 0.99
                # (a retrieval drafter reads the same stored full KV for its fetches: counted for each reader)
                readers = 2 if name in ("freekv", "specache") else 1
                assert out.resident_bytes["store"] == readers * saved.full_kv_bytes


@pytest.mark.parametrize("name", ["snapkv", "quant", "h2o"])
def test_lossless_from_a_stored_batch_with_ragged_questions_equals_uncompressed(tiny, tmp_path, name):
    # The first round verifies each row's question block (left-padded, of its own length) with the drafts.
    model, tokenizer = tiny
    url = str(tmp_path / "store")
    texts = [CONTEXTS[0], CONTEXTS[2]]
    questions = [QUESTIONS[0], QUESTIONS[1] + " And which one is it, precisely?"]
    saved = save_context(model, tokenizer, texts, compressor=methods.lossy(name), store=url, full_kv=True)
    ctx = load_context(model, saved.key, url)
    reference = kvcomp.generate(model, tokenizer, texts, questions, max_new_tokens=12)
    assert reference.token_ids == [kvcomp.generate(model, tokenizer, t, q, max_new_tokens=12).token_ids[0]
                                   for t, q in zip(texts, questions)]
    for tier in ("store", "resident"):
        out = kvcomp.generate(model, tokenizer, question=questions, context=ctx, max_new_tokens=12,
                              lossless=Lossless(gamma=3, tier=tier, tier_options={"store": url} if tier == "store"
                                                else {}))
        assert out.token_ids == reference.token_ids, tier
    compressed = kvcomp.generate(model, tokenizer, texts, questions, compressor=methods.lossy(name),
                                 max_new_tokens=12)
    assert kvcomp.generate(model, tokenizer, question=questions, context=ctx, max_new_tokens=12).token_ids == \
        compressed.token_ids


def test_uncompressed_decoding_from_the_stored_full_kv_and_a_fresh_store_tier(tiny, redis_session):
    from kvcomp.generation import _left_pad, stop_token_ids
    from kvcomp.lossless import full_kv_decode, lossless_decode

    model, tokenizer = tiny
    url = f"{redis_session.url}?prefix=fk{uuid.uuid4().hex[:8]}:"
    reference = kvcomp.generate(model, tokenizer, CONTEXTS[1], QUESTIONS[1], max_new_tokens=12)
    saved = save_context(model, tokenizer, CONTEXTS[1], compressor=methods.lossy("quant"), store=url,
                         full_kv=True)
    ctx = load_context(model, saved.key, url)
    block = [_left_pad([contexts.question_ids(tokenizer, ctx, QUESTIONS[1])], 0)]
    stops = stop_token_ids(model, tokenizer)
    ids, stats = full_kv_decode(model, block, Lossless(tier="store"), 12, stops, context=ctx)
    assert ids == reference.token_ids and stats["lossless"].bytes_in > 0
    # A fresh run with the store as its tier (no saved context): the prefill's K/V go to Redis, one scratch
    # entry per layer, read back at each verification and deleted at the end.
    parts = [split_prompt(tokenizer, CONTEXTS[1], QUESTIONS[1])]
    blocks = [_left_pad([parts[0].context_ids], 0), _left_pad([parts[0].question_ids], 0)]
    for decode in (lambda cfg: full_kv_decode(model, blocks, cfg, 12, stops),
                   lambda cfg: lossless_decode(model, blocks, methods.lossy("snapkv"), cfg, 12, stops)):
        ids, stats = decode(Lossless(gamma=3, tier="store", tier_options={"store": url}))
        assert ids == reference.token_ids and stats["lossless"].bytes_in > 0
        assert [k for k in open_store(url).list() if k.startswith("kvcomp-scratch/")] == []


# -- two processes through a real Redis server -------------------------------------------------------------------
def test_a_context_written_by_one_process_is_answered_by_another_through_redis(tiny, redis_session):
    url = f"{redis_session.url}?prefix=two{uuid.uuid4().hex[:8]}:"
    writer = python("""
        import sys, kvcomp
        from helpers import CONTEXTS
        from compressors.snapkv import SnapKV
        model, tokenizer = kvcomp.load_model("tiny")
        for c in (SnapKV(compression_ratio=0.5), None):
            print(kvcomp.save_context(model, tokenizer, CONTEXTS[1], compressor=c, store=sys.argv[1], full_kv=True).key)
    """, url)
    assert writer.returncode == 0, writer.stderr[-3000:]
    keys = writer.stdout.split()
    reader = python("""
        import json, sys, kvcomp
        from helpers import QUESTIONS
        model, tokenizer = kvcomp.load_model("tiny")
        out = {}
        for key in sys.argv[2:]:
            ctx = kvcomp.load_context(model, key, sys.argv[1])
            out[key] = [kvcomp.generate(model, tokenizer, question=q, context=ctx, max_new_tokens=10).token_ids[0]
                        for q in QUESTIONS]
            if key == sys.argv[2]:
                out["lossless"] = kvcomp.generate(model, tokenizer, question=QUESTIONS[1], context=ctx,
                    max_new_tokens=10, lossless=kvcomp.Lossless(tier="store", tier_options={"store": sys.argv[1]})
                    ).token_ids[0]
        print(json.dumps(out))
    """, url, *keys)
    assert reader.returncode == 0, reader.stderr[-3000:]
    answers = json.loads(reader.stdout.strip().splitlines()[-1])
    model, tokenizer = tiny
    from compressors.snapkv import SnapKV

    for key, compressor in zip(keys, (SnapKV(compression_ratio=0.5), None)):
        for q, ids in zip(QUESTIONS, answers[key]):
            alone = kvcomp.generate(model, tokenizer, CONTEXTS[1], q, compressor=compressor, max_new_tokens=10)
            assert ids == alone.token_ids[0], (key, q)
    uncompressed = kvcomp.generate(model, tokenizer, CONTEXTS[1], QUESTIONS[1], max_new_tokens=10)
    assert answers["lossless"] == uncompressed.token_ids[0]


# -- faults ---------------------------------------------------------------------------------------------------
def test_a_server_killed_mid_read_is_a_clear_error_and_nothing_half_loaded_is_used(tiny, redis_fresh, monkeypatch):
    model, tokenizer = tiny
    server = redis_fresh()
    saved = save_context(model, tokenizer, CONTEXTS[0], compressor=methods.lossy("quant"), store=server.url,
                         full_kv=True)
    redis_store = open_store(server.url)
    reads = []
    original = type(redis_store)._read_part

    def kill_after_first_layer(self, manifest, part, start=0, stop=None):
        if part.name == "state/1":
            server.kill()  # the server dies between two layers of one load
        reads.append(part.name)
        return original(self, manifest, part, start, stop)

    monkeypatch.setattr(type(redis_store), "_read_part", kill_after_first_layer)
    result = None
    t0 = time.perf_counter()
    with pytest.raises(StoreUnavailable, match="unreachable while reading part 'state/1'.*nothing half-read"):
        result = load_context(model, saved.key, redis_store)
    assert result is None and reads[-2:] == ["state/0", "state/1"] and time.perf_counter() - t0 < 30
    monkeypatch.setattr(type(redis_store), "_read_part", original)

    # Killed while lossless decoding reads the full KV for a verification: the generation raises, no output.
    server = redis_fresh()
    saved = save_context(model, tokenizer, CONTEXTS[0], compressor=methods.lossy("quant"), store=server.url,
                         full_kv=True)
    ctx = load_context(model, saved.key, server.url)
    tier_read = StoreTier.read

    def dying_read(self, layer, *args, **kwargs):
        if layer == 1:
            server.kill()
        return tier_read(self, layer, *args, **kwargs)

    monkeypatch.setattr(StoreTier, "read", dying_read)
    with pytest.raises(StoreUnavailable):
        result = kvcomp.generate(model, tokenizer, question=QUESTIONS[0], context=ctx, max_new_tokens=8,
                                 lossless=Lossless(tier="store", tier_options={"store": server.url}))
    assert result is None
    # And a server that is not there at all.
    with pytest.raises(StoreUnavailable, match=f"redis://127.0.0.1:{server.port}/0 is unreachable"):
        load_context(model, saved.key, server.url)


def test_an_evicted_part_is_refused_and_load_or_save_recomputes(tiny, redis_session):
    model, tokenizer = tiny
    url = f"{redis_session.url}?prefix=ev{uuid.uuid4().hex[:8]}:"
    saved = save_context(model, tokenizer, CONTEXTS[0], compressor=methods.lossy("snapkv"), store=url)
    s = open_store(url)
    manifest = s.manifest(saved.key)
    s.client.delete(s._p(manifest.gen, manifest.parts["state/1"].index))  # as an allkeys-lru eviction would
    with pytest.raises(KeyEvicted, match="'state/1'.*gone or short"):
        load_context(model, saved.key, url)
    # A truncated part (a value shorter than its manifest says) is refused the same way.
    key0 = s._p(manifest.gen, manifest.parts["state/0"].index)
    s.client.set(key0, s.client.get(key0)[:-7])
    with pytest.raises(KeyEvicted, match="'state/0'"):
        load_context(model, saved.key, url)
    parts = [split_prompt(tokenizer, CONTEXTS[0], contexts.PROBE_QUESTION)]
    calls = []

    def pre_fn():
        calls.append(1)
        return prefill(model, parts)

    ctx, recomputed = contexts.load_or_save(model, pre_fn, methods.lossy("snapkv"), url, saved.key)
    assert recomputed and calls == [1]
    assert s.manifest(saved.key).gen != manifest.gen
    ctx, recomputed = contexts.load_or_save(model, pre_fn, methods.lossy("snapkv"), url, saved.key)
    assert not recomputed and calls == [1]
    alone = kvcomp.generate(model, tokenizer, CONTEXTS[0], QUESTIONS[0], compressor=methods.lossy("snapkv"),
                            max_new_tokens=8)
    assert kvcomp.generate(model, tokenizer, question=QUESTIONS[0], context=ctx, max_new_tokens=8).token_ids == \
        alone.token_ids


def test_a_corrupt_part_in_a_directory_store_is_refused(tiny, tmp_path):
    model, tokenizer = tiny
    url = str(tmp_path / "store")
    saved = save_context(model, tokenizer, CONTEXTS[0], compressor=methods.lossy("quant"), store=url)
    s = open_store(url)
    manifest = s.manifest(saved.key)
    path = Path(s._entry_dir(saved.key)) / f"{manifest.gen}-{manifest.parts['state/0'].index}"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # one bit of a stored tensor
    path.write_bytes(bytes(data))
    with pytest.raises(KeyEvicted, match="does not match its digest"):
        load_context(model, saved.key, url)


def test_a_writer_killed_mid_put_leaves_no_entry(tiny, tmp_path, redis_session):
    for url in (str(tmp_path / "store"), f"{redis_session.url}?prefix=kill{uuid.uuid4().hex[:8]}:"):
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
            import sys, time, kvcomp
            from kvcomp import store
            from helpers import CONTEXTS
            from compressors.quant import Quant
            cls = type(store.open_store(sys.argv[1]))
            original = cls._write_parts
            def slow(self, gen, parts, ttl):
                original(self, gen, parts[:2], ttl)  # some parts are written ...
                print("writing", flush=True)
                time.sleep(600)                      # ... and the writer dies before the rest and the manifest
            cls._write_parts = slow
            model, tokenizer = kvcomp.load_model("tiny")
            kvcomp.save_context(model, tokenizer, CONTEXTS[0], compressor=Quant(), store=sys.argv[1], key="doc")
        """), url], cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        if not url.startswith("redis"):  # the dead writer's directory stays until a process opens the store
            assert len(os.listdir(Path(url) / ".tmp")) == 1 and os.listdir(Path(url) / "entries") == []
        s = open_store(url)
        assert s.list() == [] and not s.exists("doc")
        with pytest.raises(KeyMissing):
            load_context(tiny[0], "doc", url)
        if url.startswith("redis"):
            written = list(s.client.scan_iter(match=f"{s.prefix}*"))
            assert len(written) == 2 and all(0 < s.client.pttl(k) <= 3600 * 1000 for k in written)  # they expire
        else:
            assert os.listdir(Path(url) / ".tmp") == []  # swept by the first open_store of this process


def test_a_full_store_is_a_clear_error_and_keeps_nothing(tiny, tmp_path, redis_fresh, monkeypatch):
    model, tokenizer = tiny
    server = redis_fresh("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    client = server.client()
    long_context = CONTEXTS[0] * 12  # ~1,700 tokens: ~1.7 MB of K/V and states, the server holds 2 MB
    with pytest.raises(StoreFull, match="store full: the Redis server .* maxmemory"):
        save_context(model, tokenizer, long_context, store=server.url, full_kv=True, key="big")
    assert client.dbsize() == 0  # no manifest, no part
    small = save_context(model, tokenizer, CONTEXTS[2], compressor=methods.lossy("snapkv"), store=server.url)
    assert open_store(server.url).list() == [small.key]
    # A directory store on a filesystem without room: refused before writing, nothing left.
    monkeypatch.setattr(directory_store, "_free_bytes", lambda path: 1000)
    url = str(tmp_path / "dir")
    with pytest.raises(StoreFull, match="needs .* bytes for this entry .* 1,000 free"):
        save_context(model, tokenizer, CONTEXTS[2], store=url, key="x")
    assert os.listdir(Path(url) / "entries") == [] and os.listdir(Path(url) / ".tmp") == []


def test_a_context_of_another_model_version_format_or_compressor_is_refused(tiny, tiny64, artifact, tmp_path,
                                                                            monkeypatch):
    from compressors.kvtc import KVTC
    from compressors.snapkv import SnapKV
    from kvcomp import kvtc_calibration as calibration

    model, tokenizer = tiny
    url = str(tmp_path / "store")
    saved = save_context(model, tokenizer, CONTEXTS[0], compressor=SnapKV(compression_ratio=0.5), store=url,
                         key="doc")
    with pytest.raises(StoreMismatch, match="by another model .*dtype"):
        load_context(tiny64[0], "doc", url)  # the same architecture in float64
    other, _ = kvcomp.load_model("tiny")
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3  # weights differ below any K/V
    with pytest.raises(StoreMismatch, match="by another model .*weights"):
        load_context(other, "doc", url)
    with pytest.raises(StoreMismatch, match="compressed by snapkv with other settings"):
        load_context(model, "doc", url, compressor=SnapKV(compression_ratio=0.75))
    with pytest.raises(StoreMismatch, match="compressed by snapkv"):
        kvcomp.generate(model, tokenizer, question="?", context=load_context(model, "doc", url),
                        compressor=SnapKV(compression_ratio=0.75))
    # Written by another kvcomp version, or in another format version.
    monkeypatch.setattr(contexts, "KVCOMP_VERSION", "0.0.9")
    save_context(model, tokenizer, CONTEXTS[0], compressor=SnapKV(compression_ratio=0.5), store=url, key="old")
    monkeypatch.undo()
    with pytest.raises(StoreMismatch, match="by kvcomp 0.0.9 .*this is kvcomp"):
        load_context(model, "old", url)
    monkeypatch.setattr(contexts, "FORMAT_VERSION", 0)
    save_context(model, tokenizer, CONTEXTS[0], store=url, key="v0")
    monkeypatch.undo()
    with pytest.raises(StoreMismatch, match="in another format"):
        load_context(model, "v0", url)
    # KVTC blocks coded with one calibration cannot be decoded with another.
    second = str(calibration.calibrate(model, tokenizer, tmp_path / "other.safetensors", tokens=1024, seq_len=256))
    save_context(model, tokenizer, CONTEXTS[0], compressor=KVTC(artifact=artifact, window=8, block_size=8),
                 store=url, key="kvtc")
    with pytest.raises(StoreMismatch, match="another calibration artifact"):
        load_context(model, "kvtc", url, compressor=KVTC(artifact=second, window=8, block_size=8))
    # The default key already differs: another model finds nothing under its own key.
    default = save_context(model, tokenizer, CONTEXTS[0], compressor=SnapKV(compression_ratio=0.5), store=url)
    assert saved.key == "doc" and default.key == contexts.context_key(model, [prefill(model, [split_prompt(
        tokenizer, CONTEXTS[0], contexts.PROBE_QUESTION)]).token_rows[0]], SnapKV(compression_ratio=0.5))
    assert contexts.context_key(other, [[1, 2]], None) != contexts.context_key(model, [[1, 2]], None)
    # Not a kvcomp entry at all.
    open_store(url).put("junk", {"x": b"1"}, {"format": "something"})
    with pytest.raises(StoreMismatch, match="in another format"):
        load_context(model, "junk", url)


def test_a_stored_state_naming_a_foreign_class_is_refused(tiny, tmp_path):
    blob = contexts.encode_state({"x": torch.ones(2)})
    meta = contexts._metadata(blob)
    tree = {"$dc": "subprocess:Popen", "f": {"args": "true"}}
    from safetensors.torch import save

    forged = save({"$bytes": torch.zeros(1, dtype=torch.uint8)}, metadata={"tree": json.dumps(tree), "bytes": "0"})
    with pytest.raises(StoreMismatch, match="not part of kvcomp"):
        contexts.decode_state(forged, "cpu")
    assert meta["bytes"] == "0"


# -- the store protocol ---------------------------------------------------------------------------------------
def test_store_protocol_put_get_stream_ranges_list_delete(any_store):
    s = open_store(any_store)
    m = s.put("doc/a", {"state/0": b"abc", "state/1": bytes(range(200)), "empty": b""}, {"n": 1})
    s.put("doc/b", {"x": b"1"})
    s.put("other", {"x": b"2"})
    assert s.list() == ["doc/a", "doc/b", "other"] and s.list("doc/") == ["doc/a", "doc/b"]
    assert s.metadata("doc/a") == {"n": 1} and s.manifest("doc/a").nbytes == 203
    assert [name for name, _ in s.stream("doc/a", ["state/1", "state/0"])] == ["state/1", "state/0"]
    assert s.get("doc/a")[1] == {"state/0": b"abc", "state/1": bytes(range(200)), "empty": b""}
    assert s.read(m, "state/1", 10, 13) == bytes([10, 11, 12])
    assert s.read_ranges(m, "state/1", [(0, 2), (198, 200), (5, 5)]) == [b"\x00\x01", bytes([198, 199]), b""]
    # Replacing an entry: a reader of the old generation gets KeyEvicted, never the new bytes.
    s.put("doc/a", {"state/0": b"ABC"}, {"n": 2})
    with pytest.raises(KeyEvicted):
        s.read(m, "state/0")
    assert s.get("doc/a")[1] == {"state/0": b"ABC"} and s.metadata("doc/a") == {"n": 2}
    assert s.delete("doc/a") and not s.delete("doc/a") and not s.exists("doc/a")
    with pytest.raises(KeyMissing, match="no entry 'doc/a'"):
        s.manifest("doc/a")
    # A time to live.
    s.put("brief", {"x": b"1"}, ttl=0.3)
    assert s.exists("brief")
    time.sleep(0.5)
    assert not s.exists("brief") and "brief" not in s.list()
    with pytest.raises(store.StoreError, match="bad store key"):
        s.put("../escape", {"x": b"1"})


def test_many_readers_and_writers_of_one_key_see_whole_entries(any_store):
    s = open_store(any_store)
    s.put("k", {"a": b"0" * 1000, "b": b"0" * 1000}, {"v": 0})
    seen, errors = set(), []

    def write(i):
        try:
            for _ in range(20):
                open_store(any_store).put("k", {"a": str(i).encode() * 1000, "b": str(i).encode() * 1000}, {"v": i})
        except Exception as err:
            errors.append(err)

    def read():
        r = open_store(any_store)
        for _ in range(60):
            try:
                _, parts = r.get("k")
            except (KeyEvicted, KeyMissing):
                continue  # replaced mid-read: refused, never mixed
            except Exception as err:
                errors.append(err)
                return
            if parts["a"] != parts["b"] or len(set(parts["a"])) != 1:
                errors.append(AssertionError("a mixed entry"))
            seen.add(parts["a"][:1])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(1, 4)] + [
        threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and seen


def test_a_directory_store_refuses_links_and_keeps_its_files_private(tmp_path):
    root = tmp_path / "store"
    s = open_store(str(root))
    s.put("k", {"x": b"1"})
    entry = Path(s._entry_dir("k"))
    assert oct(entry.stat().st_mode & 0o777) == "0o700"
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in entry.iterdir())
    target = tmp_path / "elsewhere"
    target.mkdir()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "entries").symlink_to(target)
    with pytest.raises(store.StoreError, match="symbolic link"):
        open_store(str(bad))
    assert open_store(f"file://{root}").list() == ["k"]
    with pytest.raises(store.StoreError, match="no store backend for 's3://b'"):
        open_store("s3://b")


def test_store_tier_behaves_as_a_ram_tier_and_removes_its_scratch_entries(any_store):
    torch.manual_seed(0)
    k, v = torch.randn(2, 3, 40, 8), torch.randn(2, 3, 40, 8)
    ram, tier = RamTier(), kvcomp.tiers.make_tier("store", store=any_store)
    for t in (ram, tier):
        t.write(0, k, v)
        t.append(0, k[:, :, :5], v[:, :, :5])
    assert tier.length(0) == ram.length(0) == 45 and open_store(any_store).list("kvcomp-scratch/")
    index = torch.randint(-1, 45, (2, 3, 11))
    index[0, 0] = torch.arange(11)  # a run of consecutive tokens: one ranged read
    for args in ((0,), (0, 3, 44), (0, 38, 45), (0, 41, 45)):
        assert all(torch.equal(a, b) for a, b in zip(ram.read(*args), tier.read(*args)))
    assert all(torch.equal(a, b) for a, b in zip(ram.gather(0, index), tier.gather(0, index)))
    tier.write(1, k, v)
    # A whole layer comes back as contiguous K and V (one pass over the stored bytes, the tail in the same buffer).
    assert all(t.is_contiguous() for t in (*tier.read(0), *tier.read(1)))
    assert torch.equal(tier.read(1)[1], v)
    tier.free(1)
    version = tier.version(0)
    for t in (ram, tier):
        t.crop(0, 30)  # into the stored part
    assert tier.version(0) != version and tier.length(0) == 30
    assert all(torch.equal(a, b) for a, b in zip(ram.read(0), tier.read(0)))
    assert tier.nbytes_by_kind()["store"] == 2 * 3 * 30 * 2 * 8 * 4
    tier.close()
    assert open_store(any_store).list("kvcomp-scratch/") == []


def test_store_tier_scratch_entries_are_removed_on_sigterm(tmp_path, redis_session):
    url = f"{redis_session.url}?prefix=sig{uuid.uuid4().hex[:8]}:"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time, torch
        from kvcomp.tiers import make_tier
        tier = make_tier("store", store=sys.argv[1])
        tier.write(0, torch.ones(1, 2, 10, 4), torch.ones(1, 2, 10, 4))
        print("written", flush=True)
        time.sleep(600)
    """), url], cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written", proc.stderr.read()
        assert len(open_store(url).list("kvcomp-scratch/")) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert open_store(url).list() == []


# -- the grid and the command line ------------------------------------------------------------------------------
def test_grid_with_a_store_reuses_stored_prefills_across_runs(tiny, tmp_path, redis_session, monkeypatch):
    from eval.runner import load_records, load_samples, run_grid
    from kvcomp import shared_prefill

    model, tok = tiny
    url = f"{redis_session.url}?prefix=grid{uuid.uuid4().hex[:8]}:"
    task = load_samples("ruler/niah_single_1", tok, length=256, num_samples=2, seed=0, tokens_to_generate=8)
    grid = {"none": None, "snapkv": methods.lossy("snapkv"), "quant": methods.lossy("quant")}
    for mode in (False, True):
        plain = run_grid(model, tok, task, grid, query_aware=mode, out_dir=tmp_path / f"plain{mode}", progress=False)
        first = run_grid(model, tok, task, grid, query_aware=mode, out_dir=tmp_path / f"a{mode}", progress=False,
                         store=url)

        def no_prefill(*args, **kwargs):
            raise AssertionError("a stored sample was prefilled again")

        monkeypatch.setattr(shared_prefill, "prefill", no_prefill)
        second = run_grid(model, tok, task, grid, query_aware=mode, out_dir=tmp_path / f"b{mode}", progress=False,
                          store=url)
        monkeypatch.undo()
        for label in grid:
            a = load_records(tmp_path / f"a{mode}" / label / "results.jsonl")
            b = load_records(tmp_path / f"b{mode}" / label / "results.jsonl")
            p = load_records(tmp_path / f"plain{mode}" / label / "results.jsonl")
            assert [r["from_store"] for r in a] == [False, False] and [r["from_store"] for r in b] == [True, True]
            for x, y, z in zip(a, b, p):
                for key in ("prediction", "score", "memory_factor", "kept_tokens", "exact_match"):
                    assert x[key] == y[key] == z[key], (label, key)
            assert first[label]["score"] == second[label]["score"] == plain[label]["score"]


def test_the_store_command_puts_lists_and_removes(tmp_path, capsys):
    from experiments.cli import main

    url = str(tmp_path / "store")
    assert main(["store", "put", "--model", "tiny", "--store", url, "--context", CONTEXTS[1], "--compressor",
                 "snapkv", "--compression-ratio", "0.5", "--full-kv"]) == 0
    key = capsys.readouterr().out.split()[0]
    assert main(["store", "ls", "--store", url]) == 0
    listing = capsys.readouterr().out
    assert key in listing and "snapkv" in listing and "full_kv=yes" in listing
    assert main(["generate", "--model", "tiny", "--store", url, "--context-key", key, "--question", "Who?",
                 "--max-new-tokens", "6"]) == 0
    answer = capsys.readouterr().out
    assert main(["generate", "--model", "tiny", "--context", CONTEXTS[1], "--question", "Who?", "--compressor",
                 "snapkv", "--compression-ratio", "0.5", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == answer
    assert main(["store", "rm", "--store", url, key]) == 0
    assert "removed" in capsys.readouterr().out
    assert main(["generate", "--model", "tiny", "--store", url, "--context-key", key, "--question", "?"]) == 2
    assert "no entry" in capsys.readouterr().err


# -- the embedded model ---------------------------------------------------------------------------------------
@pytest.mark.real
def test_embedded_model_answers_from_redis_as_in_process_and_lossless_as_uncompressed(embedded, redis_session):
    from compressors.kvtc import KVTC
    from compressors.quant import Quant
    from compressors.snapkv import SnapKV
    from eval.runner import load_samples
    from experiments.rate_distortion import ensure_artifact

    model, tokenizer = embedded
    url = f"{redis_session.url}?prefix=real{uuid.uuid4().hex[:8]}:"
    sample = load_samples("ruler/niah_single_1", tokenizer, length=1024, num_samples=1, seed=0).samples[0]
    artifact = ensure_artifact(model, tokenizer, None, tokens=8192)  # the default artifact, made if missing
    ask = dict(question=sample.question, answer_prefix=sample.answer_prefix, max_new_tokens=8)
    for make in (lambda: SnapKV(compression_ratio=0.75), lambda: KVTC(compression_factor=8, artifact=artifact)):
        saved = save_context(model, tokenizer, sample.context, compressor=make(), store=url)
        stored = kvcomp.generate(model, tokenizer, context=load_context(model, saved.key, url), **ask)
        alone = kvcomp.generate(model, tokenizer, sample.context, compressor=make(), **ask)
        assert stored.token_ids == alone.token_ids
    saved = save_context(model, tokenizer, sample.context, compressor=Quant(bits=4), store=url, full_kv=True)
    cfg = model.config
    per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * 4  # K and V, float32
    assert saved.full_kv_bytes == per_token * saved.prompt_tokens[0]
    # 4-bit codes against float32 K/V; the residual window (128 tokens of ~850) stays float32: about 3x
    assert saved.full_kv_bytes / saved.state_bytes > 2.5
    exact = kvcomp.generate(model, tokenizer, context=load_context(model, saved.key, url),
                            lossless=Lossless(tier="store", tier_options={"store": url}), **ask)
    assert exact.token_ids == kvcomp.generate(model, tokenizer, sample.context, **ask).token_ids
    assert exact.lossless["bytes_in"] >= saved.full_kv_bytes


def test_store_bench_writes_rows_as_it_goes_and_resumes(tmp_path, monkeypatch):
    """experiments.store_bench on the tiny model: every answer from a store equals the in-process one, lossless
    decoding from Redis (reads overlapped and not) equals uncompressed decoding, and a rerun with the same --out
    measures only what is missing (here: the one row taken out of each file)."""
    import json

    from experiments import store_bench

    out = tmp_path / "bench"
    argv = ["--model", "tiny", "--lengths", "512", "--samples", "1", "--tasks", "ruler/niah_single_1",
            "--methods", "none", "snapkv:compression_ratio=0.5", "--drafters", "quant:bits=4",
            "--lossless-tokens", "6", "--gamma", "2", "--out", str(out)]
    summary = store_bench.main(argv)
    rows = [json.loads(line) for line in (out / "store_bench.jsonl").read_text().splitlines()]
    lossless = [json.loads(line) for line in (out / "lossless.jsonl").read_text().splitlines()]
    assert sorted((r["method"], r["store"]) for r in rows) == [
        ("none", "dir"), ("none", "redis"), ("snapkv:compression_ratio=0.5", "dir"),
        ("snapkv:compression_ratio=0.5", "redis")]
    assert all(r["identical"] for r in rows)
    assert sorted(r["overlap"] for r in lossless) == [False, True]
    assert all(r["exact"] and r["uncompressed_exact"] for r in lossless)
    assert {(r["overlap"], r["n"]) for r in summary["lossless"]} == {(True, 1), (False, 1)}

    # Take the last row out of each file: the rerun measures exactly those again and nothing else.
    for name, kept in (("store_bench.jsonl", rows[:-1]), ("lossless.jsonl", lossless[:-1])):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in kept))
    calls = []
    real = store_bench._lossless
    monkeypatch.setattr(store_bench, "_lossless", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    store_bench.main(argv)
    again = [json.loads(line) for line in (out / "store_bench.jsonl").read_text().splitlines()]
    assert [(r["method"], r["store"]) for r in again] == [(r["method"], r["store"]) for r in rows]
    assert calls == [lossless[-1]["overlap"]]
    assert len((out / "lossless.jsonl").read_text().splitlines()) == 2
