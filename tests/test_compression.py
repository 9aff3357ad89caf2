"""Fast tier: the compression spine on the tiny random Llama."""

import dataclasses

import pytest
import torch

import kvcomp
from compressors.h2o import H2O
from compressors.snapkv import SnapKV
from compressors.streaming_llm import StreamingLLM
from kvcomp import Compose, CompressedCache, CompressorError, generate
from kvcomp.generation import _left_pad, split_prompt, stop_token_ids
from kvcomp.selection import TokenSelection
from tests.helpers import CONTEXTS, QUESTIONS, SELECTION_METHODS

NEW_TOKENS = 12


def reference_generate(model, tokenizer, contexts, questions, max_new_tokens=NEW_TOKENS):
    """Plain transformers greedy generate on the same token ids kvcomp uses (no kvcomp involved)."""
    parts = [split_prompt(tokenizer, c, q) for c, q in zip(contexts, questions)]
    ids, mask = _left_pad([p.context_ids + p.question_ids for p in parts], tokenizer.pad_token_id)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    stops = stop_token_ids(model, tokenizer)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stops), len(row))
        rows.append(row[:cut])
    return rows


@pytest.mark.parametrize("method", SELECTION_METHODS)
@pytest.mark.parametrize("query_aware", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_ratio_zero_is_token_identical_to_plain_generate(tiny, tiny_reference, method, query_aware, batch):
    model, tokenizer = tiny
    contexts, questions = CONTEXTS[:batch], QUESTIONS[:batch]
    expected = reference_generate(*tiny_reference, contexts, questions)
    result = generate(model, tokenizer, contexts, questions, compressor=method(compression_ratio=0.0),
                      max_new_tokens=NEW_TOKENS, query_aware=query_aware)
    assert result.token_ids == expected
    assert all(len(row) > 0 for row in expected)


def test_uncompressed_baseline_matches_plain_generate(tiny, tiny_reference):
    model, tokenizer = tiny
    expected = reference_generate(*tiny_reference, CONTEXTS, QUESTIONS)
    result = generate(model, tokenizer, CONTEXTS, QUESTIONS, compressor=None, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == expected
    assert result.memory_factor == pytest.approx(1.0)


@pytest.mark.parametrize("method", SELECTION_METHODS)
def test_model_generate_with_compressed_cache(tiny, tiny_reference, method):
    """`model.generate(..., cache=CompressedCache(...))` works; at ratio 0 it equals plain generate."""
    model, tokenizer = tiny
    ids = tokenizer(CONTEXTS[0] + QUESTIONS[0], return_tensors="pt")["input_ids"]
    plain = tiny_reference[0].generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=2)
    cache = CompressedCache(model, method(compression_ratio=0.0))
    out = model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False, pad_token_id=2)
    assert torch.equal(out, plain)
    cache = CompressedCache(model, method(compression_ratio=0.5))
    out = model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False, pad_token_id=2)
    assert out.shape == plain.shape
    assert cache.memory_factor() > 1.5


def prefill(model, ids, compressor, question_length=None):
    cache = CompressedCache(model, compressor, question_length=question_length)
    with torch.inference_mode():
        out = model(input_ids=ids, cache=cache, use_cache=True)
    return cache, out


@pytest.mark.parametrize("method", SELECTION_METHODS)
@pytest.mark.parametrize("ratio,n_prompt,expected", [(0.5, 101, 50), (0.75, 120, 30), (0.9, 64, 6)])
def test_prefill_keeps_exact_budget_per_kv_head(tiny, method, ratio, n_prompt, expected):
    model, _ = tiny
    ids = torch.randint(10, 40000, (1, n_prompt), generator=torch.Generator().manual_seed(n_prompt))
    cache, _ = prefill(model, ids, method(compression_ratio=ratio))
    for layer in cache.layers:
        state = layer.state
        assert state.keys.shape == (1, model.config.num_key_value_heads, expected, 16)
        assert state.values.shape == state.keys.shape
        assert layer.compressor.stored_tokens(state).tolist() == [[expected] * model.config.num_key_value_heads]
        assert layer.get_seq_length() == n_prompt  # logical length counts every token seen


@pytest.mark.parametrize("method", SELECTION_METHODS)
def test_absolute_budget(tiny, method):
    model, _ = tiny
    ids = torch.randint(10, 40000, (1, 80), generator=torch.Generator().manual_seed(0))
    cache, _ = prefill(model, ids, method(budget=24))
    assert all(k.tolist() == [[24, 24]] for k in cache.kept_tokens())


def decode_steps(model, cache, out, steps):
    """Greedy decode `steps` tokens by hand; yields the cache after each step."""
    for _ in range(steps):
        next_ids = out.logits[:, -1:].argmax(-1)
        with torch.inference_mode():
            out = model(input_ids=next_ids, cache=cache, use_cache=True)
        yield cache


@pytest.mark.parametrize("method", [StreamingLLM, H2O])
def test_decode_time_methods_stay_at_budget_for_200_steps(tiny, method):
    model, _ = tiny
    ids = torch.randint(10, 40000, (1, 60), generator=torch.Generator().manual_seed(1))
    cache, out = prefill(model, ids, method(budget=32))
    first_positions = None
    for step, c in enumerate(decode_steps(model, cache, out, 200)):
        for layer in c.layers:
            assert layer.state.keys.shape[2] == 32
            assert layer.compressor.stored_tokens(layer.state).tolist() == [[32, 32]]
        if step == 0:
            first_positions = cache.layers[0].state.positions.clone()
    last = cache.layers[0].state.positions
    assert int(last.max()) == 60 + 200 - 1  # the newest token is kept
    assert not torch.equal(first_positions, last)  # old tokens were evicted along the way


@pytest.mark.parametrize("method", [StreamingLLM, H2O])
def test_ratio_budget_tracks_seen_tokens_while_decoding(tiny, method):
    model, _ = tiny
    ids = torch.randint(10, 40000, (1, 40), generator=torch.Generator().manual_seed(2))
    cache, out = prefill(model, ids, method(compression_ratio=0.5))
    for step, c in enumerate(decode_steps(model, cache, out, 30)):
        seen = 40 + step + 1
        assert c.kept_tokens()[0].tolist() == [[seen // 2] * 2]


def test_streaming_llm_keeps_sinks_and_recent(tiny):
    model, _ = tiny
    ids = torch.randint(10, 40000, (1, 50), generator=torch.Generator().manual_seed(3))
    cache, _ = prefill(model, ids, StreamingLLM(budget=12, n_sink=4))
    positions = cache.layers[0].state.positions[0, 0].tolist()
    assert positions == [0, 1, 2, 3] + list(range(42, 50))


def test_snapkv_keeps_observation_window(tiny):
    model, _ = tiny
    ids = torch.randint(10, 40000, (1, 64), generator=torch.Generator().manual_seed(4))
    cache, _ = prefill(model, ids, SnapKV(budget=20, window=8))
    for layer in cache.layers:
        positions = layer.state.positions[0]
        for head in positions:
            assert set(range(56, 64)) <= set(head.tolist())


def test_h2o_keeps_heavy_hitters(tiny):
    """The kept non-recent tokens are the ones with the largest accumulated attention."""
    from kvcomp.ops import received_attention

    model, _ = tiny
    ids = torch.randint(10, 40000, (1, 48), generator=torch.Generator().manual_seed(5))
    captured = {}
    original = H2O.prefill

    def spy(self, layer, q, k, v, ctx):
        if layer == 0:
            captured["scores"] = received_attention(q, k, ctx.query_positions, ctx.query_valid, ctx.positions,
                                                    ctx.spec)[0]
        return original(self, layer, q, k, v, ctx)

    H2O.prefill = spy
    try:
        cache, _ = prefill(model, ids, H2O(budget=16, recent_fraction=0.5))
    finally:
        H2O.prefill = original
    scores = captured["scores"][0]  # [H_kv, 48]
    for head in range(2):
        kept = set(cache.layers[0].state.positions[0, head].tolist())
        recent = set(range(40, 48))
        assert recent <= kept
        heavy = scores[head, :40].topk(8).indices.tolist()
        assert kept - recent == set(heavy)


@pytest.mark.parametrize("with_values", [False, True])
@pytest.mark.parametrize("case", ["prompt", "prompt-native", "padded", "window", "softcap", "sinks"])
def test_received_attention_equals_the_dense_probabilities(monkeypatch, case, with_values):
    """H2O's prompt statistics equal the column sums of the whole probability matrix (the layer's visibility,
    softcap, sinks; padding queries weigh nothing), and the attention output of the same pass equals dense
    attention's, on the fast paths of an unpadded causal prompt (300 queries: five chunks, the last partial;
    with head_dim 16, float32 on a CPU, the native kernel) and on the general one."""
    import kvcomp.ops as ops
    from kvcomp.kernels import cpu_native
    from kvcomp.ops import SENTINEL, AttentionSpec, dense_attention, softcap, softmax, visible

    if case == "prompt-native" and cpu_native.load() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(11)
    b, hq, hkv, n, d = 2, 6, 2, 300, 16 if case == "prompt-native" else 8
    q, k = torch.randn(b, hq, n, d, generator=gen), torch.randn(b, hkv, n, d, generator=gen)
    v = torch.randn(b, hkv, n, d, generator=gen)
    q_pos = torch.arange(n).repeat(b, 1)
    q_real = torch.ones(b, n, dtype=torch.bool)
    if case == "padded":  # row 1 left-padded by 40
        q_pos[1] = (torch.arange(n) - 40).clamp_min(0)
        q_real[1, :40] = False
    k_pos = q_pos.masked_fill(~q_real, SENTINEL).to(torch.int32).view(b, 1, n).expand(b, hkv, n).contiguous()
    spec = AttentionSpec(scaling=d ** -0.5, window=50 if case == "window" else None,
                         softcap=2.0 if case == "softcap" else None,
                         sinks=torch.linspace(-1, 1, hq) if case == "sinks" else None)
    fast, native = [], []
    original, kernel = ops._causal_prompt_received, cpu_native.prompt_attention
    monkeypatch.setattr(ops, "_causal_prompt_received", lambda *a: fast.append(1) or original(*a))
    monkeypatch.setattr(cpu_native, "prompt_attention", lambda *a: native.append(1) or kernel(*a))
    got, out = ops.received_attention(q, k, q_pos, q_real, k_pos, spec, v if with_values else None)
    assert (bool(fast), bool(native)) == (case == "prompt", case == "prompt-native")

    g = hq // hkv
    logits = softcap(torch.einsum("bhgqd,bhkd->bhgqk", q.view(b, hkv, g, n, d), k) * spec.scaling, spec.softcap)
    seen = visible(q_pos[:, None, None, :, None], k_pos[:, :, None, None, :], spec.window)
    sinks = None if spec.sinks is None else spec.sinks.view(1, hkv, g, 1, 1)
    probs = softmax(logits.masked_fill(~seen, float("-inf")), sinks).nan_to_num(0.0)
    want = (probs * q_real[:, None, None, :, None]).sum((2, 3))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if not with_values:
        assert out is None
        return
    dense, _ = dense_attention(q, k, v, q_pos, k_pos, spec)
    real = q_real[:, None, :, None].expand(b, hq, n, d)  # a padding query's output is never used
    torch.testing.assert_close(out[real], dense[real], rtol=1e-5, atol=1e-5)
    want_out = torch.einsum("bhgqk,bhkd->bhgqd", probs, v).reshape(b, hq, n, d)
    torch.testing.assert_close(out[real], want_out[real], rtol=1e-5, atol=1e-5)


def _h2o_alone():
    return H2O(budget=16, recent_fraction=0.5)


def _h2o_wrapped(name):
    def make():
        from kvcomp.registry import create

        return create(name, scorer="h2o", budget=16)
    return make


@pytest.mark.parametrize("make", [_h2o_alone, _h2o_wrapped("adakv"), _h2o_wrapped("pyramidkv"),
                                  _h2o_wrapped("criticalkv"), _h2o_wrapped("decode_evict")],
                         ids=["h2o", "adakv", "pyramidkv", "criticalkv", "decode_evict"])
def test_h2o_prefill_takes_its_statistic_from_the_attention_pass(tiny, monkeypatch, make):
    """H2O's prefill (alone, or as the scorer of an allocator or wrapper) gets its accumulated attention from the
    prefill's own attention pass (no second pass over the prompt), and builds the same cache and the same tokens
    as with the separate pass."""
    import compressors.h2o as h2o
    import kvcomp.cache

    model, tokenizer = tiny
    ids = torch.randint(10, 40000, (2, 40), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # row 1 left-padded: the general path
    calls = {"pass": 0, "separate": 0}
    in_pass, separate = kvcomp.cache.received_attention, h2o.received_attention
    monkeypatch.setattr(kvcomp.cache, "received_attention",
                        lambda *a: calls.__setitem__("pass", calls["pass"] + 1) or in_pass(*a))
    monkeypatch.setattr(h2o, "received_attention",
                        lambda *a: calls.__setitem__("separate", calls["separate"] + 1) or separate(*a))

    def run():
        cache = CompressedCache(model, make())
        out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=6,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
        return cache, out

    fused, fused_out = run()
    layers = model.config.num_hidden_layers
    assert calls == {"pass": layers, "separate": 0}
    monkeypatch.setattr(H2O, "capabilities", dataclasses.replace(H2O.capabilities, prefill_received=False))
    apart, apart_out = run()
    assert calls == {"pass": layers, "separate": layers}
    assert torch.equal(fused_out, apart_out)
    for a, b in zip(fused.layers, apart.layers):
        assert torch.equal(a.state.positions, b.state.positions)
        if a.state.scores is not None:
            torch.testing.assert_close(a.state.scores, b.state.scores, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.state.keys, b.state.keys, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", SELECTION_METHODS)
def test_resident_bytes_are_the_stored_tensors(tiny, method):
    model, _ = tiny
    ids = torch.randint(10, 40000, (1, 90), generator=torch.Generator().manual_seed(6))
    cache, _ = prefill(model, ids, method(compression_ratio=0.5))
    cfg = model.config
    kept, d, itemsize = 45, cfg.head_dim, 4
    per_layer = 2 * cfg.num_key_value_heads * kept * d * itemsize + cfg.num_key_value_heads * kept * 4  # K, V, int32 positions
    if method is H2O:
        per_layer += cfg.num_key_value_heads * kept * 4  # float32 accumulated attention
    stored = sum(t.numel() * t.element_size() for layer in cache.layers for t in layer.state.tensors())
    assert cache.resident_bytes()["device"] == stored == per_layer * cfg.num_hidden_layers
    assert cache.full_bytes() == 2 * cfg.num_key_value_heads * 90 * d * itemsize * cfg.num_hidden_layers
    assert cache.memory_factor() == pytest.approx(cache.full_bytes() / stored)
    for layer in cache.layers:
        assert layer.state.keys.shape[1] == cfg.num_key_value_heads != cfg.num_attention_heads


def test_padding_is_never_stored(tiny):
    model, tokenizer = tiny
    result_cache = {}
    compressor = StreamingLLM(compression_ratio=0.0)
    parts = [split_prompt(tokenizer, c, q) for c, q in zip(CONTEXTS, QUESTIONS)]
    ids, mask = _left_pad([p.context_ids + p.question_ids for p in parts], tokenizer.pad_token_id)
    cache = CompressedCache(model, compressor)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache)
    lengths = mask.sum(1).tolist()
    result_cache["kept"] = cache.kept_tokens()[0][:, 0].tolist()
    assert result_cache["kept"] == lengths
    state = cache.layers[0].state
    assert state.keys.shape[2] == max(lengths)  # no slot for padding beyond the longest row


def test_compose_multiplies_budgets(tiny):
    model, _ = tiny
    ids = torch.randint(10, 40000, (1, 100), generator=torch.Generator().manual_seed(7))
    cache, _ = prefill(model, ids, Compose(SnapKV(compression_ratio=0.5), StreamingLLM(compression_ratio=0.5)))
    assert all(k.tolist() == [[25, 25]] for k in cache.kept_tokens())
    assert cache.memory_factor() > 3.5


def test_external_compressor_via_register(tiny, monkeypatch):
    from kvcomp import registry

    kvcomp.available()  # load the entry points first, then register on a copy that the test throws away
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))

    @dataclasses.dataclass
    class KeepFirst(TokenSelection):
        """Keeps the oldest tokens: defined outside the package."""

        def score(self, q, k, v, ctx):
            return -ctx.positions.float()

    kvcomp.register("keep_first_test", KeepFirst)
    assert "keep_first_test" in kvcomp.available()
    model, tokenizer = tiny
    result = generate(model, tokenizer, CONTEXTS[0], QUESTIONS[0], compressor="keep_first_test",
                      compression_ratio=0.5, query_aware=True, max_new_tokens=4)
    assert result.compressor == "keep_first_test"
    assert result.memory_factor > 1.5


def test_external_compressor_via_entry_point(monkeypatch):
    from importlib.metadata import EntryPoint

    from kvcomp import registry

    ep = EntryPoint(name="ep_streaming_test", value="compressors.streaming_llm:StreamingLLM",
                    group=registry.GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep] if group == registry.GROUP else [])
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    compressor = registry.create("ep_streaming_test", compression_ratio=0.25)
    assert isinstance(compressor, StreamingLLM) and compressor.compression_ratio == 0.25
    assert StreamingLLM.name == "streaming_llm"  # registering under a second name does not rename it


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, "half"])
@pytest.mark.parametrize("method", SELECTION_METHODS)
def test_bad_ratio_is_a_clear_error(method, ratio):
    with pytest.raises(CompressorError, match=r"compression_ratio must be in \[0, 1\)"):
        method(compression_ratio=ratio)


@pytest.mark.parametrize("budget", [0, -5, 2.5])
def test_bad_budget_is_a_clear_error(budget):
    with pytest.raises(CompressorError, match="budget must be a positive"):
        SnapKV(budget=budget)


def test_unknown_compressor_lists_known_ones():
    with pytest.raises(CompressorError, match="Unknown compressor 'snapvk'.*h2o.*snapkv.*streaming_llm"):
        kvcomp.create("snapvk")


def test_bad_parameter_names_the_parameters():
    with pytest.raises(CompressorError, match="Its parameters are: .*compression_ratio"):
        kvcomp.create("snapkv", ratio=0.5)


def test_batch_unsafe_method_rejects_batches_before_compute(tiny):
    @dataclasses.dataclass
    class SingleOnly(StreamingLLM):
        capabilities = dataclasses.replace(StreamingLLM.capabilities, supports_batch=False)

    model, tokenizer = tiny
    calls = []
    model_forward = model.forward
    with pytest.raises(CompressorError, match="does not support batch size > 1"):
        model.forward = lambda *a, **k: calls.append(1) or model_forward(*a, **k)
        try:
            generate(model, tokenizer, CONTEXTS, QUESTIONS, compressor=SingleOnly(compression_ratio=0.5))
        finally:
            del model.forward
    assert calls == []


def test_compose_rejects_decode_time_first_stage():
    with pytest.raises(CompressorError, match="can only be the last stage"):
        Compose(H2O(compression_ratio=0.5), SnapKV(compression_ratio=0.5))


def test_kvcomp_attention_without_compressed_cache_matches_sdpa(tiny, tiny_reference):
    model, tokenizer = tiny
    kvcomp.attention.install(model)
    ids = tokenizer([CONTEXTS[0], CONTEXTS[2]], return_tensors="pt", padding=True, padding_side="left")
    with torch.inference_mode():
        a = model(**ids).logits
        b = tiny_reference[0](**ids).logits
    mask = ids["attention_mask"].bool()
    torch.testing.assert_close(a[mask], b[mask], rtol=1e-4, atol=1e-4)
