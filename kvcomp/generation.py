"""Prefill-compress-decode with an explicit context/question split.

The chat template renders ``context + question`` (concatenated as given) as the user turn, followed by the
assistant header and an optional ``answer_prefix``. A model without a chat template (a base model such as
Gemma 3 270M), or ``chat_template=False``, gets the plain template: the tokenizer's own leading special tokens
(BOS), then ``context + question + answer_prefix``; which template was used is recorded
(:func:`prompt_template`). The rendered prompt is split right after the context:

* query-agnostic (default): the context part is prefilled and compressed before the question is seen; the
  question part is then appended to the compressed cache (the realistic setting for a reused context);
* query-aware: the whole prompt is prefilled and compressed at once, so methods like SnapKV observe the
  question. ``question_length`` (the tokens after the context) is passed to the compressor.

Both parts are tokenized separately (``add_special_tokens=False``; the template already holds them), and the
uncompressed reference uses the same token ids, so differences come from compression only.
Batches are left-padded per part; padding is never stored and never attended.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from kvcomp import metrics, steps, validation
from kvcomp.attention import check_supported, install
from kvcomp.cache import CompressedCache
from kvcomp.compressor import Compressor
from kvcomp.lossless import Lossless, Sampling, lossless_decode
from kvcomp.registry import name_of


@dataclass
class GenerationResult:
    texts: list[str]
    token_ids: list[list[int]]  # generated ids per row, cut after the first stop token (excluded)
    prompt_tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    resident_bytes: dict[str, int]  # at the end of generation, per tier
    full_bytes: int  # what an uncompressed cache in the same dtype would hold
    kept_tokens_per_layer: list[float]  # mean over rows and KV heads, at the end of generation
    query_aware: bool
    compressor: str
    dtype: str
    extra: dict[str, Any] = field(default_factory=dict)
    # Lossless decoding's statistics (kvcomp.lossless.LosslessStats.as_dict()), None otherwise.
    lossless: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return self.texts[0]

    @property
    def memory_factor(self) -> float:
        return metrics.fast_tier_factor(self.full_bytes, self.resident_bytes)


@dataclass
class PromptParts:
    context_ids: list[int]
    question_ids: list[int]
    template: str = "chat"  # "chat" (the tokenizer's chat template) or "plain" (see prompt_template)


def prompt_template(tokenizer, chat_template: bool = True) -> str:
    """``"chat"`` when ``chat_template`` is asked for and the tokenizer has one, else ``"plain"``."""
    return "chat" if chat_template and getattr(tokenizer, "chat_template", None) else "plain"


def leading_special_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text by default (BOS for Llama and Gemma; none for
    SmolLM2): the plain template starts with them, as the model saw in training."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    n = len(with_special) - len(plain)
    return list(with_special[:n]) if n > 0 and with_special[n:n + len(plain)] == plain else []


def template_overhead(tokenizer, chat_template: bool = True) -> int:
    """Tokens the template adds around an empty user message (chat) or before the text (plain)."""
    if prompt_template(tokenizer, chat_template) == "plain":
        return len(leading_special_ids(tokenizer))
    text = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


def split_prompt(tokenizer, context: str, question: str, answer_prefix: str = "", chat_template: bool = True,
                 system_prompt: str | None = None) -> PromptParts:
    """Render the prompt and tokenize its context part and its question part separately."""
    template = prompt_template(tokenizer, chat_template)
    prefix: list[int] = []
    if template == "chat":
        messages = [{"role": "user", "content": context + question}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The assistant turn starts right after its header: a raw-text prefix's leading space does not belong.
        answer_prefix = answer_prefix.lstrip()
    else:
        if system_prompt is not None:
            raise ValueError("system_prompt needs a chat template; this tokenizer has none (or chat_template=False).")
        rendered = context + question
        prefix = leading_special_ids(tokenizer)
    rendered += answer_prefix
    cut = rendered.find(context + question)
    if cut < 0:
        raise ValueError("The chat template changed the user text; pass chat_template=False to use the raw text.")
    cut += len(context)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    return PromptParts(prefix + encode(rendered[:cut]), encode(rendered[cut:]), template)


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
    return ids, mask


def stop_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    for e in (eos if isinstance(eos, list) else [eos]):
        if e is not None:
            ids.add(int(e))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _positions(mask: torch.Tensor) -> torch.Tensor:
    # Same convention as transformers' generate (and kvcomp.steps.Rows): real tokens numbered 0.. per row,
    # padding given 1.
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


@torch.inference_mode()
def generate_ids(model, parts: list[PromptParts], compressor: Compressor | None, max_new_tokens: int = 32,
                 query_aware: bool = False, pad_id: int = 0, stop_ids: set[int] | None = None,
                 lossless: Lossless | None = None, sampling: Sampling | None = None,
                 ) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy decoding of a batch of split prompts; returns generated ids per row and statistics.

    ``lossless``: draft with ``compressor`` and verify with the full KV (:mod:`kvcomp.lossless`); only then
    can ``sampling`` be given (its output distribution is that of uncompressed sampling)."""
    install(model)
    device = model.device
    stop_ids = stop_ids or set()
    if query_aware:
        blocks = [[p.context_ids + p.question_ids for p in parts]]
        question_length = [len(p.question_ids) for p in parts] if any(p.question_ids for p in parts) else None
    else:
        blocks = [[p.context_ids for p in parts], [p.question_ids for p in parts]]
        blocks = [b for b in blocks if any(b)]
        question_length = None
    if lossless is not None:
        padded = [_left_pad(rows, pad_id) for rows in blocks]
        return lossless_decode(model, padded, compressor, lossless, max_new_tokens, stop_ids, sampling,
                               question_length)
    if sampling is not None:
        raise ValueError("Sampling is only implemented with lossless=True (speculative sampling).")
    if compressor is None:
        cache = DynamicCache(config=model.config)  # transformers' own cache: sliding layers hold their window
    else:
        cache = CompressedCache(model, compressor, question_length=question_length)

    rows = steps.Rows(len(parts), device, capacity=sum(max(len(r) for r in b) for b in blocks) + max_new_tokens)
    t0 = time.perf_counter()
    for block in blocks:
        ids, block_mask = _left_pad(block, pad_id)
        logits = steps.prefill(model, cache, ids, rows, block_mask)
    prefill_seconds = time.perf_counter() - t0
    prefill_kept = cache.kept_tokens() if isinstance(cache, CompressedCache) else None
    out, decode_seconds, n_steps = steps.greedy_decode(model, cache, logits, rows, max_new_tokens, stop_ids)
    stats = dict(prefill_seconds=prefill_seconds, decode_seconds=decode_seconds, cache=cache,
                 prefill_kept=prefill_kept, generated_steps=n_steps)
    return out, stats


def decode_greedy(model, cache, logits: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
                  stop_ids: set[int]) -> tuple[list[list[int]], float, int]:
    """Greedy decoding from the prompt's last logits ``[B, V]`` and attention mask ``[B, T]`` over ``cache``
    (:func:`kvcomp.steps.greedy_decode` with the rows rebuilt from the mask).

    Returns the generated ids per row cut before the first stop token, the seconds spent and the steps run.
    """
    return steps.greedy_decode(model, cache, logits, steps.Rows.from_mask(mask), max_new_tokens, stop_ids)


def cache_stats(cache) -> tuple[dict[str, int], int, list[float]]:
    """Resident bytes per tier, uncompressed bytes, and mean kept tokens per layer."""
    if isinstance(cache, CompressedCache):
        kept = [float(k.float().mean()) for k in cache.kept_tokens()]
        return cache.resident_bytes(), cache.full_bytes(), kept
    resident = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)
    kept = [float(layer.keys.shape[-2]) for layer in cache.layers if layer.is_initialized]
    return {"device": resident, "host": 0, "disk": 0}, resident, kept


def add_full_kv_bytes(resident: dict[str, int], stats) -> dict[str, int]:
    """Lossless decoding keeps the full KV too: add its bytes to the tier that holds it."""
    total = dict(resident)
    for tier, n in stats.full_kv_bytes.items():
        total[tier] = total.get(tier, 0) + n
    return total


def resolve_compressor(compressor: Compressor | str | None, **params) -> Compressor | None:
    if compressor is None or compressor == "none":
        return None
    if isinstance(compressor, str):
        from kvcomp.registry import create

        return create(compressor, **params)
    return compressor


def generate(model, tokenizer, context: str | list[str], question: str | list[str] = "",
             compressor: Compressor | str | None = None, max_new_tokens: int = 32, query_aware: bool = False,
             answer_prefix: str = "", chat_template: bool = True, system_prompt: str | None = None,
             lossless: bool | Lossless = False, gamma: int | None = None, do_sample: bool = False,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             **compressor_params) -> GenerationResult:
    """Generate an answer to ``question`` about ``context`` with a compressed KV cache (greedy).

    ``compressor``: a Compressor, a registered name (its hyper-parameters as keyword arguments), or None for
    the uncompressed baseline. Lists of contexts/questions run as one left-padded batch.
    ``lossless``: True (or a :class:`kvcomp.lossless.Lossless`) drafts ``gamma`` tokens per round with the
    compressed cache and verifies them with the full KV: the output is exactly the uncompressed one (greedy),
    or distributed exactly as uncompressed sampling with ``do_sample`` (``temperature``, ``top_k``, ``top_p``,
    ``seed``). Statistics land in ``GenerationResult.lossless``.

    ``context`` may also be a :class:`kvcomp.contexts.LoadedContext` (:func:`kvcomp.load_context`): the stored,
    already compressed context is continued with ``question`` (no prefill of the context), token-identical to
    passing the context's text with the compressor it was saved with.
    """
    if not isinstance(context, (str, list, tuple)):
        from kvcomp.contexts import generate_from_context

        return generate_from_context(
            model, tokenizer, context, question, compressor=compressor, max_new_tokens=max_new_tokens,
            query_aware=query_aware, answer_prefix=answer_prefix, lossless=lossless, gamma=gamma,
            do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            chat_template=chat_template, system_prompt=system_prompt, **compressor_params)
    check_supported(model)  # an unsupported model family is refused before anything else
    validation.positive_int("max_new_tokens", max_new_tokens, owner="generate", error=validation.UsageError)
    compressor = resolve_compressor(compressor, **compressor_params)
    config = lossless_config(lossless, gamma)
    if config is None and (do_sample or gamma is not None):
        raise ValueError("gamma and do_sample are lossless-decoding options: pass lossless=True as well.")
    sampling = Sampling(temperature, top_k, top_p, seed) if do_sample else None
    if not do_sample:
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        validation.warn_ignored_sampling("generate", **{k: v for k, v in given.items() if v not in (1.0, 0)})
    contexts = [context] if isinstance(context, str) else list(context)
    questions = [question] * len(contexts) if isinstance(question, str) else list(question)
    if len(questions) != len(contexts):
        raise ValueError(f"{len(contexts)} contexts but {len(questions)} questions: pass one question per context.")
    parts = [split_prompt(tokenizer, c, q, answer_prefix, chat_template, system_prompt)
             for c, q in zip(contexts, questions)]
    validation.check_prompts(model, [len(p.context_ids) + len(p.question_ids) for p in parts], max_new_tokens)
    if compressor is not None:
        compressor.check(len(parts))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows, stats = generate_ids(model, parts, compressor, max_new_tokens, query_aware, pad_id,
                               stop_token_ids(model, tokenizer), config, sampling)
    return make_result(model, tokenizer, compressor, rows, stats,
                       [len(p.context_ids) + len(p.question_ids) for p in parts], query_aware, parts[0].template)


def make_result(model, tokenizer, compressor: Compressor | None, rows: list[list[int]], stats: dict[str, Any],
                prompt_tokens: list[int], query_aware: bool, template: str) -> GenerationResult:
    """The :class:`GenerationResult` of a decode (``rows`` and ``stats`` as :func:`generate_ids` returns them)."""
    resident, full, kept = cache_stats(stats["cache"])
    if "lossless" in stats:
        resident = add_full_kv_bytes(resident, stats["lossless"])
    name = "none" if compressor is None else name_of(compressor)
    extra = {"params": {} if compressor is None else compressor.params(), "steps": stats["generated_steps"],
             "template": template}
    extra.update({k: stats[k] for k in ("context_key", "load_seconds", "build_seconds") if k in stats})
    return GenerationResult(
        texts=[tokenizer.decode(r, skip_special_tokens=True) for r in rows],
        token_ids=rows,
        prompt_tokens=prompt_tokens,
        prefill_seconds=stats["prefill_seconds"],
        decode_seconds=stats["decode_seconds"],
        resident_bytes=resident,
        full_bytes=full,
        kept_tokens_per_layer=kept,
        query_aware=query_aware,
        compressor=name,
        dtype=str(model.dtype).removeprefix("torch."),
        extra=extra,
        lossless=stats["lossless"].as_dict() if "lossless" in stats else None,
    )


def lossless_config(lossless: bool | Lossless | None, gamma: int | None = None) -> Lossless | None:
    """``True`` -> the default :class:`Lossless` (with ``gamma`` when given); a Lossless as is; else None."""
    if isinstance(lossless, Lossless):
        return lossless if gamma is None else dataclasses.replace(lossless, gamma=gamma)
    if lossless:
        return Lossless() if gamma is None else Lossless(gamma=gamma, max_gamma=max(gamma, Lossless.max_gamma))
    return None
