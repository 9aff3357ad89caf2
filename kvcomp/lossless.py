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

Appending the verified K/V rides on the next round's first draft forward (one forward instead of two): the
cache substitutes them for the K/V the draft model computed for those tokens (``CompressedCache.stage_verified``).

Rollback: ``Compressor.checkpoint/rollback`` snapshot a layer state (free for states whose ``append`` builds new
tensors, a deep copy otherwise), and ``CompressedLayer`` restores its counters (tokens seen, next position).
The verified tokens' queries in that first draft forward update decode-time statistics (H2O) as plain decoding
would; on a GPU the extra tokens cost nothing (memory-bound), on a CPU about their compute.

The full KV in a slower tier (``Lossless(tier="disk" | "host" | "ram")``, :class:`TieredFullKV`): only
verified tokens are appended to it (rejected drafts never reach it, so nothing is cropped there). When a round
starts drafting, reads of the first ``window`` layers are queued on the tiers' background worker; the
verification forward takes each layer as it reaches it and queues the read ``window`` layers ahead. What
overlaps: the reads with the gamma draft forwards (all of them, when the tier is fast enough), then with the
compute of earlier layers during verification. Measured per generation: ``read_seconds`` (what the reads took)
against ``transfer_seconds`` (what verification waited for them); ``overlap=False`` in ``tier_options`` reads
each layer only when needed, the no-overlap reference. On CUDA the copies run on a side stream. On a CPU the
worker thread competes with the model for cores, so "hidden" transfers can still slow compute down.

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
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcomp import steps, validation
from kvcomp.attention import install
from kvcomp.cache import CompressedCache
from kvcomp.compressor import Compressor, CompressorError
from kvcomp.tiers import Tier, tier_kinds


@dataclass
class Lossless:
    """How lossless decoding runs.

    gamma: tokens drafted per round (the first round when ``adaptive``).
    adaptive: choose gamma each round in ``[1, max_gamma]`` to maximise expected tokens per second, from the
    running acceptance rate and the measured draft-step and verification times (Leviathan et al., 2023, Sec. 3.5).
    tier: where the full KV lives: ``"resident"`` (a plain ``DynamicCache`` next to the model) or a slower tier
    (see :func:`make_full_kv`): ``"host"``, ``"disk"``, ``"ram"``, or ``"store"`` with
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
class Sampling:
    """Temperature, then top-k, then top-p (transformers' order), applied identically to draft and target."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        validation.finite_float("temperature", self.temperature, 0.0, low_open=True, owner=self,
                                hint=" (use greedy decoding for 0)")
        validation.non_negative_int("top_k", self.top_k, high=None, owner=self, hint=" (0: no top-k)")
        validation.fraction("top_p", self.top_p, low_open=True, owner=self)
        validation.non_negative_int("seed", self.seed, high=2**63 - 1, owner=self)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits -> probabilities (float64, so p/q ratios are not rounding noise)."""
        if self.top_k and self.top_k < logits.shape[-1]:
            # Only the top k can survive: warp those and scatter them back (a few passes over V, not ten).
            top, index = logits.topk(self.top_k, dim=-1)
            top = top.to(torch.float64) / self.temperature
            if self.top_p < 1.0:
                top_probs = top.softmax(-1)  # sorted descending already
                top = top.masked_fill((top_probs.cumsum(-1) - top_probs) >= self.top_p, float("-inf"))
            out = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
            return out.scatter_(-1, index, top.softmax(-1))
        logits = logits.to(torch.float64) / self.temperature
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (sorted_probs.cumsum(-1) - sorted_probs) >= self.top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits.softmax(-1)


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
# the full KV


class ResidentFullKV:
    """The full KV in a plain ``transformers.DynamicCache`` next to the model (nothing is transferred).

    The interface every full-KV holder has: ``cache`` (what the model runs on), ``tee`` (prefill K/V from the
    compressed cache's forward), ``prefetch`` (start bringing the KV in for the next forward), ``new_kv`` /
    ``commit`` (the K/V of the last forward's tokens; keep the first ``kept`` of them), ``nbytes``, ``close``
    and the transfer counters."""

    def __init__(self, model):
        self.cache = DynamicCache()
        self.bytes_in = 0
        self.transfer_seconds = 0.0
        self.read_seconds = 0.0

    def tee(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.update(k, v, layer)

    def prefetch(self) -> None:
        pass

    def new_kv(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K/V ``[B, H_kv, n, D]`` per layer of the ``n`` tokens of the last forward (copies: a view would keep
        the whole old cache tensor alive after the next forward grows it)."""
        layers = self.cache.layers
        return [lay.keys[:, :, -n:].clone() for lay in layers], [
            lay.values[:, :, -n:].clone() for lay in layers
        ]

    def commit(self, n: int, kept: int) -> None:
        if n > kept:
            for lay in self.cache.layers:
                lay.crop(kept - n)

    def nbytes(self) -> dict[str, int]:
        total = sum(lay.keys.nbytes + lay.values.nbytes for lay in self.cache.layers if lay.is_initialized)
        return {"device": total, "host": 0, "disk": 0}

    def close(self) -> None:
        pass


class _TierLayer(CacheLayerMixin):
    """A verification layer over a :class:`TieredFullKV`: past K/V come from the tier (prefetched), the new
    tokens' K/V stay in memory until ``commit`` appends the accepted ones (rejected drafts never reach the tier)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, owner: TieredFullKV, layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.new = (key_states, value_states)
        past = self.owner.fetch(self.layer_idx)
        if past is None:
            return key_states, value_states
        return torch.cat([past[0], key_states], dim=2), torch.cat([past[1], value_states], dim=2)

    def get_seq_length(self) -> int:
        return self.owner.tier.length(self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class TieredFullKV:
    """The full KV in a slower tier of :mod:`kvcomp.tiers` (``"host"``, ``"disk"``, or ``"ram"``), streamed in
    layer by layer for each verification.

    ``prefetch()`` (called when a round starts drafting) queues reads of the first ``window`` layers on the
    tiers' background worker; each layer the verification forward consumes queues the read of the layer
    ``window`` further, so at most ``window`` layers of full KV are in memory at once (``window=0``: all).
    ``transfer_seconds`` is the time the verification waited for reads (not hidden); ``read_seconds`` the time
    the reads took; the difference ran while the draft model or earlier layers computed.
    This adapter uses only ``Tier.append/read/length/nbytes/close`` and ``tiers.shared_worker``: whole-layer
    reads are contiguous (``read``), which the Prefetcher's index ``gather`` would do slower, and a sliding
    window of reads needs more than its one outstanding request.
    """

    def __init__(self, model, tier: str | Tier = "disk", window: int = 0, overlap: bool = True, **tier_options):
        from kvcomp.tiers import make_tier

        n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        # A Tier object (a kvcomp.store.StoreTier over a stored context's full KV) is used as it is.
        self.tier = tier if isinstance(tier, Tier) else make_tier(tier, device=model.device, **tier_options)
        self.cache = Cache(layers=[_TierLayer(self, i) for i in range(n_layers)])
        self.n_layers = n_layers
        self.window = window if window > 0 else n_layers
        self.overlap = (
            overlap  # False: read each layer when the forward needs it (measures what overlap buys)
        )
        self._reads: dict[int, Any] = {}
        # On CUDA the copies run on a side stream, so they overlap the model's kernels (the default stream
        # would serialise them); the consumer waits on each read's event.
        cuda = self.tier.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.tier.device) if cuda else None
        self.bytes_in = 0
        self.transfer_seconds = 0.0
        self.read_seconds = 0.0

    def tee(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.tier.append(layer, k, v)

    def _read(self, layer: int, ready=None):
        t0 = time.perf_counter()
        if self._stream is None:
            k, v = self.tier.read(layer)
            return k, v, None, time.perf_counter() - t0
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)  # what the model stream wrote into a device tier comes first
            k, v = self.tier.read(layer, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return k, v, event, time.perf_counter() - t0

    def _submit(self, layer: int) -> None:
        from kvcomp.tiers import shared_worker

        if layer < self.n_layers and layer not in self._reads and self.tier.length(layer) > 0:
            ready = None
            if self._stream is not None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.tier.device))
            self._reads[layer] = shared_worker().submit(self._read, layer, ready)

    def prefetch(self) -> None:
        if self.overlap:
            for layer in range(self.window):
                self._submit(layer)

    def fetch(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        self._submit(layer)  # a miss (no prefetch): read now
        future = self._reads.pop(layer, None)
        if future is None:
            return None
        t0 = time.perf_counter()
        k, v, event, read_s = future.result()
        if event is not None:
            current = torch.cuda.current_stream(self.tier.device)
            current.wait_event(event)
            k.record_stream(current)
            v.record_stream(current)
        self.transfer_seconds += time.perf_counter() - t0
        self.read_seconds += read_s
        self.bytes_in += k.numel() * k.element_size() + v.numel() * v.element_size()
        if self.overlap:
            self._submit(layer + self.window)
        return k, v

    def new_kv(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [lay.new[0] for lay in self.cache.layers], [lay.new[1] for lay in self.cache.layers]

    def commit(self, n: int, kept: int) -> None:
        for lay in self.cache.layers:
            k, v = lay.new
            self.tier.append(lay.layer_idx, k[:, :, :kept], v[:, :, :kept])
            lay.new = None

    def nbytes(self) -> dict[str, int]:
        total = {"device": 0, "host": 0, "disk": 0}
        for kind, n in self.tier.nbytes_by_kind().items():
            total[kind] = total.get(kind, 0) + n
        return total

    def close(self) -> None:
        for future in self._reads.values():
            future.result()
        self._reads.clear()
        self.tier.close()


def make_full_kv(model, config: Lossless, context=None):
    """Where verification's full KV lives: ``"resident"`` (a DynamicCache) or a :mod:`kvcomp.tiers` tier
    (``"store"``: a :mod:`kvcomp.store`). With a stored ``context`` (:class:`kvcomp.contexts.LoadedContext`), its
    stored full KV: read from the store at every verification for ``"store"``, else copied into the tier."""
    if context is None:
        if config.tier == "resident":
            return ResidentFullKV(model)
        return TieredFullKV(model, config.tier, **config.tier_options)
    stored = context.full_kv_tier(model.device)
    if config.tier == "store":
        options = {k: v for k, v in config.tier_options.items() if k in ("window", "overlap")}
        return TieredFullKV(model, stored, **options)
    full = make_full_kv(model, config)
    try:
        for layer in stored.layers:
            full.tee(layer, *stored.read(layer))
    finally:
        stored.close()
    return full


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
# decoding


def _choose(
    scores: torch.Tensor, sampling: Sampling | None, gen: torch.Generator | None
) -> tuple[torch.Tensor, Any]:
    """Next token per row from ``[B, V]`` logits, and the draft distribution (sampling) or None."""
    if sampling is None:
        return scores.argmax(-1), None
    probs = sampling.probs(scores)
    return _draw(probs, gen), probs


@torch.inference_mode()
def _feed_full(model, full, ids, block_mask, mask, next_pos, keep_new: bool = False):
    """Run a left-padded prompt block ``ids`` ``[B, n]`` over the full KV and commit it there.

    Returns the logits after the block ``[B, 1, V]``, the extended attention mask, the block's positions (each row continues at its
    own ``next_pos``) and, when ``keep_new``, the block's K/V per layer (else None)."""
    n = ids.shape[1]
    mask = torch.cat([mask, block_mask], dim=1)
    pos = next_pos.view(-1, 1) + (block_mask.cumsum(1) - 1).clamp(min=0)
    logits = steps.forward(model, full.cache, ids, pos, mask)
    new_kv = full.new_kv(n) if keep_new else None
    full.commit(n, n)
    return logits, mask, pos, new_kv


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
    # Verified K/V (and their ids, validity, positions) waiting to be appended to the compressed cache.
    pend_k, pend_v = None, None
    pend_ids = torch.zeros(batch, 0, dtype=torch.long, device=device)
    pend_valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
    pend_pos = torch.zeros(batch, 0, dtype=torch.long, device=device)

    # -- prefill ---------------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    head = None  # (ids, valid, positions) the first verification runs before the drafts: a question block
    if context is None:
        draft = CompressedCache(model, compressor, question_length=question_length)
        full = make_full_kv(model, config)
        ids, mask = (t.to(device) for t in blocks[0])
        draft.tee = full.tee
        logits = steps.forward(model, draft, ids, _positions(mask), mask)[:, -1]
        draft.tee = None
        draft_mask = mask.clone()
        full_mask = mask.clone()
        next_pos = mask.sum(1)  # [B] position of the next real token of each row
        for ids, mask in blocks[1:]:
            ids, mask = ids.to(device), mask.to(device)
            block_logits, full_mask, pos, (k_new, v_new) = _feed_full(model, full, ids, mask, full_mask, next_pos,
                                                                      keep_new=True)
            logits = block_logits[:, -1]
            pend_k = k_new if pend_k is None else [torch.cat(p, dim=2) for p in zip(pend_k, k_new)]
            pend_v = v_new if pend_v is None else [torch.cat(p, dim=2) for p in zip(pend_v, v_new)]
            pend_ids = torch.cat([pend_ids, ids], dim=1)
            pend_valid = torch.cat([pend_valid, mask.bool()], dim=1)
            pend_pos = torch.cat([pend_pos, pos], dim=1)
            next_pos = next_pos + mask.sum(1)
    else:
        draft = context.new_cache(model)
        full = make_full_kv(model, config, context)
        full.prefetch()  # the full KV starts streaming in now
        logits = context.logits
        draft_mask = context.mask.clone()
        full_mask = context.mask.clone()
        next_pos = context.mask.sum(1)
        if blocks and blocks[0][0].shape[1]:
            ids, mask = (t.to(device) for t in blocks[0])
            head = (ids, mask.bool(), next_pos.view(-1, 1) + (mask.cumsum(1) - 1).clamp(min=0))
    prefill_seconds = time.perf_counter() - t0

    if head is None:
        last, _ = _choose(logits, sampling, gen)
        generated: list[list[int]] = [[t] for t in last.tolist()]
        finished = [t in stop_ids or max_new_tokens <= 1 for t in last.tolist()]
        head = (last.view(-1, 1), torch.ones(batch, 1, dtype=torch.bool, device=device), next_pos.view(-1, 1))
    else:
        generated = [[] for _ in range(batch)]
        finished = [False] * batch

    # -- rounds ----------------------------------------------------------------------------------------------
    # Each round verifies [head | d_1..d_gamma]: head is `last` (the newest token, in neither cache), or in the
    # first round of a stored context the question block.
    t_decode = time.perf_counter()
    while not all(finished):
        head_ids, head_valid, head_pos = head
        after_head = next_pos + head_valid.sum(1)  # [B] position of the first drafted token
        needed = max(max_new_tokens - len(g) for g, f in zip(generated, finished) if not f)
        gamma = min(gamma_ctl.next(), needed - 1)
        full.prefetch()  # the full KV streams in while the draft model works
        t0 = time.perf_counter()
        drafts = torch.zeros(batch, 0, dtype=torch.long, device=device)
        q_probs = []
        snapshots = None
        width_at_snapshot = draft_mask.shape[1]
        if gamma > 0:
            # Step 1: the verified tokens of the previous round, then the head.
            if pend_k is None:
                snapshots = draft.checkpoint()
            else:
                draft.stage_verified(pend_k, pend_v)
            step_ids = torch.cat([pend_ids, head_ids], dim=1)
            step_valid = torch.cat([pend_valid, head_valid], dim=1)
            step_pos = torch.cat([pend_pos, head_pos], dim=1)
            width_at_snapshot += pend_ids.shape[1]
            for i in range(gamma):
                draft_mask = torch.cat([draft_mask, step_valid.long()], dim=1)
                logits = steps.forward(model, draft, step_ids, step_pos, draft_mask)
                stats.draft_forwards += 1
                if snapshots is None:
                    snapshots = draft.take_snapshots()
                token, q = _choose(logits[:, -1], sampling, gen)
                drafts = torch.cat([drafts, token.view(-1, 1)], dim=1)
                if q is not None:
                    q_probs.append(q)
                step_ids = token.view(-1, 1)
                step_valid = torch.ones(batch, 1, dtype=torch.bool, device=device)
                step_pos = after_head.view(-1, 1) + i
        _sync(device)
        draft_s = time.perf_counter() - t0

        # -- verify: one forward of [head, d_1..d_gamma] over the full KV -----------------------------------
        t0 = time.perf_counter()
        v_ids = torch.cat([head_ids, drafts], dim=1)
        n_head = head_ids.shape[1]
        n = n_head + gamma
        v_valid = torch.cat([head_valid, torch.ones(batch, gamma, dtype=torch.bool, device=device)], dim=1)
        verify_mask = torch.cat([full_mask, v_valid.to(full_mask.dtype)], dim=1)
        v_pos = torch.cat([head_pos, after_head.view(-1, 1) + torch.arange(gamma, device=device)], dim=1)
        # [B, gamma + 1, V]: after the head's last token, then after each draft
        logits = steps.forward(model, full.cache, v_ids, v_pos, verify_mask, logits_to_keep=gamma + 1)
        if sampling is None:
            target = logits.argmax(-1)  # [B, gamma + 1]
            match = (drafts == target[:, :gamma]).long().cumprod(dim=1)
            accepted = match.sum(1)  # [B]
            bonus = target.gather(1, accepted.view(-1, 1)).squeeze(1)
        else:
            accepted, bonus = _speculative_sample(sampling.probs(logits), q_probs, drafts, gen)
        _sync(device)
        verify_s = time.perf_counter() - t0

        # -- commit -------------------------------------------------------------------------------------------
        t0 = time.perf_counter()
        kept = n_head + int(accepted.max())  # slots of this forward the full KV keeps: head, d_1..d_a
        k_new, v_new = full.new_kv(n)
        k_new, v_new = [k[:, :, :kept] for k in k_new], [v[:, :, :kept] for v in v_new]
        full.commit(n, kept)
        slot = torch.arange(kept - n_head, device=device)
        valid = torch.cat([head_valid, slot.view(1, -1) < accepted.view(-1, 1)], dim=1)  # [B, kept]
        kept_pos = torch.cat([head_pos, after_head.view(-1, 1) + slot], dim=1)
        full_mask = torch.cat([full_mask, valid.to(full_mask.dtype)], dim=1)
        stats.holes += int((~valid[:, n_head:]).sum())
        if snapshots is None and pend_k is not None:
            # Nothing was drafted (gamma 0), so the earlier verified tokens are still waiting: keep them.
            pend_k = [torch.cat(p, dim=2) for p in zip(pend_k, k_new)]
            pend_v = [torch.cat(p, dim=2) for p in zip(pend_v, v_new)]
            pend_ids = torch.cat([pend_ids, v_ids[:, :kept]], dim=1)
            pend_valid = torch.cat([pend_valid, valid], dim=1)
            pend_pos = torch.cat([pend_pos, kept_pos], dim=1)
        else:
            pend_k, pend_v, pend_ids, pend_valid = k_new, v_new, v_ids[:, :kept], valid
            pend_pos = kept_pos
        if snapshots is not None:
            draft.rollback(snapshots)
            draft_mask = draft_mask[:, :width_at_snapshot]
        next_pos = after_head + accepted
        for b, (row, a, t_bonus) in enumerate(zip(drafts.tolist(), accepted.tolist(), bonus.tolist())):
            if finished[b]:
                continue
            for t in row[:a] + [t_bonus]:
                generated[b].append(t)
                if t in stop_ids or len(generated[b]) >= max_new_tokens:
                    finished[b] = True
                    break
        head = (bonus.view(-1, 1), torch.ones(batch, 1, dtype=torch.bool, device=device), next_pos.view(-1, 1))
        stats.commit_seconds += time.perf_counter() - t0

        stats.rounds += 1
        stats.verify_passes += 1
        stats.gammas.append(gamma)
        stats.drafted_tokens += gamma * batch
        stats.accepted_tokens += int(accepted.sum())
        for a in accepted.tolist():
            stats.accepted_hist[a] = stats.accepted_hist.get(a, 0) + 1
        stats.draft_seconds += draft_s
        stats.verify_seconds += verify_s
        if gamma > 0:
            gamma_ctl.update(accepted, gamma, draft_s, verify_s)
    decode_seconds = time.perf_counter() - t_decode

    stats.bytes_in = full.bytes_in
    stats.transfer_seconds = full.transfer_seconds
    stats.read_seconds = full.read_seconds
    stats.full_kv_bytes = full.nbytes()
    full.close()
    rows = [steps.cut_at_stop(row, stop_ids, limit=max_new_tokens) for row in generated]
    return rows, dict(
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        cache=draft,
        generated_steps=max(len(g) for g in generated),
        lossless=stats,
        raw=generated,
    )


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
    full = make_full_kv(model, config, context)
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
    stats.bytes_in, stats.transfer_seconds, stats.read_seconds = (
        full.bytes_in,
        full.transfer_seconds,
        full.read_seconds,
    )
    stats.full_kv_bytes = full.nbytes()
    full.close()
    rows = [steps.cut_at_stop(row, stop_ids) for row in generated]
    return rows, dict(
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        lossless=stats,
        raw=generated,
        generated_steps=max(len(g) for g in generated),
    )


def _speculative_sample(
    p: torch.Tensor, q_probs: list[torch.Tensor], drafts: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard rule (Leviathan et al., 2023; Chen et al., 2023), per row.

    p: ``[B, gamma + 1, V]`` target probabilities; q_probs: gamma ``[B, V]`` draft probabilities; drafts:
    ``[B, gamma]``. Returns accepted counts ``[B]`` and the token each row emits after its accepted prefix.
    """
    batch, n, _ = p.shape
    gamma = n - 1
    if gamma == 0:
        return torch.zeros(batch, dtype=torch.long, device=p.device), _draw(p[:, 0], gen)
    q = torch.stack(q_probs, dim=1)  # [B, gamma, V]
    p_d = p[:, :gamma].gather(2, drafts.unsqueeze(-1)).squeeze(-1)
    q_d = q.gather(2, drafts.unsqueeze(-1)).squeeze(-1)
    r = torch.rand(batch, gamma, generator=gen, device=p.device, dtype=p.dtype)
    ok = r * q_d < p_d  # r < p/q, without dividing
    accepted = ok.long().cumprod(dim=1).sum(1)
    at = accepted.clamp(max=gamma - 1).view(-1, 1, 1).expand(-1, 1, p.shape[-1])
    residual = (p[:, :gamma].gather(1, at) - q.gather(1, at)).clamp(min=0).squeeze(1)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-300), p[:, :gamma].gather(1, at).squeeze(1))
    dist = torch.where((accepted == gamma).view(-1, 1), p[:, gamma], residual)
    return accepted, _draw(dist, gen)


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``[B, V]`` probabilities (inverse CDF; torch.multinomial is ~50x slower in float64)."""
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=gen, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


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
