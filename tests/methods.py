"""The one list of per-method settings that the parametrised tests sweep over every registered compressor.

Tests iterate over :func:`kvcomp.available` (third-party compressors registered by entry point included), so a
new method is tested the moment it is registered; what a test needs to know about a method is here:

* ``EXACT``: settings under which the method must give output identical to no compression (ratio 0, a
  budget covering the whole context, a full-precision window longer than the prompt, every unit fetched).
  A token selection method not listed uses ``compression_ratio=0``; any other method must be listed, or
  the tests fail naming it.
* ``LOSSY``: a setting that really compresses a short tiny-model prompt (for shapes, bytes, rollback, batch
  equals alone, lossless identity). Defaults to the method's own defaults.
* ``NEEDS_ARTIFACT``: methods that take a calibration ``artifact=`` for the model under test.
"""

from __future__ import annotations

import pytest

import kvcomp
from kvcomp import TokenSelection

BIG = 1 << 16

EXACT = {
    "streaming_llm": dict(compression_ratio=0.0),
    "h2o": dict(compression_ratio=0.0),
    "snapkv": dict(compression_ratio=0.0),
    "quant": dict(residual=BIG),  # nothing leaves the full-precision window
    "kvtc": dict(window=BIG),  # nothing is coded
    "freekv": dict(top_k=BIG, tier="ram"),  # every page is fetched
    "specache": dict(top_k=BIG, tier="ram"),  # every token is fetched; no low-bit copy is attended
}

LOSSY = {
    "streaming_llm": dict(compression_ratio=0.5, n_sink=2),
    "h2o": dict(compression_ratio=0.5),
    "snapkv": dict(compression_ratio=0.5, window=4),
    "quant": dict(bits=4, group_size=8, residual=8, n_sink=2),
    "kvtc": dict(compression_factor=4, window=8, block_size=8, n_sink=2),
    "freekv": dict(top_k=2, page_size=4, window=8, n_sink=2, tier="ram"),
    "specache": dict(top_k=4, group_size=8, window=8, n_sink=2, tier="ram"),
    "knorm": dict(compression_ratio=0.5),  # wrappers below use keydiff: RoPE keeps key norms, so repeated text ties
    "keydiff": dict(compression_ratio=0.5),
    "tova": dict(compression_ratio=0.5),
    "expected_attention": dict(compression_ratio=0.5, n_sink=2),
    # No instruction and no chat template: the tiny test models have no tokenizer of their own.
    "kvzip": dict(compression_ratio=0.5, chunk_size=16, n_sink=2, prompt="", continue_prompt="", chat_template=False),
    "adakv": dict(compression_ratio=0.5, scorer="keydiff"),
    "pyramidkv": dict(compression_ratio=0.5, scorer="keydiff"),
    "criticalkv": dict(compression_ratio=0.5, scorer="keydiff"),
    "duo_attention": dict(compression_ratio=0.5, scorer="keydiff", heads="alternating", n_sink=2, recent=8),
    "decode_evict": dict(compression_ratio=0.5, scorer="keydiff", interval=1),  # evicting at every step
    "inertiakv": dict(compression_ratio=0.5, scorer="keydiff", refresh=4, window=4),
}

NEEDS_ARTIFACT = {"kvtc"}

# Settings under which a ``needs_calibration`` method reads its artifact (LOSSY may use one that does not).
CALIBRATED = {"duo_attention": dict(heads="calibrated")}

# Methods whose kept set among exactly tied scores depends on float rounding, which differs between a batched
# and a single matmul: KNorm on these prompts (RoPE keeps key norms, so a repeated token's keys tie in the first
# layers). The batch test runs them through the wrappers instead (LOSSY's allocators use KeyDiff).
ROUNDING_TIES = {"knorm": "RoPE keeps key norms: repeated tokens tie exactly"}


def names() -> list[str]:
    return sorted(kvcomp.available())


def exact(name: str, **extra) -> kvcomp.Compressor:
    """The method ``name`` in a setting that must equal no compression."""
    cls = kvcomp.available()[name]
    if name in EXACT:
        return cls(**EXACT[name], **extra)
    if issubclass(cls, TokenSelection):
        return cls(compression_ratio=0.0, **extra)
    pytest.fail(f"compressor {name!r} has no exact setting: add one to EXACT in tests/methods.py")


def lossy(name: str, **extra) -> kvcomp.Compressor:
    """The method ``name`` in a setting that compresses a short prompt."""
    return kvcomp.available()[name](**{**LOSSY.get(name, {}), **extra})
