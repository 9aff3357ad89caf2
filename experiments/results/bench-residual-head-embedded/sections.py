"""Inclusive wall time per decode step of KVTC's parts: ``PYTHONPATH=. python
experiments/results/bench-residual-head-embedded/sections.py [COMPRESSOR] [CONTEXT]`` (default ``kvtc 2048``;
2 threads, 64 steps after 3; :func:`experiments.step_sections.time_sections`)."""

import sys

import compressors.kvtc as kvtc_module
from experiments.step_sections import time_sections
from kvcomp import selection
from kvcomp.kernels import cpu_native

time_sections(sys.argv[1] if len(sys.argv) > 1 else "kvtc", int(sys.argv[2]) if len(sys.argv) > 2 else 2048,
              methods=["attend", "append", "_flush", "_attend_native", "_encode", "codec", "rope_half_table"],
              functions=[(cpu_native, "kvtc_attention"), (selection.TokenStore, "cat"), (kvtc_module, "compact"),
                         (kvtc_module, "store_of_new")], steps=64)
