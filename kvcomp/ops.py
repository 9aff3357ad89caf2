"""Tensor ops that every path computing attention or attention scores shares.

One rule for which keys a query sees (:func:`visible`), one place for logit soft-capping (:func:`softcap`) and
attention sinks (:func:`softmax`), dense attention over kept K/V (:func:`dense_attention`) and the attention
each key receives (:func:`received_attention`). Dense attention, the selection scorers, the kernels' torch
implementations, KVTC's online softmax, retrieval and lossless verification all go through these; the C and
Triton kernels implement the same formulas and are tested against them. This module imports nothing of kvcomp
and nothing of transformers.

Positions, not slot indices, decide visibility: a compressed cache keeps tokens that are not contiguous, so a
key at original position ``k_pos`` is visible to a query at ``q_pos`` when ``q_pos - window < k_pos <= q_pos``
(``window`` None: no lower bound). That is transformers' causal mask with its sliding-window overlay
(``kv_idx > q_idx - sliding_window``). Empty slots (padding, a shorter row's unused slots) hold ``SENTINEL``,
larger than any real position, so the same test hides them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Position of an empty slot (padding, or a slot a shorter row does not use). Larger than any real position,
# so the causal bound of :func:`visible` masks it without a separate validity tensor.
SENTINEL = 2**30

_QUERY_CHUNK = 1024  # queries per block when a mask must be materialized (bounds prefill memory)
PROBS_PER_CHUNK = 1 << 22  # probabilities a scoring pass holds at once (16 MiB in float32): below what a
# layer's own K/V costs at long prompts, so scoring never lifts the prefill's peak above no compression's


def rows_per_chunk(batch_heads: int, length: int, most: int = 256, budget: int = PROBS_PER_CHUNK) -> int:
    """Query rows to score at a time: at most ``most``, and few enough that their float32 probabilities over
    ``length`` keys, for ``batch_heads`` (batch x query heads), stay within ``budget`` (a pass that runs
    while the full prompt KV of every layer is held, as KVzip's does, takes a smaller one)."""
    return max(1, min(most, budget // max(1, batch_heads * length)))


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer attends, read from the model (``kvcomp.attention.layer_specs``).

    scaling: the logit scale (``head_dim ** -0.5`` for most models; Gemma's ``query_pre_attn_scalar ** -0.5``).
    window: a sliding-window layer's window ``W`` (a query sees its own and the ``W - 1`` previous positions),
    or None for full attention.
    softcap: logits become ``softcap * tanh(logits / softcap)`` before masking (Gemma 2), or None.
    sinks: ``[H_q]`` per-head sink logits (gpt-oss): one more softmax entry per query head whose value is zero,
    so probabilities over the real keys sum to less than one; or None.
    """

    scaling: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """True when attention is a plain softmax of scaled logits (what ``scaled_dot_product_attention`` does)."""
        return self.softcap is None and self.sinks is None

    def grouped_sinks(self, n_kv_heads: int, n_queries: int, device=None) -> torch.Tensor | None:
        """The sink logits laid out as the grouped query rows ``[1, H_kv, G * n, 1]`` float32 (row ``g * n + i``
        is query ``i`` of the group's head ``g``), or None."""
        if self.sinks is None:
            return None
        g = self.sinks.numel() // n_kv_heads
        rows = self.sinks.float().to(device).view(n_kv_heads, g, 1).expand(n_kv_heads, g, n_queries)
        return rows.reshape(1, n_kv_heads, g * n_queries, 1)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Bool, broadcast of ``q_pos`` and ``k_pos``: whether a key at ``k_pos`` is visible to a query at ``q_pos``
    (``q_pos - window < k_pos <= q_pos``; SENTINEL keys are never visible)."""
    ok = k_pos <= q_pos
    if window is not None:
        ok = ok & (k_pos > q_pos - window)
    return ok


def reach(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> tuple[int, int]:
    """The slots ``[lo, hi)`` of ``k_pos`` (``[B, H, L]``) that hold every key some query at ``q_pos`` (``[B, m]``)
    sees by :func:`visible` (first to last such slot over all rows and heads; a slot between them that no query
    sees stays for the mask to hide). ``(0, L)`` when no query sees any key. One host read: for long blocks, so
    that a query chunk of a sliding-window layer attends to a band of keys, and a causal one skips the keys after
    its last query."""
    q_hi = q_pos.amax(1).view(-1, 1, 1)
    band = None if window is None else window + (q_hi - q_pos.amin(1).view(-1, 1, 1))  # from the lowest query's window
    slots = visible(q_hi, k_pos, band).any(1).any(0).nonzero()
    if not len(slots):
        return 0, k_pos.shape[-1]
    return int(slots[0]), int(slots[-1]) + 1


def horizon(next_pos: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """The oldest position a query at ``next_pos`` or later can still see (None: every position)."""
    return None if window is None else next_pos - window + 1


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma 2's attention soft-capping), or ``logits`` unchanged when ``cap`` is
    None. Apply it to scaled logits, before masking."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def softmax(logits: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dimension of (masked, ``-inf``) logits, with optional sink logits (broadcast to
    ``logits.shape[:-1] + (1,)``) as an extra entry whose probability is dropped."""
    if sinks is None:
        return logits.softmax(-1)
    top = torch.maximum(logits.amax(-1, keepdim=True), sinks)
    e = torch.exp(logits - top)
    return e / (e.sum(-1, keepdim=True) + torch.exp(sinks - top))


def attention_probs(qg: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None, spec: AttentionSpec,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float32 probabilities ``[B, H_kv, R, L]`` of grouped queries ``qg`` ``[B, H_kv, R, D]`` over keys ``k``
    ``[B, H_kv, L, D]`` (or a tuple of key blocks, read as their concatenation without copying the keys):
    scale, soft-cap, mask by ``allowed`` (broadcast to ``[B, H_kv, R, L]``; None: every key visible), softmax
    with the layer's sinks (``sinks``: :meth:`AttentionSpec.grouped_sinks` for these rows)."""
    if isinstance(k, tuple):
        logits = torch.cat([torch.matmul(qg, part.transpose(-1, -2)) for part in k], dim=-1)
    else:
        logits = torch.matmul(qg, k.transpose(-1, -2))
    logits = softcap(logits.float() * spec.scaling, spec.softcap)
    return softmax(logits if allowed is None else logits.masked_fill(~allowed, float("-inf")), sinks)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor | None,
                    spec: AttentionSpec, need_weights: bool = False, all_visible: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``q`` over kept K/V, masked by positions (:func:`visible`), with the layer's softcap and sinks.

    q: [B, H_q, n, D]; k, v: [B, H_kv, L, D]; q_pos: [B, n]; k_pos: [B, H_kv, L] (SENTINEL = empty slot).
    Query heads are grouped per KV head (GQA) instead of repeating K/V. A query that sees no key at all (a
    padding query) attends to every slot rather than produce NaN; its output is never used.
    ``all_visible``: the caller knows on the host that the single query (n == 1) of each row sees every slot (a
    decode step over a store without empty slots on a full-attention layer); nothing is read back to check it,
    and ``k_pos`` may be None.
    Returns out [B, H_q, n, D] and, if asked, weights [B, H_kv, G, n, L] (float32 probabilities).
    """
    b, hq, n, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    from kvcomp.kernels import cpu_native  # (kvcomp.files, which it imports, imports this module)

    if n == 1 and all_visible and length and cpu_native.supports_decode(q, k, v):
        # One pass over the keys and one over the values (sdpa, or a matmul, softmax and matmul, take more).
        out, probs = cpu_native.decode_attention(q.reshape(b, hkv, g, d), k, v, spec.scaling, spec.softcap,
                                                 spec.grouped_sinks(hkv, 1, q.device))
        return out.reshape(b, hq, n, d), (probs.view(b, hkv, g, 1, length) if need_weights else None)
    if spec.plain and not need_weights and length:
        # Decode (n == 1) with every stored key visible, and an unpadded causal prefill, need no mask.
        if n == 1:
            if all_visible or bool(visible(q_pos.view(b, 1, 1), k_pos, spec.window).all()):
                out = F.scaled_dot_product_attention(q.reshape(b, hkv, g, d), k, v, scale=spec.scaling)
                return out.reshape(b, hq, n, d), None
        elif n == length and spec.window is None and not bool((k_pos >= SENTINEL).any()):
            if bool((k_pos == q_pos.view(b, 1, n)).all()):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.scaling, enable_gqa=g > 1)
                return out, None
    if n == 1 and all_visible and length:  # weights asked, or softcap / sinks: still no mask to build
        probs = attention_probs(q.reshape(b, hkv, g, d), k, None, spec, spec.grouped_sinks(hkv, 1, q.device))
        out = torch.matmul(probs.to(v.dtype), v).reshape(b, hq, n, d)
        return out, (probs.view(b, hkv, g, 1, length) if need_weights else None)
    k_pos = k_pos.to(q_pos.dtype)
    # A long block over many keys (a prefill, a question block): each query chunk attends only to the slots it
    # can reach (a band on a sliding-window layer, no keys after its last query on a causal one). Not when the
    # weights are returned: they cover every slot (a query that sees no key spreads over all of them).
    banded = n > 1 and length > _QUERY_CHUNK and not need_weights
    outs, weights = [], []
    for start in range(0, n, _QUERY_CHUNK):
        stop = min(n, start + _QUERY_CHUNK)
        m = stop - start
        qc = q[:, :, start:stop].reshape(b, hkv, g * m, d)
        lo, hi = reach(q_pos[:, start:stop], k_pos, spec.window) if banded else (0, length)
        kc, vc = k[:, :, lo:hi], v[:, :, lo:hi]
        mask = visible(q_pos[:, None, None, start:stop, None], k_pos[:, :, None, None, lo:hi], spec.window)
        mask = mask | ~mask.any(-1, keepdim=True)  # [B, H_kv, 1, m, hi - lo]
        mask = mask.expand(b, hkv, g, m, hi - lo).reshape(b, hkv, g * m, hi - lo)
        if need_weights or not spec.plain:
            probs = attention_probs(qc, kc, mask, spec, spec.grouped_sinks(hkv, m, q.device))
            outs.append(torch.matmul(probs.to(v.dtype), vc))
            if need_weights:
                weights.append(probs.view(b, hkv, g, m, length))
        else:
            outs.append(F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=spec.scaling))
    out = torch.cat([o.view(b, hkv, g, -1, d) for o in outs], dim=3).reshape(b, hq, n, d)
    return out, (torch.cat(weights, dim=3) if need_weights else None)


def received_attention(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, q_real: torch.Tensor,
                       k_pos: torch.Tensor, spec: AttentionSpec, v: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention each key receives (the layer's own: causal, window, soft-cap, sinks), summed over the real
    queries and the query group (H2O's statistic), and, given ``v``, the attention output of the same
    probabilities: what :func:`dense_attention` returns, to float rounding, from one pass instead of two.

    q: [B, H_q, n, D], k (and v): [B, H_kv, L, D], q_pos / q_real: [B, n] positions / real-token flags of the
    queries, k_pos: [B, H_kv, L] (SENTINEL = padding) -> (received [B, H_kv, L] float32, out [B, H_q, n, D] or
    None). Queries go in chunks, each against the keys up to the last one it can see, so the ``n x L`` matrix is
    never whole and the causal upper triangle is mostly skipped.
    """
    b, hq, n, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    prompt = spec.plain and spec.window is None and n == length and bool(q_real.all()) and bool(
        (k_pos == q_pos.view(b, 1, n)).all())
    from kvcomp.kernels import cpu_native  # (kvcomp.files, which it imports, imports this module)

    if prompt and cpu_native.supports_prompt(q, k, v):  # one pass, the probabilities never whole: ~1.8x sdpa's speed
        return cpu_native.prompt_attention(q, k, v, spec.scaling)
    received = torch.zeros(b, hkv, length, dtype=torch.float32, device=q.device)
    out = None if v is None else torch.empty(b, hkv, g, n, d, dtype=v.dtype, device=q.device)
    if prompt:
        _causal_prompt_received(q, k, v, q_pos, k_pos, spec.scaling, received, out)
    else:
        weights = q_real.float()
        chunk = rows_per_chunk(b * hq, length)
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            m = stop - start
            # Slots some query of the chunk can see: a sliding layer touches a band of keys, not every earlier one.
            lo, hi = reach(q_pos[:, start:stop], k_pos, spec.window)
            qc = q[:, :, start:stop].reshape(b, hkv, g * m, d)
            allowed = visible(q_pos[:, None, None, start:stop, None], k_pos[:, :, None, None, lo:hi], spec.window)
            allowed = allowed | ~allowed.any(-1, keepdim=True)  # padding queries: finite, then zero-weighted
            allowed = allowed.expand(b, hkv, g, m, hi - lo).reshape(b, hkv, g * m, hi - lo)
            probs = attention_probs(qc, k[:, :, lo:hi], allowed, spec, spec.grouped_sinks(hkv, m, q.device))
            # Sum over the group and the real queries as one batched matmul (einsum here was ~30x slower on CPU).
            rows = weights[:, start:stop].view(b, 1, 1, m).expand(b, hkv, g, m).reshape(b, hkv, 1, g * m)
            received[..., lo:hi] += torch.matmul(rows, probs).view(b, hkv, hi - lo)
            if out is not None:
                out[:, :, :, start:stop] = torch.matmul(probs.to(v.dtype), v[:, :, lo:hi]).view(b, hkv, g, m, d)
    return received, (None if out is None else out.view(b, hq, n, d))


_PROMPT_QUERIES = 64  # queries per chunk of an unpadded causal prompt (of 16-512, fastest at 2K and 8K on a CPU)


def _causal_prompt_received(q, k, v, q_pos, k_pos, scaling: float, received: torch.Tensor,
                            out: torch.Tensor | None) -> None:
    """:func:`received_attention` of an unpadded prompt over its own keys on a plain full-attention layer (the
    common prefill), into ``received`` and ``out`` (``[B, H_kv, G, n, D]``, or None): every key before a query
    chunk is visible to all of it, so only the chunk's diagonal block is masked, the scale is folded into the
    queries, and the logits and probabilities go to two buffers allocated once. ~2.5x faster than the general
    path at 4K tokens; with ``out``, 1.5x faster than sdpa's attention plus the statistic alone at 2K-8K."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    chunk = min(_PROMPT_QUERIES, rows_per_chunk(b * hq, n))
    logits_buffer = torch.empty(b * hq * chunk * n, dtype=torch.float32, device=q.device)
    probs_buffer = torch.empty_like(logits_buffer)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        m = stop - start
        qc = (q[:, :, start:stop] * scaling).reshape(b, hkv, g * m, d)
        logits = logits_buffer[: b * hq * m * stop].view(b, hkv, g * m, stop)
        if q.dtype == torch.float32:
            torch.matmul(qc, k[:, :, :stop].transpose(-1, -2), out=logits)
        else:
            logits.copy_(torch.matmul(qc, k[:, :, :stop].transpose(-1, -2)))
        hidden = ~visible(q_pos[:, None, None, start:stop, None], k_pos[:, :, None, None, start:stop])
        logits[..., start:stop].view(b, hkv, g, m, m).masked_fill_(hidden, float("-inf"))
        probs = probs_buffer[: logits.numel()].view_as(logits)
        torch.softmax(logits, -1, out=probs)
        received[..., :stop] += probs.sum(2)
        if out is not None:
            out[:, :, :, start:stop] = torch.matmul(probs.to(v.dtype), v[:, :, :stop]).view(b, hkv, g, m, d)


# -- slots ------------------------------------------------------------------------------------------------------
def take_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, h, index[b, h, i]]``: ``x`` ``[B, H, L, ...]`` at slots ``index`` ``[B, H, L']`` (int64), giving
    ``[B, H, L', ...]``. One row copy per slot (``index_select`` over the flattened slots), several times faster
    on a CPU than ``gather`` with an index expanded over the trailing dimensions (measured 56 against 278 us
    for 1,100 slots of 3 heads x 64 floats); a non-contiguous ``x`` (a view of a larger buffer) uses ``gather``."""
    b, h, length = x.shape[:3]
    rest = x.shape[3:]
    if not x.is_contiguous():
        return x.gather(2, index.view(*index.shape, *[1] * len(rest)).expand(*index.shape, *rest))
    offsets = torch.arange(b * h, device=x.device).view(b, h, 1) * length
    flat = (index + offsets).reshape(-1)
    return x.reshape(b * h * length, *rest).index_select(0, flat).view(b, h, index.shape[-1], *rest)
