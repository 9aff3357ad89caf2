"""Quant (KIVI-style): packed storage, error bounds, residual flush, blockwise attention, composition."""

import pytest
import torch

import kvcomp
from compressors import quant as quant_module
from compressors.quant import Quant
from compressors.snapkv import SnapKV
from kvcomp import Compose, CompressedCache, CompressorError, LayerContext, generate
from kvcomp.compressor import SENTINEL
from kvcomp.generation import _left_pad, _positions, split_prompt
from kvcomp.kernels import quant_cpu, quant_ref
from kvcomp.metrics import fidelity
from kvcomp.models import tiny_config
from kvcomp.ops import AttentionSpec, dense_attention
from tests.helpers import CONTEXTS, QUESTIONS
from tests.test_compression import decode_steps, prefill

BITS = [2, 4, 8]


def random_ids(n, seed):
    return torch.randint(10, 40000, (1, n), generator=torch.Generator().manual_seed(seed))


# -- reference kernels ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
def test_round_trip_error_within_half_a_step(bits):
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 3, 4, 32, 16, generator=gen) * torch.linspace(0.1, 5, 16)  # [B, H, N, G, D]
    x[0, 0, 0] = 1.25  # a constant group: scale 0, reconstructed exactly
    packed, scale, zero = quant_ref.quantize_keys(x, bits)
    assert scale.shape == zero.shape == (2, 3, 4, 16)  # one per group of tokens and channel
    err = (quant_ref.dequantize_keys(packed, scale, zero, bits) - x).abs()
    assert bool((err <= scale.unsqueeze(-2) / 2 * (1 + 1e-5) + 1e-6).all())
    assert float(err[0, 0, 0].max()) == 0.0
    assert float((err / scale.unsqueeze(-2).clamp_min(1e-12)).max()) > 0.4  # it does round (bound is tight)

    packed, scale, zero = quant_ref.quantize_values(x, bits, channels=8)
    assert scale.shape == (2, 3, 4, 32, 2)  # one per token and group of 8 channels
    err = (quant_ref.dequantize_values(packed, scale, zero, bits) - x).abs()
    assert bool((err <= scale.repeat_interleave(8, -1) / 2 * (1 + 1e-5) + 1e-6).all())


def test_more_bits_less_error():
    x = torch.randn(1, 2, 3, 32, 16, generator=torch.Generator().manual_seed(0))
    errors = [
        float((quant_ref.dequantize_keys(*quant_ref.quantize_keys(x, b), b) - x).abs().mean()) for b in BITS
    ]
    assert errors[0] > 3 * errors[1] > 9 * errors[2]


@pytest.mark.parametrize("bits", BITS)
def test_pack_unpack_round_trip_and_size(bits):
    codes = torch.randint(
        0, 2**bits, (3, 5, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    packed = quant_ref.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 16 * bits // 8)
    assert packed.numel() * packed.element_size() == codes.numel() * bits // 8
    assert torch.equal(quant_ref.unpack(packed, bits), codes)


def test_pack_layout():
    assert quant_ref.pack(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert quant_ref.pack(torch.tensor([7, 12], dtype=torch.uint8), 4).tolist() == [7 | 12 << 4]


# -- storage and bytes ---------------------------------------------------------------------------------------
def quant_bytes(n, bits, group, residual, heads, d, itemsize, value_channels=None, n_sink=0):
    """Closed form for one layer and one sequence of n tokens."""
    c = value_channels or min(group, d)
    sinks = min(n_sink, n)
    n_groups = max(0, (n - sinks - residual) // group)
    quantized = n_groups * group
    full_precision = n - quantized  # the sinks and the window
    per_head = (
        2 * quantized * d * bits // 8  # packed key and value codes
        + 2 * n_groups * d * itemsize  # key scale + zero: per group and channel
        + 2 * quantized * (d // c) * itemsize  # value scale + zero: per token and channel group
        + quantized * 4  # int32 positions
        + full_precision * (2 * d * itemsize + 4)  # full-precision sinks and window: K, V, positions
    )
    return heads * per_head


@pytest.mark.parametrize(
    "bits,group,residual,n_sink,n",
    [(4, 32, 128, 4, 300), (2, 16, 20, 0, 101), (2, 16, 20, 4, 101), (8, 32, 0, 4, 64), (4, 32, 128, 4, 100),
     (4, 16, 0, 8, 5)],
)
def test_nbytes_is_the_formula_and_the_tensors(tiny, bits, group, residual, n_sink, n):
    model, _ = tiny
    compressor = Quant(bits=bits, group_size=group, residual=residual, n_sink=n_sink)
    cache, _ = prefill(model, random_ids(n, n), compressor)
    cfg = model.config
    expected = quant_bytes(n, bits, group, residual, cfg.num_key_value_heads, cfg.head_dim, 4, n_sink=n_sink)
    sinks = min(n_sink, n)
    quantized = max(0, (n - sinks - residual) // group) * group
    for layer in cache.layers:
        state = layer.state
        stored = sum(t.numel() * t.element_size() for t in state.tensors())
        assert layer.compressor.nbytes(state)["device"] == stored == expected
        assert state.key_codes.dtype == torch.uint8
        assert state.sink_tokens.tolist() == [[sinks] * 2]
        assert state.sinks.positions[0, 0].tolist() == list(range(sinks))  # the first tokens, in full precision
        assert state.quantized_tokens.tolist() == [[quantized] * 2]
        assert state.residual_tokens.tolist() == [[n - sinks - quantized] * 2]
    assert cache.resident_bytes()["device"] == expected * cfg.num_hidden_layers
    assert cache.memory_factor() == pytest.approx(cache.full_bytes() / (expected * cfg.num_hidden_layers))


def test_memory_factor_of_4_bits_matches_the_formula():
    # head_dim 64 (SmolLM2's): per token and head 100 bytes quantized vs 512 in float32 -> 5.12x.
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(head_dim=64, num_hidden_layers=1))
    cache, _ = prefill(model, random_ids(512, 3), Quant(bits=4, group_size=32, residual=0, n_sink=0))
    full = 512 * 2 * 2 * 64 * 4
    assert (
        cache.memory_factor()
        == pytest.approx(full / quant_bytes(512, 4, 32, 0, 2, 64, 4))
        == pytest.approx(5.12)
    )
    assert cache.memory_factor() > 5


def test_sinks_stay_exact_and_only_they(tiny):
    """The first n_sink tokens are stored bit for bit; with n_sink=0 they are quantized like the rest."""
    model, _ = tiny
    ids = random_ids(200, 5)
    full, _ = prefill(model, ids, Quant(bits=2, group_size=16, residual=400))  # everything in the window
    keys, values, positions = full.layers[0].compressor.materialize(full.layers[0].state)
    assert positions[0, 0].tolist() == list(range(200))
    for n_sink, exact in [(4, True), (0, False)]:
        cache, _ = prefill(model, ids, Quant(bits=2, group_size=16, residual=16, n_sink=n_sink))
        k, v, p = cache.layers[0].compressor.materialize(cache.layers[0].state)
        assert p[0, 0].tolist() == list(range(200))
        assert torch.equal(k[..., :4, :], keys[..., :4, :]) is exact
        assert torch.equal(v[..., :4, :], values[..., :4, :]) is exact
        assert not torch.equal(k[..., 4:20, :], keys[..., 4:20, :])  # the next tokens are quantized


# -- decoding ------------------------------------------------------------------------------------------------
def test_residual_flush_keeps_cache_quantized_for_300_steps(tiny):
    model, _ = tiny
    group, residual, n_prompt = 16, 32, 40
    cache, out = prefill(model, random_ids(n_prompt, 8), Quant(bits=4, group_size=group, residual=residual))
    quantized_before = int(cache.layers[0].state.quantized_tokens.min())
    last = quantized_before
    for step, c in enumerate(decode_steps(model, cache, out, 300)):
        seen = n_prompt + step + 1
        for layer in c.layers:
            state = layer.state
            assert int(state.residual_tokens.max()) < residual + group
            assert layer.compressor.stored_tokens(state).tolist() == [[seen, seen]]
        quantized = int(c.layers[0].state.quantized_tokens.min())
        assert quantized >= last and quantized % group == 0
        last = quantized
    assert last == (n_prompt + 300 - 4 - residual) // group * group > quantized_before  # 4 sinks stay
    _, _, positions = cache.layers[1].compressor.materialize(cache.layers[1].state)
    assert sorted(positions[0, 0].tolist()) == list(range(n_prompt + 300))  # every token once, in its group


def ctx_for(q_pos, hkv, g, scaling=0.25):
    b, n = q_pos.shape
    return LayerContext(
        layer=0,
        positions=torch.zeros(b, hkv, 0, dtype=torch.long),
        query_positions=q_pos,
        query_valid=torch.ones(b, n, dtype=torch.bool),
        seen=q_pos.amax(1) + 1,
        spec=AttentionSpec(scaling),
        n_groups=g,
    )


@pytest.mark.parametrize("bits", BITS)
def test_blockwise_attend_equals_dense_attention_on_materialized_cache(tiny, bits, monkeypatch):
    """Ragged left-padded batch (rows hold different numbers of groups), several blocks, several queries."""
    model, tokenizer = tiny
    monkeypatch.setattr(quant_module, "_DECODE_BLOCK", 32)
    parts = [split_prompt(tokenizer, c, q) for c, q in zip(CONTEXTS, QUESTIONS)]
    ids, mask = _left_pad([p.context_ids + p.question_ids for p in parts], tokenizer.pad_token_id)
    compressor = Quant(bits=bits, group_size=16, residual=16)
    cache = CompressedCache(model, compressor)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), cache=cache)
    state = cache.layers[0].state
    lengths = mask.sum(1)
    assert cache.kept_tokens()[0][:, 0].tolist() == lengths.tolist()  # padding is never stored
    assert len(set(state.quantized_tokens[:, 0].tolist())) == 3  # ragged groups
    q = torch.randn(3, 4, 3, 16, generator=torch.Generator().manual_seed(bits))
    q_pos = torch.stack([lengths - 5, lengths - 1, lengths + 2], dim=1)  # causal inside the stored tokens too
    out = compressor.attend(0, state, q, ctx_for(q_pos, 2, 2))
    keys, values, positions = compressor.materialize(state)
    expected, _ = dense_attention(q, keys, values, q_pos, positions, AttentionSpec(0.25))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    real = positions[positions < SENTINEL]
    assert sorted(real.tolist()) == sorted(p for n in lengths.tolist() for p in list(range(n)) * 2)


def test_decoding_dequantizes_one_block_at_a_time(tiny, monkeypatch):
    model, _ = tiny
    monkeypatch.setenv("KVCOMP_NATIVE", "0")  # the torch path (the C kernel holds one token at a time)
    monkeypatch.setattr(quant_module, "_DECODE_BLOCK", 32)
    cache, out = prefill(model, random_ids(200, 12), Quant(bits=4, group_size=16, residual=16))
    blocks = []
    unpack_planes = quant_cpu.unpack_planes

    def spy(packed, bits, out):
        blocks.append(out[..., 0].numel())  # tokens (x batch x heads) dequantized by this call
        return unpack_planes(packed, bits, out)

    def no_materialize(self, state):
        raise AssertionError("decoding materialized the whole cache")

    monkeypatch.setattr(quant_cpu, "unpack_planes", spy)
    monkeypatch.setattr(Quant, "materialize", no_materialize)
    for _ in decode_steps(model, cache, out, 3):
        pass
    heads = model.config.num_key_value_heads
    # steps x layers x (keys, values) x blocks
    assert max(blocks) == 32 * heads and len(blocks) == 3 * 2 * 2 * (176 // 32 + 1)


def test_8_bits_stays_close_to_uncompressed(tiny):
    model, tokenizer = tiny
    ids = random_ids(200, 9)
    with torch.inference_mode():
        full = model(input_ids=ids).logits[0, -1]
    errors = {}
    for bits in BITS:
        cache, _ = prefill(model, ids[:, :-1], Quant(bits=bits, group_size=32, residual=32))
        with torch.inference_mode():
            logits = model(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits[0, -1]
        errors[bits] = float((logits - full).abs().max() / full.abs().max())
    assert errors[8] < 0.02 and errors[8] < errors[4] < errors[2]
    reference = generate(model, tokenizer, CONTEXTS[0], QUESTIONS[0], max_new_tokens=16)
    result = generate(
        model,
        tokenizer,
        CONTEXTS[0],
        QUESTIONS[0],
        compressor=Quant(bits=8, group_size=16, residual=16),
        max_new_tokens=16,
    )
    assert fidelity(result.token_ids[0], reference.token_ids[0]).agreement >= 0.75
    assert result.memory_factor > 1.5


# -- composition and batches ---------------------------------------------------------------------------------
def test_compose_with_snapkv_multiplies_memory_factor(tiny):
    model, tokenizer = tiny
    ids = random_ids(128, 10)
    quant = Quant(bits=4, group_size=32, residual=0, n_sink=0)  # whole groups only: the factor doubles exactly
    alone, _ = prefill(model, ids, quant)
    composed, _ = prefill(model, ids, Compose(SnapKV(compression_ratio=0.5), quant))
    assert all(k.tolist() == [[64, 64]] for k in composed.kept_tokens())
    assert composed.memory_factor() == pytest.approx(2 * alone.memory_factor())
    # Through both generate paths, with a residual window and flushes while decoding.
    compressor = Compose(SnapKV(compression_ratio=0.5), Quant(bits=4, group_size=16, residual=16, n_sink=0))
    cache = CompressedCache(model, compressor)
    prompt = tokenizer(CONTEXTS[0] + QUESTIONS[0], return_tensors="pt")["input_ids"]
    out = model.generate(prompt, cache=cache, max_new_tokens=20, do_sample=False, pad_token_id=2)
    assert out.shape[1] == prompt.shape[1] + 20
    kept = prompt.shape[1] // 2 + 19  # prefill keeps half, then one more per step
    assert cache.kept_tokens()[0].tolist() == [[kept, kept]]
    assert cache.memory_factor() > 2 * 2.0
    result = generate(
        model, tokenizer, CONTEXTS[0], QUESTIONS[0], compressor=compressor, query_aware=True, max_new_tokens=8
    )
    assert result.memory_factor > 3.0 and len(result.token_ids[0]) > 0


@pytest.mark.parametrize("composed", [False, True])
@pytest.mark.parametrize("query_aware", [False, True])
def test_batch_equals_each_prompt_alone(tiny64, composed, query_aware):
    model, tokenizer = tiny64
    compressor = Quant(bits=4, group_size=16, residual=16)
    if composed:
        compressor = Compose(SnapKV(compression_ratio=0.5), compressor)
    batched = generate(
        model,
        tokenizer,
        CONTEXTS,
        QUESTIONS,
        compressor=compressor,
        max_new_tokens=12,
        query_aware=query_aware,
    )
    for i, (c, q) in enumerate(zip(CONTEXTS, QUESTIONS)):
        alone = generate(
            model, tokenizer, c, q, compressor=compressor, max_new_tokens=12, query_aware=query_aware
        )
        assert batched.token_ids[i] == alone.token_ids[0], f"row {i} differs"


def test_registered_by_name(tiny):
    kvcomp.register("quant", Quant)
    model, tokenizer = tiny
    result = generate(
        model,
        tokenizer,
        CONTEXTS[2],
        QUESTIONS[2],
        compressor="quant",
        bits=2,
        group_size=16,
        residual=0,
        max_new_tokens=4,
    )
    assert result.compressor == "quant" and result.extra["params"]["bits"] == 2
    assert result.memory_factor > 2  # 59 tokens: 48 in 2-bit groups, 11 in full precision


# -- errors --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 3, 16, 4.0, "4", True])
def test_bad_bits_is_a_clear_error(bits):
    with pytest.raises(CompressorError, match="bits must be one of 2, 4, 8"):
        Quant(bits=bits)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"group_size": 0}, "group_size must be a positive"),
        ({"group_size": -4}, "group_size must be a positive"),
        ({"residual": -1}, "residual must be a non-negative"),
        ({"n_sink": -1}, "n_sink must be a non-negative"),
        ({"n_sink": 2.0}, "n_sink must be a non-negative"),
    ],
)
def test_bad_group_or_residual_is_a_clear_error(kwargs, match):
    with pytest.raises(CompressorError, match=match):
        Quant(**kwargs)


def test_head_dim_not_divisible_by_value_group_is_a_clear_error(tiny):
    model, _ = tiny
    with pytest.raises(CompressorError, match="multiple of the value group"):
        prefill(model, random_ids(20, 11), Quant(group_size=12))
