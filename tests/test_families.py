"""The support matrix: every decoder family kvcomp claims x every registered compressor, exact or refused.

For each tiny random family model (tests/families.py: sliding-window layers, soft-capping, sinks, partial and
interleaved RoPE), every compressor in its exact setting (tests/methods.py) must give greedy tokens identical
to plain ``model.generate`` on an identical model left on its own attention, with logits equal to float
rounding, at batch 1 and at batch 3 with different prompt lengths, prompts several windows long. What kvcomp
cannot do exactly on a family must raise UnsupportedModel naming the feature, before any compute.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

import kvcomp
from kvcomp import CompressedCache, kvtc_calibration
from kvcomp.attention import UnsupportedModel, attention_modules, layer_specs
from kvcomp.generation import _left_pad, split_prompt
from tests.families import FAMILIES, WINDOW, build, has_sliding_layers
from tests.methods import NEEDS_ARTIFACT, exact, names

NEW_TOKENS = 10
# (compressor, family) pairs kvcomp refuses, and the words the refusal must contain.
SLIDING = [f for f in FAMILIES if f in ("mistral_window", "qwen2", "gemma2", "gemma3_text", "gpt_oss")]
REFUSED = {("kvtc", "cohere"): "rotates keys differently", ("kvtc", "gpt2"): "no rotary embedding"}


@pytest.fixture(scope="module")
def family_models():
    """family -> (model kvcomp runs, identical reference model on its own attention); built on first use."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = (build(family), build(family))
        return cache[family]

    return get


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny):
    """family -> KVTC calibration artifact for its tiny model (the embedded tokenizer tokenizes the text)."""
    _, tokenizer = tiny
    paths = {}

    def get(family, model):
        if family not in paths:
            path = tmp_path_factory.mktemp("kvtc") / f"{family}.safetensors"
            paths[family] = str(kvtc_calibration.calibrate(model, tokenizer, path, tokens=512, seq_len=128))
        return paths[family]

    return get


def post_rope_artifact(model, tokenizer, directory) -> str:
    path = kvtc_calibration.calibrate(model, tokenizer, directory / "post.safetensors", tokens=512, seq_len=128,
                                      keys="post_rope")
    assert kvtc_calibration.load_artifact(path).inv_freq.numel() == 0  # no RoPE recorded: none is needed
    return str(path)


@pytest.mark.parametrize("family", sorted({f for _, f in REFUSED}))
def test_post_rope_kvtc_codes_the_families_whose_rope_it_cannot_undo(family_models, tiny, tmp_path, family):
    """KVTC with keys coded as cached runs where undoing RoPE is refused: keys are coded (a near-lossless budget)
    and the next token's logits follow the uncompressed model."""
    from compressors.kvtc import KVTC

    model, reference = family_models(family)
    compressor = KVTC(compression_factor=1, artifact=post_rope_artifact(model, tiny[1], tmp_path), window=8,
                      block_size=8, n_sink=2, keys="post_rope")
    ids, mask = prompts(1)
    with torch.inference_mode():
        expected = reference(input_ids=ids, attention_mask=mask).logits[0, -1]
        cache = CompressedCache(model, compressor)
        model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], cache=cache, use_cache=True)
        logits = model(input_ids=ids[:, -1:], attention_mask=mask, cache=cache, use_cache=True).logits[0, -1]
    assert all(int(layer.state.coded_tokens.min()) >= 8 for layer in cache.layers)
    assert float((logits - expected).abs().max() / expected.abs().max()) < 0.08


def prompts(batch: int, seed: int = 0):
    """Left-padded prompts of 3, 2 and 4 windows plus a few tokens."""
    lengths = [3 * WINDOW + 5, 2 * WINDOW + 1, 4 * WINDOW][:batch]
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((batch, width), 2, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(10, 40000, (n,), generator=gen)
        mask[i, width - n:] = 1
    return ids, mask


def generate(model, ids, mask, cache=None):
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                  output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        return model.generate(ids, cache=cache, **kwargs) if cache is not None else model.generate(ids, **kwargs)


def _cases():
    for family in FAMILIES:
        for name in names():
            cls = kvcomp.available()[name]
            for batch in (1, 3):
                if batch > 1 and not cls.capabilities.supports_batch:
                    continue  # refused before compute: tests/test_compression.py checks that
                yield family, name, batch


@pytest.mark.parametrize("family,name,batch", list(_cases()))
def test_exact_setting_matches_plain_generate(family_models, artifacts, tiny, tmp_path, family, name, batch):
    model, reference = family_models(family)
    extra = {}
    if (name, family) in REFUSED:  # refused where a user first meets it: calibrating the method for the model
        with pytest.raises(UnsupportedModel, match=REFUSED[(name, family)] + ".*KVTC\\(keys='post_rope'\\)"):
            kvtc_calibration.calibrate(model, tiny[1], tmp_path / "refused.safetensors", tokens=512, seq_len=128)
        assert not (tmp_path / "refused.safetensors").exists()
        extra = {"artifact": post_rope_artifact(model, tiny[1], tmp_path), "keys": "post_rope"}  # needs no RoPE
    elif name in NEEDS_ARTIFACT:
        extra = {"artifact": artifacts(family, model)}
    ids, mask = prompts(batch)
    expected = generate(reference, ids, mask)
    cache = CompressedCache(model, exact(name, **extra))
    out = generate(model, ids, mask, cache)
    assert all(layer.state is not None for layer in cache.layers), "kvcomp did not manage every layer"
    assert torch.equal(out.sequences, expected.sequences)
    diff = max(float((a - b).abs().max()) for a, b in zip(out.logits, expected.logits))
    assert diff < 1e-3, f"logits differ by {diff}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sliding_layers_hold_at_most_their_window(family_models, family):
    model, _ = family_models(family)
    ids, mask = prompts(3)
    for compressor in (exact("snapkv"), exact("quant")):  # one that compresses sliding layers, one that does not
        cache = CompressedCache(model, compressor)
        generate(model, ids, mask, cache)
        for layer, spec in zip(cache.layers, layer_specs(model)):
            stored = int(layer.compressor.stored_tokens(layer.state).max())
            assert stored <= (spec.window - 1 if spec.window else ids.shape[1] + NEW_TOKENS)
            if spec.window:
                assert stored == spec.window - 1  # exactly what transformers' own sliding layer holds


@pytest.mark.parametrize("family", SLIDING)
def test_uncompressed_memory_factor_is_one_against_transformers_cache(family_models, family):
    model, reference = family_models(family)
    ids, mask = prompts(1)
    assert has_sliding_layers(model)
    plain = generate(reference, ids, mask)
    resident = sum(layer.keys.nbytes + layer.values.nbytes for layer in plain.past_key_values.layers)
    cache = CompressedCache(model, exact("snapkv"))
    generate(model, ids, mask, cache)
    assert cache.full_bytes() == resident  # the reference is what transformers' own (sliding) cache holds


def test_reach_is_the_slot_range_of_every_key_a_query_chunk_sees():
    from kvcomp.ops import SENTINEL, reach

    k_pos = torch.tensor([[[SENTINEL, 0, 1, 2, 3, 4]]])  # one left-padding slot, then positions 0..4
    q_pos = torch.tensor([[3, 4]])
    assert reach(q_pos, k_pos, window=2) == (3, 6)  # query 3 sees 2, 3; query 4 sees 3, 4
    assert reach(q_pos, k_pos) == (1, 6)  # causal: every real slot up to position 4
    assert reach(torch.tensor([[1]]), k_pos) == (1, 3)  # nothing after the last query
    assert reach(q_pos, torch.full((1, 1, 6), SENTINEL)) == (0, 6)  # no key seen: every slot (output unused)


@pytest.mark.parametrize("family", SLIDING)
@pytest.mark.parametrize("batch", [1, 3])
def test_long_prompts_attend_chunk_by_chunk_to_the_keys_each_chunk_reaches(family_models, monkeypatch, family,
                                                                           batch):
    """A prompt longer than a query chunk is attended chunk by chunk (8 queries here, so that prompts of a few
    windows have several), each chunk over the slots it can reach: a band of about its window on a sliding
    layer, nothing after its last query on a causal one (with padding; unpadded causal prefill is one call).
    Tokens and logits equal plain generate, and a sliding layer's chunks attend to fewer keys than the prompt."""
    from kvcomp import ops
    from kvcomp.selection import WindowStore

    monkeypatch.setattr(ops, "_QUERY_CHUNK", 8)
    attended, reach = [], ops.reach

    def spy(q_pos, k_pos, window=None):
        lo, hi = reach(q_pos, k_pos, window)
        attended.append((window, hi - lo, k_pos.shape[-1]))
        return lo, hi

    monkeypatch.setattr(ops, "reach", spy)
    model, reference = family_models(family)
    ids, mask = prompts(batch)
    expected = generate(reference, ids, mask)
    out = generate(model, ids, mask, CompressedCache(model, WindowStore()))
    assert torch.equal(out.sequences, expected.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(out.logits, expected.logits)) < 1e-3
    sliding = [(width, length) for window, width, length in attended if window is not None]
    assert sliding and all(width < length for width, length in sliding)
    if batch == 1:  # no padding: a chunk of 8 queries reaches its window before its first query and itself
        assert all(width <= WINDOW - 1 + 8 for width, _ in sliding)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("query_aware", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_kvcomp_generate_ratio_zero_equals_uncompressed(family_models, tiny, family, query_aware, batch):
    """kvcomp.generate's own paths (context, then a question block over the cache): uncompressed equals plain
    generate on the whole prompt, and every compressor's exact setting equals uncompressed."""
    model, reference = family_models(family)
    _, tokenizer = tiny
    context = ["The grass is green. " * 9 + "The code is 4417.", "The sky is blue. " * 5 + "The code is 90."][:batch]
    question = "\nWhat is the code? Tell me the code, the code that was given above, please."
    kwargs = dict(max_new_tokens=NEW_TOKENS, query_aware=query_aware)
    base = kvcomp.generate(model, tokenizer, context, question, None, **kwargs)
    parts = [split_prompt(tokenizer, c, question) for c in context]
    ids, mask = _left_pad([p.context_ids + p.question_ids for p in parts], 2)
    plain = generate(reference, ids, mask).sequences[:, ids.shape[1]:].tolist()
    assert [row[:len(b)] for row, b in zip(plain, base.token_ids)] == base.token_ids
    for name in ("snapkv", "h2o", "quant"):
        out = kvcomp.generate(model, tokenizer, context, question, exact(name), **kwargs)
        assert out.token_ids == base.token_ids, name


# -- refused features ------------------------------------------------------------------------------------------
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def _refused(model_type, auto=AutoModelForCausalLM, **fields):
    return auto.from_config(AutoConfig.for_model(model_type, **fields)).eval()


@pytest.mark.parametrize("build_model,feature", [
    (lambda: _refused("t5", AutoModelForSeq2SeqLM, vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                      num_heads=4), "encoder-decoder attention"),
    (lambda: _refused("llama4_text", **SMALL, attention_chunk_size=8, num_local_experts=2, interleave_moe_layer_step=1,
                      intermediate_size_mlp=128), r"layer types \['chunked_attention'\]"),
    (lambda: _refused("qwen3_next", **SMALL, layer_types=["linear_attention", "full_attention"], num_experts=2,
                      num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32),
     r"layer types \['linear_attention'\]"),
    (lambda: _refused("gemma3_text", **SMALL, use_bidirectional_attention=True), "bidirectional attention"),
    (lambda: _refused("falcon", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True),
     "ALiBi"),
    (lambda: _refused("bloom", vocab_size=256, hidden_size=64, n_layer=2, n_head=4), "attention interface"),
], ids=["encoder-decoder", "chunked", "linear", "bidirectional", "alibi", "no-attention-interface"])
def test_unsupported_feature_is_refused_before_compute(build_model, feature):
    model = build_model()
    calls = []
    handle = model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(UnsupportedModel, match=feature) as err:
        CompressedCache(model, exact("snapkv"))
    assert model.config.model_type in str(err.value)
    with pytest.raises(UnsupportedModel, match=feature):
        kvcomp.generate(model, None, "some context", "?", exact("snapkv"))
    handle.remove()
    assert not calls  # nothing ran


def test_attention_that_differs_from_its_config_is_refused(family_models):
    """The backstop: what the model passes at call time must be what kvcomp read (here a window changed after
    the cache read the config), else UnsupportedModel, not a silent difference."""
    model, _ = family_models("qwen2")
    ids, mask = prompts(1)
    cache = CompressedCache(model, exact("snapkv"))
    sliding = [m for m in attention_modules(model).values() if m.sliding_window]
    sliding[0].sliding_window = WINDOW // 2
    try:
        with pytest.raises(UnsupportedModel, match="sliding_window 4 where the config gave 8"):
            generate(model, ids, mask, cache)
    finally:
        sliding[0].sliding_window = WINDOW
