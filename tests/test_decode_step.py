"""A decode step reads nothing back from its tensors inside a layer (no host synchronisation per layer).

Counted with a test double: a ``TorchFunctionMode`` that records every ``bool()``, ``int()``, ``float()``,
``.item()``, ``.tolist()`` and ``.nonzero()`` called from kvcomp's own code (frames under ``kvcomp/`` or
``compressors/``) while one decode step runs. Each is a device-to-host read: on a GPU it stalls the queue of
kernels; on a CPU it still costs a reduction. The step of an unpadded batch over a store without empty slots must
read nothing per layer: what remains is per forward (the cache's stored length, asked by transformers' mask code
once per layer type), so models with 2 and 4 layers read the same count.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM

import kvcomp
from kvcomp import CompressedCache, steps
from kvcomp.selection import WindowStore
from tests import methods

ROOT = Path(kvcomp.__file__).resolve().parent.parent
OURS = (str(ROOT / "kvcomp"), str(ROOT / "compressors"))
READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero"}

# Methods whose decode step is free of per-layer reads. Decode-time eviction decides its budgets on the host from
# what the host knows (kvcomp.host: the tokens each row has seen, the slots of a store without empty ones), on
# steps that evict and steps that do not; over a head-wise allocator (decode_evict with scorer=adakv) each
# eviction still reads the new per-head layout back. Retrieval still reads its fetch lists, and DuoAttention's
# streaming heads how many tokens left their window. AdaKV and KVzip store ragged: a ragged store keeps its
# segments' layout on the host.
SYNC_FREE = ["snapkv", "knorm", "keydiff", "expected_attention", "pyramidkv", "criticalkv", "quant", "adakv", "kvzip",
             "streaming_llm", "tova", "h2o", "decode_evict", "inertiakv"]
EVICTING = ["streaming_llm", "tova", "h2o", "decode_evict", "inertiakv"]


class HostReads(TorchFunctionMode):
    """Counts tensor-to-host reads made from kvcomp's code, by ``file:line``."""

    def __init__(self):
        super().__init__()
        self.where: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(OURS):
                self.where[f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"] += 1
        return func(*args, **(kwargs or {}))


def tiny_llama(layers: int):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


class CallsFrom(TorchFunctionMode):
    """Counts torch functions called from the given files of kvcomp, by name."""

    def __init__(self, *files: str):
        super().__init__()
        self.files = tuple(str(ROOT / "kvcomp" / f) for f in files)
        self.where: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if sys._getframe(1).f_code.co_filename in self.files:
            self.where[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def reads_in_a_decode_step(model, compressor, warm: int = 3, mode=HostReads) -> Counter[str]:
    cache = CompressedCache(model, compressor)
    rows = steps.Rows(1, "cpu")
    ids = torch.randint(3, 120, (1, 120), generator=torch.Generator().manual_seed(1))
    token = steps.prefill(model, cache, ids, rows).argmax(-1)
    for _ in range(warm):  # the first steps check a store once (then it is known to hold no empty slot)
        token = steps.decode_one(model, cache, token, rows).argmax(-1)
    with mode() as reads:
        steps.decode_one(model, cache, token, rows)
    return reads.where


def test_a_forward_derives_its_positions_once_not_per_layer():
    """The new tokens' validity, positions and counts are the same for every layer of a forward: kvcomp's
    attention and cache derive them in the first layer only (the per-layer ops that remain: the layer's own
    running counts and next position)."""
    def calls(layers):
        return reads_in_a_decode_step(tiny_llama(layers), WindowStore(),
                                      mode=lambda: CallsFrom("attention.py", "cache.py"))

    two, four = calls(2), calls(4)
    per_layer = {f: (four[f] - two[f]) // 2 for f in four if four[f] != two[f]}
    assert sum(two.values()) > 0  # the counter sees these files' calls
    assert not {f: n for f, n in per_layer.items() if f in ("where", "amax", "sum", "ones", "long", "masked_fill")}, (
        per_layer)


@pytest.mark.parametrize("name", ["none-kvcomp", *SYNC_FREE])
def test_a_decode_step_reads_nothing_back_per_layer(name):
    def make():
        return WindowStore() if name == "none-kvcomp" else methods.lossy(name)

    two, four = (reads_in_a_decode_step(tiny_llama(n), make()) for n in (2, 4))
    assert sum(four.values()) == sum(two.values()), f"reads that grow with the layers: {four - two}"
    assert sum(two.values()) <= 1, f"host reads in one decode step: {dict(two)}"


@pytest.mark.parametrize("name", EVICTING)
def test_decode_time_eviction_reads_nothing_back_on_the_step_after_too(name):
    """At ratio 0.5 the budget grows every other step: the step after the one counted above is the other kind
    (evicting or not), and it reads nothing back either."""
    two, four = (reads_in_a_decode_step(tiny_llama(n), methods.lossy(name), warm=4) for n in (2, 4))
    assert sum(four.values()) == sum(two.values()) <= 1, f"host reads in one decode step: {dict(four)}"


def test_the_counter_sees_a_host_read_in_a_layer():
    """The double is not blind: DuoAttention's streaming heads read back where their window's leavers are, once
    per layer for all of its streaming heads."""
    two, four = (reads_in_a_decode_step(tiny_llama(n), methods.lossy("duo_attention")) for n in (2, 4))
    assert sum(four.values()) - sum(two.values()) == 2, dict(four)


@torch.inference_mode()
def test_the_host_counts_equal_the_tensors_they_stand_for_in_a_padded_batch():
    """What a decode step decides on the host (kvcomp.host) is what the device tensors hold: the seen counts of
    every layer after a left-padded prefill and through decode steps, and the budgets derived from them; counts
    the host lost (as a loaded or replayed cache has them) are read once and known again."""
    from kvcomp import host

    model = tiny_llama(2)
    compressor = methods.lossy("streaming_llm")
    cache = CompressedCache(model, compressor)
    ids = torch.randint(3, 120, (2, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :13] = 0  # row 1: 27 real tokens
    rows = steps.Rows(2, "cpu")
    token = steps.prefill(model, cache, ids, rows, block_mask=mask).argmax(-1)
    for step in range(6):
        for layer in cache.layers:
            assert host.known_values(layer.seen) == tuple(layer.seen.tolist()) == (40 + step, 27 + step)
            budget = compressor.kept_tokens(layer.seen)
            assert host.known_values(budget) == tuple(budget.tolist()) == (20 + step // 2, 13 + (step + 1) // 2)
        if step == 3:
            for layer in cache.layers:
                layer.seen = layer.seen.clone()  # no longer known on the host
        token = steps.decode_one(model, cache, token, rows).argmax(-1)


# -- growable stores -----------------------------------------------------------------------------------------
def _store(n: int, start: int = 0, seed: int = 0):
    from kvcomp.selection import TokenStore

    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(start, start + n, dtype=torch.int32).view(1, 1, n).expand(2, 3, n).contiguous()
    return TokenStore(torch.randn(2, 3, n, 8, generator=g), torch.randn(2, 3, n, 8, generator=g), positions,
                      all_real=True)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip((a.keys, a.values, a.positions), (b.keys, b.values, b.positions)))


def test_extend_writes_in_place_until_its_spare_slots_run_out_and_equals_cat():
    from kvcomp import selection

    store = _store(1100)
    reference = store
    buffers = []
    for step in range(selection._spare(1101) + 3):
        token = _store(1, 1100 + step, seed=step + 1)
        store, reference = store.extend(token), reference.cat(token)
        assert _same(store, reference) and store.all_real
        buffers.append(store._buffers[0].data_ptr())
    # One copy on the first append, one more when the spare slots ran out: every other step wrote in place.
    assert len(set(buffers)) == 2
    assert store.nbytes() == sum(b.numel() * b.element_size() for b in store._buffers if b is not None)
    assert store.nbytes() > reference.nbytes()  # the spare slots are counted: they are memory


def test_extend_carries_per_token_statistics_in_its_buffers_as_cat_does():
    from kvcomp import selection

    store = _store(1100)
    store.scores, store.aux = torch.rand(store.positions.shape), torch.rand(store.positions.shape)
    reference, ptrs = store, set()
    for step in range(4):
        token = _store(1, 1100 + step, seed=step + 1)
        store, reference = store.extend(token), reference.cat(token)
        assert torch.equal(store.scores, reference.scores)
        assert torch.equal(store.aux.nan_to_num(-1.0), reference.aux.nan_to_num(-1.0))
        assert store.aux[..., -1].isnan().all() and (store.scores[..., -1] == 0).all()
        ptrs.add(tuple(b.data_ptr() for b in store.live_buffers()))
    assert len(ptrs) == 1 and len(store.live_buffers()) == len(selection.SLOT_FIELDS)
    # A statistic replaced since is no buffer's view any more: it is counted as itself, and the next extend copies.
    replaced = store.replace(scores=store.scores.clone())
    assert replaced.live_buffers()[3] is None and replaced.nbytes() == store.nbytes() - store._buffers[3].nbytes + \
        replaced.scores.nbytes
    assert replaced.extend(_store(1, 1104, seed=9)).live_buffers()[0].data_ptr() not in ptrs.pop()


def test_a_rolled_back_snapshot_extends_in_place_over_the_discarded_drafts():
    """Lossless decoding checkpoints a store, drafts on it, rolls back and appends the verified tokens: the
    snapshot sees none of the drafts and reuses the spare slots (no copy), and a store copied with
    ``dataclasses.replace`` (not a snapshot) owns no buffers, so it copies."""
    import dataclasses

    from kvcomp.selection import WindowStore

    live = _store(1100).extend(_store(1, 1100, seed=1))  # now growable
    snapshot = WindowStore().checkpoint(live)
    drafted = live.extend(_store(1, 1101, seed=2)).extend(_store(1, 1102, seed=4))
    assert _same(drafted, live.cat(_store(1, 1101, seed=2)).cat(_store(1, 1102, seed=4)))
    assert _same(snapshot, _store(1100).cat(_store(1, 1100, seed=1)))  # the drafts are beyond what it shows
    after_rollback = snapshot.extend(_store(1, 1101, seed=3))
    assert _same(after_rollback, snapshot.cat(_store(1, 1101, seed=3)))
    assert after_rollback._buffers[0].data_ptr() == live._buffers[0].data_ptr()
    assert snapshot.nbytes() == live.nbytes()  # the same memory
    copied = dataclasses.replace(live).extend(_store(1, 1101, seed=5))
    assert copied._buffers[0].data_ptr() != live._buffers[0].data_ptr()


def test_a_sliced_store_keeps_extending_in_place():
    """A sliding-window layer drops its oldest tokens (a slice) every step and appends one: still no copy."""
    store = _store(1100).extend(_store(1, 1100, seed=1))
    ptr = store._buffers[0].data_ptr()
    reference = store
    for step in range(5):
        token = _store(1, 1101 + step, seed=step + 2)
        store, reference = store.slice(1).extend(token), reference.slice(1).cat(token)
        assert _same(store, reference)
    assert store._buffers[0].data_ptr() == ptr


def test_take_slots_equals_gather_on_contiguous_and_sliced_tensors():
    from kvcomp.ops import take_slots

    x = torch.randn(2, 3, 40, 8, generator=torch.Generator().manual_seed(0))
    index = torch.randint(0, 30, (2, 3, 17), generator=torch.Generator().manual_seed(1))
    for t in (x, x[:, :, 5:35]):  # the second is a view of a larger buffer (not contiguous)
        want = t.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1]))
        assert torch.equal(take_slots(t, index), want)
    assert torch.equal(take_slots(x[..., 0], index), x[..., 0].gather(2, index))  # no trailing dimension


@pytest.mark.parametrize("seed", range(6))
def test_dropping_one_token_per_head_keeps_what_the_general_top_k_keeps(seed):
    """A decode step of an evicting method drops one token per head (:func:`drop_lowest`, an argmin); with
    distinct scores it keeps exactly what the general path keeps (a top-k and a sort by position), including
    +inf scores (StreamingLLM's sinks) and NaN ones (tokens not scored yet: kept, as top-k ranks NaN highest)."""
    from kvcomp import selection

    g = torch.Generator().manual_seed(seed)
    store = _store(50).replace(all_real=True)
    scores = torch.randperm(2 * 3 * 50, generator=g).float().view(2, 3, 50)
    scores[..., :2] = float("inf")
    scores[:, seed % 3, 10 + seed] = float("nan")
    scores[:, (seed + 1) % 3, 20] = -5.0  # the lowest of that head
    budget = torch.tensor([49, 49])
    fast = selection.select_top(store, scores, budget)
    general = selection.select_top(store.replace(all_real=False), scores, budget)  # all_real unknown: top-k path
    assert _same(fast, general) and fast.all_real
    assert fast.keys.shape[2] == 49
    assert not (fast.positions[0, (seed + 1) % 3] == 20).any()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("stats", [False, True])
def test_native_in_place_eviction_moves_what_the_torch_path_moves(seed, stats, monkeypatch):
    """The native in-place eviction (argmin and moves in one call) against torch's (KVCOMP_NATIVE=0), step after
    step of appends and evictions on a growable store, with ties, NaN and infinite scores: the same tensors bit
    for bit, still views of the same buffers. With per-slot statistics (H2O's scores as a buffer view, an
    InertiaKV-like aux replaced since) both move or copy them alike."""
    from kvcomp import selection
    from kvcomp.kernels import cpu_native

    moved = []
    evict = cpu_native.evict_lowest
    monkeypatch.setattr(cpu_native, "evict_lowest", lambda *a: moved.append(evict(*a)) or moved[-1])
    g = torch.Generator().manual_seed(seed)
    stores = []
    for native in ("1", "0"):
        monkeypatch.setenv("KVCOMP_NATIVE", native)
        store = _store(300, seed=seed)
        if stats:
            store = store.replace(scores=torch.rand(2, 3, 300, generator=torch.Generator().manual_seed(seed)))
        g.manual_seed(seed)
        for step in range(12):
            new = _store(1, 300 + step, seed=100 + step)
            if stats:
                new = new.replace(scores=torch.ones(2, 3, 1))
            store = store.extend(new)
            store._owned = True
            if stats and step % 3 == 2:  # a statistic that is no longer a buffer's view
                store.aux = torch.rand(2, 3, store.keys.shape[2], generator=g)
            scores = torch.randint(0, 4, (2, 3, store.keys.shape[2]), generator=g).float()
            scores[0, step % 3, step] = float("nan")
            scores[1, (step + 1) % 3, :5] = float("-inf") if step % 2 else float("inf")
            buffer = store.live_buffers()[0]
            store = selection.drop_lowest(store, scores)
            assert store.keys.shape[2] == 300 and store.all_real
            assert store.live_buffers() is None or store.live_buffers()[0] is buffer
        stores.append(store)
    if cpu_native.load() is not None:  # steps without a replaced statistic went native
        assert sum(m is not None for m in moved) == (8 if stats else 12)
    native, torch_path = stores
    for a, b in zip(native.slot_tensors(), torch_path.slot_tensors()):
        assert (a is None and b is None) or torch.equal(a, b)


def test_ties_drop_the_oldest_token():
    from kvcomp import selection

    store = _store(6).replace(all_real=True)
    kept = selection.drop_lowest(store, torch.tensor([[[3.0, 1.0, 2.0, 1.0, 5.0, 1.0]] * 3] * 2))
    assert kept.positions[0, 0].tolist() == [0, 2, 3, 4, 5]


@pytest.mark.parametrize("spec", ["plain", "softcap", "sinks"])
def test_all_visible_decode_attention_with_weights_equals_the_masked_path(spec, monkeypatch):
    """A decode query over an unpadded full-attention store builds no mask, also when the weights are asked
    (TOVA, H2O) or the layer soft-caps or has sinks: it takes the native kernel (float32 on the CPU), whose
    output and weights equal the masked path's up to the order of its sums; without it (KVCOMP_NATIVE=0), torch's
    unmasked path is bit-identical to the masked one."""
    from kvcomp.kernels import cpu_native
    from kvcomp.ops import AttentionSpec, dense_attention

    torch.manual_seed(0)
    b, hkv, g, length, d = 2, 3, 3, 50, 16
    spec = AttentionSpec(d ** -0.5, softcap=2.0 if spec == "softcap" else None,
                         sinks=torch.randn(hkv * g) if spec == "sinks" else None)
    q, k, v = torch.randn(b, hkv * g, 1, d), torch.randn(b, hkv, length, d), torch.randn(b, hkv, length, d)
    k_pos = torch.randperm(length).to(torch.int32).expand(b, hkv, length)  # slots in any order
    q_pos = torch.full((b, 1), length)
    calls = []
    native = cpu_native.decode_attention
    monkeypatch.setattr(cpu_native, "decode_attention", lambda *a: calls.append(1) or native(*a))
    for use_native in ("1", "0"):
        monkeypatch.setenv("KVCOMP_NATIVE", use_native)
        for need in (False, True):
            fast, fast_w = dense_attention(q, k, v, q_pos, k_pos, spec, need, all_visible=True)
            masked, masked_w = dense_attention(q, k, v, q_pos, k_pos, spec, need)
            assert (fast_w is None) == (masked_w is None) == (not need)
            if use_native == "1":
                torch.testing.assert_close(fast, masked, rtol=1e-5, atol=1e-6)
                assert fast_w is None or torch.allclose(fast_w, masked_w, rtol=1e-5, atol=1e-7)
            else:
                assert torch.equal(fast, masked) and (fast_w is None or torch.equal(fast_w, masked_w))
    assert len(calls) == (2 if cpu_native.load() is not None else 0)  # the all-visible calls with the kernel on
