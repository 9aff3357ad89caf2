"""The unified compressor interface.

A :class:`Compressor` is a dataclass whose fields are its hyper-parameters. It owns, per layer, a *state*
holding that layer's KV in whatever form it stores it; the framework (``kvcomp.cache`` and
``kvcomp.attention``) calls its hooks:

=============================================  ===============================================================
``prefill(layer, q, k, v, ctx)``               after the prefill attention ran on full KV: build the state
``append(layer, state, k, v, ctx)``            every later forward (decode step, question block): add tokens
``attend(layer, state, q, ctx)``               inside attention: output over what the state keeps
``observe(layer, state, weights, ctx)``        attention statistics, when ``needs_attention_weights``
``after_attend(layer, state, ctx)``            after each forward's attention: evict what it has decided
``after_prefill(cache, contexts)``             once every layer's state is built from the prefill: decide over
                                               all layers at once (KVzip: re-read the context, global top-k)
``checkpoint(state)`` / ``rollback(state, s)``  snapshot a state / restore it (undo what was appended since)
``nbytes(state)``                              resident bytes per tier
``stored_form(layer, state)``                  the form a store keeps (optional; KVTC entropy-codes here)
``restored(layer, state, convert)``            a state read back from a store, before it serves (optional)
=============================================  ===============================================================

A method that needs the attention each prompt key receives (H2O) declares ``Capabilities.prefill_received``:
the prefill's attention pass then computes it from the same probabilities as its output and hands it over as
``ctx.received`` (one pass over the prompt instead of two).

Shapes: ``q`` is ``[B, H_q, n, D]``; ``k``/``v`` are ``[B, H_kv, n, D]`` (one entry per KV head, never per
query head); positions are ``[B, H_kv, n]`` original token positions, ``SENTINEL`` marking padding.

Attention is the layer's (``ctx.spec``, :class:`kvcomp.ops.AttentionSpec`: scaling, sliding window, logit
soft-cap, sinks); whatever a method computes from queries and keys goes through :mod:`kvcomp.ops`.
Sliding-window layers (``ctx.spec.window``): a compressor whose ``sliding_layers`` is ``"window"`` (the
default) never sees them: the framework stores their window exactly, as transformers does (its last
``window - 1`` tokens). One whose ``sliding_layers`` is ``"compress"`` (token selection) gets them too and must
keep no token that no later query can see (``kvcomp.ops.horizon``).

Rollback (lossless decoding drafts tokens, then undoes them): ``checkpoint(state)`` returns a snapshot and
``rollback(state, snapshot)`` returns the state as it was then, however many tokens were appended, evicted
or re-encoded since (a token count could not undo an H2O eviction or a KIVI residual flush). The default
deep-copies every tensor of the state, which is correct for any state; a method whose ``append`` never
writes into the tensors it is given (it builds new ones, as ``TokenSelection`` and ``Quant`` do) overrides
it with a shallow copy, which costs nothing. A snapshot is consumed by the rollback that uses it.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvcomp.ops import SENTINEL, AttentionSpec, dense_attention

__all__ = ["SENTINEL", "Capabilities", "Compose", "Compressor", "CompressorError", "LayerContext", "SharedWork"]


class CompressorError(ValueError):
    """A compressor was configured or combined in a way that cannot work; the message says how to fix it."""


@dataclass(frozen=True)
class Capabilities:
    """What a compressor does and needs; checked before any compute."""

    lossy: bool = True
    decode_time: bool = False  # evicts or re-encodes while decoding, not only at prefill
    needs_attention_weights: bool = False  # wants observe() with the decode-step attention probabilities
    needs_calibration: bool = False
    query_aware: bool = False  # scores tokens with the queries of the compressed prompt itself
    supports_batch: bool = True
    # The prefill hook gets ``ctx.received``: the attention each prompt key receives, from the prefill's own
    # attention pass (:func:`kvcomp.ops.received_attention`) instead of a second pass over the prompt (H2O).
    prefill_received: bool = False
    # What a decode step leaves in the state depends on that step's queries or attention (statistics, evictions
    # by attention, retrieval); None: whenever the method is decode_time or needs attention weights. A method
    # that only re-encodes K/V while decoding (quantization's residual flush) declares False.
    decode_uses_queries: bool | None = None

    @property
    def state_uses_queries(self) -> bool:
        """Whether decode steps' queries shape the state (so verified tokens must be fed through a forward)."""
        if self.decode_uses_queries is not None:
            return self.decode_uses_queries
        return self.decode_time or self.needs_attention_weights


class SharedWork:
    """Results several compressors compute from the same prefill of a layer, computed once.

    :mod:`kvcomp.shared_prefill` hands every compressor of a sweep the same ``q``/``k``/``v``/``ctx`` of a
    layer, so a statistic that depends on those alone (H2O's accumulated attention, whatever its budget)
    need not be recomputed per compressor: ``ctx.shared.get(key, compute)`` computes it on first use and
    returns the stored value afterwards. The key must name everything the value depends on beyond the
    layer's prefill. Callers must not modify a returned tensor in place (clone it first).
    ``saved_seconds`` adds up what the stored values cost to compute, each time one is reused, so a caller
    can report what a compressor's prefill costs on its own.
    """

    def __init__(self) -> None:
        self._values: dict[Any, tuple[Any, float]] = {}
        self.saved_seconds = 0.0

    def get(self, key, compute):
        if key in self._values:
            value, seconds = self._values[key]
            self.saved_seconds += seconds
            return value
        t0 = time.perf_counter()
        value = compute()
        self._values[key] = (value, time.perf_counter() - t0)
        return value


@dataclass
class LayerContext:
    """What the framework knows about the tokens handed to a hook.

    positions: ``[B, H_kv, n]`` int64 positions of the ``k``/``v`` passed in (SENTINEL for padding).
    query_positions: ``[B, n_q]`` positions of the queries of this forward.
    query_valid: ``[B, n_q]`` bool, which queries are real tokens (not padding).
    seen: ``[B]`` real (non-padding) tokens seen so far in each row, including this block (its values are known
    on the host: :func:`kvcomp.host.values` reads nothing back).
    spec: how the layer attends (scaling, sliding window, soft-cap, sinks).
    question_length: ``[B]`` tokens at the end of each prompt that hold the question, when the caller knows it.
    next_position: ``[B]`` position of each row's next token after this block (None: derived from the queries).
    token_ids: ``[B, n]`` input ids of this block (left-padded like ``positions``), when the model was called
    with ids (KVzip re-reads the prompt); None otherwise.
    all_real: every token of this block is real (no padding), known on the host; False when it is not known.
    A decode step uses it to skip checks that would read a tensor back (a host synchronisation per layer).
    received: ``[B, H_kv, n]`` float32 attention each token of this block received from the block's real
    queries, summed over its query group (:func:`kvcomp.ops.received_attention`): set on a prefill for a
    compressor whose capabilities ask for it (``prefill_received``), computed in the prefill's attention pass;
    None otherwise.
    """

    layer: int
    positions: torch.Tensor
    query_positions: torch.Tensor
    query_valid: torch.Tensor
    seen: torch.Tensor
    spec: AttentionSpec
    n_groups: int
    question_length: torch.Tensor | None = None
    # Set by kvcomp.shared_prefill when several compressors build from the same prefill; None otherwise.
    shared: SharedWork | None = None
    next_position: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    all_real: bool = False
    received: torch.Tensor | None = None

    @property
    def scaling(self) -> float:
        return self.spec.scaling

    @property
    def valid(self) -> torch.Tensor:
        """``[B, H_kv, n]`` bool: which of the tokens passed in are real."""
        return self.positions < SENTINEL

    def next_positions(self) -> torch.Tensor:
        """``[B]`` position of each row's next token."""
        if self.next_position is not None:
            return self.next_position
        return self.query_positions.masked_fill(~self.query_valid, -1).amax(1) + 1


@dataclass
class Compressor:
    """Base class of every compression method. Subclasses are dataclasses; validate fields in __post_init__."""

    capabilities: ClassVar[Capabilities] = Capabilities()
    # Registry name; set by kvcomp.registry.register or the entry point name.
    name: ClassVar[str] = ""
    # "window": the framework stores sliding-window layers exactly and this compressor sees full-attention layers
    # only; "compress": it gets sliding-window layers too (see the module docstring).
    sliding_layers: ClassVar[str] = "window"

    def __post_init__(self) -> None:
        pass

    # -- hooks ---------------------------------------------------------------------------------------------
    def bind(self, model) -> None:
        """Called once by ``CompressedCache`` with the model it serves, before any compute: a method that
        needs model-specific data (a calibration artifact) loads and checks it here."""

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext) -> Any:
        raise NotImplementedError

    def append(self, layer: int, state: Any, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext) -> Any:
        raise NotImplementedError

    def materialize(self, state: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, positions)`` of everything the state keeps, ``[B, H_kv, L, D]`` and ``[B, H_kv, L]``."""
        raise NotImplementedError

    def attend(self, layer: int, state: Any, q: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """Attention output ``[B, H_q, n_q, D]`` of ``q`` over the state. Default: dense over the materialized KV."""
        keys, values, positions = self.materialize(state)
        need = self.capabilities.needs_attention_weights
        out, weights = dense_attention(q, keys, values, ctx.query_positions, positions, ctx.spec, need)
        if need:
            self.observe(layer, state, weights, ctx)
        return out

    def observe(self, layer: int, state: Any, weights: torch.Tensor, ctx: LayerContext) -> None:
        """``weights``: ``[B, H_kv, G, n_q, L]`` attention probabilities over the materialized slots."""

    def after_attend(self, layer: int, state: Any, ctx: LayerContext) -> Any:
        """The state once this forward's attention (``attend``, ``observe``) is done: what a method decides
        from the step's own attention happens here. Default: unchanged."""
        return state

    def after_prefill(self, cache, contexts: dict[int, LayerContext]) -> None:
        """Called once by ``CompressedCache`` when every layer's state has been built from the prefill
        (``contexts``: each layer's prefill :class:`LayerContext`). A method that decides over all layers at once
        replaces ``cache.layers[i].state`` of its layers here; ``cache.model`` is the model (for extra forward
        passes, which count in the prefill's time). Default: nothing."""

    @property
    def decides_after_prefill(self) -> bool:
        """Whether this method overrides :meth:`after_prefill` (it decides over all layers at once)."""
        return type(self).after_prefill is not Compressor.after_prefill

    def checkpoint(self, state: Any) -> Any:
        """A snapshot from which :meth:`rollback` restores ``state`` as it is now. Default: a deep copy."""
        return clone_state(state)

    def rollback(self, state: Any, snapshot: Any) -> Any:
        """The state as it was at :meth:`checkpoint` (``state`` is the current one, dropped here)."""
        return snapshot

    def nbytes(self, state: Any) -> dict[str, int]:
        raise NotImplementedError

    def stored_form(self, layer: int, state: Any) -> Any:
        """What a store (:mod:`kvcomp.contexts`) keeps of ``state``, leaving ``state`` unchanged;
        :meth:`restored` turns it back into a state bit-identical to ``state``. Default: the state itself
        (KVTC entropy-codes its live codes)."""
        return state

    def stored_nbytes(self, state: Any) -> int:
        """Bytes of :meth:`stored_form` (before the store's own framing): the stored memory factor's
        denominator. Default: the resident bytes of every tier."""
        return sum(self.nbytes(state).values())

    def restored(self, layer: int, state: Any, convert: bool = True) -> Any:
        """The state, ready to serve, after it came back from a store (:mod:`kvcomp.contexts`) in its
        :meth:`stored_form`, bit-identical to the one :meth:`prefill` built: what a live state has beyond its
        stored form is rebuilt here (retrieval: the prefetch for the first step; KVTC: its live codes).
        ``convert``: a method whose stored form is not its fastest working form may convert it further, once,
        changing resident bytes but never the output; ``False`` keeps the state exactly as built in-process.
        Default: unchanged."""
        return state

    def stored_tokens(self, state: Any) -> torch.Tensor:
        """``[B, H_kv]`` tokens the state holds per row and KV head (for budgets and reports)."""
        _, _, positions = self.materialize(state)
        return (positions < SENTINEL).sum(-1)

    # -- checks --------------------------------------------------------------------------------------------
    def check(self, batch_size: int) -> None:
        """Raise CompressorError for an unsupported use, before any compute."""
        if batch_size > 1 and not self.capabilities.supports_batch:
            raise CompressorError(
                f"{type(self).__name__} does not support batch size > 1 (got {batch_size}); run one sequence at a time."
            )

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def clone_state(state: Any) -> Any:
    """A copy of ``state`` sharing no tensor with it (dataclasses, lists, tuples and dicts are walked)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        new = copy.copy(state)
        for f in dataclasses.fields(state):
            object.__setattr__(new, f.name, clone_state(getattr(state, f.name)))
        return new
    if isinstance(state, (list, tuple)):
        return type(state)(clone_state(x) for x in state)
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    return state


@dataclass
class Compose(Compressor):
    """Apply compressors in order: each later one compresses what the earlier ones kept at prefill.

    ``Compose(SnapKV(0.5), StreamingLLM(0.5))`` keeps a quarter of the prompt. The last compressor owns the
    state from then on (appends, attention, bytes); earlier ones act at prefill only, so they must not be
    ``decode_time`` methods.
    """

    stages: list[Compressor] = field(default_factory=list)

    def __init__(self, *stages: Compressor):
        self.stages = list(stages)
        self.__post_init__()

    def __post_init__(self) -> None:
        if len(self.stages) < 2:
            raise CompressorError("Compose needs at least two compressors, e.g. Compose(SnapKV(0.5), StreamingLLM(0.5)).")
        for stage in self.stages:
            if not isinstance(stage, Compressor):
                raise CompressorError(f"Compose takes Compressor instances, got {stage!r}.")
        for stage in self.stages[:-1]:
            if stage.decides_after_prefill:
                raise CompressorError(
                    f"{type(stage).__name__} decides over all layers after the prefill, so it can only be the last "
                    "stage of Compose."
                )
            if stage.capabilities.decode_time:
                raise CompressorError(
                    f"{type(stage).__name__} evicts during decoding, so it can only be the last stage of Compose."
                )

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        caps = [s.capabilities for s in self.stages]
        last = caps[-1]
        return Capabilities(
            lossy=any(c.lossy for c in caps),
            decode_time=last.decode_time,
            needs_attention_weights=last.needs_attention_weights,
            needs_calibration=any(c.needs_calibration for c in caps),
            query_aware=any(c.query_aware for c in caps),
            supports_batch=all(c.supports_batch for c in caps),
            prefill_received=caps[0].prefill_received,  # the first stage's prefill sees the prompt's own block
            decode_uses_queries=last.state_uses_queries,
        )

    @property
    def sliding_layers(self) -> str:  # type: ignore[override]
        return "compress" if all(s.sliding_layers == "compress" for s in self.stages) else "window"

    def check(self, batch_size: int) -> None:
        for stage in self.stages:
            stage.check(batch_size)

    def bind(self, model) -> None:
        for stage in self.stages:
            stage.bind(model)

    def params(self) -> dict[str, Any]:
        from kvcomp.registry import name_of  # the registry imports this module

        return {"stages": [{"name": name_of(s), **s.params()} for s in self.stages]}

    def prefill(self, layer, q, k, v, ctx):
        state = self.stages[0].prefill(layer, q, k, v, ctx)
        for prev, stage in zip(self.stages, self.stages[1:]):
            k, v, positions = prev.materialize(state)
            ctx = dataclasses.replace(ctx, positions=positions.long(), received=None)
            state = stage.prefill(layer, q, k, v, ctx)
        return state

    def _last(self) -> Compressor:
        return self.stages[-1]

    def append(self, layer, state, k, v, ctx):
        return self._last().append(layer, state, k, v, ctx)

    def materialize(self, state):
        return self._last().materialize(state)

    def attend(self, layer, state, q, ctx):
        return self._last().attend(layer, state, q, ctx)

    def observe(self, layer, state, weights, ctx):
        return self._last().observe(layer, state, weights, ctx)

    def after_attend(self, layer, state, ctx):
        return self._last().after_attend(layer, state, ctx)

    def after_prefill(self, cache, contexts):
        return self._last().after_prefill(cache, contexts)

    @property
    def decides_after_prefill(self) -> bool:
        return self._last().decides_after_prefill

    def checkpoint(self, state):
        return self._last().checkpoint(state)

    def rollback(self, state, snapshot):
        return self._last().rollback(state, snapshot)

    def nbytes(self, state):
        return self._last().nbytes(state)

    def stored_tokens(self, state):
        return self._last().stored_tokens(state)

    def stored_form(self, layer, state):
        return self._last().stored_form(layer, state)

    def stored_nbytes(self, state):
        return self._last().stored_nbytes(state)

    def restored(self, layer, state, convert=True):
        return self._last().restored(layer, state, convert)
