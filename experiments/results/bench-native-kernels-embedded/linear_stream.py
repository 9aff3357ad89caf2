"""Every linear layer of the embedded SmolLM2 (211 layers, 538 MB of float32 weights) once on one row, as a decode
step runs them: torch's F.linear against kvcomp.kernels.cpu_native.linear, and a sum over the same weights (the
read stream's rate); mean of 10 passes after 3: ``PYTHONPATH=. python
experiments/results/bench-native-kernels-embedded/linear_stream.py [THREADS]``."""

import sys
import time

import torch

from kvcomp import load_model
from kvcomp.kernels import cpu_native

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
model, _ = load_model("embedded", dtype="float32", device="cpu")
layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
total = sum(m.weight.numel() * 4 for m in layers)
rows = {m.in_features: torch.randn(1, 1, m.in_features) for m in layers}


def timed(step):
    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(10):
        step()
    return (time.perf_counter() - start) / 10


with torch.inference_mode():
    for label, step in [
        ("torch F.linear", lambda: [torch.nn.functional.linear(rows[m.in_features], m.weight) for m in layers]),
        ("cpu_native.linear", lambda: [cpu_native.linear(rows[m.in_features], m.weight) for m in layers]),
        ("sum over the weights", lambda: [m.weight.sum() for m in layers]),
    ]:
        seconds = timed(step)
        print(f"{label:22s} {seconds * 1e3:6.1f} ms  {total / seconds / 1e9:5.1f} GB/s "
              f"({len(layers)} layers, {total / 1e6:.0f} MB, {torch.get_num_threads()} threads)")
