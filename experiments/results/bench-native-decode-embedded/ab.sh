#!/bin/bash
# A/B of the native float decode attention and in-place eviction (aab041b, 3c31dff) against ba3d2f5
# (git worktree add /tmp/base ba3d2f5): 2 threads, two interleaved rounds; then the kernels alone, both
# checkouts interleaved in one process (the base times sdpa, or matmul + softmax + matmul, there).
cd "$(dirname "$0")/../../.." && source .venv/bin/activate
bash experiments/ab_bench.sh /tmp/base runs/ab-s10 2 -- --contexts 2048 8192 --compressors none none-kvcomp \
  snapkv tova h2o streaming_llm --decode-steps 32 --threads 2 --no-memory
python -m experiments.native_kernel_ab --base /tmp/base --contexts 1024 2048 8192 --threads 1 --out runs/native-ab-s10-1
python -m experiments.native_kernel_ab --base /tmp/base --contexts 1024 2048 8192 --threads 2 --out runs/native-ab-s10-2
