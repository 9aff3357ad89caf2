"""Lossless decoding: draft with the compressed cache, verify with the full KV (VeriCache-style).

Any compressor drafts; the uncompressed KV, kept in a slower tier, verifies; the output is what uncompressed
decoding produces, token for token (greedy) or in distribution (sampling).

One round, per sequence (``last`` is the newest token, not yet in either cache)::

    draft:   feed [verified K/V of the previous round's accepted tokens | last] to the compressed cache,
             snapshot it right after the verified part, then draft d_1..d_gamma one token at a time;
    verify:  one forward of [last, d_1..d_gamma] over the full KV -> the full model's distributions;
    accept:  greedy: the longest prefix with d_i == argmax, plus the full model's own next token;
             sampling: d_i with probability min(1, p/q), else a token from norm(max(0, p - q));
    commit:  the full KV keeps the K/V of [last, d_1..d_a] (the rest is cropped); the compressed cache rolls
             back to the snapshot (undoing the drafted tokens, their evictions and re-encodings), and the
             *verified* K/V of [last, d_1..d_a] are what it appends at the start of the next round, so the
             draft cache never holds a drafted K/V for a committed token (no drift).

Appending the verified K/V: when what the compressor stores of a token does not depend on its decode step's
queries (no decode-time eviction, no attention statistics: quantization, KVTC, select-once selection,
retrieval), the cache appends them directly (``CompressedCache.absorb_verified``) and the first draft forward
is the head alone. Otherwise (H2O, TOVA, StreamingLLM, decode_evict) they ride on the next round's first draft
forward, so their queries update decode-time statistics as plain decoding would: the cache substitutes the
verified K/V for the ones the draft model computed (``CompressedCache.stage_verified``). On a GPU the extra
tokens of that forward cost nothing (memory-bound); on a CPU a forward of 5 tokens costs about twice one token.

Rollback: ``Compressor.checkpoint/rollback`` snapshot a layer state (free for states whose ``append`` builds new
tensors, a deep copy otherwise), and ``CompressedLayer`` restores its counters (tokens seen, next position).

The full KV in a slower tier (``Lossless(tier="disk" | "host" | "ram")``, :class:`kvcomp.full_kv.TieredFullKV`): only
verified tokens are appended to it (rejected drafts never reach it, so nothing is cropped there). When a round
starts drafting, reads of the first ``window`` layers are queued on the tiers' background worker; the
verification forward takes each layer as it reaches it and queues the read ``window`` layers ahead. What
overlaps: the reads with the gamma draft forwards (all of them, when the tier is fast enough), then with the
compute of earlier layers during verification. Measured per generation: ``read_seconds`` (what the reads took)
against ``transfer_seconds`` (what verification waited for them); ``overlap=False`` in ``tier_options`` reads
each layer only when needed, the no-overlap reference. On CUDA the copies run on a side stream. On a CPU the
worker thread competes with the model for cores, so "hidden" transfers can still slow compute down.

The parts: :mod:`kvcomp.full_kv` holds the full KV (resident, or streamed from a tier or a store),
:mod:`kvcomp.speculative` the token rules (greedy or sampled choice, acceptance), and this module the round
itself (``_draft``, ``_verify``, ``_commit``) and the loop of :func:`lossless_decode` over them.

Batches with ragged acceptance: every sequence keeps its own true positions (explicit ``position_ids``) and
its own caches: the compressed cache stores per-row tokens (padding never stored); the full KV is one
``[B, H, L, D]`` tensor per layer where a round appends ``max_b(a_b + 1)`` slots and a row that accepted fewer
leaves masked holes (attention mask 0). A hole costs a masked slot, never a wrong position: a row's output is
the same token ids as when it is decoded alone (tested). Holes are at most gamma per round and row.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcomp import steps, validation
from kvcomp.attention import install
from kvcomp.cache import CompressedCache
from kvcomp.compressor import Compressor, CompressorError
from kvcomp.full_kv import make_full_kv
from kvcomp.speculative import Sampling, accept, choose
from kvcomp.tiers import tier_kinds

__all__ = ["Lossless", "LosslessStats", "Sampling", "custom_generate", "full_kv_decode", "lossless_decode"]


@dataclass
class Lossless:
    """How lossless decoding runs.

    gamma: tokens drafted per round (the first round when ``adaptive``).
    adaptive: choose gamma each round in ``[1, max_gamma]`` to maximise expected tokens per second, from the
    running acceptance rate and the measured draft-step and verification times (Leviathan et al., 2023, Sec. 3.5).
    tier: where the full KV lives: ``"resident"`` (a plain ``DynamicCache`` next to the model) or a slower tier
    (see :func:`kvcomp.full_kv.make_full_kv`): ``"host"``, ``"disk"``, ``"ram"``, or ``"store"`` with
    ``tier_options={"store": "redis://host:port/db"}`` (any :func:`kvcomp.store.open_store` URL).
    """

    gamma: int = 4
    adaptive: bool = False
    max_gamma: int = 12
    tier: str = "resident"
    tier_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validation.positive_int("gamma", self.gamma, high=1024, owner=self, hint=" (drafted tokens per round)")
        validation.integer("max_gamma", self.max_gamma, self.gamma, 1024, owner=self, hint=" (>= gamma)")
        validation.boolean("adaptive", self.adaptive, owner=self)
        validation.choice("tier", self.tier, ("resident", *tier_kinds()), owner=self)
        if not isinstance(self.tier_options, dict):
            raise CompressorError(f"Lossless: tier_options must be a dict of tier settings; got {self.tier_options!r}.")


@dataclass
class LosslessStats:
    """Per generation. ``accepted_hist[a]``: row-rounds that accepted ``a`` drafted tokens (each round also
    emits the full model's own token, so a round yields ``a + 1``)."""

    rounds: int = 0
    verify_passes: int = 0
    draft_forwards: int = 0
    drafted_tokens: int = 0  # per row, summed over rows
    accepted_tokens: int = 0
    accepted_hist: dict[int, int] = field(default_factory=dict)
    gammas: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    commit_seconds: float = 0.0
    bytes_in: int = 0  # brought in from the slow tier for verification
    transfer_seconds: float = 0.0  # spent waiting for the slow tier (not hidden behind drafting/compute)
    read_seconds: float = (
        0.0  # time the reads took; read_seconds - transfer_seconds was hidden behind compute
    )
    full_kv_bytes: dict[str, int] = field(default_factory=dict)
    holes: int = 0  # masked slots left in the full KV by ragged batch acceptance

    def record_round(self, gamma: int, batch: int, accepted: torch.Tensor, draft_s: float, verify_s: float) -> None:
        self.rounds += 1
        self.verify_passes += 1
        self.gammas.append(gamma)
        self.drafted_tokens += gamma * batch
        self.accepted_tokens += int(accepted.sum())
        for a in accepted.tolist():
            self.accepted_hist[a] = self.accepted_hist.get(a, 0) + 1
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s

    @property
    def mean_accepted(self) -> float:
        row_rounds = sum(self.accepted_hist.values())
        return self.accepted_tokens / row_rounds if row_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "verify_passes": self.verify_passes,
            "draft_forwards": self.draft_forwards,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted": self.mean_accepted,
            "mean_tokens_per_round": self.mean_accepted + 1 if self.accepted_hist else 0.0,
            "acceptance_rate": self.acceptance_rate,
            "accepted_hist": {str(k): v for k, v in sorted(self.accepted_hist.items())},
            "gammas": dict(Counter(self.gammas)),
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "commit_seconds": self.commit_seconds,
            "bytes_in": self.bytes_in,
            "transfer_seconds": self.transfer_seconds,
            "read_seconds": self.read_seconds,
            "full_kv_bytes": self.full_kv_bytes,
            "holes": self.holes,
        }


# ---------------------------------------------------------------------------------------------------------
# gamma


class GammaController:
    """Fixed gamma, or the gamma maximising expected tokens per second: a round drafting g tokens yields
    ``(1 - alpha^(g+1)) / (1 - alpha)`` tokens in expectation and costs ``g * t_draft + t_verify``."""

    def __init__(self, config: Lossless):
        self.config = config
        self.accepted = 0
        self.rejections = 0
        self.t_draft: float | None = None
        self.t_verify: float | None = None

    def update(self, accepted: torch.Tensor, gamma: int, draft_s: float, verify_s: float) -> None:
        self.accepted += int(accepted.sum())
        self.rejections += int((accepted < gamma).sum())
        ema = 0.7
        step = draft_s / gamma
        self.t_draft = step if self.t_draft is None else ema * self.t_draft + (1 - ema) * step
        self.t_verify = verify_s if self.t_verify is None else ema * self.t_verify + (1 - ema) * verify_s

    def next(self) -> int:
        cfg = self.config
        if not cfg.adaptive or self.t_draft is None:
            return cfg.gamma
        # Per-token acceptance, the maximum-likelihood estimate from accepted prefixes (with a weak prior).
        alpha = (self.accepted + 1) / (self.accepted + self.rejections + 2)
        alpha = min(alpha, 0.999)

        def rate(g: int) -> float:
            return (1 - alpha ** (g + 1)) / (1 - alpha) / (g * self.t_draft + self.t_verify)

        return max(range(1, cfg.max_gamma + 1), key=rate)


# ---------------------------------------------------------------------------------------------------------
# decoding: one round is draft, verify, commit


@dataclass
class _Tokens:
    """Tokens of a batch as a block ``[B, n]``: ids, which are real (a ragged round leaves holes), positions;
    with their verified K/V per layer (``[B, H_kv, n, D]``) when they wait to reach the compressed cache."""

    ids: torch.Tensor
    valid: torch.Tensor
    pos: torch.Tensor
    k: list[torch.Tensor] | None = None
    v: list[torch.Tensor] | None = None

    @classmethod
    def empty(cls, batch: int, device) -> _Tokens:
        none = torch.zeros(batch, 0, dtype=torch.long, device=device)
        return cls(none, none.bool(), none)

    @classmethod
    def one(cls, token: torch.Tensor, pos: torch.Tensor) -> _Tokens:
        """One real token per row (``[B]`` ids at ``[B]`` positions)."""
        return cls(token.view(-1, 1), torch.ones_like(token, dtype=torch.bool).view(-1, 1), pos.view(-1, 1))

    def then(self, other: _Tokens) -> _Tokens:
        """These tokens followed by ``other``'s (K/V joined when both carry them)."""
        def join(a, b):
            return b if a is None else a if b is None else [torch.cat(p, dim=2) for p in zip(a, b)]

        return _Tokens(torch.cat([self.ids, other.ids], 1), torch.cat([self.valid, other.valid], 1),
                       torch.cat([self.pos, other.pos], 1), join(self.k, other.k), join(self.v, other.v))


@dataclass
class _Drafted:
    tokens: torch.Tensor  # [B, gamma]
    q_probs: list[torch.Tensor]  # the draft distributions (sampling)
    snapshots: Any  # the compressed cache before the drafts (None: nothing was drafted)
    width: int  # the draft mask's width at the snapshot


@torch.inference_mode()
def _feed_full(model, full, ids, block_mask, mask, next_pos, keep_new: bool = False):
    """Run a left-padded prompt block ``ids`` ``[B, n]`` over the full KV and commit it there.

    Returns the logits after the block ``[B, 1, V]``, the extended attention mask, the block's positions (each
    row continues at its own ``next_pos``) and, when ``keep_new``, the block's K/V per layer (else None)."""
    n = ids.shape[1]
    mask = torch.cat([mask, block_mask], dim=1)
    pos = next_pos.view(-1, 1) + (block_mask.cumsum(1) - 1).clamp(min=0)
    logits = steps.forward(model, full.cache, ids, pos, mask)
    new_kv = full.new_kv(n) if keep_new else None
    full.commit(n, n)
    return logits, mask, pos, new_kv


def _draft(model, draft: CompressedCache, pending: _Tokens, head: _Tokens, after_head: torch.Tensor, gamma: int,
           draft_mask: torch.Tensor, sampling, gen, stats: LosslessStats) -> tuple[_Drafted, torch.Tensor]:
    """Draft ``gamma`` tokens on the compressed cache. Its first forward also appends the verified tokens that wait
    (their verified K/V substituted for the draft model's) and the head; the snapshot is taken right after them,
    so the rollback undoes the drafts only. Returns the drafts and the extended draft mask."""
    batch, device = head.ids.shape[0], head.ids.device
    tokens = torch.zeros(batch, 0, dtype=torch.long, device=device)
    q_probs, snapshots, width = [], None, draft_mask.shape[1] + pending.ids.shape[1]
    if gamma == 0:
        return _Drafted(tokens, q_probs, None, width), draft_mask
    if pending.k is not None and draft.absorbs_verified:
        # Nothing the compressor keeps depends on the verified tokens' queries: append their K/V directly, and
        # the first draft forward is the head alone (a multi-token forward costs up to 3x one token on a CPU).
        draft.absorb_verified(pending.k, pending.v, pending.pos, pending.valid, pending.ids)
        draft_mask = torch.cat([draft_mask, pending.valid.long()], dim=1)
        pending = _Tokens.empty(batch, device)
    if pending.k is None:
        snapshots = draft.checkpoint()
    else:
        draft.stage_verified(pending.k, pending.v)
    step = pending.then(head)
    for i in range(gamma):
        draft_mask = torch.cat([draft_mask, step.valid.long()], dim=1)
        logits = steps.forward(model, draft, step.ids, step.pos, draft_mask)
        stats.draft_forwards += 1
        if snapshots is None:
            snapshots = draft.take_snapshots()
        token, q = choose(logits[:, -1], sampling, gen)
        tokens = torch.cat([tokens, token.view(-1, 1)], dim=1)
        if q is not None:
            q_probs.append(q)
        step = _Tokens.one(token, after_head + i)
    return _Drafted(tokens, q_probs, snapshots, width), draft_mask


def _verify(model, full, head: _Tokens, drafted: _Drafted, after_head: torch.Tensor, full_mask: torch.Tensor,
            sampling, gen) -> tuple[_Tokens, torch.Tensor, torch.Tensor]:
    """One forward of ``[head, d_1..d_gamma]`` over the full KV; returns that block, the accepted count per row
    ``[B]`` and the full model's token after each row's accepted prefix ``[B]``."""
    gamma = drafted.tokens.shape[1]
    pos = after_head.view(-1, 1) + torch.arange(gamma, device=after_head.device)
    block = head.then(_Tokens(drafted.tokens, torch.ones_like(pos, dtype=torch.bool), pos))
    mask = torch.cat([full_mask, block.valid.to(full_mask.dtype)], dim=1)
    # [B, gamma + 1, V]: after the head's last token, then after each draft
    logits = steps.forward(model, full.cache, block.ids, block.pos, mask, logits_to_keep=gamma + 1)
    accepted, bonus = accept(logits, drafted.tokens, sampling, drafted.q_probs, gen)
    return block, accepted, bonus


def _commit(full, block: _Tokens, n_head: int, accepted: torch.Tensor) -> _Tokens:
    """Keep the head and every row's accepted drafts in the full KV (``max_b(a_b)`` drafted slots: a row that
    accepted fewer leaves masked holes); returns the kept tokens, with their verified K/V."""
    n = block.ids.shape[1]
    kept = n_head + int(accepted.max())
    k_new, v_new = full.new_kv(n)
    k_new, v_new = [k[:, :, :kept] for k in k_new], [v[:, :, :kept] for v in v_new]
    full.commit(n, kept)
    slot = torch.arange(kept - n_head, device=accepted.device)
    valid = torch.cat([block.valid[:, :n_head], slot.view(1, -1) < accepted.view(-1, 1)], dim=1)  # [B, kept]
    return _Tokens(block.ids[:, :kept], valid, block.pos[:, :kept], k_new, v_new)


def _emit(generated: list[list[int]], finished: list[bool], drafts: torch.Tensor, accepted: torch.Tensor,
          bonus: torch.Tensor, stop_ids: set[int], max_new_tokens: int) -> None:
    """Append each unfinished row's accepted drafts and the full model's token, up to a stop or the limit."""
    for b, (row, a, t_bonus) in enumerate(zip(drafts.tolist(), accepted.tolist(), bonus.tolist())):
        if finished[b]:
            continue
        for t in row[:a] + [t_bonus]:
            generated[b].append(t)
            if t in stop_ids or len(generated[b]) >= max_new_tokens:
                finished[b] = True
                break


@torch.inference_mode()
def lossless_decode(
    model,
    blocks: list[tuple[torch.Tensor, torch.Tensor]],
    compressor: Compressor | None,
    config: Lossless | None = None,
    max_new_tokens: int = 32,
    stop_ids: set[int] | None = None,
    sampling: Sampling | None = None,
    question_length: list[int] | None = None,
    context=None,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Decode with ``compressor`` drafting and the full KV verifying; returns ids per row and statistics.

    ``blocks``: the prompt as left-padded ``(ids [B, n], mask [B, n])`` blocks. The first is prefilled once:
    the compressed cache is built from it while the full KV receives its K/V (``CompressedCache.tee``). Later
    blocks (the question, query-agnostic) run on the full KV only; their verified K/V reach the compressed
    cache like accepted tokens do. So every logit that picks a token comes from uncompressed attention.

    ``context``: a :class:`kvcomp.contexts.LoadedContext` instead of a prefill: its stored compressed cache
    drafts (``compressor`` None, or the one it was saved with) and its stored full KV verifies, read where
    ``config.tier`` says (``"store"``: from the store at every verification; otherwise copied into that tier
    first). ``blocks`` is then what follows the context (the question, at most one block). The question does
    not wait for the full KV: the first round drafts over the compressed context plus the question while the
    full KV streams in, and one forward over the full KV verifies the question and the drafts together.
    """
    config = config or Lossless()
    if context is not None:
        if compressor is not None and compressor is not context.compressor:
            raise CompressorError("lossless_decode: a stored context drafts with the compressor it was saved with; "
                                  "pass compressor=None.")
        compressor = context.compressor
        if len(blocks) > 1:
            raise ValueError("lossless_decode: a stored context is continued with one block (the question).")
    if compressor is None:
        raise CompressorError("Lossless decoding needs a compressor to draft with; got None.")
    install(model)
    stop_ids = stop_ids or set()
    device = model.device
    batch = blocks[0][0].shape[0] if context is None else context.mask.shape[0]
    compressor.check(batch)
    stats = LosslessStats()
    gen = None if sampling is None else torch.Generator(device=device).manual_seed(sampling.seed)
    gamma_ctl = GammaController(config)

    t0 = time.perf_counter()
    draft, full, logits, draft_mask, full_mask, next_pos, pending, head = _start(
        model, blocks, compressor, config, question_length, context)
    prefill_seconds = time.perf_counter() - t0
    if head is None:  # the prefill's next token is the head of the first round
        last, _ = choose(logits, sampling, gen)
        generated: list[list[int]] = [[t] for t in last.tolist()]
        finished = [t in stop_ids or max_new_tokens <= 1 for t in last.tolist()]
        head = _Tokens.one(last, next_pos)
    else:  # a stored context's question: verified together with the first round's drafts
        generated, finished = [[] for _ in range(batch)], [False] * batch

    t_decode = time.perf_counter()
    while not all(finished):
        after_head = next_pos + head.valid.sum(1)  # [B] position of the first drafted token
        needed = max(max_new_tokens - len(g) for g, f in zip(generated, finished) if not f)
        gamma = min(gamma_ctl.next(), needed - 1)
        full.prefetch()  # the full KV streams in while the draft model works
        t0 = time.perf_counter()
        drafted, draft_mask = _draft(model, draft, pending, head, after_head, gamma, draft_mask, sampling, gen,
                                     stats)
        _sync(device)
        draft_s, t0 = time.perf_counter() - t0, time.perf_counter()
        block, accepted, bonus = _verify(model, full, head, drafted, after_head, full_mask, sampling, gen)
        _sync(device)
        verify_s, t0 = time.perf_counter() - t0, time.perf_counter()
        kept = _commit(full, block, head.ids.shape[1], accepted)
        full_mask = torch.cat([full_mask, kept.valid.to(full_mask.dtype)], dim=1)
        stats.holes += int((~kept.valid[:, head.ids.shape[1]:]).sum())
        # Nothing drafted (gamma 0): the earlier verified tokens still wait, so they stay in front.
        pending = pending.then(kept) if drafted.snapshots is None and pending.k is not None else kept
        if drafted.snapshots is not None:
            draft.rollback(drafted.snapshots)
            draft_mask = draft_mask[:, :drafted.width]
        next_pos = after_head + accepted
        _emit(generated, finished, drafted.tokens, accepted, bonus, stop_ids, max_new_tokens)
        head = _Tokens.one(bonus, next_pos)
        stats.commit_seconds += time.perf_counter() - t0
        stats.record_round(gamma, batch, accepted, draft_s, verify_s)
        if gamma > 0:
            gamma_ctl.update(accepted, gamma, draft_s, verify_s)
    decode_seconds = time.perf_counter() - t_decode

    _close(full, stats)
    rows = [steps.cut_at_stop(row, stop_ids, limit=max_new_tokens) for row in generated]
    return rows, dict(prefill_seconds=prefill_seconds, decode_seconds=decode_seconds, cache=draft,
                      generated_steps=max(len(g) for g in generated), lossless=stats, raw=generated)


def _start(model, blocks, compressor, config: Lossless, question_length, context):
    """The state before the first round: the compressed (draft) cache, the full KV, the logits after the prompt,
    both attention masks, each row's next position, the verified tokens waiting for the compressed cache, and
    the first round's head when it is a stored context's question (else None)."""
    device = model.device
    if context is not None:
        draft = context.new_cache(model)
        full = make_full_kv(model, config.tier, config.tier_options, context)
        full.prefetch()  # the full KV starts streaming in now
        next_pos = context.mask.sum(1)
        head = None
        if blocks and blocks[0][0].shape[1]:
            ids, mask = (t.to(device) for t in blocks[0])
            head = _Tokens(ids, mask.bool(), next_pos.view(-1, 1) + (mask.cumsum(1) - 1).clamp(min=0))
        pending = _Tokens.empty(context.mask.shape[0], device)
        return draft, full, context.logits, context.mask.clone(), context.mask.clone(), next_pos, pending, head
    draft = CompressedCache(model, compressor, question_length=question_length)
    full = make_full_kv(model, config.tier, config.tier_options)
    ids, mask = (t.to(device) for t in blocks[0])
    draft.tee = full.tee
    logits = steps.forward(model, draft, ids, _positions(mask), mask)[:, -1]
    draft.tee = None
    draft_mask, full_mask, next_pos = mask.clone(), mask.clone(), mask.sum(1)
    pending = _Tokens.empty(ids.shape[0], device)
    for ids, mask in blocks[1:]:  # the question, query-agnostic: on the full KV only, verified K/V kept
        ids, mask = ids.to(device), mask.to(device)
        block_logits, full_mask, pos, (k_new, v_new) = _feed_full(model, full, ids, mask, full_mask, next_pos,
                                                                  keep_new=True)
        logits = block_logits[:, -1]
        pending = pending.then(_Tokens(ids, mask.bool(), pos, k_new, v_new))
        next_pos = next_pos + mask.sum(1)
    return draft, full, logits, draft_mask, full_mask, next_pos, pending, None


def _close(full, stats: LosslessStats) -> None:
    stats.bytes_in, stats.transfer_seconds, stats.read_seconds = full.bytes_in, full.transfer_seconds, full.read_seconds
    stats.full_kv_bytes = full.nbytes()
    full.close()


@torch.inference_mode()
def full_kv_decode(
    model,
    blocks: list[tuple[torch.Tensor, torch.Tensor]],
    config: Lossless,
    max_new_tokens: int = 32,
    stop_ids: set[int] | None = None,
    context=None,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Uncompressed greedy decoding with the full KV where ``config.tier`` puts it, one token per forward: the
    baseline lossless decoding is measured against (same tier, same streaming, no drafting). ``context``: a
    :class:`kvcomp.contexts.LoadedContext` whose stored full KV it continues (``blocks``: what follows it)."""
    install(model)
    stop_ids = stop_ids or set()
    device = model.device
    full = make_full_kv(model, config.tier, config.tier_options, context)
    stats = LosslessStats()
    t0 = time.perf_counter()
    if context is None:
        mask = torch.zeros(blocks[0][0].shape[0], 0, dtype=torch.long, device=device)
        next_pos = torch.zeros(blocks[0][0].shape[0], dtype=torch.long, device=device)
        logits = None
    else:
        mask, logits = context.mask.clone(), context.logits
        next_pos = mask.sum(1)
    for ids, block_mask in blocks:
        ids, block_mask = ids.to(device), block_mask.to(device)
        block_logits, mask, _, _ = _feed_full(model, full, ids, block_mask, mask, next_pos)
        logits = block_logits[:, -1]
        next_pos = next_pos + block_mask.sum(1)
    prefill_seconds = time.perf_counter() - t0
    batch = mask.shape[0]
    generated: list[list[int]] = [[] for _ in range(batch)]
    finished = [False] * batch
    t_decode = time.perf_counter()
    while True:
        token = logits.argmax(-1)
        for b, t in enumerate(token.tolist()):
            if not finished[b]:
                generated[b].append(t)
                finished[b] = t in stop_ids or len(generated[b]) >= max_new_tokens
        if all(finished):
            break
        full.prefetch()
        t0 = time.perf_counter()
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=device)], dim=1)
        logits = steps.forward(model, full.cache, token.view(-1, 1), next_pos.view(-1, 1), mask)[:, -1]
        full.commit(1, 1)
        next_pos = next_pos + 1
        stats.verify_passes += 1
        _sync(device)
        stats.verify_seconds += time.perf_counter() - t0
    decode_seconds = time.perf_counter() - t_decode
    _close(full, stats)
    rows = [steps.cut_at_stop(row, stop_ids) for row in generated]
    return rows, dict(
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        lossless=stats,
        raw=generated,
        generated_steps=max(len(g) for g in generated),
    )


def _sync(device: torch.device) -> None:
    # Timings split draft from verify: on CUDA, wait for the queued kernels first.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def bound_note(stats: LosslessStats, tokens: int) -> str:
    """What bounds the speed, from measured times (for reports)."""
    total = stats.draft_seconds + stats.verify_seconds + stats.commit_seconds
    if not total or not tokens:
        return ""
    parts = {"draft": stats.draft_seconds, "verify": stats.verify_seconds, "commit": stats.commit_seconds}
    top = max(parts, key=parts.get)
    return (
        f"{top} {parts[top] / total:.0%} of decode time; {tokens / total:.1f} tok/s; "
        + f"{stats.mean_accepted + 1:.2f} tokens/round"
    )


# ---------------------------------------------------------------------------------------------------------
# transformers' generate(custom_generate=...)

_WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")


def custom_generate(
    model,
    input_ids: torch.Tensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    compressor=None,
    gamma: int | None = None,
    lossless: Lossless | None = None,
    seed: int = 0,
    **model_kwargs,
) -> torch.Tensor:
    """A decoding loop for ``model.generate(ids, custom_generate=custom_generate, compressor=..., gamma=...)``.

    Greedy or sampling as ``generation_config`` says (``do_sample``, ``temperature``, ``top_k``, ``top_p``;
    ``seed`` seeds the sampler); stops at ``max_new_tokens``/``max_length`` and the EOS ids. Returns the
    sequences like ``generate`` does (prompt, then new tokens; rows that stopped early padded after EOS).
    Logits processors other than those warpers (repetition penalty, ...) are refused rather than ignored.
    """
    if compressor is None:
        raise CompressorError("custom_generate needs compressor=<a Compressor> to draft with.")
    if isinstance(compressor, str):
        from kvcomp.registry import create

        compressor = create(compressor)
    others = [type(p).__name__ for p in (logits_processor or []) if type(p).__name__ not in _WARPERS]
    if others:
        raise ValueError(
            f"Lossless decoding applies temperature/top-k/top-p only; got logits processors {others}."
        )
    cfg = generation_config
    validation.check_greedy_or_sampled(cfg, model.generation_config, "custom_generate (lossless decoding)")
    config = lossless or Lossless()
    if gamma is not None:
        config = Lossless(**{**config.__dict__, "gamma": gamma, "max_gamma": max(gamma, config.max_gamma)})
    sampling = None
    if cfg.do_sample:
        sampling = Sampling(
            cfg.temperature or 1.0, cfg.top_k or 0, cfg.top_p if cfg.top_p is not None else 1.0, seed
        )
    eos = cfg.eos_token_id
    stop_ids = set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    if isinstance(eos, torch.Tensor):
        stop_ids = {int(e) for e in eos.flatten().tolist()}
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(input_ids)
    max_new_tokens = cfg.max_length - input_ids.shape[1]
    _, stats = lossless_decode(
        model, [(input_ids, mask)], compressor, config, max_new_tokens, stop_ids, sampling
    )
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (min(stop_ids) if stop_ids else 0)
    rows = [steps.cut_at_stop(row, stop_ids, keep_stop=True, limit=max_new_tokens) for row in stats["raw"]]
    width = max(len(r) for r in rows)
    new = torch.full((len(rows), width), int(pad), dtype=torch.long, device=input_ids.device)
    for i, r in enumerate(rows):
        new[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    model.last_lossless_stats = stats["lossless"]  # the statistics of the last call, for inspection
    return torch.cat([input_ids, new], dim=1)
