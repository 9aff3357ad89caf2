"""kvcomp.steps: positions, stop handling, and generation through the step API giving the tokens the model calls
it replaced gave (the loop below is the one generation.py ran before the step API existed)."""

import pytest
import torch
from transformers import DynamicCache

from compressors.h2o import H2O
from compressors.quant import Quant
from compressors.snapkv import SnapKV
from kvcomp import steps
from kvcomp.cache import CompressedCache
from kvcomp.generation import _left_pad, generate_ids, split_prompt
from kvcomp.lossless import Lossless
from tests.helpers import CONTEXTS, QUESTIONS


def _old_positions(mask):
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


@torch.inference_mode()
def old_generate(model, parts, compressor, max_new_tokens, stop_ids, query_aware=False):
    """generate_ids as it was: one model call per block and per step, the whole mask passed every time."""
    if query_aware:
        blocks = [[p.context_ids + p.question_ids for p in parts]]
    else:
        blocks = [b for b in ([p.context_ids for p in parts], [p.question_ids for p in parts]) if any(b)]
    cache = DynamicCache(config=model.config) if compressor is None else CompressedCache(model, compressor)
    mask = torch.zeros(len(parts), 0, dtype=torch.long)
    for rows in blocks:
        ids, block_mask = _left_pad(rows, 0)
        mask = torch.cat([mask, block_mask], dim=1)
        out = model(input_ids=ids, attention_mask=mask, position_ids=_old_positions(mask)[:, -ids.shape[1]:],
                    cache=cache, use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1]
    generated = torch.zeros(len(parts), 0, dtype=torch.long)
    done = torch.zeros(len(parts), dtype=torch.bool)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long)
    for step in range(max_new_tokens):
        next_ids = logits.argmax(-1)
        generated = torch.cat([generated, next_ids[:, None]], dim=1)
        done |= torch.isin(next_ids, stop)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones(len(parts), 1, dtype=mask.dtype)], dim=1)
        out = model(input_ids=next_ids[:, None], attention_mask=mask, position_ids=_old_positions(mask)[:, -1:],
                    cache=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]
    rows = []
    for row in generated.tolist():
        cut = next((i for i, t in enumerate(row) if t in stop_ids), len(row))
        rows.append(row[:cut])
    return rows


def test_rows_number_each_rows_real_tokens_and_give_padding_position_one():
    rows = steps.Rows(2, "cpu")
    first = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    positions, padded = rows.add_block(first)
    assert padded and positions.tolist() == [[1, 1, 0, 1], [0, 1, 2, 3]]
    second = torch.tensor([[1, 1, 1], [0, 1, 1]])
    positions, _ = rows.add_block(second)
    assert positions.tolist() == [[2, 3, 4], [1, 4, 5]]
    assert rows.add_tokens(2).tolist() == [[5, 6], [6, 7]]
    assert rows.next.tolist() == [7, 8]
    expected = torch.cat([first, second, torch.ones(2, 2, dtype=torch.long)], dim=1)
    assert torch.equal(rows.mask, expected)
    # The same positions as transformers' convention over the whole mask, block by block.
    assert torch.equal(_old_positions(expected)[:, 4:7], torch.tensor([[2, 3, 4], [1, 4, 5]]))
    grown = steps.Rows(1, "cpu")  # no capacity: the mask buffer grows as needed
    for _ in range(300):
        grown.add_tokens(1)
    assert grown.mask.shape == (1, 300) and bool(grown.mask.all()) and not grown.padded


def test_model_mask_only_when_something_must_be_masked(tiny):
    model, _ = tiny
    rows = steps.Rows(1, "cpu")
    rows.add_block(torch.ones(1, 3, dtype=torch.long))
    assert rows.model_mask(DynamicCache(), False) is None and rows.model_mask(CompressedCache(model, SnapKV()), False) is None
    rows.add_block(torch.tensor([[0, 1]]))
    assert rows.padded
    assert rows.model_mask(DynamicCache(), False) is not None  # transformers' cache masks stored padding
    assert rows.model_mask(CompressedCache(model, SnapKV()), False) is None  # kvcomp never stores padding
    assert rows.model_mask(CompressedCache(model, SnapKV()), True) is not None  # the new block's padding


def test_cut_at_stop_is_one_rule():
    row = [5, 6, 2, 7, 2]
    assert steps.cut_at_stop(row, {2}) == [5, 6]
    assert steps.cut_at_stop(row, {2}, keep_stop=True) == [5, 6, 2]
    assert steps.cut_at_stop(row, {2}, limit=2) == [5, 6]
    assert steps.cut_at_stop(row, {9}, limit=4) == [5, 6, 2, 7]
    assert steps.cut_at_stop(row, set(), keep_stop=True, limit=3) == [5, 6, 2]


COMPRESSORS = [None, SnapKV(compression_ratio=0.5, window=4), H2O(compression_ratio=0.5),
               Quant(bits=4, group_size=8, residual=8, n_sink=2)]


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=lambda c: "none" if c is None else type(c).__name__)
@pytest.mark.parametrize("query_aware", [False, True])
def test_step_api_generates_the_tokens_of_direct_model_calls(tiny64, compressor, query_aware):
    model, tokenizer = tiny64
    parts = [split_prompt(tokenizer, c, q) for c, q in zip(CONTEXTS, QUESTIONS)]  # a left-padded batch of 3
    stop_ids = {int(tokenizer.eos_token_id)}
    expected = old_generate(model, parts, compressor, 10, stop_ids, query_aware)
    got, stats = generate_ids(model, parts, compressor, 10, query_aware, 0, stop_ids)
    assert got == expected
    assert stats["generated_steps"] == max(len(r) for r in expected) or stats["generated_steps"] == 10


def test_step_api_drives_lossless_decoding_to_the_same_tokens(tiny64):
    model, tokenizer = tiny64
    parts = [split_prompt(tokenizer, c, q) for c, q in zip(CONTEXTS[:2], QUESTIONS[:2])]
    expected = old_generate(model, parts, None, 12, set())
    got, stats = generate_ids(model, parts, Quant(bits=2, group_size=8, residual=8), 12, lossless=Lossless(gamma=3))
    assert got == expected and stats["lossless"].verify_passes >= 1


def test_native_linears_run_decode_steps_only_and_give_torchs_logits(tiny, monkeypatch):
    """Inside native_linears a one-token step's linear layers go through the native kernel (counted), a prefill's
    stay torch's; the logits equal torch's to float rounding; the modules' own forward is back afterwards."""
    from kvcomp.kernels import cpu_native

    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    model, _ = tiny
    kernel, calls = cpu_native.linear, []
    monkeypatch.setattr(cpu_native, "linear", lambda *a: calls.append(1) or kernel(*a))
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]

    def run():
        rows = steps.Rows(1, "cpu")
        cache = CompressedCache(model, SnapKV(compression_ratio=0.5, window=4))
        with torch.inference_mode():
            first = steps.prefill(model, cache, ids, rows)
            return first, steps.decode_one(model, cache, first.argmax(-1)[:, None], rows)

    plain_first, plain_next = run()
    assert calls == []
    with steps.native_linears(model):
        native_first, native_next = run()
    # one decode step: every linear layer once; the prefill's only one-row call is the output layer on the one
    # position it keeps
    assert len(calls) == len(linears) + 1
    torch.testing.assert_close(native_first, plain_first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native_next, plain_next, rtol=1e-5, atol=1e-5)
    assert not any("forward" in vars(m) for m in linears)
