"""Retrieval with offload (FreeKV-style pages, SpeCache-style low-bit copy) on the tiny Llama and on tensors."""

import gc
import math
import os

import pytest
import torch

from compressors.freekv import FreeKV
from compressors.specache import SpeCache
from kvcomp import CompressedCache, CompressorError, generate
from kvcomp.compressor import LayerContext
from kvcomp.kernels.retrieval_ref import members
from kvcomp.ops import AttentionSpec
from kvcomp.retrieval import retrieval_stats
from kvcomp.tiers import BLOCK, shared_worker
from tests.helpers import CONTEXTS, QUESTIONS
from tests.test_compression import reference_generate

NEW_TOKENS = 12
SMALL = dict(window=8, n_sink=4)  # the tiny prompts are ~60-160 tokens: a small window leaves a summary
VARIANTS = [lambda **kw: FreeKV(page_size=8, **SMALL, **kw), lambda **kw: SpeCache(group_size=8, **SMALL, **kw)]
IDS = ["freekv", "specache"]


def drain_prefetches():
    shared_worker().submit(lambda: None).result()
    gc.collect()


@pytest.mark.parametrize("make", VARIANTS, ids=IDS)
@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("query_aware", [False, True])
def test_whole_context_budget_is_token_identical(tiny, tiny_reference, tmp_path, make, speculative, query_aware):
    model, tokenizer = tiny
    for context, question in zip(CONTEXTS, QUESTIONS):
        expected = reference_generate(*tiny_reference, [context], [question])
        compressor = make(top_k=10**6, speculative=speculative, tier="disk", offload_dir=str(tmp_path))
        result = generate(model, tokenizer, context, question, compressor=compressor, max_new_tokens=NEW_TOKENS,
                          query_aware=query_aware)
        assert result.token_ids == expected
        assert result.resident_bytes["disk"] > 0


@pytest.mark.parametrize("make", VARIANTS, ids=IDS)
def test_model_generate_with_compressed_cache(tiny, tiny_reference, make):
    model, tokenizer = tiny
    ids = tokenizer(CONTEXTS[0] + QUESTIONS[0], return_tensors="pt")["input_ids"]
    plain = tiny_reference[0].generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=2)
    cache = CompressedCache(model, make(top_k=10**6, tier="ram"))
    out = model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False, pad_token_id=2)
    assert torch.equal(out, plain)
    cache = CompressedCache(model, make(top_k=2, tier="host"))
    out = model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False, pad_token_id=2)
    assert out.shape == plain.shape
    assert cache.resident_bytes()["host"] > 0 and cache.memory_factor() > 1.5
    stats = retrieval_stats(cache)
    assert stats["decode_steps"] == 7 and stats["bytes_per_token"] > 0 and 0 <= stats["hit_rate"] <= 1


def test_budget_fraction_sets_the_fast_tier_size(tiny):
    model, _ = tiny
    ids = torch.randint(10, 40000, (1, 1200), generator=torch.Generator().manual_seed(0))
    for compressor in (FreeKV(budget_fraction=0.125, page_size=32, **SMALL),
                       SpeCache(budget_fraction=0.25, group_size=16, **SMALL)):
        cache = CompressedCache(model, compressor)
        with torch.inference_mode():
            out = model(input_ids=ids, cache=cache, use_cache=True)
            for _ in range(3):
                out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
        # Within the budget, and short of it by less than one unit (page or token) per layer.
        budget = compressor.budget_fraction * cache.full_bytes()
        unit_bytes = compressor.unit * 2 * 2 * 16 * 4 * model.config.num_hidden_layers
        assert budget - unit_bytes <= cache.resident_bytes()["device"] <= budget
        assert retrieval_stats(cache)["fetched_tokens_per_head_step"] > 0


def layer_inputs(n=200, d=16, h=2, g=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h * g, n, d, generator=gen)
    k = torch.randn(1, h, n, d, generator=gen)
    v = torch.randn(1, h, n, d, generator=gen)
    pos = torch.arange(n).view(1, 1, n).expand(1, h, n)
    ctx = LayerContext(0, pos, torch.arange(n).view(1, n), torch.ones(1, n, dtype=torch.bool), torch.tensor([n]),
                       AttentionSpec(d**-0.5), g)
    return q, k, v, ctx


def decode_ctx(n, h=2, d=16, g=2):
    pos = torch.full((1, h, 1), n)
    return LayerContext(0, pos, torch.tensor([[n]]), torch.ones(1, 1, dtype=torch.bool), torch.tensor([n + 1]),
                        AttentionSpec(d**-0.5), g)


def test_freekv_selection_is_the_true_top_k():
    """With one-token pages the digest bound is exactly q.k: selection equals brute-force top-k; with larger
    pages it equals the top-k of Quest's bound computed page by page."""
    q, k, v, ctx = layer_inputs()
    qg = torch.randn(1, 2, 2, 16, generator=torch.Generator().manual_seed(1))
    fk = FreeKV(page_size=1, top_k=17, n_sink=4, window=8, tier="ram")
    state = fk.prefill(0, q, k, v, ctx)
    middle = k[:, :, 4:state.boundary]
    brute = torch.einsum("bhgd,bhnd->bhgn", qg, middle).amax(2).topk(17).indices.sort().values
    assert torch.equal(fk._select(state, qg, 1.0), brute)
    fk = FreeKV(page_size=8, top_k=5, n_sink=4, window=8, tier="ram")
    state = fk.prefill(0, q, k, v, ctx)
    n_pages = (state.boundary - 4) // 8
    bound = torch.zeros(2, n_pages)
    for head in range(2):
        for p in range(n_pages):
            keys = k[0, head, 4 + 8 * p: 12 + 8 * p]
            lo, hi = keys.min(0).values, keys.max(0).values
            bound[head, p] = max(float(torch.maximum(qi * lo, qi * hi).sum()) for qi in qg[0, head])
    assert torch.equal(fk._select(state, qg, 1.0)[0], bound.topk(5).indices.sort().values)


def test_specache_selection_is_the_true_top_k_when_the_low_bit_copy_is_exact():
    """Keys taking two values per channel and group are exact in 1 bit: low-bit scores are full-precision
    scores, and the selection equals brute-force top-k."""
    q, _, v, ctx = layer_inputs()
    gen = torch.Generator().manual_seed(2)
    lo, hi = torch.randint(-4, 0, (1, 2, 1, 16), generator=gen), torch.randint(1, 5, (1, 2, 1, 16), generator=gen)
    k = torch.where(torch.rand(1, 2, 200, 16, generator=gen) < 0.5, lo, hi).float()
    sc = SpeCache(bits=1, group_size=8, top_k=23, n_sink=4, window=8, tier="ram")
    state = sc.prefill(0, q, k, v, ctx)
    qg = torch.randn(1, 2, 2, 16, generator=gen)
    brute = torch.einsum("bhgd,bhnd->bhgn", qg, k[:, :, 4:state.boundary]).amax(2).topk(23).indices.sort().values
    assert torch.equal(sc._select(state, qg, 1.0), brute)


@pytest.mark.parametrize("make", [FreeKV, SpeCache], ids=IDS)
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("correction", ["cosine", "missed"])
def test_correction_replaces_stale_prefetch(tmp_path, make, overlap, correction):
    """The prefetch is chosen with the prompt's last query; a decode query pointing elsewhere (cosine -1) must
    be corrected: the output equals exact (non-speculative) retrieval with the new query, a repeated query uses
    the prefetch unchanged, and with one KV head's query turned around only that head is corrected."""
    kw = dict(top_k=3, n_sink=4, window=8, tier="disk", offload_dir=str(tmp_path), overlap=overlap,
              correction=correction)
    if make is FreeKV:
        kw["page_size"] = 8
    else:
        kw["group_size"] = 8
    q, k, v, ctx = layer_inputs()
    new_k, new_v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    last = q[:, :, -1:]
    mixed = torch.cat([-last[:, :2], last[:, 2:]], dim=1)  # KV head 0's queries turn around, head 1's stay
    for query, corrected in ((-last, 2), (last, 0), (mixed, 1)):
        outs = []
        for speculative in (True, False):
            c = make(speculative=speculative, **kw)
            state = c.prefill(0, q, k, v, ctx)
            state = c.append(0, state, new_k, new_v, decode_ctx(200))
            outs.append(c.attend(0, state, query, decode_ctx(200)))
            if speculative:
                assert state.stats.speculated == 2 and state.stats.corrected == corrected
                # A corrected head keeps the prefetched units its own selection wants (its recall) and fetches
                # only the missed ones: 2 heads x 3 prefetched units, then the missed units (a FreeKV unit is a
                # page of 8 tokens, a SpeCache unit one token).
                assert state.stats.served_sum == (state.stats.recall_sum if corrected else 2)
                missed = round(3 * (2 - state.stats.recall_sum))
                assert state.stats.decode_bytes == (6 + missed) * kw.get("page_size", 1) * 2 * 16 * 4
                assert state.prefetcher.stats.prefetches_used == 1
                # The same query selects the same units (recall 1 per head); the opposite one mostly others.
                assert state.stats.recall_sum == 2.0 if corrected == 0 else state.stats.recall_sum < 2.0
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_members_marks_the_units_found_among_the_others_and_never_a_missing_one():
    units = torch.tensor([[[0, 3, 5, -1], [2, 2, 7, 1]]])
    among = torch.tensor([[[5, -1, 0], [1, 6, 7]]])
    assert members(units, among, 8).tolist() == [[[True, False, True, False], [False, False, True, True]]]
    assert members(among, units, 8).tolist() == [[[True, False, True], [True, False, True]]]


@pytest.mark.parametrize("make", [FreeKV, SpeCache], ids=IDS)
def test_missed_correction_equals_exact_retrieval_over_many_steps(make):
    """correction="missed": queries that drift step to step (prefetches partly right) attend exactly what
    exact retrieval attends, bit for bit, and only the missed units cost a synchronous fetch."""
    kw = dict(top_k=4, n_sink=4, window=8, tier="ram", **({"page_size": 8} if make is FreeKV else {"group_size": 8}))
    q, k, v, ctx = layer_inputs()
    gen = torch.Generator().manual_seed(3)
    exact, spec = make(speculative=False, **kw), make(speculative=True, correction="missed", **kw)
    states = [exact.prefill(0, q, k, v, ctx), spec.prefill(0, q, k, v, ctx)]
    query = q[:, :, -1:]
    for step in range(12):
        query = query + 0.6 * torch.randn(query.shape, generator=gen)  # drifts: some units change per step
        new_k, new_v = torch.randn(1, 2, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen)
        outs = []
        for i, c in enumerate((exact, spec)):
            states[i] = c.append(0, states[i], new_k, new_v, decode_ctx(200 + step))
            outs.append(c.attend(0, states[i], query, decode_ctx(200 + step)))
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    st = states[1].stats
    assert st.speculated == 24 and 0 < st.corrected < 24  # some head-steps were fully prefetched, some not
    assert 0 < st.recall_sum / st.speculated < 1
    assert st.served_sum == st.recall_sum  # the hit rate counts the prefetched units that were kept


@pytest.mark.parametrize("make", [FreeKV, SpeCache], ids=IDS)
def test_resident_bytes_match_the_formula(make):
    q, k, v, ctx = layer_inputs(n=200)
    kw = dict(top_k=3, n_sink=4, window=8, tier="ram", **({} if make is FreeKV else {"group_size": 16}))
    c = make(speculative=True, **kw)
    state = c.prefill(0, q, k, v, ctx)
    b, h, d, s = 1, 2, 16, 4
    chunk = c.chunk
    summarized = (200 - 4 - 8) // chunk * chunk
    assert state.boundary == 4 + summarized
    if make is FreeKV:
        summary = 2 * b * h * (summarized // chunk) * d * s  # key min and max per page and channel
    else:  # bits-bit codes for K and V, key scale+zero per group and channel, value scale+zero per token
        summary = 2 * b * h * summarized * d * c.bits // 8 + 2 * b * h * (summarized // chunk) * d * s \
            + 2 * b * h * summarized * 1 * s
    assert sum(t.numel() * t.element_size() for t in c.summary_tensors(state.summary)) == summary
    recent = 200 - 4 - summarized
    fetch = 2 * b * h * 3 * c.unit * d * s  # the outstanding prefetch buffer
    fetch += b * h * 3 * 8  # and its int64 unit index
    prev_q = b * h * 2 * d * s
    full_res = 2 * b * h * (4 + recent) * d * s
    tier = 2 * b * h * math.ceil(200 / BLOCK) * BLOCK * d * s  # the ram tier's 200 tokens, in whole blocks, are
    assert c.nbytes(state) == {"device": summary + full_res + fetch + prev_q + tier,  # on the device too
                               "host": 0, "disk": 0}
    if make is SpeCache:  # by default it does not prefetch over this CPU's memory: no buffer, no last query
        default = make(**kw)
        assert default.nbytes(default.prefill(0, q, k, v, ctx)) == {
            "device": summary + full_res + tier, "host": 0, "disk": 0}


def test_disk_files_are_removed_when_the_cache_is_freed_and_on_exceptions(tiny, tmp_path):
    model, tokenizer = tiny
    ids = tokenizer(CONTEXTS[0], return_tensors="pt")["input_ids"]
    cache = CompressedCache(model, FreeKV(page_size=8, top_k=2, tier="disk", offload_dir=str(tmp_path), **SMALL))
    model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=2)
    assert len(os.listdir(tmp_path)) == model.config.num_hidden_layers  # one directory per layer state
    assert all(os.listdir(tmp_path / d) for d in os.listdir(tmp_path))
    del cache
    drain_prefetches()
    assert os.listdir(tmp_path) == []

    calls = {"n": 0}
    forward = model.model.forward

    def crash(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return forward(*args, **kwargs)

    model.model.forward = crash
    try:
        with pytest.raises(RuntimeError, match="boom"):
            generate(model, tokenizer, CONTEXTS[0], QUESTIONS[0], max_new_tokens=8,
                     compressor=SpeCache(group_size=8, top_k=4, tier="disk", offload_dir=str(tmp_path), **SMALL))
    finally:
        del model.model.forward
    drain_prefetches()
    assert calls["n"] == 3 and os.listdir(tmp_path) == []


def test_bad_parameters_are_clear_errors():
    with pytest.raises(CompressorError, match="tier must be"):
        FreeKV(tier="nvme")
    with pytest.raises(CompressorError, match="bits must be one of"):
        SpeCache(bits=3)
    with pytest.raises(CompressorError, match="Set budget_fraction"):
        FreeKV(budget_fraction=None)
    with pytest.raises(CompressorError, match="page_size"):
        FreeKV(page_size=0)


def test_batches_are_refused_before_compute(tiny):
    model, tokenizer = tiny
    with pytest.raises(CompressorError, match="batch size > 1"):
        generate(model, tokenizer, CONTEXTS[:2], QUESTIONS[:2], compressor=FreeKV())


@pytest.mark.parametrize("make", VARIANTS, ids=IDS)
def test_long_decode_moves_chunks_into_the_summary(tiny, make):
    """60 steps with a small budget: the window stays within [window, window + chunk), the summary covers
    exactly the tokens between sinks and window, and every step fetched at most top_k units per head."""
    model, _ = tiny
    ids = torch.randint(10, 40000, (1, 50), generator=torch.Generator().manual_seed(3))
    compressor = make(top_k=2, tier="disk")
    cache = CompressedCache(model, compressor)
    with torch.inference_mode():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        for _ in range(60):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    for layer in cache.layers:
        state = layer.state
        assert state.length == 110 == state.tier.length(layer.layer_idx)
        recent = state.recent_k.shape[2]
        assert 8 <= recent < 8 + compressor.chunk and state.boundary == 110 - recent
        assert (state.boundary - 4) % compressor.chunk == 0
        assert state.stats.decode_steps == 60
        assert state.stats.fetched_tokens <= 60 * 2 * 2 * compressor.unit
        k, _ = state.tier.read(layer.layer_idx, state.boundary)
        assert torch.equal(k, state.recent_k)
    stats = retrieval_stats(cache)
    assert stats["bytes_per_token"] > 0
    if compressor.speculative is None:  # SpeCache over this CPU's disk tier: synchronous, nothing speculated
        assert stats["hit_rate"] == 0 and math.isnan(stats["recall"])
    else:
        assert 0 <= stats["hit_rate"] <= 1 and 0 <= stats["recall"] <= 1


@pytest.mark.parametrize("path", ["native", "triton", "torch"])
def test_specache_attends_fetched_tokens_in_place_of_their_low_bit_copies(path, monkeypatch):
    """Every decode path: the fused C kernels (scoring logits reused, values read packed), the Triton kernels
    (under the interpreter on the CPU) and torch (dequantize, then attend)."""
    import contextlib

    from kvcomp import kernels
    from kvcomp.kernels import cpu_native, quant_ref
    from kvcomp.ops import dense_attention

    monkeypatch.setenv("KVCOMP_NATIVE", "1" if path == "native" else "0")
    if path == "native" and cpu_native.load() is None:
        pytest.skip("no C compiler")
    if path == "triton":
        pytest.importorskip("triton")
    chosen = []
    choose = SpeCache._path
    monkeypatch.setattr(SpeCache, "_path", lambda self, *a: chosen.append(choose(self, *a)) or chosen[-1])
    backend = kernels.use_backend("triton") if path == "triton" else contextlib.nullcontext()
    q, k, v, ctx = layer_inputs()
    c = SpeCache(bits=2, group_size=8, top_k=9, n_sink=4, window=8, tier="ram", speculative=False)
    state = c.prefill(0, q, k, v, ctx)
    query = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(5))
    with backend:
        units = c._select(state, query.view(1, 2, 2, 16), 1.0)
        out = c.attend(0, state, query, decode_ctx(199))
    s, mid = state.summary, slice(4, state.boundary)
    k_low = quant_ref.dequantize_keys(s.key_codes, s.key_scale, s.key_zero, 2).flatten(2, 3)
    v_low = quant_ref.dequantize_values(s.value_codes, s.value_scale, s.value_zero, 2).flatten(2, 3)
    assert not torch.equal(k_low, k[:, :, mid])
    idx = units.unsqueeze(-1).expand(-1, -1, -1, 16)
    k_low.scatter_(2, idx, k[:, :, mid].gather(2, idx))
    v_low.scatter_(2, idx, v[:, :, mid].gather(2, idx))
    keys = torch.cat([k[:, :, :4], k_low, k[:, :, state.boundary:]], dim=2)
    values = torch.cat([v[:, :, :4], v_low, v[:, :, state.boundary:]], dim=2)
    expected, _ = dense_attention(query, keys, values, torch.tensor([[199]]), ctx.positions, AttentionSpec(16**-0.5))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert chosen and set(chosen) == {path}


@pytest.mark.parametrize("make", [FreeKV, SpeCache], ids=IDS)
def test_rollback_equals_never_having_appended(make):
    """Lossless decoding rolls a drafter back: undoing tokens that already entered the summary leaves the
    state a shorter history would have built (tier, window, summary)."""
    kw = dict(top_k=2, n_sink=4, window=8, tier="ram", **({"page_size": 8} if make is FreeKV else {"group_size": 8}))
    q, k, v, ctx = layer_inputs(n=60)
    extra_k, extra_v = torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)

    def run(steps, snapshot_at=None):
        c = make(**kw)
        state = c.prefill(0, q, k, v, ctx)
        snapshot = None
        for i in range(steps):
            if i == snapshot_at:
                snapshot = c.checkpoint(state)
            state = c.append(0, state, extra_k[:, :, i:i + 1], extra_v[:, :, i:i + 1], decode_ctx(60 + i))
            c.attend(0, state, torch.randn(1, 4, 1, 16), decode_ctx(60 + i))
        return c, state, snapshot

    c, rolled, snapshot = run(30, snapshot_at=11)
    rolled = c.rollback(rolled, snapshot)
    _, fresh, _ = run(11)
    assert rolled.length == fresh.length == rolled.tier.length(0) == 71
    assert rolled.boundary == fresh.boundary
    assert torch.equal(rolled.recent_k, fresh.recent_k) and torch.equal(rolled.recent_v, fresh.recent_v)
    for a, b in zip(c.summary_tensors(rolled.summary), c.summary_tensors(fresh.summary)):
        assert torch.equal(a, b)
    assert torch.equal(rolled.tier.read(0)[0], fresh.tier.read(0)[0])
    c.attend(0, rolled, torch.randn(1, 4, 1, 16), decode_ctx(71))  # decoding continues after a rollback


@pytest.mark.real
@pytest.mark.parametrize("make", [FreeKV, SpeCache], ids=IDS)
def test_embedded_model_whole_budget_identity_and_needle(embedded, embedded_reference, make):
    """On SmolLM2-135M: a budget covering everything is token-identical; a quarter budget at 1K finds the
    needle (1/8 at 1K leaves no room for fetched pages once the summary and window are paid for)."""
    from eval.ruler import generate_samples, score

    model, tokenizer = embedded
    expected = reference_generate(*embedded_reference, CONTEXTS[1:2], QUESTIONS[1:2], max_new_tokens=10)
    result = generate(model, tokenizer, CONTEXTS[1], QUESTIONS[1], max_new_tokens=10,
                      compressor=make(top_k=10**6, window=8))
    assert result.token_ids == expected
    s = generate_samples("niah_single_1", tokenizer, 1024, 1, seed=3, tokens_to_generate=12)[0]
    out = generate(model, tokenizer, s.context, s.question, answer_prefix=s.answer_prefix, max_new_tokens=12,
                   compressor=make(budget_fraction=0.25))
    assert score("niah_single_1", out.text, s.outputs) == 100
    assert out.memory_factor >= 4.0


def test_fetches_run_in_a_thread_only_where_they_are_transfers(tiny, tmp_path):
    """overlap=None: FreeKV's fetches run inline over this CPU's disk tier (the page cache: a thread would only
    contend for the same cores) and in the background once the full KV is read from a store; which one never
    changes the tokens, and overlap=True / False still force either way."""
    from kvcomp.contexts import load_context, save_context
    from kvcomp.generation import generate_ids, split_prompt

    model, tokenizer = tiny
    prompt = [split_prompt(tokenizer, CONTEXTS[0], QUESTIONS[0])]

    def run(**kw):
        ids, stats = generate_ids(model, prompt, FreeKV(page_size=4, top_k=2, n_sink=2, window=8, **kw),
                                  max_new_tokens=12)
        return ids, {layer.state.prefetcher.overlap for layer in stats["cache"].layers}

    (default, inline), (forced, threads), (off, never) = run(), run(overlap=True), run(overlap=False)
    assert (inline, threads, never) == ({False}, {True}, {False})
    assert default == forced == off
    saved = save_context(model, tokenizer, CONTEXTS[0], compressor=FreeKV(page_size=4, top_k=2, n_sink=2, window=8),
                         store=str(tmp_path / "store"))
    _, stored = load_context(model, saved.key, str(tmp_path / "store")).continue_ids(model, None, 12)
    assert {layer.state.prefetcher.overlap for layer in stored["cache"].layers} == {True}
    assert all(layer.state.prefetcher.stats.prefetches > 0 for layer in stored["cache"].layers)


def test_specache_speculates_from_a_store_and_not_over_this_cpus_page_cache(tiny, tmp_path):
    """speculative=None: with its exact correction a prefetch only hides transfer time; none over the disk tier
    of a CPU (the page cache), one per step once the full KV is read from a store."""
    from kvcomp.contexts import load_context, save_context
    from kvcomp.generation import generate_ids, split_prompt

    model, tokenizer = tiny

    def make():
        return SpeCache(group_size=8, top_k=2, n_sink=2, window=8)  # tier "auto": disk on the CPU

    _, alone = generate_ids(model, [split_prompt(tokenizer, CONTEXTS[0], QUESTIONS[0])], make(), max_new_tokens=12)
    saved = save_context(model, tokenizer, CONTEXTS[0], compressor=make(), store=str(tmp_path / "store"))
    _, stored = load_context(model, saved.key, str(tmp_path / "store")).continue_ids(model, None, 12)
    assert {type(layer.state.tier).__name__ for layer in stored["cache"].layers} == {"StoreTier"}
    local, remote = retrieval_stats(alone["cache"]), retrieval_stats(stored["cache"])
    assert local["decode_steps"] > 0 and math.isnan(local["recall"]) and local["hit_rate"] == 0
    assert remote["decode_steps"] > 0 and 0 <= remote["recall"] <= 1 and remote["hit_rate"] > 0
