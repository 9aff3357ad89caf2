"""Inclusive wall time per decode step of a retrieval compressor's step and its parts (wrapped methods, no
profiler overhead on everything else): ``PYTHONPATH=. python
experiments/results/bench-retrieval-step-embedded/sections.py freekv 2048`` (2 threads, 24 steps after 3;
:func:`experiments.step_sections.time_sections`)."""

import sys

import kvcomp.kernels as kernels
from experiments.step_sections import time_sections
from kvcomp import retrieval, tiers
from kvcomp.kernels import cpu_native

time_sections(sys.argv[1] if len(sys.argv) > 1 else "freekv", int(sys.argv[2]) if len(sys.argv) > 2 else 2048,
              methods=["attend", "append", "_select", "_correct_moved", "attend_decode", "_prefetch_next",
                       "_request", "score"],
              functions=[(kernels, "speculation_check"), (kernels, "top_ascending"), (retrieval, "_complete"),
                         (tiers.Prefetcher, "wait"), (tiers.Prefetcher, "fetch"), (tiers.Tier, "append"),
                         (tiers.Tier, "gather_rows"), (cpu_native, "decode_attention"),
                         (cpu_native, "gather_tokens"), (cpu_native, "quant_attention"),
                         (cpu_native, "quant_key_logits")])
