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
  sdpa, or a matmul, softmax and matmul).

Each side compiles its own copy of ``kvcomp/kernels/cpu_native.py``'s source; the sides alternate in every
round, so load changes hit both. Prints min-max microseconds per call and writes ``native_kernel_ab.json``::

    git worktree add /tmp/base <rev>
    python -m experiments.native_kernel_ab --base /tmp/base --contexts 2048 8192 --threads 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

from kvcomp.kernels import quant_ref

HEADS, QUERY_HEADS, HEAD_DIM = 3, 9, 64


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
    return out


def operations(native, inputs: dict) -> dict:
    """Name -> a call of ``native``'s kernels on ``inputs``."""
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
    return {
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
    sides = {"this": load_native(Path(__file__).resolve().parent.parent, "native_this"),
             "base": load_native(args.base.resolve(), "native_base")}
    results: dict = {"threads": args.threads, "base": str(args.base), "contexts": {}}
    for length in args.contexts:
        inputs = cases(length)
        ops = {side: operations(native, inputs) for side, native in sides.items()}
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
