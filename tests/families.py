"""Tiny random models of every decoder family kvcomp claims (the README's support matrix), built from configs.

Each has 4 layers, GQA (4 query / 2 KV heads), head dim 16, the embedded model's vocabulary size (so the KVTC
calibration text tokenizes), and, where the family has them, sliding-window layers with a window of 8 tokens,
logit soft-capping and attention sinks, so that prompts of a few dozen tokens exercise every feature.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

WINDOW = 8
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.3,
              bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)

# family -> (model_type, config overrides); "what it exercises" in the comment.
FAMILIES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", dict(sliding_window=None)),
    "mistral_window": ("mistral", dict(sliding_window=WINDOW)),  # every layer sliding
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),  # mixed layers
    "qwen3": ("qwen3", {}),  # q/k norms
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=30.0)),
    "gemma3_text": ("gemma3_text", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2)),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "cohere": ("cohere", {}),  # interleaved RoPE
    "starcoder2": ("starcoder2", dict(sliding_window=None)),
    "gpt_oss": ("gpt_oss", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)),  # sinks
    "gpt_neox": ("gpt_neox", dict(rotary_pct=0.25, num_key_value_heads=4)),  # partial rotary; multi-head only
    "phi": ("phi", dict(partial_rotary_factor=0.5)),  # partial rotary
    "gpt2": ("gpt2", None),  # multi-head attention, learned absolute positions (no RoPE)
}
# Families whose configs do not take the common fields.
OWN_CONFIGS = {
    "gpt2": dict(vocab_size=49152, n_embd=64, n_layer=4, n_head=4, n_positions=512, initializer_range=0.3,
                 bos_token_id=1, eos_token_id=2, pad_token_id=2),
}


def build(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny random model of ``family`` (the same weights for the same seed), in eval mode."""
    model_type, overrides = FAMILIES[family]
    fields = OWN_CONFIGS[family] if overrides is None else {**COMMON, **overrides}
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def has_sliding_layers(model) -> bool:
    from kvcomp.attention import layer_specs

    return any(spec.window is not None for spec in layer_specs(model))
