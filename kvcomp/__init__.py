"""kvcomp: KV-cache compression for Hugging Face causal language models."""

from kvcomp.cache import CompressedCache
from kvcomp.compressor import Capabilities, Compose, Compressor, CompressorError, LayerContext
from kvcomp.contexts import LoadedContext, SavedContext, load_context, save_context
from kvcomp.generation import GenerationResult, generate
from kvcomp.lossless import Lossless
from kvcomp.models import load_model
from kvcomp.registry import available, create, register
from kvcomp.selection import TokenSelection, TokenStore
from kvcomp.speculative import Sampling

__all__ = [
    "Capabilities", "Compose", "CompressedCache", "Compressor", "CompressorError", "GenerationResult",
    "LayerContext", "LoadedContext", "Lossless", "Sampling", "SavedContext", "TokenSelection", "TokenStore", "available",
    "create", "generate", "load_context", "load_model", "register", "save_context",
]
__version__ = "0.1.0"
