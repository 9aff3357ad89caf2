"""KVzip: query-agnostic selection by context reconstruction.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", NeurIPS 2025,
https://arxiv.org/abs/2505.23416 (reference code: github.com/snu-mllab/KVzip; kvpress's KVzipPress)

After the prefill the model re-reads its own context: for each chunk of ``chunk_size`` context tokens it is
fed ``prompt`` ("Repeat the previous context exactly.", or for later chunks ``continue_prompt`` and the last
``overlap`` tokens of the previous chunk), the chat template's end of user turn and start of the answer, then
the chunk itself (teacher forcing), over the prefilled cache. A prefilled token's score in a layer and KV head
is the largest attention any query of its chunk's repetition (and of the KV head's query group) gives it,
the softmax taken over the protected prefix, the chunk and the repetition itself (the reference code's
normalisation). These extra forward passes (:func:`kvcomp.replay.replay`) run inside the prefill, so they
count in its seconds (and in a shared-prefill grid's ``compress_seconds``).

The protected prefix (the chat template's system prompt and user header when the prompt starts with it, else
the first ``n_sink`` tokens) is always kept. ``level="global"`` (the default) keeps the best pairs over every
full-attention layer and KV head together (layers and heads keep different counts: stored ragged,
:class:`kvcomp.ragged.RaggedStore`), ``"layer"`` over the heads of each layer, ``"head"`` the same count per
head. Sliding-window layers keep their window as transformers does. Batch size 1 (as the reference code and
kvpress). The tokenizer (for the prompts and the template) is the model's own, read from its directory or
Hub cache at :meth:`bind`; set ``kvzip.tokenizer`` for a model without one, or use ``prompt=""``,
``continue_prompt=""``, ``chat_template=False`` (the bare context is re-read; no tokenizer needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcomp import validation
from kvcomp.allocation import adaptive_keep
from kvcomp.compressor import Capabilities, CompressorError
from kvcomp.kernels import cpu_native
from kvcomp.ops import attention_probs, rows_per_chunk, softcap, softmax, visible
from kvcomp.ragged import RaggedStore
from kvcomp.replay import replay
from kvcomp.selection import TokenSelection, compact, select_top, store_from_block

# Probabilities the replay holds at once (4 MiB in float32; a scoring pass of its chunk makes about four such
# transients): it runs while the prompt's full K/V of every layer is held, at no compression's own peak.
_REPLAY_PROBS = 1 << 20


@dataclass
class KVzip(TokenSelection):
    level: str = "global"
    n_sink: int = 4
    chunk_size: int = 2000
    overlap: int = 8
    prompt: str = "\n\nRepeat the previous context exactly."
    continue_prompt: str = "\n\nRepeat the part of the previous context exactly, starting with"
    chat_template: bool = True

    capabilities: ClassVar[Capabilities] = Capabilities(supports_batch=False)
    sliding_layers: ClassVar[str] = "window"
    whole_model_scorer: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.choice("level", self.level, ("global", "layer", "head"), owner=self)
        validation.non_negative_int("n_sink", self.n_sink, owner=self, hint=" (first tokens always kept)")
        validation.positive_int("chunk_size", self.chunk_size, owner=self, hint=" (context tokens re-read at once)")
        validation.non_negative_int("overlap", self.overlap, owner=self, hint=" (tokens of the previous chunk repeated)")
        for name in ("prompt", "continue_prompt"):
            if not isinstance(getattr(self, name), str):
                raise CompressorError(f"KVzip: {name} must be a string; got {getattr(self, name)!r}.")
        validation.boolean("chat_template", self.chat_template, owner=self)
        self.tokenizer = None

    def _compressing(self) -> bool:
        return self.budget is not None or self.compression_ratio > 0

    def bind(self, model) -> None:
        if not self._compressing() or self.tokenizer is not None:
            return
        if not (self.prompt or self.continue_prompt or self.chat_template):
            return
        from transformers import AutoTokenizer

        name = getattr(model.config, "_name_or_path", "") or ""
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True) if name else None
        except (OSError, ValueError):
            self.tokenizer = None
        if self.tokenizer is None:
            raise CompressorError(
                f"KVzip needs the model's tokenizer for its reconstruction prompt and found none for {name!r}: set "
                "kvzip.tokenizer = tokenizer, or use prompt='', continue_prompt='', chat_template=False.")

    # -- prompts --------------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _template(self) -> tuple[list[int], list[int]]:
        """``(prefix, suffix)`` ids of the chat template around the user's text ([], [] without one)."""
        tok = self.tokenizer
        if not self.chat_template or tok is None or not getattr(tok, "chat_template", None):
            return [], ([] if tok is None or not self.chat_template else self._encode("\n"))
        marker = "\n" + "#" * 13
        text = tok.apply_chat_template([{"role": "user", "content": "dummy context" + marker}],
                                       add_generation_prompt=True, tokenize=False)
        before, suffix = text.split(marker)
        return self._encode(before.split("dummy context")[0]), self._encode(suffix)

    def blocks(self, ids: list[int]) -> tuple[int, list[tuple[int, int, list[int]]]]:
        """``(protected, [(start, stop, repetition ids), ...])`` for a prompt of ``ids``: the protected prefix
        length and, per chunk of the rest, its slot range and the ids fed to re-read it."""
        prefix, suffix = self._template()
        protected = len(prefix) if prefix and ids[:len(prefix)] == prefix else 0
        protected = min(len(ids), max(protected, self.n_sink))
        out = []
        for start in range(protected, len(ids), self.chunk_size):
            stop = min(len(ids), start + self.chunk_size)
            if start == protected:
                lead = self._encode(self.prompt)
            else:
                lead = self._encode(self.continue_prompt) + ids[max(protected, start - self.overlap):start]
            out.append((start, stop, lead + suffix + ids[start:stop]))
        return protected, out

    # -- hooks ----------------------------------------------------------------------------------------------
    def prefill(self, layer, q, k, v, ctx):
        return compact(store_from_block(k, v, ctx))  # everything, until after_prefill has scored all layers

    def score(self, q, k, v, ctx):
        raise CompressorError("KVzip scores with the whole model after the prefill (after_prefill), not per layer.")

    def after_prefill(self, cache, contexts) -> None:
        mine = [layer for layer in cache.layers if layer.compressor is self]
        if not mine or not self._compressing():
            return
        ctx0 = contexts[mine[0].layer_idx]
        if ctx0.token_ids is None:
            raise CompressorError("KVzip re-reads the prompt, so the model must be called with input_ids (not "
                                  "inputs_embeds).")
        ids = ctx0.token_ids[0].tolist()
        protected, chunks = self.blocks(ids)
        scores = {layer.layer_idx: torch.full(layer.state.positions.shape, float("inf"), dtype=torch.float32,
                                              device=layer.state.keys.device) for layer in mine}
        current: dict[str, int] = {}

        def observe(layer, q, ctx, context, block):
            if layer not in scores:
                return None  # a sliding layer: attended as usual, not scored
            start, stop = current["start"], current["stop"]
            out, scores[layer][..., start:stop] = attend_and_score(q, ctx, context, block, protected, start, stop)
            return out

        device = ctx0.token_ids.device
        for start, stop, rep in chunks:
            current.update(start=start, stop=stop)
            replay(cache, [torch.tensor([rep], device=device)], observe)
        self._evict(mine, scores, contexts)

    def _evict(self, layers, scores, contexts) -> None:
        budgets = {layer.layer_idx: self.kept_tokens(layer.state.valid[:, 0].sum(-1)) for layer in layers}
        if self.level == "global":
            flat = torch.cat([scores[layer.layer_idx].reshape(-1) for layer in layers])
            total = sum(int(budgets[layer.layer_idx][0]) * layer.state.positions.shape[1] for layer in layers)
            keep = torch.zeros_like(flat, dtype=torch.bool)
            keep[flat.topk(min(total, flat.numel())).indices] = True
            offset = 0
            for layer in layers:
                n = scores[layer.layer_idx].numel()
                mask = keep[offset:offset + n].view_as(scores[layer.layer_idx])
                layer.state = RaggedStore.from_dense(layer.state, mask)
                offset += n
            return
        for layer in layers:
            budget = budgets[layer.layer_idx]
            if self.level == "layer":
                mask = adaptive_keep(scores[layer.layer_idx], layer.state.valid, budget, 0.0)
                layer.state = RaggedStore.from_dense(layer.state, mask)
            else:
                layer.state = select_top(layer.state, scores[layer.layer_idx], budget)


def attend_and_score(q, ctx, context, block, protected: int, start: int, stop: int):
    """The attention output of the repetition queries ``q`` ``[B, H_q, m, D]`` over the prefilled ``context`` and
    the repetition ``block`` (each ``(keys, values, positions)``), and the chunk's reconstruction scores
    ``[B, H_kv, stop - start]`` from the same probabilities: renormalised over the protected prefix, the chunk
    and the repetition (and the sink), as :func:`reconstruction_scores` computes them directly. The context's
    K/V are read in place (never concatenated with the block's: that copy would be a layer's K/V on top of
    the full prompt KV this pass already holds)."""
    (ck, cv, cpos), (bk, bv, bpos) = context, block
    b, hq, m, d = q.shape
    hkv, n_ctx = ck.shape[1], ck.shape[2]
    g = hq // hkv
    # On a full-attention layer every prefilled token comes before the repetition: with no empty slot in the
    # context, only the repetition's own (causal) part needs a mask.
    context_mask = None
    if ctx.spec.window is not None or not bool((cpos < bpos.min()).all()):
        context_mask = cpos.to(bpos.dtype)
    # The repetition's keys are its own queries (positions in order): queries lo:hi see none of the keys after
    # hi, so those are neither multiplied nor masked, and the keys before lo need no mask.
    own = bpos.shape[2] == m and bool((bpos == ctx.query_positions[:, None, :]).all())
    if own and context_mask is None and ctx.spec.plain and cpu_native.supports_prompt(q, ck, cv, bk, bv):
        # One pass per 16 queries, the probabilities never in memory: ~2.5x faster at 8K on SmolLM2.
        best, out = cpu_native.reconstruction_attention(q, bk, bv, ctx.spec.scaling, (ck, cv), protected, start, stop)
        return out.to(q.dtype), best
    out = torch.empty_like(q)
    best = torch.zeros(b, hkv, stop - start, dtype=torch.float32, device=q.device)
    step = rows_per_chunk(b * hq, n_ctx + bk.shape[2], budget=_REPLAY_PROBS)
    for lo in range(0, m, step):
        hi = min(m, lo + step)
        rows = hi - lo
        width, masked_from = (hi, lo) if own else (bk.shape[2], 0)
        probs = _replay_probs(q, lo, hi, ck, bk[:, :, :width], bpos[..., :width], masked_from, context_mask, ctx)
        mixed = (torch.matmul(probs[..., :n_ctx].to(cv.dtype), cv)
                 + torch.matmul(probs[..., n_ctx:].to(bv.dtype), bv[:, :, :width]))
        out[:, :, lo:hi] = mixed.view(b, hkv, g, rows, d).reshape(b, hq, rows, d)
        chunk = probs[..., start:stop]
        total = probs[..., :protected].sum(-1) + chunk.sum(-1) + probs[..., n_ctx:].sum(-1)
        if ctx.spec.sinks is not None:
            total = total + (1.0 - probs.sum(-1)).clamp_min(0.0)  # the sink's share stays in the denominator
        best = torch.maximum(best, chunk.div_(total.clamp_min(1e-30).unsqueeze(-1)).amax(2))
    return out, best


def _replay_probs(q, lo: int, hi: int, ck, bk, bpos, masked_from: int, context_mask, ctx) -> torch.Tensor:
    """Probabilities ``[B, H_kv, G * (hi - lo), n_ctx + n_blk]`` of the repetition queries ``lo:hi`` over the
    context keys ``ck`` then the repetition keys ``bk``, grouped per KV head, with the layer's soft-cap and sinks:
    both products written into one buffer (no concatenation), the scale folded into the queries, and the
    visibility rule applied to the repetition's columns from ``masked_from`` on (and to the context's only when
    ``context_mask``, its positions, is given: a sliding layer or a context with empty slots)."""
    b, hq, _, d = q.shape
    hkv, n_ctx, n_blk = ck.shape[1], ck.shape[2], bk.shape[2]
    g, rows = hq // hkv, hi - lo
    qg = (q[:, :, lo:hi] * ctx.spec.scaling).reshape(b, hkv, g * rows, d)
    logits = torch.empty(b, hkv, g * rows, n_ctx + n_blk, dtype=qg.dtype, device=q.device)
    torch.matmul(qg, ck.transpose(-1, -2), out=logits[..., :n_ctx])
    torch.matmul(qg, bk.transpose(-1, -2), out=logits[..., n_ctx:])
    logits = softcap(logits.float(), ctx.spec.softcap)
    q_pos = ctx.query_positions[:, None, None, lo:hi, None]
    for cols, k_pos in ((slice(n_ctx + masked_from, None), bpos[..., masked_from:]),
                        (slice(None, n_ctx), context_mask)):
        if k_pos is not None:
            hidden = ~visible(q_pos, k_pos[:, :, None, None, :], ctx.spec.window)  # [B, H_kv, 1, rows, L]
            logits[..., cols].view(b, hkv, g, rows, -1).masked_fill_(hidden, float("-inf"))
    return softmax(logits, ctx.spec.grouped_sinks(hkv, rows, q.device))


def _row_probs(q, lo: int, hi: int, keys, positions, ctx) -> torch.Tensor:
    """Attention probabilities ``[B, H_kv, G * (hi - lo), L]`` of the queries ``lo:hi`` of ``q`` over ``keys``
    (a tensor or a tuple of key blocks, as :func:`kvcomp.ops.attention_probs` takes them), grouped per KV
    head, with the layer's visibility, soft-cap and sinks."""
    b, hq, _, d = q.shape
    hkv = positions.shape[1]
    g, rows = hq // hkv, hi - lo
    qg = q[:, :, lo:hi].reshape(b, hkv, g * rows, d)
    q_pos = ctx.query_positions[:, lo:hi]
    allowed = visible(q_pos[:, None, None, :, None], positions[:, :, None, None, :], ctx.spec.window)
    allowed = allowed.expand(b, hkv, g, rows, positions.shape[-1]).reshape(b, hkv, g * rows, -1)
    return attention_probs(qg, keys, allowed, ctx.spec, ctx.spec.grouped_sinks(hkv, rows, q.device))


def reconstruction_scores(q, keys, positions, ctx, protected: int, n_chunk: int) -> torch.Tensor:
    """``[B, H_kv, n_chunk]``: the largest attention the repetition queries ``q`` ``[B, H_q, m, D]`` give each
    chunk token, over the keys ``[B, H_kv, protected + n_chunk + m, D]`` (protected prefix, chunk, repetition),
    with the layer's own visibility, soft-cap and sinks, maximised over the query group and the queries."""
    b, m = q.shape[0], q.shape[2]
    best = torch.zeros(b, keys.shape[1], n_chunk, dtype=torch.float32, device=q.device)
    step = rows_per_chunk(b * q.shape[1], keys.shape[2], budget=_REPLAY_PROBS)
    for lo in range(0, m, step):
        hi = min(m, lo + step)
        probs = _row_probs(q, lo, hi, keys, positions, ctx)
        best = torch.maximum(best, probs[..., protected:protected + n_chunk].nan_to_num(0.0).amax(2))
    return best


