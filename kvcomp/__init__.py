"""kvcomp: KV-cache compression for Hugging Face causal language models.

The public names below are imported on first use (PEP 562), so ``import kvcomp.kernels`` or ``kvcomp.ops``
(the Triton and CPU kernels, the attention rule) needs torch alone, not transformers: a GPU image with another
transformers runs the kernel tests and ``experiments/kernel_bench.py`` as they are. A submodule is reachable as
an attribute too (``kvcomp.tiers.Prefetcher`` after ``import kvcomp``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "CompressedCache": "kvcomp.cache",
    "Capabilities": "kvcomp.compressor",
    "Compose": "kvcomp.compressor",
    "Compressor": "kvcomp.compressor",
    "CompressorError": "kvcomp.compressor",
    "LayerContext": "kvcomp.compressor",
    "LoadedContext": "kvcomp.contexts",
    "SavedContext": "kvcomp.contexts",
    "load_context": "kvcomp.contexts",
    "save_context": "kvcomp.contexts",
    "GenerationResult": "kvcomp.generation",
    "generate": "kvcomp.generation",
    "Lossless": "kvcomp.lossless",
    "load_model": "kvcomp.models",
    "available": "kvcomp.registry",
    "create": "kvcomp.registry",
    "register": "kvcomp.registry",
    "TokenSelection": "kvcomp.selection",
    "TokenStore": "kvcomp.selection",
    "Sampling": "kvcomp.speculative",
}
__all__ = [  # the keys of _EXPORTS, spelled out for linters and type checkers
    "Capabilities", "Compose", "CompressedCache", "Compressor", "CompressorError", "GenerationResult",
    "LayerContext", "LoadedContext", "Lossless", "Sampling", "SavedContext", "TokenSelection", "TokenStore", "available",
    "create", "generate", "load_context", "load_model", "register", "save_context",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from kvcomp.cache import CompressedCache
    from kvcomp.compressor import Capabilities, Compose, Compressor, CompressorError, LayerContext
    from kvcomp.contexts import LoadedContext, SavedContext, load_context, save_context
    from kvcomp.generation import GenerationResult, generate
    from kvcomp.lossless import Lossless
    from kvcomp.models import load_model
    from kvcomp.registry import available, create, register
    from kvcomp.selection import TokenSelection, TokenStore
    from kvcomp.speculative import Sampling
