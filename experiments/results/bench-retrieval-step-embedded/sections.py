"""Inclusive wall time per decode step of a retrieval compressor's step and its parts (wrapped methods, no
profiler overhead on everything else): ``PYTHONPATH=. python
experiments/results/bench-retrieval-step-embedded/sections.py freekv 2048`` (2 threads, 24 steps after 3)."""

import collections
import functools
import sys
import time

import torch

import kvcomp.kernels as kernels
from experiments import bench
from kvcomp import load_model, retrieval, tiers
from kvcomp.kernels import cpu_native

torch.set_num_threads(2)
name = sys.argv[1] if len(sys.argv) > 1 else "freekv"
length = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
model, _ = load_model("embedded", dtype="float32", device="cpu")
ids = bench.synthetic_prompt(length, model.config.vocab_size, 0)
label, comp = bench.build_compressor(name, bench.BenchConfig())
run = bench.prefill(model, ids, comp, "cpu")
times, calls = collections.Counter(), collections.Counter()


def wrap(owner, attr):
    fn, key = getattr(owner, attr, None), f"{getattr(owner, '__name__', owner)}.{attr}"
    if fn is None:
        return

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[key] += time.perf_counter() - start
            calls[key] += 1

    setattr(owner, attr, timed)


for attr in ["attend", "append", "_select", "_correct_moved", "attend_decode", "_prefetch_next", "_request", "score"]:
    wrap(type(comp), attr)
for owner, attr in [(kernels, "speculation_check"), (kernels, "top_ascending"), (retrieval, "_complete"),
                    (tiers.Prefetcher, "wait"), (tiers.Prefetcher, "fetch"), (tiers.Tier, "append"),
                    (tiers.Tier, "gather_rows"), (cpu_native, "decode_attention"), (cpu_native, "gather_tokens"),
                    (cpu_native, "quant_attention"), (cpu_native, "quant_key_logits")]:
    wrap(owner, attr)
for _ in range(3):
    bench.decode_step(model, run, comp, "cpu")
times.clear()
calls.clear()
steps = 24
start = time.perf_counter()
for _ in range(steps):
    bench.decode_step(model, run, comp, "cpu")
print(f"{label}: {(time.perf_counter() - start) / steps * 1e3:.1f} ms per step")
for key, seconds in sorted(times.items(), key=lambda item: -item[1]):
    print(f"{key:45s} {seconds / steps * 1e3:6.2f} ms per step {seconds / calls[key] * 1e6:7.1f} us per call")
