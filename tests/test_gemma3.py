"""Real tier: the second embedded model, Gemma 3 270M (15 sliding-window layers with window 512, 3 full
attention layers, one KV head of dimension 256, no chat template)."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from kvcomp import CompressedCache, generate, load_model
from kvcomp.generation import split_prompt, stop_token_ids
from tests.methods import exact

pytestmark = pytest.mark.real

WINDOW = 512


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_reference():
    """A second instance left on transformers' own attention: the "without kvcomp" reference."""
    model, tokenizer = load_model("gemma3-270m")
    model.set_attn_implementation("sdpa")
    return model, tokenizer


def reference_ids(model, tokenizer, s) -> list[int]:
    """Plain transformers greedy generate on the token ids kvcomp uses for sample ``s`` (no kvcomp involved)."""
    parts = split_prompt(tokenizer, s.context, s.question, s.answer_prefix, s.chat_template)
    ids = torch.tensor([parts.context_ids + parts.question_ids])
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=s.max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    stops = stop_token_ids(model, tokenizer)
    return out[: next((i for i, t in enumerate(out) if t in stops), len(out))]


@pytest.fixture(scope="module")
def needle(gemma):
    from eval.runner import load_samples

    return load_samples("ruler/niah_single_1", gemma[1], length=2250, num_samples=1, seed=1).samples[0]


def test_gemma3_shape_and_plain_template(gemma, needle):
    model, tokenizer = gemma
    types = model.config.layer_types
    assert (len(types), types.count("sliding_attention"), model.config.sliding_window) == (18, 15, WINDOW)
    assert (model.config.num_key_value_heads, model.config.head_dim) == (1, 256)
    assert not tokenizer.chat_template and not needle.chat_template  # a base model gets the plain template
    parts = split_prompt(tokenizer, needle.context, needle.question, needle.answer_prefix, needle.chat_template)
    assert parts.template == "plain" and parts.context_ids[0] == tokenizer.bos_token_id
    assert 4 * WINDOW < len(parts.context_ids) + len(parts.question_ids) <= 2250


@pytest.mark.parametrize("query_aware", [False, True])
def test_ratio_zero_is_token_identical_at_four_windows(gemma, gemma_reference, needle, query_aware):
    model, tokenizer = gemma
    s = needle
    expected = [reference_ids(*gemma_reference, s)]
    base = generate(model, tokenizer, s.context, s.question, None, max_new_tokens=s.max_new_tokens,
                    answer_prefix=s.answer_prefix, query_aware=query_aware)
    assert base.token_ids == expected and base.extra["template"] == "plain"
    assert s.references[0] in base.text  # the model finds the needle uncompressed
    for name in ("snapkv", "quant"):  # one that compresses sliding layers, one whose sliding layers keep the window
        out = generate(model, tokenizer, s.context, s.question, exact(name), max_new_tokens=s.max_new_tokens,
                       answer_prefix=s.answer_prefix, query_aware=query_aware)
        assert out.token_ids == expected, name
        assert out.memory_factor == pytest.approx(1.0, abs=0.005), name  # against transformers' own cache


class _Watch(StoppingCriteria):
    """Records, after every decoding step, the most tokens any sliding layer stores."""

    def __init__(self, cache):
        self.cache, self.most = cache, []

    def __call__(self, input_ids, scores, **kwargs):
        self.most.append(max(int(layer.compressor.stored_tokens(layer.state).max())
                             for layer in self.cache.layers if layer.is_sliding))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_sliding_layers_hold_at_most_the_window_through_600_steps(gemma):
    from compressors.h2o import H2O

    model, tokenizer = gemma
    ids = tokenizer("The grass is green. The sky is blue. " * 40, return_tensors="pt")["input_ids"]
    cache = CompressedCache(model, H2O(compression_ratio=0.5))
    watch = _Watch(cache)
    with torch.inference_mode():
        model.generate(ids, cache=cache, max_new_tokens=600, min_new_tokens=600, do_sample=False,
                       stopping_criteria=StoppingCriteriaList([watch]))
    assert len(watch.most) == 600 and max(watch.most) <= WINDOW
    full = [layer for layer in cache.layers if not layer.is_sliding]
    assert len(full) == 3 and all(int(layer.seen.max()) == ids.shape[1] + 599 for layer in full)
