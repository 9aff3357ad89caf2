"""Saved contexts: prefill a context once, store every layer's compressed state, answer from it anywhere.

    saved = kvcomp.save_context(model, tokenizer, document, compressor=SnapKV(0.75), store="redis://host:6379/0")
    # any process, any time later:
    ctx = kvcomp.load_context(model, saved.key, store="redis://host:6379/0")
    kvcomp.generate(model, tokenizer, question="\\nWho signed it?", context=ctx)   # as many questions as you like

The answer is token-identical to ``kvcomp.generate(model, tokenizer, document, question, compressor=...)`` in
one process (query-agnostic: the context is compressed before any question is seen), because the states that
come back are bit-identical to the ones the in-process cache builds, with the same counters (tokens seen,
next position) per layer.

What an entry holds (:mod:`kvcomp.store`, one entry per context and compressor):

* ``state/<i>``: layer ``i``'s compressor state in its own form, as a safetensors blob (tensors plus a JSON tree
  of the state's dataclasses): token selection, the kept K/V and their int32 positions; quant, the packed codes,
  scales and full-precision sinks and window; KVTC, its entropy-coded blocks as stored bytes
  (:meth:`compressors.kvtc.KVTC.stored_form`; turned back into its live codes once when the context is
  loaded, :meth:`compressors.kvtc.KVTC.restored`); retrieval, the
  resident summary, sinks and window (its full KV is ``full/<i>``); no compressor, the layer's K/V as
  transformers' own cache holds them;
* ``full/<i>`` (``full_kv=True``, and always for retrieval): the layer's full K/V, head-major, for lossless
  decoding's verification and retrieval's fetches, read through :class:`kvcomp.store.StoreTier`;
* ``prompt``: the prefilled token ids, the attention mask and the logits after the last token (so a context can be
  continued with no question at all).

The manifest records the model fingerprint (:func:`model_fingerprint`: config and a sha256 of every weight),
the tokens' sha256, the compressor's name and parameters (KVTC's include its calibration digest), kvcomp's
version and this format's version; :func:`load_context` refuses an entry whose model, version, format or
compressor differs (:class:`~kvcomp.store.StoreMismatch`), so a cache built for another model can never be
used. The default key, :func:`context_key`, is a digest of all of them: another model or compressor simply
finds nothing. Faults of the store itself (server down, key evicted, a part short or corrupt) raise before any
cache is returned, so nothing half-loaded is ever used; :func:`load_or_save` recomputes instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import struct
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from kvcomp import __version__ as KVCOMP_VERSION
from kvcomp.compressor import Compose, Compressor, CompressorError
from kvcomp.store import (
    KeyEvicted,
    KeyMissing,
    Manifest,
    Store,
    StoreMismatch,
    StoreTier,
    kv_bytes,
    open_store,
)
from kvcomp.tiers import Prefetcher, Tier

FORMAT = "kvcomp-context"
FORMAT_VERSION = 1
PROBE_QUESTION = "\nIs this a probe?"
_PLACEHOLDER = "placeholder context"


# -- identity ---------------------------------------------------------------------------------------------------
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_fingerprint(model) -> dict[str, str]:
    """What ties a stored cache to a model: its name, a sha256 of its configuration (without names and the
    transformers version), a sha256 of every parameter and buffer (name, dtype, shape, bytes) and its dtype.
    Computed once per model object (about 0.5 s for SmolLM2-135M); change the weights in place and it is stale."""
    if model in _fingerprints:
        return _fingerprints[model]
    config = model.config.to_dict()
    config = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("transformers_version",
                                                                                     "name_or_path")}
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    weights = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            t = tensor.detach().cpu().contiguous()
            weights.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            weights.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    fp = {"name": str(getattr(model.config, "_name_or_path", "") or type(model).__name__),
          "config_sha256": config_hash[:32], "weights_sha256": weights.hexdigest()[:32],
          "dtype": str(model.dtype).removeprefix("torch.")}
    _fingerprints[model] = fp
    return fp


def tokens_digest(rows: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:32]


def compressor_spec(compressor: Compressor | None) -> dict[str, Any] | None:
    """``{"name", "params"}`` of a bound compressor (None: uncompressed), JSON-able."""
    if compressor is None:
        return None
    from kvcomp.registry import name_of

    return {"name": name_of(compressor), "params": _jsonable(compressor.params())}


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


def compressor_from_spec(spec: dict[str, Any] | None) -> Compressor | None:
    """Rebuild the compressor a spec names (its fields; derived entries such as KVTC's calibration digest are
    checked after :meth:`Compressor.bind`, by :func:`_check_compressor`)."""
    if spec is None:
        return None
    from kvcomp.registry import get

    if spec["name"] == "Compose":
        return Compose(*(compressor_from_spec({"name": s["name"], "params": {k: v for k, v in s.items()
                                                                             if k != "name"}})
                         for s in spec["params"]["stages"]))
    cls = get(spec["name"])
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{k: v for k, v in spec["params"].items() if k in fields})


def context_key(model, token_rows: list[list[int]], compressor: Compressor | None, query_aware: bool = False,
                question_length: list[int] | None = None) -> str:
    """The default key of a context: ``ctx/<model name>/<digest>``, the digest over everything the stored cache
    depends on (model fingerprint, tokens, compressor and parameters, mode, kvcomp and format versions)."""
    if compressor is not None:
        compressor.bind(model)
    fp = model_fingerprint(model)
    blob = json.dumps([FORMAT, FORMAT_VERSION, KVCOMP_VERSION, fp, tokens_digest(token_rows),
                       compressor_spec(compressor), query_aware, question_length], sort_keys=True)
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in fp["name"].rsplit("/", 1)[-1])[:48] or "model"
    return f"ctx/{name}/{hashlib.sha256(blob.encode()).hexdigest()[:32]}"


# -- states as bytes --------------------------------------------------------------------------------------------
class _TierSlot:
    """Where a state held a :class:`~kvcomp.tiers.Tier` (a retrieval state's full KV): the loader puts a
    :class:`~kvcomp.store.StoreTier` over the entry's ``full/<i>`` there."""


@dataclass
class _PrefetcherSlot:
    overlap: bool


def _allowed(module: str) -> bool:
    if module.split(".")[0] in ("kvcomp", "compressors"):
        return True
    from kvcomp.registry import available

    return any(module == c.__module__ or module.startswith(c.__module__.rsplit(".", 1)[0] + ".")
               for c in available().values())


class _Encoder:
    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.blobs: list[bytes] = []
        self.size = 0

    def encode(self, x):
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, torch.Tensor):
            name = f"t{len(self.tensors)}"
            self.tensors[name] = x.detach().to("cpu", copy=True).contiguous()
            return {"$t": name}
        if isinstance(x, (bytes, bytearray)):
            at = self.size
            self.blobs.append(bytes(x))
            self.size += len(x)
            return {"$b": [at, len(x)]}
        if isinstance(x, Tier):
            return {"$tier": True}
        if isinstance(x, Prefetcher):
            return {"$prefetcher": bool(x.overlap)}
        if isinstance(x, torch.dtype):
            return {"$dtype": str(x).removeprefix("torch.")}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            cls = type(x)
            return {"$dc": f"{cls.__module__}:{cls.__qualname__}",
                    "f": {f.name: self.encode(getattr(x, f.name)) for f in dataclasses.fields(x)}}
        if isinstance(x, tuple):
            return {"$tuple": [self.encode(v) for v in x]}
        if isinstance(x, list):
            return [self.encode(v) for v in x]
        if isinstance(x, dict) and all(isinstance(k, str) for k in x):
            return {"$d": {k: self.encode(v) for k, v in x.items()}}
        raise CompressorError(f"kvcomp cannot store a compressor state holding a {type(x).__name__}; keep states "
                              "to tensors, bytes, numbers, strings and dataclasses, lists, tuples and dicts of them.")


def encode_state(state) -> bytes:
    """A state (tensors, bytes, dataclasses, containers) as one safetensors blob; exact, device-independent."""
    enc = _Encoder()
    tree = enc.encode(state)
    tensors = dict(enc.tensors)
    tensors["$bytes"] = torch.frombuffer(bytearray(b"".join(enc.blobs)) or bytearray(1), dtype=torch.uint8)
    from safetensors.torch import save

    return save(tensors, metadata={"tree": json.dumps(tree), "bytes": str(enc.size)})


def _metadata(blob: bytes) -> dict[str, str]:
    (n,) = struct.unpack_from("<Q", blob)
    return json.loads(blob[8:8 + n]).get("__metadata__", {})


def decode_state(blob: bytes, device) -> Any:
    from safetensors.torch import load

    meta = _metadata(blob)
    tensors = load(blob)
    raw = tensors.pop("$bytes").numpy().tobytes()[: int(meta["bytes"])]

    def dec(x):
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [dec(v) for v in x]
        if "$t" in x:
            return tensors[x["$t"]].to(device)
        if "$b" in x:
            at, n = x["$b"]
            return raw[at:at + n]
        if "$tier" in x:
            return _TierSlot()
        if "$prefetcher" in x:
            return _PrefetcherSlot(x["$prefetcher"])
        if "$dtype" in x:
            return getattr(torch, x["$dtype"])
        if "$tuple" in x:
            return tuple(dec(v) for v in x["$tuple"])
        if "$d" in x:
            return {k: dec(v) for k, v in x["$d"].items()}
        if "$dc" in x:
            module, _, qualname = x["$dc"].partition(":")
            if not _allowed(module):
                raise StoreMismatch(22, f"a stored state names the class {x['$dc']}, which is not part of kvcomp or "
                                        "a registered compressor; refusing to build it.")
            cls = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            if not dataclasses.is_dataclass(cls):
                raise StoreMismatch(22, f"a stored state names {x['$dc']}, which is not a dataclass.")
            obj = object.__new__(cls)  # no __init__/__post_init__: the fields are the stored ones
            for name, value in x["f"].items():
                object.__setattr__(obj, name, dec(value))
            return obj
        raise StoreMismatch(22, f"unreadable stored state node {sorted(x)[:3]}.")

    return dec(json.loads(meta["tree"]))


def _plug(state, tier: Tier, device):
    """Put ``tier`` and fresh prefetchers where the stored state had them (in place; returns the state)."""
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        for f in dataclasses.fields(state):
            value = getattr(state, f.name)
            if isinstance(value, _TierSlot):
                object.__setattr__(state, f.name, tier)
            elif isinstance(value, _PrefetcherSlot):
                object.__setattr__(state, f.name, Prefetcher(overlap=value.overlap, device=device))
            else:
                _plug(value, tier, device)
    elif isinstance(state, (list, tuple)):
        for v in state:
            _plug(v, tier, device)
    return state


def _has_tier_slot(state) -> bool:
    if isinstance(state, (_TierSlot, Tier)):
        return True
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return any(_has_tier_slot(getattr(state, f.name)) for f in dataclasses.fields(state))
    if isinstance(state, (list, tuple)):
        return any(_has_tier_slot(v) for v in state)
    return False


def _tiers_of(state) -> list[Tier]:
    found = []
    if isinstance(state, (Tier, Prefetcher)):
        return [state]
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        for f in dataclasses.fields(state):
            found += _tiers_of(getattr(state, f.name))
    return found


# -- saving -----------------------------------------------------------------------------------------------------
@dataclass
class SavedContext:
    """What :func:`save_context` stored: ``key`` in ``store`` (its URL), bytes of the states and of the full KV,
    the prompt's tokens and the seconds the prefill and the write took."""

    key: str
    store: str
    state_bytes: int
    full_kv_bytes: int
    prompt_tokens: list[int]
    prefill_seconds: float
    write_seconds: float
    meta: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def stored_bytes(self) -> int:
        return self.state_bytes + self.full_kv_bytes


def _layer_record(layer) -> dict[str, Any]:
    state = layer.state if layer.state is None else layer.compressor.stored_form(layer.layer_idx, layer.state)
    return {"seen_total": layer.seen_total, "seen": layer.seen, "next_position": layer.next_position,
            "kv_shape": list(layer.kv_shape), "dtype": layer.dtype, "state": state}


def _dynamic_record(layer) -> dict[str, Any]:
    record = {"keys": layer.keys, "values": layer.values}
    if hasattr(layer, "cumulative_length"):
        record["cumulative_length"] = int(layer.cumulative_length)
    return record


def save_prefilled(model, pre, compressor: Compressor | None, store: str | Store | None = None,
                   key: str | None = None, full_kv: bool = False, template: dict | None = None,
                   ttl: float | None = None) -> SavedContext:
    """Build ``compressor``'s cache from a :func:`kvcomp.shared_prefill.prefill` and store it (one prefill can
    be saved under many compressors). ``full_kv``: also store every layer's full K/V (lossless decoding from the
    context); retrieval compressors always store it (it is their offloaded KV)."""
    from kvcomp.shared_prefill import _build_cache

    store = open_store(store)
    t0 = time.perf_counter()
    cache = _build_cache(model, pre, compressor)
    token_rows = [row for row in pre.token_rows]
    qlen = None if pre.cache.question_length is None else pre.cache.question_length.tolist()
    key = key or context_key(model, token_rows, compressor, pre.query_aware, qlen)
    parts: dict[str, bytes] = {}
    kv_info: dict[str, Any] = {}
    try:
        if compressor is None:
            records = [_dynamic_record(layer) for layer in cache.layers]
        else:
            records = [_layer_record(layer) for layer in cache.layers]
        retrieval = compressor is not None and any(_has_tier_slot(r["state"]) for r in records)
        for i, record in enumerate(records):
            parts[f"state/{i}"] = encode_state(record)
        if full_kv or retrieval:
            for i, (_, k, v, _) in sorted(pre.recorder.records.items()):
                parts[f"full/{i}"], kv_info[f"full/{i}"] = kv_bytes(k, v)
    finally:
        if compressor is not None:
            for layer in cache.layers:
                for obj in _tiers_of(layer.state):
                    obj.close()
    ids = torch.zeros(len(token_rows), pre.mask.shape[1], dtype=torch.int32)
    for r, row in enumerate(token_rows):
        if row:
            ids[r, ids.shape[1] - len(row):] = torch.tensor(row, dtype=torch.int32)
    parts["prompt"] = encode_state({"ids": ids, "mask": pre.mask, "logits": pre.logits})
    state_bytes = sum(len(v) for k, v in parts.items() if k.startswith("state/"))
    full_bytes = sum(len(v) for k, v in parts.items() if k.startswith("full/"))
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kvcomp": KVCOMP_VERSION,
        "model": model_fingerprint(model), "tokens_sha256": tokens_digest(token_rows),
        "prompt_tokens": [len(r) for r in token_rows], "compressor": compressor_spec(compressor),
        "query_aware": pre.query_aware, "question_length": qlen, "layers": len(cache.layers),
        "template": template or {}, "kv": kv_info, "state_bytes": state_bytes, "full_kv_bytes": full_bytes,
        "torch": torch.__version__,
    }
    store.put(key, parts, meta, ttl=ttl)
    return SavedContext(key, store.url, state_bytes, full_bytes, meta["prompt_tokens"], pre.seconds,
                        time.perf_counter() - t0, meta)


def _context_parts(tokenizer, contexts: list[str], chat_template: bool, system_prompt: str | None):
    """Each context's token ids as the chat (or plain) template renders it before any question, checked to be
    independent of the question (so a question asked later is tokenized exactly as in one prompt)."""
    from kvcomp.generation import split_prompt
    from kvcomp.validation import UsageError

    parts = []
    probe = split_prompt(tokenizer, _PLACEHOLDER, PROBE_QUESTION, "", chat_template, system_prompt).question_ids
    for text in contexts:
        p = split_prompt(tokenizer, text, PROBE_QUESTION, "", chat_template, system_prompt)
        if p.question_ids != probe:
            raise UsageError("This tokenizer's template renders the question differently depending on the "
                             "context, so a saved context could not be continued exactly; use generate() with "
                             "the whole prompt, or chat_template=False.")
        parts.append(p)
    return parts


def save_context(model, tokenizer, context: str | list[str], compressor: Compressor | str | None = None,
                 store: str | Store | None = None, key: str | None = None, full_kv: bool = False,
                 chat_template: bool = True, system_prompt: str | None = None, ttl: float | None = None,
                 **compressor_params) -> SavedContext:
    """Prefill ``context`` once (query-agnostic: before any question), compress it with ``compressor`` (a
    Compressor, a registered name with its parameters as keywords, or None) and store it under ``key`` (default
    :func:`context_key`). Returns a :class:`SavedContext`; answer from it with
    ``generate(model, tokenizer, question=..., context=load_context(model, saved.key, store))``."""
    from kvcomp.attention import check_supported
    from kvcomp.generation import resolve_compressor
    from kvcomp.shared_prefill import prefill
    from kvcomp.validation import check_prompts

    check_supported(model)
    compressor = resolve_compressor(compressor, **compressor_params)
    contexts = [context] if isinstance(context, str) else list(context)
    parts = _context_parts(tokenizer, contexts, chat_template, system_prompt)
    check_prompts(model, [len(p.context_ids) for p in parts], 1)
    if compressor is not None:
        compressor.check(len(parts))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    pre = prefill(model, parts, query_aware=False, pad_id=pad_id)
    template = {"chat_template": chat_template, "system_prompt": system_prompt, "template": parts[0].template}
    return save_prefilled(model, pre, compressor, store, key, full_kv, template, ttl)


# -- loading ----------------------------------------------------------------------------------------------------
def _check_meta(meta: dict[str, Any], model, key: str, url: str) -> None:
    def refuse(what: str) -> None:
        raise StoreMismatch(22, f"the stored context {key!r} in {url} was written {what}; refusing it (its cache "
                                "would be wrong here). Save the context again with this model and kvcomp.")

    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        refuse(f"in another format ({meta.get('format')} version {meta.get('format_version')}, this kvcomp reads "
               f"{FORMAT} version {FORMAT_VERSION})")
    if meta.get("kvcomp") != KVCOMP_VERSION:
        refuse(f"by kvcomp {meta.get('kvcomp')} (this is kvcomp {KVCOMP_VERSION})")
    fp, mine = meta.get("model") or {}, model_fingerprint(model)
    for field_name, what in (("dtype", "dtype"), ("config_sha256", "configuration"), ("weights_sha256", "weights")):
        if fp.get(field_name) != mine[field_name]:
            refuse(f"by another model ({fp.get('name')}; its {what} does not match this model's, {mine['name']})")


def _check_compressor(stored: dict | None, compressor: Compressor | None, model, key: str) -> None:
    if (stored is None) != (compressor is None):
        raise StoreMismatch(22, f"the stored context {key!r} holds {'an uncompressed' if stored is None else ''} "
                                f"{'' if stored is None else stored['name']} cache, not "
                                f"{'an uncompressed one' if compressor is None else type(compressor).__name__}.")
    if compressor is None:
        return
    compressor.bind(model)
    mine = compressor_spec(compressor)
    if mine != stored:
        diff = {k: (stored["params"].get(k), v) for k, v in mine["params"].items() if stored["params"].get(k) != v}
        raise StoreMismatch(22, f"the stored context {key!r} was compressed by {stored['name']} with other settings "
                                f"than this one ({mine['name']}; stored vs here: {diff or stored}). KVTC: a context "
                                "coded with another calibration artifact cannot be decoded with this one.")


@dataclass
class LoadedContext:
    """A stored context, checked and decoded: :meth:`new_cache` gives a ready cache (a fresh one each call, so
    every question starts from the stored state), :meth:`full_kv_tier` a tier over its full KV."""

    key: str
    store: Store
    manifest: Manifest
    compressor: Compressor | None
    logits: torch.Tensor  # [B, V] after the last stored token
    mask: torch.Tensor  # [B, T] attention mask of the stored block
    token_ids: torch.Tensor  # [B, T] (left-padded)
    device: torch.device
    load_seconds: float
    bytes_read: int
    convert: bool = True  # Compressor.restored(convert=...): a faster working form than the in-process one
    _blobs: list[bytes] = field(repr=False, default_factory=list)
    _first: Any = field(repr=False, default=None)

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.meta

    @property
    def template(self) -> dict[str, Any]:
        return self.meta.get("template") or {}

    @property
    def has_full_kv(self) -> bool:
        return all(f"full/{i}" in self.manifest.parts for i in range(self.meta["layers"]))

    def full_kv_tier(self, device=None, cache: bool = False, layers: list[int] | None = None) -> StoreTier:
        """A :class:`~kvcomp.store.StoreTier` reading the stored full K/V of ``layers`` (default: all); tokens
        appended to it stay in memory."""
        from kvcomp.validation import UsageError

        if not self.has_full_kv:
            raise UsageError(f"the stored context {self.key!r} holds no full KV: save it with full_kv=True for "
                             "lossless decoding from the store.")
        layers = range(self.meta["layers"]) if layers is None else layers
        return StoreTier.over(self.store, self.manifest, {i: f"full/{i}" for i in layers}, device or self.device,
                              cache=cache)

    def _build(self, model, states: list[Any]):
        if self.compressor is None:
            cache = DynamicCache(config=model.config)
            for i, record in enumerate(states):
                cache.update(record["keys"], record["values"], i)
                if "cumulative_length" in record:
                    cache.layers[i].cumulative_length = record["cumulative_length"]
            return cache
        from kvcomp.cache import CompressedCache

        qlen = self.meta.get("question_length")
        cache = CompressedCache(model, self.compressor, question_length=qlen)
        for layer, record in zip(cache.layers, states):
            heads, head_dim = record["kv_shape"]
            empty = torch.empty(record["seen"].shape[0], heads, 0, head_dim, dtype=record["dtype"], device=self.device)
            layer.lazy_initialization(empty, empty)
            layer.seen_total = record["seen_total"]
            layer.seen, layer.next_position = record["seen"], record["next_position"]
            state = record["state"]
            if _has_tier_slot(state):  # a retrieval state: its own tier over its layer's stored full KV
                _plug(state, self.full_kv_tier(layers=[layer.layer_idx]), self.device)
            layer.state = layer.compressor.restored(layer.layer_idx, state, self.convert)
        return cache

    def new_cache(self, model):
        """A cache holding the stored state, ready for the question (each call a fresh, independent one)."""
        if self._first is not None:
            cache, self._first = self._first, None
            return cache
        return self._build(model, [decode_state(b, self.device) for b in self._blobs])

    def continue_ids(self, model, rows: list[list[int]] | None, max_new_tokens: int, pad_id: int = 0,
                     stop_ids: set[int] | None = None) -> tuple[list[list[int]], dict[str, Any]]:
        """Feed ``rows`` (the question's ids per row; None or empty: none) and decode greedily: the statistics of
        :func:`kvcomp.generation.generate_ids` (``prefill_seconds`` = the question block)."""
        from kvcomp import steps
        from kvcomp.cache import CompressedCache
        from kvcomp.generation import _left_pad

        t0 = time.perf_counter()
        cache = self.new_cache(model)
        build_seconds = time.perf_counter() - t0
        logits, positions = self.logits, steps.Rows.from_mask(self.mask)
        with torch.inference_mode():
            if rows is not None and any(rows):
                ids, block_mask = _left_pad(rows, pad_id)
                logits = steps.prefill(model, cache, ids, positions, block_mask)
            prefill_seconds = time.perf_counter() - t0
            prefill_kept = cache.kept_tokens() if isinstance(cache, CompressedCache) else None
            out_rows, decode_seconds, n_steps = steps.greedy_decode(model, cache, logits, positions, max_new_tokens,
                                                                    stop_ids or set())
        return out_rows, dict(prefill_seconds=prefill_seconds, decode_seconds=decode_seconds, cache=cache,
                              prefill_kept=prefill_kept, generated_steps=n_steps, build_seconds=build_seconds,
                              load_seconds=self.load_seconds, from_store=True)


def load_context(model, key: str, store: str | Store | None = None, compressor: Compressor | None = None,
                 convert: bool = True) -> LoadedContext:
    """Read, check and decode the stored context ``key``: the manifest first (model, version, format and
    compressor are checked before any state is read), then the states layer by layer (each part checked
    against its digest), then a ready cache is built. The full KV (if stored) is not read here: lossless
    decoding and retrieval read it from the store as they need it. Raises :mod:`kvcomp.store` errors; nothing
    half-loaded is returned. ``convert=False`` keeps every state exactly in the form the in-process cache has
    (no method converts further today: every state comes back as the in-process cache had it)."""
    from kvcomp.attention import check_supported

    check_supported(model)
    t0 = time.perf_counter()
    store = open_store(store)
    manifest = store.manifest(key)
    meta = manifest.meta
    _check_meta(meta, model, key, store.url)
    stored = meta.get("compressor")
    if compressor is None and stored is not None:
        compressor = compressor_from_spec(stored)
    _check_compressor(stored, compressor, model, key)
    device = model.device
    read = 0
    prompt = store.read(manifest, "prompt")
    read += len(prompt)
    prompt = decode_state(prompt, device)
    blobs, states = [], []
    for _, blob in store.stream(manifest, [f"state/{i}" for i in range(meta["layers"])]):
        read += len(blob)
        blobs.append(blob)
        states.append(decode_state(blob, device))
    loaded = LoadedContext(key, store, manifest, compressor, prompt["logits"], prompt["mask"], prompt["ids"],
                           torch.device(device), 0.0, read, convert, blobs)
    loaded._first = loaded._build(model, states)
    loaded.load_seconds = time.perf_counter() - t0
    return loaded


def load_or_save(model, pre_fn, compressor: Compressor | None, store: str | Store, key: str,
                 full_kv: bool = False, template: dict | None = None, convert: bool = True
                 ) -> tuple[LoadedContext, bool]:
    """The stored context ``key``, or, when it is missing, evicted or unreadable, a recompute: ``pre_fn()`` (a
    :func:`kvcomp.shared_prefill.prefill`) saved under ``key`` and loaded back. Returns ``(context, recomputed)``.
    Errors that a recompute cannot fix (the server is down, an entry of another model under ``key``) raise."""
    store = open_store(store)
    try:
        return load_context(model, key, store, compressor, convert), False
    except (KeyMissing, KeyEvicted):
        pass
    save_prefilled(model, pre_fn(), compressor, store, key, full_kv, template)
    return load_context(model, key, store, compressor, convert), True


def continue_stored(model, parts, query_aware: bool, compressor: Compressor | None, store: str | Store, pre_fn,
                    max_new_tokens: int, pad_id: int = 0, stop_ids: set[int] | None = None,
                    chat_template: bool = True) -> tuple[list[list[int]], dict[str, Any]]:
    """:func:`kvcomp.shared_prefill.continue_from` through a store: the prefilled block of ``parts`` (the context,
    or query-aware the whole prompt) compressed by ``compressor`` is loaded from ``store`` when it is there (no
    prefill), else ``pre_fn()`` is saved there first. Token-identical either way, resident bytes too (states
    are loaded as built, ``convert=False``). Statistics add ``from_store``, ``recomputed``, ``context_key``."""
    rows = [p.context_ids + (p.question_ids if query_aware else []) for p in parts]
    qlen = [len(p.question_ids) for p in parts] if query_aware and any(p.question_ids for p in parts) else None
    key = context_key(model, rows, compressor, query_aware, qlen)
    template = {"chat_template": chat_template, "system_prompt": None, "template": parts[0].template}
    seconds = []

    def prefilled():
        pre = pre_fn()
        seconds.append(pre.seconds)
        return pre

    loaded, recomputed = load_or_save(model, prefilled, compressor, store, key, template=template, convert=False)
    rest = None if query_aware else [p.question_ids for p in parts]
    out, stats = loaded.continue_ids(model, rest, max_new_tokens, pad_id, stop_ids)
    stats.update(recomputed=recomputed, context_key=key, compress_seconds=stats["build_seconds"],
                 shared_prefill_seconds=seconds[0] if seconds else 0.0,
                 prefill_seconds=stats["prefill_seconds"] + loaded.load_seconds + sum(seconds))
    return out, stats


# -- answering from a stored context ----------------------------------------------------------------------------
def question_ids(tokenizer, context: LoadedContext, question: str, answer_prefix: str = "") -> list[int]:
    """The tokens that follow the stored context for ``question``: exactly the question part of the prompt
    :func:`kvcomp.generation.split_prompt` renders with the context's template (checked at save time to be
    independent of the context's text)."""
    from kvcomp.generation import split_prompt

    t = context.template
    return split_prompt(tokenizer, _PLACEHOLDER, question, answer_prefix, t.get("chat_template", True),
                        t.get("system_prompt")).question_ids


def generate_from_context(model, tokenizer, context: LoadedContext, question: str | list[str] = "",
                          compressor: Compressor | str | None = None, max_new_tokens: int = 32,
                          query_aware: bool = False, answer_prefix: str = "", lossless=False,
                          gamma: int | None = None, do_sample: bool = False, temperature: float = 1.0,
                          top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat_template: bool | None = None,
                          system_prompt: str | None = None, **compressor_params):
    """:func:`kvcomp.generate` with ``context`` a :class:`LoadedContext` (see there)."""
    from kvcomp import validation
    from kvcomp.attention import check_supported
    from kvcomp.generation import (
        _left_pad,
        lossless_config,
        make_result,
        resolve_compressor,
        stop_token_ids,
    )
    from kvcomp.lossless import Sampling, lossless_decode
    from kvcomp.validation import UsageError

    if not isinstance(context, LoadedContext):
        raise UsageError(f"context must be a text, a list of texts or a kvcomp.load_context(...); got "
                         f"{type(context).__name__}.")
    check_supported(model)
    _check_meta(context.meta, model, context.key, context.store.url)
    if query_aware or context.meta.get("query_aware"):
        raise UsageError("A stored context is compressed before any question is seen (query-agnostic); "
                         "query_aware=True needs the question inside the compressed prompt: use generate() "
                         "with the context's text.")
    if system_prompt is not None or chat_template is False:
        raise UsageError("chat_template and system_prompt of a stored context are the ones it was saved with.")
    given = resolve_compressor(compressor, **compressor_params)
    if given is not None:
        _check_compressor(context.meta.get("compressor"), given, model, context.key)
    validation.positive_int("max_new_tokens", max_new_tokens, owner="generate", error=validation.UsageError)
    config = lossless_config(lossless, gamma)
    if config is None and (do_sample or gamma is not None):
        raise ValueError("gamma and do_sample are lossless-decoding options: pass lossless=True as well.")
    sampling = Sampling(temperature, top_k, top_p, seed) if do_sample else None
    if sampling is not None and config is None:
        raise ValueError("Sampling is only implemented with lossless=True (speculative sampling).")
    batch = context.mask.shape[0]
    questions = [question] * batch if isinstance(question, str) else list(question)
    if len(questions) != batch:
        raise UsageError(f"the stored context holds {batch} rows but {len(questions)} questions were given.")
    rows = [question_ids(tokenizer, context, q, answer_prefix) for q in questions]
    stored = context.meta["prompt_tokens"]
    validation.check_prompts(model, [n + len(r) for n, r in zip(stored, rows)], max_new_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stops = stop_token_ids(model, tokenizer)
    if config is not None:
        blocks = [_left_pad(rows, pad_id)] if any(rows) else []
        t0 = time.perf_counter()
        out_rows, stats = lossless_decode(model, blocks, None, config, max_new_tokens, stops, sampling,
                                          context=context)
        stats["build_seconds"] = time.perf_counter() - t0 - stats["prefill_seconds"] - stats["decode_seconds"]
    else:
        out_rows, stats = context.continue_ids(model, rows, max_new_tokens, pad_id, stops)
    stats.update(context_key=context.key, load_seconds=context.load_seconds)
    return make_result(model, tokenizer, context.compressor, out_rows, stats,
                       [n + len(r) for n, r in zip(stored, rows)], False,
                       context.template.get("template", "chat"))
