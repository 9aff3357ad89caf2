"""The contract every registered compressor keeps (kvcomp.available(), third-party entry points included).

Settings come from the one shared list in tests/methods.py, so a method registered tomorrow is swept here the
moment it is installed: exact setting == no compression; the hooks' shapes as the framework calls them;
``nbytes()`` == the bytes of the tensors the state holds; checkpoint -> more tokens -> rollback == never having
seen them; lossless decoding == uncompressed greedy decoding; a batch == each prompt alone; a declared
capability mismatch refused before any compute. Every test drives the compressor through the real path
(``CompressedCache`` under model forwards, ``kvcomp.generate``), never by calling hooks the way the framework
would not.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import kvcomp
from kvcomp import CompressedCache, CompressorError, TokenSelection, generate, kvtc_calibration
from kvcomp.compressor import SENTINEL
from kvcomp.generation import generate_ids, split_prompt
from kvcomp.ragged import RaggedStore
from tests.helpers import CONTEXTS, QUESTIONS
from tests.methods import CALIBRATED, NEEDS_ARTIFACT, ROUNDING_TIES, exact, lossy, names
from tests.test_compression import reference_generate

NAMES = names()
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory):
    model, tokenizer = tiny
    return str(kvtc_calibration.calibrate(model, tokenizer, tmp_path_factory.mktemp("kvtc") / "tiny.safetensors",
                                          tokens=1024, seq_len=256))


def extra(name, artifact):
    return {"artifact": artifact} if name in NEEDS_ARTIFACT else {}


def batchable(name) -> bool:
    return kvcomp.available()[name].capabilities.supports_batch


def state_bytes(obj, seen: dict | None = None) -> int:
    """Bytes of memory a state keeps alive: the whole storage under every tensor and array reachable from it
    (dataclasses, lists, dicts), each storage once, and every bytes object. A 4-token slice of a prompt's K/V
    keeps the prompt's K/V alive and counts as all of it: a state that reports the slice's bytes and holds the
    prompt is the "mask over a full cache" this contract exists to catch."""
    top = seen is None
    seen = {} if top else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        seen[("torch", storage.data_ptr())] = storage.nbytes()
    elif isinstance(obj, np.ndarray):
        base = obj
        while isinstance(base.base, np.ndarray):
            base = base.base
        seen[("numpy", base.__array_interface__["data"][0])] = base.nbytes
    elif isinstance(obj, (bytes, bytearray)):
        seen[("bytes", id(obj))] = len(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            state_bytes(getattr(obj, f.name), seen)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            state_bytes(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            state_bytes(x, seen)
    return sum(seen.values()) if top else 0


def outside_state_bytes(state) -> int:
    """Resident bytes a state accounts for but does not hold as fields: a retrieval method's fetch buffer (held by
    its prefetcher) and a full KV it keeps on the fast tier."""
    tier = getattr(state, "tier", None)
    return getattr(state, "fetch_bytes", 0) + (tier.nbytes() if getattr(tier, "kind", None) == "device" else 0)


def feed(model, cache, ids: torch.Tensor, start: int):
    """One forward of ``ids`` [1, n] at positions ``start ..`` over ``cache``; returns the last logits."""
    pos = torch.arange(start, start + ids.shape[1]).view(1, -1)
    with torch.inference_mode():
        return model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]


def prompt_ids(n: int = 70, seed: int = 0) -> torch.Tensor:
    return torch.randint(10, 40000, (1, n), generator=torch.Generator().manual_seed(seed))


# -- exact setting ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("query_aware", [False, True])
def test_exact_setting_is_token_identical(tiny, tiny_reference, artifact, name, query_aware):
    model, tokenizer = tiny
    batch = 3 if batchable(name) else 1
    contexts, questions = CONTEXTS[:batch], QUESTIONS[:batch]
    expected = reference_generate(*tiny_reference, contexts, questions, max_new_tokens=NEW_TOKENS)
    result = generate(model, tokenizer, contexts, questions, exact(name, **extra(name, artifact)),
                      max_new_tokens=NEW_TOKENS, query_aware=query_aware)
    assert result.token_ids == expected


# -- shapes and bytes --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_hook_shapes_and_bytes_are_the_tensors_that_exist(tiny, artifact, name):
    """After a prompt (prefill), a question block (append -> attend) and decode steps: per layer, the shapes the
    framework reads and ``nbytes()`` equal to the bytes of what the state holds."""
    model, tokenizer = tiny
    batch = 3 if batchable(name) else 1
    cfg = model.config
    parts = [split_prompt(tokenizer, CONTEXTS[i], QUESTIONS[i]) for i in range(batch)]
    _, stats = generate_ids(model, parts, lossy(name, **extra(name, artifact)), max_new_tokens=6)
    cache = stats["cache"]
    assert all(layer.state is not None for layer in cache.layers)
    for layer in cache.layers:
        c, state = layer.compressor, layer.state
        stored = c.stored_tokens(state)
        assert stored.shape == (batch, cfg.num_key_value_heads)
        assert bool((stored <= layer.seen.view(-1, 1)).all())
        keys, values, positions = c.materialize(state)
        assert keys.shape[:2] == values.shape[:2] == positions.shape[:2] == stored.shape
        assert keys.shape[-1] == values.shape[-1] == cfg.head_dim and keys.shape[2] == positions.shape[2]
        assert torch.equal((positions < SENTINEL).sum(-1), stored)
        held = c.nbytes(state)
        assert set(held) >= {"device", "host", "disk"} and all(v >= 0 for v in held.values())
        assert held["device"] == state_bytes(state) + outside_state_bytes(state), name


@pytest.mark.parametrize("name", [n for n in NAMES if issubclass(kvcomp.available()[n], TokenSelection)])
def test_selection_bytes_follow_the_hand_formula(tiny, name):
    """Kept K/V at the model dtype plus an int32 position per slot and KV head (plus a float32 per statistic a
    method keeps per token): nothing is padded to the prompt length. A ragged store (per-head budgets) holds
    the kept tokens of all heads back to back plus an int64 count per row and KV head: no padding to the
    largest head either."""
    model, _ = tiny
    cache = CompressedCache(model, lossy(name))
    feed(model, cache, prompt_ids(80), 0)
    d, itemsize = model.config.head_dim, 4
    for layer in cache.layers:
        store = layer.state
        per_slot = 2 * d * itemsize + 4 + sum(4 for t in (store.scores, getattr(store, "aux", None)) if t is not None)
        extra = sum(t.numel() * t.element_size() for t in (getattr(store, "extra", None) or {}).values())
        if isinstance(store, RaggedStore):
            b, h = store.lengths.shape
            n = int(store.lengths.sum())
            assert store.keys.shape == (n, d) and store.positions.shape == (n,)
            assert layer.compressor.nbytes(store)["device"] == n * per_slot + 8 * b * h + extra
            assert n < b * h * int(store.lengths.max()) or bool((store.lengths == store.lengths.max()).all())
        else:
            b, h, slots = store.positions.shape
            assert layer.compressor.nbytes(store)["device"] == b * h * slots * per_slot + extra
        assert int(layer.compressor.stored_tokens(store).max()) < 80


# -- checkpoint / rollback ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_rollback_equals_never_having_seen_the_tokens(tiny, artifact, name):
    model, _ = tiny
    prompt, later = prompt_ids(60), prompt_ids(9, seed=7)

    def build(steps):
        cache = CompressedCache(model, lossy(name, **extra(name, artifact)))
        feed(model, cache, prompt, 0)
        for i in range(steps):
            feed(model, cache, later[:, i:i + 1], 60 + i)
        return cache

    rolled = build(3)
    snapshot = rolled.checkpoint()
    for i in range(3, 9):  # enough tokens to evict, flush a quantized group or a coded block
        feed(model, rolled, later[:, i:i + 1], 60 + i)
    rolled.rollback(snapshot)
    fresh = build(3)
    for a, b in zip(rolled.layers, fresh.layers):
        assert a.seen_total == b.seen_total and torch.equal(a.next_position, b.next_position)
        for x, y in zip(a.compressor.materialize(a.state), b.compressor.materialize(b.state)):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        if getattr(a.state, "prefetcher", None) is None:  # a speculative prefetch is cancelled by a rollback
            assert a.compressor.nbytes(a.state) == b.compressor.nbytes(b.state)
        assert torch.equal(a.compressor.stored_tokens(a.state), b.compressor.stored_tokens(b.state))
    step = later[:, 3:4]
    torch.testing.assert_close(feed(model, rolled, step, 63), feed(model, fresh, step, 63), rtol=0, atol=0)


# -- lossless decoding ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("query_aware", [False, True])
def test_lossless_decoding_is_uncompressed_decoding(tiny, artifact, name, query_aware):
    model, tokenizer = tiny
    batch = 2 if batchable(name) else 1
    contexts, questions = CONTEXTS[:batch], QUESTIONS[:batch]
    kwargs = dict(max_new_tokens=16, query_aware=query_aware)
    expected = generate(model, tokenizer, contexts, questions, None, **kwargs)
    result = generate(model, tokenizer, contexts, questions, lossy(name, **extra(name, artifact)), lossless=True,
                      gamma=3, **kwargs)
    assert result.token_ids == expected.token_ids
    assert result.lossless["verify_passes"] >= 1


# -- batches ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in NAMES if batchable(n) and n not in ROUNDING_TIES])
@pytest.mark.parametrize("query_aware", [False, True])
def test_batch_equals_each_prompt_alone(tiny64, tmp_path_factory, name, query_aware):
    model, tokenizer = tiny64
    kw = {}
    if name in NEEDS_ARTIFACT:
        kw["artifact"] = str(kvtc_calibration.calibrate(model, tokenizer, tmp_path_factory.mktemp("kvtc64") / "a.st",
                                                        tokens=1024, seq_len=256))
    together = generate(model, tokenizer, CONTEXTS, QUESTIONS, lossy(name, **kw), max_new_tokens=NEW_TOKENS,
                        query_aware=query_aware)
    for i, (c, q) in enumerate(zip(CONTEXTS, QUESTIONS)):
        alone = generate(model, tokenizer, c, q, lossy(name, **kw), max_new_tokens=NEW_TOKENS, query_aware=query_aware)
        assert alone.token_ids[0] == together.token_ids[i], (name, i)


# -- declared capabilities -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in NAMES if not batchable(n)])
def test_batch_unsupported_is_refused_before_compute(tiny, name):
    model, tokenizer = tiny
    calls = []
    handle = model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(CompressorError, match="batch size"):
            generate(model, tokenizer, CONTEXTS[:2], QUESTIONS[:2], lossy(name), max_new_tokens=4)
    finally:
        handle.remove()
    assert not calls


@pytest.mark.parametrize("name", [n for n in NAMES if kvcomp.available()[n].capabilities.needs_calibration])
def test_missing_calibration_is_refused_before_compute(tiny, tmp_path, monkeypatch, name):
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path))  # no default artifact there
    model, tokenizer = tiny
    calls = []
    handle = model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(CompressorError, match="kvcomp calibrate"):
            generate(model, tokenizer, CONTEXTS[0], QUESTIONS[0], lossy(name, **CALIBRATED.get(name, {})),
                     max_new_tokens=4)
    finally:
        handle.remove()
    assert not calls


def test_a_cache_is_not_reused_for_a_new_prompt(tiny):
    model, tokenizer = tiny
    cache = CompressedCache(model, exact("snapkv"))
    ids = tokenizer(CONTEXTS[0], return_tensors="pt")["input_ids"]
    model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)
    with pytest.raises(CompressorError, match="build a new CompressedCache"):
        model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False)


def kept(n: int, ratio: float) -> int:
    return max(1, int(n * (1 - ratio) + 1e-6))


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("query_aware", [False, True])
def test_compose_of_selections_and_nested_compose(tiny, nested, query_aware):
    """Later stages get the earlier stages' kept keys with the full prompt's queries (once a shape error); each
    stage keeps its fraction of what the one before kept."""
    model, tokenizer = tiny
    snap = [kvcomp.create("snapkv", compression_ratio=0.5) for _ in range(3)]
    composed = kvcomp.Compose(kvcomp.Compose(*snap[:2]), snap[2]) if nested else kvcomp.Compose(*snap[:2])
    part = split_prompt(tokenizer, CONTEXTS[0], QUESTIONS[0])
    _, stats = generate_ids(model, [part], composed, max_new_tokens=2, query_aware=query_aware)
    n = len(part.context_ids) + (len(part.question_ids) if query_aware else 0)
    expected = kept(kept(n, 0.5), 0.5)
    expected = kept(expected, 0.5) if nested else expected
    appended = 0 if query_aware else len(part.question_ids)  # the question block, appended after compression
    for k in stats["prefill_kept"]:
        assert k.tolist() == [[expected + appended] * model.config.num_key_value_heads]
