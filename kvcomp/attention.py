"""The "kvcomp" attention function and mask function registered with transformers, and each layer's attention spec.

Everything specific to the transformers attention API lives here and in ``kvcomp/cache.py``.

How a forward flows: ``CompressedLayer.update`` (called by the model's attention module) only parks the new
K/V on the layer and marks it active. The registered attention function then takes them with the queries,
the positions and the padding of the new tokens, and either runs dense prefill attention and calls
``compressor.prefill``, or calls ``compressor.append`` and ``compressor.attend``. The mask function returns a
small :class:`KVCompMask` (the 2-D padding mask plus what is needed to build transformers' own mask), because
kept tokens are not contiguous and a right-aligned 4-D mask cannot describe them; attention masks by
positions instead (:func:`kvcomp.ops.visible`, SENTINEL for padding).

Model families. :func:`layer_specs` reads each layer's :class:`~kvcomp.ops.AttentionSpec` (scaling, sliding
window, logit soft-cap, sink logits) from the model's config and attention modules, and refuses with
:class:`UnsupportedModel`, before any compute, what kvcomp cannot reproduce exactly (encoder-decoders, layer
types other than full and sliding attention, chunked or bidirectional attention, ALiBi, models whose
attention does not go through transformers' attention interface). Every call then checks that what the
model passes (``scaling``, ``sliding_window``, ``softcap``, ``s_aux``) is what the spec says, and refuses
any other keyword that could change attention: a model kvcomp does not know fails loudly instead of
differing silently. Forwards over caches that are not kvcomp's (a plain ``DynamicCache``, lossless
decoding's full KV) run the attention the model used before :func:`install` (sdpa, or the model's own
eager function where sdpa cannot do it: soft-capping, sinks).
"""

from __future__ import annotations

import importlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from kvcomp.ops import AttentionSpec

ATTN_NAME = "kvcomp"
_active = threading.local()
# Attention keywords that carry no attention semantics (kvcomp reads positions itself).
_BENIGN_KWARGS = {"position_ids", "use_cache", "output_attentions", "output_hidden_states", "output_router_logits",
                  "cache_position", "return_dict"}
_SPEC_KWARGS = {"scaling", "sliding_window", "softcap", "s_aux", "dropout"}
_LAYER_TYPES = {"full_attention", "sliding_attention"}
# What each attention module ran before install(): "sdpa", "eager", ... (for caches kvcomp does not manage).
_previous: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class UnsupportedModel(ValueError):
    """A model, or a feature of it, that kvcomp cannot run exactly; raised before any compute."""


# -- attention specs --------------------------------------------------------------------------------------------
def _model_type(model) -> str:
    return getattr(model.config, "model_type", type(model).__name__)


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """The self-attention module of each decoder layer, by ``layer_idx``."""
    found = {}
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int):
            found.setdefault(module.layer_idx, module)
    return found


def check_supported(model) -> None:
    """Raise :class:`UnsupportedModel` naming the feature and the model type when kvcomp cannot run ``model``
    exactly."""
    config = model.config.get_text_config(decoder=True)
    kind = _model_type(model)

    def refuse(feature: str) -> None:
        raise UnsupportedModel(
            f"kvcomp cannot run {kind!r} models exactly: {feature}. Use the model without kvcomp, or a supported "
            "family (see the README's support matrix)."
        )

    if getattr(model.config, "is_encoder_decoder", False):
        refuse("encoder-decoder attention")
    types = getattr(config, "layer_types", None) or []
    other = sorted(set(types) - _LAYER_TYPES)
    if other:
        refuse(f"layer types {other} (kvcomp supports full and sliding-window attention)")
    if getattr(config, "use_bidirectional_attention", False):
        refuse("bidirectional attention (use_bidirectional_attention=True)")
    if getattr(config, "attention_chunk_size", None):
        refuse(f"chunked attention (attention_chunk_size={config.attention_chunk_size})")
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        refuse("ALiBi position biases")
    if not getattr(model, "_supports_attention_backend", False):
        refuse("its attention does not go through transformers' attention interface")
    n_layers = config.num_hidden_layers
    modules = attention_modules(model)
    if sorted(modules) != list(range(n_layers)):
        refuse(f"kvcomp found attention modules for layers {sorted(modules)} of {n_layers}")


def layer_specs(model) -> list[AttentionSpec]:
    """One :class:`~kvcomp.ops.AttentionSpec` per decoder layer, read from the config and the attention modules
    (after :func:`check_supported`)."""
    check_supported(model)
    config = model.config.get_text_config(decoder=True)
    modules = attention_modules(model)
    types = getattr(config, "layer_types", None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    specs = []
    for i in range(config.num_hidden_layers):
        module = modules[i]
        if hasattr(module, "sliding_window"):
            window = module.sliding_window
        elif types is not None:
            window = config.sliding_window if types[i] == "sliding_attention" else None
        else:
            window = getattr(config, "sliding_window", None)
        softcap = getattr(module, "attn_logit_softcapping", getattr(config, "attn_logit_softcapping", None))
        sinks = getattr(module, "sinks", None)
        specs.append(AttentionSpec(
            scaling=float(getattr(module, "scaling", None) or head_dim**-0.5),
            window=int(window) if window else None,
            softcap=float(softcap) if softcap else None,
            sinks=None if sinks is None else sinks.detach(),
        ))
    return specs


def check_call(module, spec: AttentionSpec, scaling, kwargs: dict[str, Any]) -> None:
    """Refuse a forward whose attention keywords differ from ``spec`` or carry semantics kvcomp does not know."""
    unknown = sorted(set(kwargs) - _BENIGN_KWARGS - _SPEC_KWARGS)
    problems = [f"attention keyword(s) {unknown} that kvcomp does not implement"] if unknown else []
    if kwargs.get("dropout"):
        problems.append(f"attention dropout {kwargs['dropout']} (kvcomp is for inference: call model.eval())")
    if scaling is not None and abs(float(scaling) - spec.scaling) > 1e-12 * abs(spec.scaling):
        problems.append(f"scaling {scaling} where the spec read {spec.scaling}")
    window = kwargs.get("sliding_window")
    if (int(window) if window else None) != spec.window:
        problems.append(f"sliding_window {window} where the config gave {spec.window}")
    softcap = kwargs.get("softcap")
    if (float(softcap) if softcap else None) != spec.softcap:
        problems.append(f"softcap {softcap} where the config gave {spec.softcap}")
    sinks = kwargs.get("s_aux")
    if (sinks is None) != (spec.sinks is None) or (sinks is not None and sinks.data_ptr() != spec.sinks.data_ptr()):
        problems.append("attention sinks (s_aux) that are not the module's own")
    if problems:
        raise UnsupportedModel(
            f"kvcomp cannot run layer {module.layer_idx} of this {type(module).__name__} exactly: "
            + "; ".join(problems) + "."
        )


# -- rotary embeddings -------------------------------------------------------------------------------------------
def _rotary_module(model, layer_type: str):
    for module in model.modules():
        if hasattr(module, f"{layer_type}_inv_freq") or (hasattr(module, "inv_freq") and hasattr(module, "attention_scaling")):
            return module
    raise UnsupportedModel(f"kvcomp found no rotary embedding (a module with inv_freq) in this {_model_type(model)!r} model.")


def rotary_embedding(model, layer_type: str = "full_attention") -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of the RoPE that ``layer_type`` layers use (Gemma 3 has one per layer
    type); static RoPE types only (a rotation that changes with the sequence length cannot be undone later)."""
    module = _rotary_module(model, layer_type)
    if hasattr(module, f"{layer_type}_inv_freq"):
        rope_type = getattr(module, "rope_type", {})
        rope_type = rope_type.get(layer_type, "default") if isinstance(rope_type, dict) else rope_type
        inv_freq, scaling = getattr(module, f"{layer_type}_inv_freq"), getattr(module, f"{layer_type}_attention_scaling")
    else:
        rope_type, inv_freq, scaling = getattr(module, "rope_type", "default"), module.inv_freq, module.attention_scaling
    if rope_type in ("dynamic", "longrope"):
        raise UnsupportedModel(f"rope_type {rope_type!r} changes with the sequence length; it cannot be undone exactly.")
    return inv_freq.detach().float().cpu().clone(), float(scaling)


def check_rope(model, rotate, layer_type: str = "full_attention") -> None:
    """Raise :class:`UnsupportedModel` unless ``rotate(x [B, H, T, D], positions [1, 1, T])`` (kvcomp's RoPE)
    equals the model's own rotary embedding on ``layer_type`` layers (checked on random vectors)."""
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    layer = types.index(layer_type) if layer_type in types else 0
    attention = attention_modules(model)[layer]
    apply = getattr(importlib.import_module(type(attention).__module__), "apply_rotary_pos_emb", None)
    module = _rotary_module(model, layer_type)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    device = next(model.parameters()).device
    x = torch.randn(1, 2, 16, head_dim, generator=torch.Generator().manual_seed(0)).to(device)
    positions = (torch.arange(16) * 97 + 3).view(1, -1).to(device)
    per_type = hasattr(module, f"{layer_type}_inv_freq")
    with torch.no_grad():
        cos, sin = module(x, positions, layer_type) if per_type else module(x, positions)
        if apply is None:
            raise UnsupportedModel(f"{_model_type(model)!r} applies its rotary embedding in a way kvcomp cannot check.")
        try:
            expected = apply(x, x, cos, sin)[0]
        except RuntimeError:  # a partial rotary embedding that the attention module splits off itself (Phi)
            rot = cos.shape[-1]
            expected = torch.cat([apply(x[..., :rot], x[..., :rot], cos, sin)[0], x[..., rot:]], dim=-1)
        ours = rotate(x, positions.view(1, 1, -1))
    if ours.shape != expected.shape or not torch.allclose(ours.float(), expected.float(), rtol=1e-4, atol=1e-4):
        measured = (f"shapes {tuple(ours.shape)} and {tuple(expected.shape)}" if ours.shape != expected.shape else
                    f"max |difference| {(ours.float() - expected.float()).abs().max().item():.3g}, "
                    f"non-finite values: model {int((~expected.isfinite()).sum())}, kvcomp {int((~ours.isfinite()).sum())}")
        raise UnsupportedModel(
            f"{_model_type(model)!r} rotates keys differently from the rotate-half RoPE kvcomp undoes "
            f"(e.g. interleaved channels), so methods that work on pre-RoPE keys (KVTC) cannot run on it exactly "
            f"(checked on {layer_type} layers: {measured})."
        )


# -- masks ------------------------------------------------------------------------------------------------------
@dataclass
class KVCompMask:
    """What the "kvcomp" mask function hands to attention: the padding of the new tokens, and the arguments
    to build transformers' standard mask for layers that kvcomp does not manage."""

    padding: torch.Tensor | None  # [B, seen + q] bool, True for real tokens, or None
    q_length: int
    sdpa_args: dict[str, Any] = field(default_factory=dict)
    _block: tuple | None = field(default=None, repr=False, compare=False)  # see block()

    def new_token_valid(self, batch: int, device) -> torch.Tensor:
        if self.padding is None:
            return torch.ones(batch, self.q_length, dtype=torch.bool, device=device)
        return self.padding[:, -self.q_length :].to(device)

    def block(self, batch: int, n: int, device, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(valid, position_ids)`` ``[B, n]`` of the forward's new tokens, the same two tensors for every layer
        of the forward (the mask lives for one forward), so per-block terms are computed once
        (:meth:`kvcomp.cache.CompressedCache.block_terms`)."""
        memo, shape = self._block, (batch, n, torch.device(device))
        if memo is None or memo[0] is not position_ids or memo[1] != shape:
            memo = self._block = (position_ids, shape, self.new_token_valid(batch, device),
                                  position_ids.expand(batch, n).long())
        return memo[2], memo[3]

    def standard(self, implementation: str = "sdpa", dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """The mask transformers' own ``implementation`` would have got (every argument it was built with, the
        sliding window's ``local_size`` included: without it sdpa may skip a mask it needs)."""
        if implementation == "eager":
            return eager_mask(**{**self.sdpa_args, "dtype": dtype})
        return sdpa_mask(**self.sdpa_args)


def kvcomp_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                **kwargs) -> KVCompMask:
    args = dict(kwargs, batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, attention_mask=attention_mask)
    if mask_function is not None:
        args["mask_function"] = mask_function
    padding = None
    if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
        padding = attention_mask.bool()
    return KVCompMask(padding=padding, q_length=q_length, sdpa_args=args)


# -- the attention function ---------------------------------------------------------------------------------------
def set_active(layer) -> None:
    _active.layer = layer


def _record_input_ids(module, args) -> None:
    """Forward pre-hook on the model's input embedding: the ids of the forward now starting, for the cache's
    first layer to take (:func:`take_input_ids`)."""
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
        _active.input_ids = args[0]


def take_input_ids() -> torch.Tensor | None:
    """The input ids recorded by the embedding of the forward now running (None: called with embeddings)."""
    ids = getattr(_active, "input_ids", None)
    _active.input_ids = None
    return ids


def take_active(layer_idx: int):
    layer = getattr(_active, "layer", None)
    if layer is None or layer.layer_idx != layer_idx or layer.pending is None:
        return None
    _active.layer = None
    return layer


def _standard_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What the model ran before :func:`install`, for caches kvcomp does not manage."""
    implementation = _previous.get(module, "sdpa")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        implementation = "eager"  # sdpa can do neither; transformers itself falls back to eager for these models
    if implementation == "eager":
        mask = attention_mask.standard("eager", query.dtype) if isinstance(attention_mask, KVCompMask) else attention_mask
        eager = importlib.import_module(type(module).__module__).eager_attention_forward
        return eager(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    mask = attention_mask.standard() if isinstance(attention_mask, KVCompMask) else attention_mask
    return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)


def kvcomp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered as "kvcomp": returns ``(out [B, n, H_q, D], None)``."""
    layer = take_active(module.layer_idx)
    if layer is None:
        # Not a kvcomp-managed cache (plain forward, DynamicCache, ...): behave exactly like the model did.
        return _standard_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                   **kwargs)
    check_call(module, layer.spec, scaling, dict(kwargs, dropout=dropout))
    b, _, n, _ = query.shape
    # Known on the host without reading a tensor: the mask function found no padding, so every token is real.
    all_real = not (isinstance(attention_mask, KVCompMask) and attention_mask.padding is not None)
    given = kwargs.get("position_ids")
    if isinstance(attention_mask, KVCompMask) and given is not None:
        valid, position_ids = attention_mask.block(b, n, query.device, given)
    else:
        valid = (attention_mask.new_token_valid(b, query.device) if isinstance(attention_mask, KVCompMask)
                 else torch.ones(b, n, dtype=torch.bool, device=query.device))
        if given is None:
            given = torch.arange(n, device=query.device).view(1, n) + layer.next_position.view(-1, 1)
        position_ids = given.expand(b, n).long()
    out = layer.forward(query, position_ids, valid, all_real)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    AttentionInterface.register(ATTN_NAME, kvcomp_attention)
    AttentionMaskInterface.register(ATTN_NAME, kvcomp_mask)


_hooked: weakref.WeakSet = weakref.WeakSet()


def install(model) -> None:
    """Route the model's attention through kvcomp (it behaves like before unless a CompressedCache is in use).
    A forward pre-hook on the input embedding records each forward's ids (it computes nothing), so a cache can
    hand a compressor the ids of the block it compresses (``LayerContext.token_ids``)."""
    register()
    check_supported(model)
    embedding = model.get_input_embeddings()
    if embedding is not None and embedding not in _hooked:
        embedding.register_forward_pre_hook(_record_input_ids)
        _hooked.add(embedding)
    current = getattr(model.config, "_attn_implementation", None)
    if current != ATTN_NAME:
        for module in attention_modules(model).values():
            _previous[module] = current or "sdpa"
        model.set_attn_implementation(ATTN_NAME)


register()
