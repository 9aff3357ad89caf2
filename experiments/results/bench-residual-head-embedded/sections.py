"""Inclusive wall time per decode step of KVTC's parts (wrapped methods, no profiler on anything else):
``PYTHONPATH=. python experiments/results/bench-residual-head-embedded/sections.py [COMPRESSOR] [CONTEXT]
[THREADS]`` (default ``kvtc 2048 2``; 64 steps after 3, the embedded SmolLM2 after kvcomp bench's synthetic
prompt)."""

import collections
import functools
import sys
import time

import torch

import compressors.kvtc as kvtc_module
from experiments import bench
from kvcomp import load_model, selection
from kvcomp.kernels import cpu_native

torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
name = sys.argv[1] if len(sys.argv) > 1 else "kvtc"
length = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
model, _ = load_model("embedded", dtype="float32", device="cpu")
ids = bench.synthetic_prompt(length, model.config.vocab_size, 0)
label, compressor = bench.build_compressor(name, bench.BenchConfig())
run = bench.prefill(model, ids, compressor, "cpu")
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


for attr in ["attend", "append", "_flush", "_attend_native", "_encode", "codec", "rope_half_table"]:
    wrap(type(compressor), attr)
for owner, attr in [(cpu_native, "kvtc_attention"), (selection.TokenStore, "cat"), (kvtc_module, "compact"),
                    (kvtc_module, "store_of_new")]:
    wrap(owner, attr)
for _ in range(3):
    bench.decode_step(model, run, compressor, "cpu")
times.clear()
calls.clear()
steps = []
for _ in range(64):
    start = time.perf_counter()
    bench.decode_step(model, run, compressor, "cpu")
    steps.append(time.perf_counter() - start)
print(f"{label}: {sum(steps) / len(steps) * 1e3:.1f} ms per step (min {min(steps) * 1e3:.1f})")
for key, seconds in sorted(times.items(), key=lambda item: -item[1]):
    print(f"{key:45s} {seconds / len(steps) * 1e3:6.2f} ms per step {seconds / calls[key] * 1e6:7.1f} us per call")
