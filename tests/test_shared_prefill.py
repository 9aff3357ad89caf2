"""One prefill shared by many compressors gives exactly what a prefill per compressor gives."""

import pytest
import torch
from helpers import CONTEXTS, QUESTIONS, SELECTION_METHODS

import compressors.h2o
from compressors.h2o import H2O
from compressors.quant import Quant
from kvcomp.compressor import Compose
from kvcomp.generation import generate_ids, split_prompt
from kvcomp.shared_prefill import continue_from, prefill


def _compressors():
    # Two H2O budgets: the second reuses the first's accumulated attention (SharedWork) and must still match.
    return [None, *(m(compression_ratio=0.5) for m in SELECTION_METHODS), H2O(compression_ratio=0.75),
            Quant(bits=4, group_size=8, residual=8),
            Compose(SELECTION_METHODS[-1](compression_ratio=0.5), Quant(bits=2, group_size=8, residual=8))]


@pytest.mark.parametrize("query_aware", [False, True])
@pytest.mark.parametrize("rows", [[0], [0, 1, 2]])
def test_shared_prefill_equals_one_prefill_per_compressor(tiny64, query_aware, rows):
    model, tokenizer = tiny64
    parts = [split_prompt(tokenizer, CONTEXTS[i], QUESTIONS[i]) for i in rows]
    pre = prefill(model, parts, query_aware)
    # Several compressors in a row from the same records: none may disturb what the next one sees.
    for compressor in _compressors():
        shared, shared_stats = continue_from(model, pre, compressor, max_new_tokens=12)
        alone, alone_stats = generate_ids(model, parts, compressor, max_new_tokens=12, query_aware=query_aware)
        assert shared == alone, compressor
        if compressor is not None:
            for a, b in zip(shared_stats["cache"].kept_tokens(), alone_stats["cache"].kept_tokens()):
                assert torch.equal(a, b)
            assert shared_stats["cache"].resident_bytes() == alone_stats["cache"].resident_bytes()
            assert shared_stats["compress_seconds"] > 0


def test_h2o_budgets_share_one_accumulated_attention_per_layer(tiny64, monkeypatch):
    model, tokenizer = tiny64
    calls = []
    original = compressors.h2o.received_attention

    def counting(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(compressors.h2o, "received_attention", counting)
    pre = prefill(model, [split_prompt(tokenizer, CONTEXTS[0], QUESTIONS[0])], query_aware=False)
    layers = model.config.num_hidden_layers
    for ratio in (0.5, 0.75, 0.9):
        continue_from(model, pre, H2O(compression_ratio=ratio), max_new_tokens=4)
    assert len(calls) == layers
    # What the reuse saved is counted into the later compressors' prefill cost, once per reuse.
    assert all(w._values and w.saved_seconds > 0 for w in pre.shared.values())
    # A prefill of its own (no SharedWork) takes it from its attention pass (ctx.received): no separate pass.
    parts = [split_prompt(tokenizer, CONTEXTS[0], QUESTIONS[0])]
    generate_ids(model, parts, H2O(compression_ratio=0.5), max_new_tokens=4)
    assert len(calls) == layers


def test_prefill_rejects_empty_prompts(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="Nothing to prefill"):
        prefill(model, [split_prompt(tokenizer, "", "", chat_template=False)])


@pytest.mark.parametrize("method", ["freekv", "specache"])
def test_shared_prefill_equals_own_prefill_for_retrieval(tiny64, method):
    # Retrieval methods offload the full KV in their prefill hook; from the records they must offload and
    # select the same tokens (the retrieval benchmark shares one prefill between them).
    from compressors.freekv import FreeKV
    from compressors.specache import SpeCache

    model, tokenizer = tiny64
    parts = [split_prompt(tokenizer, CONTEXTS[0], QUESTIONS[0])]
    pre = prefill(model, parts, False)
    cls = {"freekv": FreeKV, "specache": SpeCache}[method]
    extra = {"page_size": 4} if method == "freekv" else {}

    def make():
        return cls(budget_fraction=None, top_k=4, n_sink=2, window=8, tier="ram", **extra)

    shared, shared_stats = continue_from(model, pre, make(), max_new_tokens=12)
    alone, alone_stats = generate_ids(model, parts, make(), max_new_tokens=12, query_aware=False)
    assert shared == alone
    assert shared_stats["cache"].resident_bytes() == alone_stats["cache"].resident_bytes()
