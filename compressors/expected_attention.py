"""Expected Attention: keep the tokens future queries are expected to attend to, from query statistics.

Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution", 2025, https://arxiv.org/abs/2510.00636 (kvpress's ExpectedAttentionPress)

Queries before RoPE are modelled per query head as a Gaussian (mean ``mu`` ``[B, H_q, D]``, covariance ``S``
``[B, H_q, D, D]``, from the real queries of the prompt after the first ``n_sink``). A query at future position
``j`` is ``R(j) q``; averaging the rotation over the next ``n_future`` positions (``A = mean_j R(j)``, the
model's own RoPE, read in :meth:`ExpectedAttention.bind`) gives the closed form
``E[exp(s q.k)] = exp(s mu_f.k + s^2 k^T S_f k / 2)`` with ``mu_f = A mu``, ``S_f = A S A^T`` and ``s`` the layer's
scaling. These expected logits go through the layer's soft-cap, visibility (the next query's window) and sinks
(:mod:`kvcomp.ops`), are averaged over the query group and multiplied by ``||v||``: ``[B, H_kv, n]``. The first
``n_sink`` tokens are always kept and left out of the softmax (kvpress does the same). (A soft-capped layer caps the expected logit, an approximation: the
expectation of a capped exponential has no closed form.)

While decoding (inside a decode-time wrapper, which calls :meth:`enable_decode_scoring`) the running query sums
are kept with the layer (``store.extra``, counted in its bytes) and updated with each step's queries (held as
they are and added in one batched product every 16 steps or when scored), and the stored keys are re-scored for
the positions after the current one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp import validation
from kvcomp.attention import UnsupportedModel, check_rope, rotary_embedding
from kvcomp.compressor import CompressorError
from kvcomp.ops import softcap, softmax, visible
from kvcomp.selection import TokenSelection
from kvcomp.transform_coding import apply_rope, rotate, undo_rope

_FOLD = 16  # decode steps whose queries wait, as they are, before one batched update of the query statistics


def average_rope(start: torch.Tensor, n_future: int, inv_freq: torch.Tensor, scaling: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[B, 2 * len(inv_freq)]`` of the rotation ``A`` averaged over the next ``n_future`` positions:
    ``rotate(x, cos, sin) = x @ A = mean_{j < n_future} rope(x, start[b] + j)``, and ``rotate(x, cos, -sin) =
    x @ A^T`` (``A`` is block-diagonal in rotate-half pairs, so neither is a ``D x D`` product).

    In closed form (float64): ``mean_j e^{i t (p + j)} = e^{i t (p + (F - 1) / 2)} sin(F t / 2) / (F sin(t / 2))``
    for each frequency ``t``, so nothing is summed over the ``F`` positions."""
    t = inv_freq.to(device=start.device, dtype=torch.float64)
    half = torch.sin(t / 2)
    gain = torch.where(half.abs() > 1e-12, torch.sin(n_future * t / 2) / (n_future * half), torch.ones_like(t))
    angle = (start.view(-1, 1).double() + (n_future - 1) / 2) * t  # [B, R / 2]
    cos, sin = torch.cos(angle) * gain * scaling, torch.sin(angle) * gain * scaling
    return torch.cat([cos, cos], -1).float(), torch.cat([sin, sin], -1).float()


@dataclass
class ExpectedAttention(TokenSelection):
    n_future: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.positive_int("n_future", self.n_future, owner=self, hint=" (future positions averaged)")
        validation.non_negative_int("n_sink", self.n_sink, owner=self, hint=" (first tokens always kept)")
        validation.boolean("use_covariance", self.use_covariance, owner=self)
        validation.boolean("use_vnorm", self.use_vnorm, owner=self)
        validation.finite_float("epsilon", self.epsilon, 0.0, owner=self)
        self._rope: dict[bool, tuple[torch.Tensor, float] | None] = {}
        self._decode = False

    # -- model ------------------------------------------------------------------------------------------
    def bind(self, model) -> None:
        """Read the RoPE of each layer type (None: the model has none, queries carry no rotation) and check that
        it is the rotate-half RoPE undone here; refused (UnsupportedModel) only when tokens would be evicted."""
        from kvcomp.attention import layer_specs

        compressing = self.budget is not None or self.compression_ratio > 0
        for sliding in {spec.window is not None for spec in layer_specs(model)}:
            kind = "sliding_attention" if sliding else "full_attention"
            try:
                inv_freq, scaling = rotary_embedding(model, kind)
            except UnsupportedModel as err:
                if "no rotary embedding" not in str(err):
                    raise
                self._rope[sliding] = None
                continue
            try:
                check_rope(model, lambda x, pos, f=inv_freq, s=scaling: apply_rope(x, pos, f.to(x.device), s), kind)
            except UnsupportedModel:
                if compressing:
                    raise
            self._rope[sliding] = (inv_freq, scaling)

    def enable_decode_scoring(self) -> None:
        self._decode = True

    def _rope_of(self, ctx):
        key = ctx.spec.window is not None
        if key not in self._rope:
            raise CompressorError("ExpectedAttention reads the model's RoPE in bind(); use it through CompressedCache.")
        return self._rope[key]

    # -- statistics -------------------------------------------------------------------------------------
    def _pre_rope(self, q, positions, ctx):
        rope = self._rope_of(ctx)
        if rope is None:
            return q.float()
        inv_freq, scaling = rope
        return undo_rope(q.float(), positions.unsqueeze(1), inv_freq.to(q.device), scaling)

    def query_sums(self, q, positions, ctx, real):
        """Running sums of the real pre-RoPE queries ``[B, H_q, n, D]`` at ``positions`` ``[B, n]`` (``real``:
        ``[B, n]``): count ``[B]``, sum ``[B, H_q, D]``, sum of outer products ``[B, H_q, D, D]`` (when
        ``use_covariance``)."""
        x = self._pre_rope(q, positions, ctx) * real[:, None, :, None]
        sums = {"q_count": real.sum(1).float(), "q_sum": x.sum(2)}
        if self.use_covariance:
            sums["q_outer"] = torch.matmul(x.transpose(-1, -2), x)
        return sums

    def _folded(self, extra, ctx):
        """``extra`` with its pending decode-step queries (``q_new``, ``q_new_pos``) added to the sums: one batched
        RoPE inversion and product for up to ``_FOLD`` steps instead of one per step. A new dict (the tensors of
        ``extra`` are not written: a snapshot may share them)."""
        if "q_new" not in extra:
            return extra
        real = (extra["q_new_pos"] >= 0).float()  # padded queries were stored as zeros at position -1
        new = self.query_sums(extra["q_new"], extra["q_new_pos"].clamp_min(0), ctx, real)
        new.pop("q_count")  # counted at every step
        out = {name: t for name, t in extra.items() if name not in ("q_new", "q_new_pos")}
        return {**out, **{name: out[name] + t for name, t in new.items()}}

    def _expected_scores(self, keys, values, positions, valid, sums, next_pos, ctx):
        b, hkv, length, d = keys.shape
        hq = sums["q_sum"].shape[1]
        g = hq // hkv
        count = sums["q_count"].clamp_min(1.0).view(b, 1, 1)
        mu = sums["q_sum"] / count  # [B, H_q, D]
        # mu_f . k and k^T S_f k with mu_f = A mu, S_f = A S A^T are mu . (A^T k) and (A^T k)^T S (A^T k): the
        # keys are rotated back once (O(L D)) instead of S by A (O(D^3) per query head and step).
        kr = keys.float()
        rope = self._rope_of(ctx)
        if rope is not None:
            cos, sin = average_rope(next_pos, self.n_future, rope[0], rope[1])
            kr = rotate(kr, cos.view(b, 1, 1, -1), -sin.view(b, 1, 1, -1))
        s = ctx.spec.scaling
        logits = torch.matmul(kr, mu.view(b, hkv, g, d).transpose(-1, -2)) * s  # [B, H_kv, L, G]
        if self.use_covariance:
            cov = sums["q_outer"] / count.unsqueeze(-1) - mu.unsqueeze(-1) * mu.unsqueeze(-2)  # [B, H_q, D, D]
            # One product for the whole query group: [L, D] @ [D, G * D].
            cov = cov.view(b, hkv, g, d, d).permute(0, 1, 3, 2, 4).reshape(b, hkv, d, g * d)
            quad = torch.matmul(torch.matmul(kr, cov).view(b, hkv, length, g, d), kr.unsqueeze(-1))  # [.., L, G, 1]
            logits = logits + 0.5 * s * s * quad.squeeze(-1)
        logits = logits.transpose(-1, -2)  # [B, H_kv, G, L]
        logits = softcap(logits, ctx.spec.softcap)
        allowed = visible(next_pos.view(b, 1, 1, 1), positions.unsqueeze(2), ctx.spec.window) & valid.unsqueeze(2)
        # The always-kept first n_sink tokens stay out of the softmax (as kvpress's press does): they draw most
        # of the attention, and their share would set how much each query head weighs in the group's mean.
        allowed = allowed & (positions >= self.n_sink).unsqueeze(2)
        allowed = allowed | ~allowed.any(-1, keepdim=True)
        sinks = None if ctx.spec.sinks is None else ctx.spec.sinks.float().to(keys.device).view(1, hkv, g, 1)
        probs = softmax(logits.masked_fill(~allowed, float("-inf")), sinks).mean(2)  # [B, H_kv, L]
        if self.use_vnorm:
            probs = (probs + self.epsilon) * values.float().norm(dim=-1)
        return probs.masked_fill(positions < self.n_sink, float("inf"))

    # -- scoring ----------------------------------------------------------------------------------------
    def score(self, q, k, v, ctx):
        return self._prompt_scores(q, k, v, ctx, None)

    def prefill_score(self, store, q, k, v, ctx, budget):
        # With decode-time scoring on, prefill_extra has just put the prompt's query sums in store.extra: the
        # same sums, from the same queries, that scoring would compute a second time.
        sums = store.extra if store.extra and "q_sum" in store.extra else None
        return self._prompt_scores(q, k, v, ctx, sums)

    def _prompt_scores(self, q, k, v, ctx, sums):
        def compute():
            stats = sums if sums is not None else self._prompt_sums(q, ctx)
            return self._expected_scores(k, v, ctx.positions, ctx.valid, stats, ctx.next_positions(), ctx)

        if ctx.shared is None:
            return compute()
        key = ("expected_attention", tuple(k.shape), self.n_future, self.n_sink, self.use_covariance,
               self.use_vnorm, self.epsilon)
        return ctx.shared.get(key, compute).clone()

    def prefill_extra(self, q, ctx):
        return self._prompt_sums(q, ctx) if self._decode else None

    def _prompt_sums(self, q, ctx):
        real = ctx.query_valid & (ctx.query_positions >= self.n_sink)
        return self.query_sums(q, ctx.query_positions, ctx, real.float())

    def attend(self, layer, state, q, ctx):
        if state.extra and "q_sum" in state.extra:  # decode-time scoring: this step's queries join the statistics
            state.extra = self._observed(state.extra, q, ctx)
        return super().attend(layer, state, q, ctx)

    def _observed(self, extra, q, ctx):
        """``extra`` with a decode step's queries: counted now, kept as they are (post-RoPE, ``q_new``
        ``[B, H_q, m, D]`` with their positions ``q_new_pos`` ``[B, m]``, -1 for padding) and added to the sums
        every ``_FOLD`` steps or when scored (:meth:`_folded`)."""
        real = ctx.query_valid
        pending = {"q_count": extra["q_count"] + real.sum(1).float(),
                   "q_new": q.float().masked_fill(~real[:, None, :, None], 0.0),
                   "q_new_pos": ctx.query_positions.masked_fill(~real, -1)}
        if "q_new" in extra:
            pending["q_new"] = torch.cat([extra["q_new"], pending["q_new"]], 2)
            pending["q_new_pos"] = torch.cat([extra["q_new_pos"], pending["q_new_pos"]], 1)
        extra = {**extra, **pending}
        return self._folded(extra, ctx) if pending["q_new_pos"].shape[1] >= _FOLD else extra

    def decode_score(self, store, ctx):
        if not store.extra or "q_sum" not in store.extra:
            raise CompressorError("ExpectedAttention scores while decoding only inside a decode-time wrapper "
                                  "(decode_evict, inertiakv), which keeps its query statistics.")
        return self._expected_scores(store.keys, store.values, store.positions, store.valid,
                                     self._folded(store.extra, ctx), ctx.next_positions(), ctx)
