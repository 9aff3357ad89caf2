"""The "kvcomp" attention function and mask function registered with transformers.

Everything specific to the transformers attention API lives here and in ``kvcomp/cache.py``.

How a forward flows: ``CompressedLayer.update`` (called by the model's attention module) only parks the new
K/V on the layer and marks it active. The registered attention function then takes them with the queries,
the positions and the padding of the new tokens, and either runs dense prefill attention and calls
``compressor.prefill``, or calls ``compressor.append`` and ``compressor.attend``. The mask function returns a
small :class:`KVCompMask` (the 2-D padding mask plus what is needed to build transformers' own mask), because
kept tokens are not contiguous and a right-aligned 4-D mask cannot describe them; attention masks by
positions instead (``key_pos <= query_pos``, SENTINEL for padding).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvcomp.compressor import SENTINEL

ATTN_NAME = "kvcomp"
_QUERY_CHUNK = 1024  # queries per block when a mask must be materialized (bounds prefill memory)
_active = threading.local()


@dataclass
class KVCompMask:
    """What the "kvcomp" mask function hands to attention: the padding of the new tokens, and the arguments
    to build transformers' standard mask for layers that kvcomp does not manage."""

    padding: torch.Tensor | None  # [B, seen + q] bool, True for real tokens, or None
    q_length: int
    sdpa_args: dict[str, Any] = field(default_factory=dict)

    def new_token_valid(self, batch: int, device) -> torch.Tensor:
        if self.padding is None:
            return torch.ones(batch, self.q_length, dtype=torch.bool, device=device)
        return self.padding[:, -self.q_length :].to(device)

    def standard(self) -> torch.Tensor | None:
        return sdpa_mask(**self.sdpa_args)


def kvcomp_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                **kwargs) -> KVCompMask:
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, attention_mask=attention_mask, device=kwargs.get("device", "cpu"))
    if mask_function is not None:
        args["mask_function"] = mask_function
    padding = None
    if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
        padding = attention_mask.bool()
    return KVCompMask(padding=padding, q_length=q_length, sdpa_args=args)


def set_active(layer) -> None:
    _active.layer = layer


def take_active(layer_idx: int):
    layer = getattr(_active, "layer", None)
    if layer is None or layer.layer_idx != layer_idx or layer.pending is None:
        return None
    _active.layer = None
    return layer


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    scaling: float, need_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``q`` over kept K/V, masked by positions.

    q: [B, H_q, n, D]; k, v: [B, H_kv, L, D]; q_pos: [B, n]; k_pos: [B, H_kv, L] (SENTINEL = empty slot).
    Query heads are grouped per KV head (GQA) instead of repeating K/V.
    Returns out [B, H_q, n, D] and, if asked, weights [B, H_kv, G, n, L] (float32 probabilities).
    """
    b, hq, n, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, hkv, g * n, d)
    # Decode (n == 1) and unpadded causal prefill need no materialized mask. One reduction and one sync decide
    # the decode case: SENTINEL slots make max(k_pos) too large.
    if not need_weights and n == 1 and length and int(k_pos.max()) <= int(q_pos.min()):
        out = F.scaled_dot_product_attention(qg, k, v, scale=scaling)
        return out.reshape(b, hq, n, d), None
    k_pos = k_pos.to(q_pos.dtype)
    if not need_weights and n == length and n > 1 and not bool((k_pos >= SENTINEL).any()):
        if bool((k_pos == q_pos.view(b, 1, n)).all()):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=g > 1)
            return out, None
    outs, weights = [], []
    for start in range(0, n, _QUERY_CHUNK):
        stop = min(n, start + _QUERY_CHUNK)
        m = stop - start
        qc = q[:, :, start:stop].reshape(b, hkv, g * m, d)
        mask = k_pos[:, :, None, None, :] <= q_pos[:, None, None, start:stop, None]  # [B, H_kv, 1, m, L]
        # A query that sees no key (a padding query before any real token) attends to nothing harmful:
        # let it see every slot rather than produce NaN; its output is never used.
        mask = mask | ~mask.any(-1, keepdim=True)
        mask = mask.expand(b, hkv, g, m, length).reshape(b, hkv, g * m, length)
        if need_weights:
            logits = torch.matmul(qc, k.transpose(-1, -2)).float() * scaling
            probs = logits.masked_fill(~mask, float("-inf")).softmax(-1)
            outs.append(torch.matmul(probs.to(v.dtype), v))
            weights.append(probs.view(b, hkv, g, m, length))
        else:
            outs.append(F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, scale=scaling))
    out = torch.cat([o.view(b, hkv, g, -1, d) for o in outs], dim=3).reshape(b, hq, n, d)
    return out, (torch.cat(weights, dim=3) if need_weights else None)


def kvcomp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered as "kvcomp": returns ``(out [B, n, H_q, D], None)``."""
    layer = take_active(module.layer_idx)
    if layer is None:
        # Not a kvcomp-managed cache (plain forward, DynamicCache, ...): behave exactly like sdpa.
        mask = attention_mask.standard() if isinstance(attention_mask, KVCompMask) else attention_mask
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    b, _, n, _ = query.shape
    valid = (
        attention_mask.new_token_valid(b, query.device)
        if isinstance(attention_mask, KVCompMask)
        else torch.ones(b, n, dtype=torch.bool, device=query.device)
    )
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(n, device=query.device).view(1, n) + layer.next_position.view(-1, 1)
    position_ids = position_ids.expand(b, n).long()
    out = layer.forward(query, position_ids, valid, scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    AttentionInterface.register(ATTN_NAME, kvcomp_attention)
    AttentionMaskInterface.register(ATTN_NAME, kvcomp_mask)


def install(model) -> None:
    """Route the model's attention through kvcomp (it behaves like sdpa unless a CompressedCache is in use)."""
    register()
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)


register()
