"""CriticalKV: scores scaled by how much each value moves the attention output.

Feng et al., "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective", 2025,
https://arxiv.org/abs/2502.03805

Wraps any scorer (``s``, ``[B, H_kv, n]``). Stage one keeps the ``first_stage_ratio`` share of the budget with
the best ``s``; the rest is ranked by ``(s + epsilon) * ||v W_o||_1``, the L1 norm of each value projected by its
query heads' slices of the output projection ``W_o`` (``[H_q, D, hidden]``), averaged over the group (kvpress's
CriticalKVPress; ``AdaKV(scorer=CriticalKV(...))`` is its CriticalAdaKV). The projected norms depend only on
the prompt, so a sweep sharing a prefill computes them once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcomp import validation
from kvcomp.allocation import ScorerWrapper
from kvcomp.attention import attention_modules
from kvcomp.compressor import CompressorError
from kvcomp.kernels import cpu_native

_OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj", "wo")


def output_projection(module) -> torch.Tensor:
    """The attention module's output projection weight ``[hidden, H_q * D]``."""
    for name in _OUTPUT_PROJECTIONS:
        proj = getattr(module, name, None)
        weight = getattr(proj, "weight", None)
        if isinstance(weight, torch.Tensor):
            return weight.t() if type(proj).__name__ == "Conv1D" else weight  # GPT-2 stores it transposed
    raise CompressorError(f"CriticalKV found no output projection ({', '.join(_OUTPUT_PROJECTIONS)}) on "
                          f"{type(module).__name__}.")


_NORM_ROWS = 256  # tokens per product in projected_value_norm: its [G, rows, hidden] block stays in cache


def projected_value_norm(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``values`` ``[B, H_kv, L, D]``, ``weight`` ``[hidden, H_q * D]`` -> ``[B, H_kv, L]``: ``||v W_o[h_q]||_1``
    averaged over the query heads of each KV head's group. One product per KV head and ``_NORM_ROWS`` tokens,
    with the group's slices side by side (``[D, G * hidden]``): its result is reduced while it is still in cache
    (the whole ``[B, G, L, hidden]`` product is 57 MB per KV head for SmolLM2 at 8K tokens)."""
    b, hkv, length, d = values.shape
    hidden = weight.shape[0]
    g = weight.shape[1] // d // hkv
    # [H_kv, D, G * hidden]; never tracked
    w = weight.detach().t().reshape(hkv, g, d, hidden).permute(0, 2, 1, 3).reshape(hkv, d, g * hidden)
    w = w.to(values.dtype)
    native = cpu_native.projected_norms(values, w, g)  # float32 on a CPU: one pass, 2-3x faster
    if native is not None:
        return native
    out = torch.empty(b, hkv, length, dtype=torch.float32, device=values.device)
    for h in range(hkv):
        for start in range(0, length, _NORM_ROWS):
            stop = min(length, start + _NORM_ROWS)
            product = torch.matmul(values[:, h, start:stop], w[h]).abs_()  # [B, rows, G * hidden]
            out[:, h, start:stop] = product.view(b, stop - start, g, hidden).sum(-1).float().mean(-1)
    return out


@dataclass
class CriticalKV(ScorerWrapper):
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        validation.finite_float("epsilon", self.epsilon, 0.0, owner=self)
        validation.fraction("first_stage_ratio", self.first_stage_ratio, owner=self,
                            hint=" (share of the budget chosen by the scorer alone)")
        self._weights: dict[int, torch.Tensor] = {}

    def bind(self, model) -> None:
        super().bind(model)
        self._weights = {i: output_projection(m) for i, m in attention_modules(model).items()}

    def _critical(self, scores, values, valid, budget, layer, shared=None):
        if layer not in self._weights:
            raise CompressorError("CriticalKV reads the output projections in bind(); use it through CompressedCache.")

        def norms():
            return projected_value_norm(values, self._weights[layer])

        norm = norms() if shared is None else shared.get(("criticalkv.norm", tuple(values.shape)), norms)
        first = torch.floor(budget.float() * self.first_stage_ratio).long()
        width = int(first.max().clamp(max=scores.shape[-1])) if first.numel() else 0
        out = (scores.float() + self.epsilon) * norm
        if width:
            top = scores.float().masked_fill(~valid, float("-inf")).topk(width, dim=-1).indices
            stage_one = torch.arange(width, device=scores.device).view(1, 1, -1) < first.view(-1, 1, 1)
            out = out.scatter(2, top, torch.where(stage_one, float("inf"), out.gather(2, top)))
        return out

    def prefill_score(self, store, q, k, v, ctx, budget):
        scores = super().prefill_score(store, q, k, v, ctx, budget)
        return self._critical(scores, v, store.valid, budget, ctx.layer, ctx.shared)

    def decode_score(self, store, ctx):
        budget = self.layer_budget(self.held_tokens(ctx), ctx)
        return self._critical(super().decode_score(store, ctx), store.values, store.valid, budget, ctx.layer)
