"""One layer's call of a native decode kernel, captured from a real decode step and then timed alone (best of 5
rounds of 300 calls): ``PYTHONPATH=. python experiments/results/bench-native-kernels-embedded/kernel_calls.py
KERNEL COMPRESSOR CONTEXT [THREADS]``, e.g. ``kvtc_attention kvtc:keys=post_rope 2048 2``. KERNEL is a function
of kvcomp.kernels.cpu_native (kvtc_attention, quant_attention, decode_attention); the call is layer 15's of the
second decode step of the embedded SmolLM2 after a synthetic prompt (kvcomp bench's)."""

import sys
import time

import torch

from experiments import bench
from kvcomp import load_model
from kvcomp.kernels import cpu_native

kernel, name, length = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 2)
original, calls = getattr(cpu_native, kernel), []
setattr(cpu_native, kernel, lambda *a, **k: calls.append((a, k)) or original(*a, **k))
model, _ = load_model("embedded", dtype="float32", device="cpu")
_, compressor = bench.build_compressor(name, bench.BenchConfig())
run = bench.prefill(model, bench.synthetic_prompt(length, model.config.vocab_size, 0), compressor, "cpu")
calls.clear()
bench.decode_step(model, run, compressor, "cpu")
setattr(cpu_native, kernel, original)
args, kwargs = calls[15]
rounds = []
for _ in range(5):
    start = time.perf_counter()
    for _ in range(300):
        original(*args, **kwargs)
    rounds.append((time.perf_counter() - start) / 300 * 1e6)
print(f"{kernel} {name} {length} tokens, {torch.get_num_threads()} threads: {min(rounds):.1f} us a call "
      f"(rounds {', '.join(f'{r:.1f}' for r in rounds)})")
