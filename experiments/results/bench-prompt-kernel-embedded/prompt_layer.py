"""One layer's prefill attention with a statistic, three ways, on SmolLM2-135M's shapes (9 query heads, 3 KV
heads, head_dim 64, float32; random tensors: the work does not depend on the values): best of REPEATS calls.
``PYTHONPATH=. python experiments/results/bench-prompt-kernel-embedded/prompt_layer.py CONTEXT [THREADS] [REPEATS]``

- ``sdpa``: torch's causal scaled_dot_product_attention, the output alone (what an uncompressed prefill runs);
- ``h2o torch`` / ``h2o native``: :func:`kvcomp.ops.received_attention` with values (H2O's prefill: the output
  and the attention each key receives) on torch's chunked path and on the native kernel;
- ``kvzip torch`` / ``kvzip native``: KVzip's scoring pass (:func:`compressors.kvzip.attend_and_score`) of one
  2000-token chunk's repetition (2030 queries) over a CONTEXT-token prefilled context.
"""

import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import compressors.kvzip as kvzip
from kvcomp.kernels import cpu_native
from kvcomp.ops import AttentionSpec, received_attention

n = int(sys.argv[1])
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
hq, h, d, m = 9, 3, 64, 2030
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, heads, n, d, generator=gen) for heads in (hq, h, h))
rq, rk, rv = (torch.randn(1, heads, m, d, generator=gen) for heads in (hq, h, h))
spec = AttentionSpec(scaling=d ** -0.5)
pos = torch.arange(n).view(1, n)
k_pos, real = pos.view(1, 1, n).expand(1, h, n).contiguous(), torch.ones(1, n, dtype=torch.bool)
ctx = SimpleNamespace(spec=spec, query_positions=torch.arange(n, n + m).view(1, m))
context, block = (k, v, k_pos), (rk, rv, torch.arange(n, n + m).view(1, 1, m).expand(1, h, m))
start, stop = 4, min(n, 2004)


def best(fn, native: bool) -> float:
    original = cpu_native.supports_prompt
    if not native:
        cpu_native.supports_prompt = lambda *a: False
    try:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    finally:
        cpu_native.supports_prompt = original
    return min(times) * 1e3


rows = {
    "sdpa": best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=spec.scaling),
                 False),
    "h2o torch": best(lambda: received_attention(q, k, pos, real, k_pos, spec, v), False),
    "h2o native": best(lambda: received_attention(q, k, pos, real, k_pos, spec, v), True),
    "kvzip torch": best(lambda: kvzip.attend_and_score(rq, ctx, context, block, 4, start, stop), False),
    "kvzip native": best(lambda: kvzip.attend_and_score(rq, ctx, context, block, 4, start, stop), True),
}
print(f"{n} tokens, {torch.get_num_threads()} threads: "
      + ", ".join(f"{name} {ms:.1f} ms" for name, ms in rows.items()))
