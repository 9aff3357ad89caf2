"""The native CPU kernels of this checkout against another checkout's, interleaved in one process.

``kvcomp bench`` times whole decode steps, where a kernel change of a few hundred microseconds per layer drowns
in the load changes of a shared machine. This times the kernels alone on the embedded model's decode shapes
(SmolLM2-135M: 3 KV heads, 9 query heads, head dim 64, float32, one sequence):

* ``quant_attention 2-bit``: SpeCache's attention over its 2-bit copy (groups of 64 tokens, one value scale per
  token) with the key logits given, 256 full-precision residual tokens;
* ``quant_attention 4-bit``: the quant compressor's (groups of 32 tokens, a value scale per 32 channels),
  computing its own logits, 128 residual tokens;
* ``quant_key_logits 2-bit``: SpeCache's scoring pass;
* ``top-k ascending``: retrieval's per-head selection of k = L / 32 of L scores in ascending order
  (``top_ascending`` where the checkout has it, otherwise what retrieval did: ``topk`` then a sort);
* ``decode attention`` and ``decode attention + weights``: one decode query per head over a token-selection
  store's float keys and values (views of buffers with spare slots), without and with the probabilities TOVA
  and H2O observe (``decode_attention`` where the checkout has it, otherwise what ``dense_attention`` did:
  sdpa, or a matmul, softmax and matmul);
* ``page scores``: FreeKV's Quest bound over its page digests (pages of 32 tokens), maximized over each query
  group (``page_scores`` where the checkout has it, otherwise the torch reference);
* ``disk gather``: FreeKV fetches from each checkout's own disk tier (``kvcomp/tiers.py``: its storage layout
  and its read path) holding 30 layers of L tokens: L / 8 tokens per KV head in whole pages, a different layer
  and selection each call, so the page cache's bytes are not in the CPU's caches, as in a decode step.

Each side compiles its own copy of ``kvcomp/kernels/cpu_native.py``'s source (and loads its own
``kvcomp/tiers.py``); the sides alternate in every round, so load changes hit both. Prints min-max microseconds per call and writes ``native_kernel_ab.json``::

    git worktree add /tmp/base <rev>
    python -m experiments.native_kernel_ab --base /tmp/base --contexts 2048 8192 --threads 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvcomp.kernels import quant_ref, retrieval_ref

HEADS, QUERY_HEADS, HEAD_DIM = 3, 9, 64
PAGE, SINKS = 32, 4  # FreeKV's tokens per page, and the sink tokens before its first page
LAYERS, GATHERS = 30, 7  # the disk tier's layers, and the selections the gathers cycle through


def load_native(tree: Path, name: str):
    """``kvcomp/kernels/cpu_native.py`` of ``tree`` as its own module (its own compiled library)."""
    path = tree / "kvcomp" / "kernels" / "cpu_native.py"
    if not path.is_file():
        raise SystemExit(f"{tree} is not a kvcomp checkout (no {path}); make one with git worktree add.")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.load() is None:
        raise SystemExit(f"the native kernel of {tree} does not build here (see the warning above).")
    return module


def load_tiers(tree: Path, name: str):
    """``kvcomp/tiers.py`` of ``tree`` as its own module (its storage layout and read path)."""
    spec = importlib.util.spec_from_file_location(name, tree / "kvcomp" / "tiers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def cases(length: int, seed: int = 0) -> dict[str, dict]:
    """The inputs of every timed call at ``length`` tokens."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    q = randn(1, QUERY_HEADS, 1, HEAD_DIM)
    out = {}
    for name, bits, group, channels, residual in (("2-bit", 2, 64, HEAD_DIM, 256), ("4-bit", 4, 32, 32, 128)):
        n = length // group
        kc, ks, kz = quant_ref.quantize_keys(randn(1, HEADS, n, group, HEAD_DIM), bits)
        vc, vs, vz = quant_ref.quantize_values(randn(1, HEADS, n, group, HEAD_DIM), bits, channels)
        positions = torch.arange(length, dtype=torch.int32).view(1, 1, n, group).expand(1, HEADS, n, group)
        rk, rv = randn(1, HEADS, residual, HEAD_DIM), randn(1, HEADS, residual, HEAD_DIM)
        rpos = torch.arange(length, length + residual, dtype=torch.int32).expand(1, HEADS, residual)
        out[name] = dict(args=(q, torch.tensor([[length + residual]]), kc, ks, kz, vc, vs, vz, positions.contiguous(),
                               rk, rv, rpos.contiguous(), bits, HEAD_DIM**-0.5))
    out["scores"] = dict(scores=randn(1, HEADS, length), k=max(1, length // 32))
    spare = length // 128
    out["dense"] = dict(q=q.view(1, HEADS, QUERY_HEADS // HEADS, HEAD_DIM),
                        k=randn(1, HEADS, length + spare, HEAD_DIM)[:, :, :length],
                        v=randn(1, HEADS, length + spare, HEAD_DIM)[:, :, :length])
    keys = randn(1, HEADS, length // PAGE, PAGE, HEAD_DIM)
    out["pages"] = dict(q=q, page_max=keys.amax(3), page_min=keys.amin(3))
    selections = []
    for _ in range(GATHERS):
        pages = torch.stack([torch.randperm(length // PAGE - 1, generator=g)[: max(1, length // 8 // PAGE)].sort().values
                             for _ in range(HEADS)])
        selections.append((SINKS + pages.unsqueeze(-1) * PAGE + torch.arange(PAGE)).flatten(1).unsqueeze(0))
    out["gather"] = dict(layers=[(randn(1, HEADS, length, HEAD_DIM), randn(1, HEADS, length, HEAD_DIM))
                                 for _ in range(LAYERS)], selections=selections)
    return out


def operations(native, inputs: dict, tier) -> dict:
    """Name -> a call of ``native``'s kernels on ``inputs`` (``tier``: the checkout's disk tier, holding
    ``inputs["gather"]["layers"]``)."""
    two, four = inputs["2-bit"]["args"], inputs["4-bit"]["args"]
    logits = native.quant_key_logits(two[0], two[2], two[3], two[4], 2, two[13])
    scores, k = inputs["scores"]["scores"], inputs["scores"]["k"]
    if hasattr(native, "top_ascending"):
        def top():
            return native.top_ascending(scores, k)
    else:
        def top():
            return scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    dq, dk, dv, scale = inputs["dense"]["q"], inputs["dense"]["k"], inputs["dense"]["v"], HEAD_DIM**-0.5
    if hasattr(native, "decode_attention"):
        def dense():
            return native.decode_attention(dq, dk, dv, scale)[0]

        dense_weights = dense
    else:
        def dense():
            return torch.nn.functional.scaled_dot_product_attention(dq, dk, dv, scale=scale)

        def dense_weights():
            return torch.matmul((torch.matmul(dq, dk.transpose(-1, -2)) * scale).softmax(-1), dv)
    pq, pmax, pmin = inputs["pages"]["q"], inputs["pages"]["page_max"], inputs["pages"]["page_min"]
    if hasattr(native, "page_scores"):
        def page_scores():
            return native.page_scores(pq, pmax, pmin)
    else:
        def page_scores():
            return retrieval_ref.page_scores(pq, pmax, pmin, "max")
    selections, calls = inputs["gather"]["selections"], iter(range(1 << 62))

    def gather():
        call = next(calls)
        return torch.cat(tier.gather(call % LAYERS, selections[call % len(selections)]), dim=-1)
    return {
        "page scores": page_scores,
        "disk gather": gather,
        "decode attention": dense,
        "decode attention + weights": dense_weights,
        "quant_attention 2-bit": lambda: native.quant_attention(*two, key_logits=logits),
        "quant_attention 4-bit": lambda: native.quant_attention(*four),
        "quant_key_logits 2-bit": lambda: native.quant_key_logits(two[0], two[2], two[3], two[4], 2, two[13]),
        "top-k ascending": top,
    }


def per_call_us(fn, calls: int) -> float:
    for _ in range(max(1, calls // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout (a git worktree)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100, help="calls per timing")
    parser.add_argument("--out", type=Path, default=Path("runs/native_kernel_ab"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    trees = {"this": Path(__file__).resolve().parent.parent, "base": args.base.resolve()}
    sides = {side: load_native(tree, f"native_{side}") for side, tree in trees.items()}
    tier_modules = {side: load_tiers(tree, f"tiers_{side}") for side, tree in trees.items()}
    results: dict = {"threads": args.threads, "base": str(args.base), "contexts": {}}
    for length in args.contexts:
        inputs = cases(length)
        disks = {side: module.DiskTier(directory=tempfile.gettempdir()) for side, module in tier_modules.items()}
        try:
            for disk in disks.values():
                for layer, (k, v) in enumerate(inputs["gather"]["layers"]):
                    disk.write(layer, k, v)
            ops = {side: operations(native, inputs, disks[side]) for side, native in sides.items()}
            expected = {name: fn() for name, fn in ops["base"].items()}
            for name, fn in ops["this"].items():  # the same results (float tolerance; the top-k as sets of scores)
                got = fn()
                if name == "top-k ascending":
                    same = torch.equal(inputs["scores"]["scores"].gather(-1, got).sort(-1).values,
                                       inputs["scores"]["scores"].gather(-1, expected[name]).sort(-1).values)
                else:
                    same = torch.allclose(got, expected[name], rtol=1e-5, atol=1e-5)
                if not same:
                    raise SystemExit(f"{name} at {length} tokens differs between the two checkouts.")
            times = {name: {side: [] for side in sides} for name in ops["this"]}
            for _ in range(args.rounds):
                for name in times:
                    for side in sides:
                        times[name][side].append(per_call_us(ops[side][name], args.calls))
        finally:
            for disk in disks.values():
                disk.close()
        results["contexts"][length] = times
        for name, t in times.items():
            print(f"{length:>6} {name:<24} this {min(t['this']):8.1f}-{max(t['this']):8.1f} us   "
                  f"base {min(t['base']):8.1f}-{max(t['base']):8.1f} us")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "native_kernel_ab.json").write_text(json.dumps(results, indent=1))
    print(f"{args.out / 'native_kernel_ab.json'}")
    return results


if __name__ == "__main__":
    main()
