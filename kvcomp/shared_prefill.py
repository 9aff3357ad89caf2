"""One prefill, many compressors.

kvcomp runs every prefill attention on the full KV and hands a compressor the layer's ``q``/``k``/``v`` only
afterwards (:meth:`kvcomp.cache.CompressedLayer.forward`), so the prefill of a prompt is the same whatever the
compressor: only the state each builds from it differs. A sweep over N compressors therefore needs one
prefill per prompt, not N. :func:`prefill` runs it once and records each layer's ``q``/``k``/``v`` and
:class:`~kvcomp.compressor.LayerContext`; :func:`continue_from` builds one compressor's cache from the records
(calling its ``prefill`` hook exactly as the normal path does), feeds the question in query-agnostic mode and
decodes greedily. The output is token-identical to :func:`kvcomp.generation.generate_ids` (tested for every
compressor), because the compressor sees the same tensors. What a compressor derives from a layer's records
alone (H2O's accumulated attention, the same for every budget) goes through ``ctx.shared``
(:class:`~kvcomp.compressor.SharedWork`, one per layer), so a sweep computes it once. (The recorder runs plain
dense attention, so H2O's statistic is a separate pass here; H2O's own prefill takes it from its attention
pass, ``Capabilities.prefill_received``, and costs less than the ``prefill_seconds`` reported from here.)

Cost: the records hold every layer's ``q``, ``k`` and ``v`` of the prefilled block at once,
``layers x tokens x (H_q + 2 H_kv) x D x dtype bytes`` (about 470 MB for the embedded model at 4K tokens in
float32). Compressors must not modify the tensors they are given in place (none of kvcomp's do; the
equality test would catch one that did).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import DynamicCache

from kvcomp import host, steps
from kvcomp.attention import install
from kvcomp.cache import CompressedCache
from kvcomp.compressor import Capabilities, Compressor, SharedWork
from kvcomp.generation import PromptParts, _left_pad


@dataclass
class _Recorder(Compressor):
    """Keeps what each layer's prefill hook receives; its state is the full K/V (nothing is compressed)."""

    capabilities: ClassVar[Capabilities] = Capabilities(lossy=False)
    sliding_layers: ClassVar[str] = "compress"  # records every layer, sliding ones included

    def __post_init__(self) -> None:
        self.records: dict[int, tuple] = {}

    def prefill(self, layer, q, k, v, ctx):
        self.records[layer] = (q, k, v, ctx)
        return k, v, ctx.positions

    def materialize(self, state):
        return state

    def nbytes(self, state) -> dict[str, int]:
        k, v, positions = state
        return {"device": k.nbytes + v.nbytes + positions.nbytes, "host": 0, "disk": 0}


@dataclass
class Prefilled:
    """A prompt batch prefilled once: per-layer records and what decoding continues from."""

    recorder: _Recorder
    cache: CompressedCache  # the recording cache; its layers hold the per-row counters after the prefill
    logits: torch.Tensor  # [B, V] logits after the prefilled block
    mask: torch.Tensor  # [B, T] attention mask of the prefilled block
    rest: list[list[int]] | None  # query-agnostic: the question rows, fed after compression
    query_aware: bool
    seconds: float
    prompt_tokens: list[int]
    shared: dict[int, SharedWork] = field(default_factory=dict)  # per layer, what compressors computed once
    token_rows: list[list[int]] = field(default_factory=list)  # the prefilled ids per row (unpadded)
    peak_rise_mb: float | None = None  # the prefill's peak rise of process memory, where the caller measured it


@torch.inference_mode()
def prefill(model, parts: list[PromptParts], query_aware: bool = False, pad_id: int = 0) -> Prefilled:
    """Prefill the context (query-agnostic) or the whole prompt (query-aware) once, on the full KV."""
    install(model)
    if query_aware:
        rows = [p.context_ids + p.question_ids for p in parts]
        question_length = [len(p.question_ids) for p in parts] if any(p.question_ids for p in parts) else None
        rest = None
    else:
        rows = [p.context_ids for p in parts]
        question_length = None
        rest = [p.question_ids for p in parts] if any(p.question_ids for p in parts) else None
    if not any(rows):
        raise ValueError("Nothing to prefill: every prompt is empty.")
    recorder = _Recorder()
    cache = CompressedCache(model, recorder, question_length=question_length)
    ids, mask = _left_pad(rows, pad_id)
    positions = steps.Rows(len(rows), model.device)
    t0 = time.perf_counter()
    logits = steps.prefill(model, cache, ids, positions, mask)
    seconds = time.perf_counter() - t0
    return Prefilled(recorder, cache, logits, positions.mask, rest, query_aware, seconds,
                     [len(p.context_ids) + len(p.question_ids) for p in parts], token_rows=[list(r) for r in rows])


def _build_cache(model, pre: Prefilled, compressor: Compressor | None):
    if compressor is None:
        cache = DynamicCache(config=model.config)
        for layer, (_, k, v, _) in sorted(pre.recorder.records.items()):
            cache.update(k, v, layer)
        return cache
    compressor.check(pre.logits.shape[0])
    cache = CompressedCache(model, compressor, question_length=pre.cache.question_length)
    for layer, source in zip(cache.layers, pre.cache.layers):
        q, k, v, ctx = pre.recorder.records[layer.layer_idx]
        ctx = dataclasses.replace(ctx, shared=pre.shared.setdefault(layer.layer_idx, SharedWork()))
        layer.lazy_initialization(k, v)
        layer.seen_total = source.seen_total
        layer.seen = host.known(source.seen.clone(), host.values(source.seen))
        layer.next_position = source.next_position.clone()
        layer.build(q, k, v, ctx)
    return cache


@torch.inference_mode()
def continue_from(model, pre: Prefilled, compressor: Compressor | None, max_new_tokens: int = 32,
                  pad_id: int = 0, stop_ids: set[int] | None = None) -> tuple[list[list[int]], dict[str, Any]]:
    """Compress the recorded prefill with ``compressor`` (None: uncompressed) and decode greedily.

    Returns ids per row and the statistics of :func:`kvcomp.generation.generate_ids`; ``prefill_seconds`` is
    the shared prefill's seconds plus this compressor's ``compress_seconds`` (and, query-agnostic, the
    question block), so it is what a prefill with this compressor alone costs, up to the recording overhead.
    """
    stop_ids = stop_ids or set()
    saved_before = sum(w.saved_seconds for w in pre.shared.values())
    t0 = time.perf_counter()
    cache = _build_cache(model, pre, compressor)
    # What this compressor's prefill costs on its own: statistics an earlier compressor computed (and this one
    # reused, SharedWork) count at what they cost then.
    reused = sum(w.saved_seconds for w in pre.shared.values()) - saved_before
    compress_seconds = time.perf_counter() - t0 + reused
    logits, positions = pre.logits, steps.Rows.from_mask(pre.mask)
    if pre.rest is not None:
        ids, block_mask = _left_pad(pre.rest, pad_id)
        logits = steps.prefill(model, cache, ids, positions, block_mask)
    prefill_seconds = pre.seconds + time.perf_counter() - t0 + reused
    prefill_kept = cache.kept_tokens() if isinstance(cache, CompressedCache) else None
    rows, decode_seconds, n_steps = steps.greedy_decode(model, cache, logits, positions, max_new_tokens, stop_ids)
    stats = dict(prefill_seconds=prefill_seconds, decode_seconds=decode_seconds, cache=cache,
                 prefill_kept=prefill_kept, generated_steps=n_steps, compress_seconds=compress_seconds,
                 shared_prefill_seconds=pre.seconds)
    return rows, stats
