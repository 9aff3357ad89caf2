"""Peak memory a user gets back: no compressor's prefill raises the process's memory above no compression's.

``memory_factor`` counts the bytes a cache holds at rest; this bounds the peak. The probe runs in a fresh process
(so earlier tests' allocations do not hide a rise) with a fixed malloc mmap threshold, so that every large
tensor is returned to the system when freed and each compressor's rise is measured from the same floor. The
model is a tiny random Llama whose full KV (16 KV heads of 64, 12 layers: 192 MiB at 2048 tokens in float32)
dominates the prefill's other transients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.methods import NEEDS_ARTIFACT, lossy, names

LENGTH = 2048
MARGIN_MB = 16  # allocator and scoring transients a compressor may add over no compression
OFFLOADING = ("freekv", "specache")  # their full KV leaves the process as it is produced (the default tier: disk
# on a CPU machine; LOSSY's setting keeps it in RAM)



def probe(methods: list[str]) -> dict[str, float]:
    """Prefill RSS rise (MiB) of no compression and of each method (``name`` in its LOSSY setting, ``name@disk``
    offloading to its default tier), in this process."""
    import gc

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from experiments.bench import prefill, synthetic_prompt

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=12,
                         num_attention_heads=16, num_key_value_heads=16, head_dim=64, max_position_embeddings=8192)
    model = LlamaForCausalLM(config).eval()
    ids = synthetic_prompt(LENGTH, 512, seed=0) % 400 + 50
    rises = {}
    for name in ["none", "none", *methods]:  # the first run warms up (first-call allocations)
        if name == "none":
            compressor = None
        else:
            compressor = lossy(name.split("@")[0], **({"tier": "auto"} if name.endswith("@disk") else {}))
        run = prefill(model, ids, compressor, "cpu", measure=True)
        rises[name] = run["peak_rise_mb"]
        del run
        gc.collect()
    return rises


@pytest.fixture(scope="module")
def rises() -> dict[str, float]:
    methods = [n for n in names() if n not in NEEDS_ARTIFACT and n not in OFFLOADING] + [f"{n}@disk" for n in OFFLOADING]
    code = f"import json, sys; from tests.test_peak_memory import probe; print(json.dumps(probe({methods!r})))"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_compression_holds_its_full_kv(rises):
    full_kv_mb = 12 * 2 * 16 * 64 * 4 * LENGTH / 2**20
    assert rises["none"] >= full_kv_mb * 0.9, rises  # the probe measures what it claims (plus the transients)


@pytest.mark.parametrize("name", [n for n in names() if n not in NEEDS_ARTIFACT and n not in OFFLOADING]
                         + [f"{n}@disk" for n in OFFLOADING])
def test_prefill_peak_is_at_most_no_compression(rises, name):
    assert rises[name] <= rises["none"] + MARGIN_MB, rises


@pytest.mark.parametrize("name", OFFLOADING)
def test_offloading_methods_keep_the_full_kv_out_of_the_process(rises, name):
    assert rises[f"{name}@disk"] <= 0.5 * rises["none"], rises
