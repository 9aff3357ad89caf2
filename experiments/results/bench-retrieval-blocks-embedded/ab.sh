#!/bin/bash
# A/B of the retrieval step's native parts (2036df2, 256f1a1) against 9f5b0de (git worktree add /tmp/base 9f5b0de):
# kvcomp bench, 2 threads, two interleaved rounds; then the kernels and each checkout's disk tier alone, both
# checkouts interleaved in one process.
cd "$(dirname "$0")/../../.." && source .venv/bin/activate
bash experiments/ab_bench.sh /tmp/base runs/ab-s11b 2 -- --contexts 2048 8192 --compressors none none-kvcomp \
  freekv specache --decode-steps 32 --threads 2 --no-memory
python -m experiments.native_kernel_ab --base /tmp/base --contexts 2048 8192 --threads 1 --rounds 3 --out runs/native-ab-s11-1
