#!/bin/bash
# A/B of this session's decode-step changes (394ede9..8528fa2) against e91dee3
# (git worktree add /tmp/base e91dee3): 2 threads then 1 thread, two interleaved rounds each; then the native
# kernels alone, both checkouts interleaved in one process.
cd "$(dirname "$0")/../../.." && source .venv/bin/activate
bash experiments/ab_bench.sh /tmp/base runs/ab-s9b 2 -- --contexts 2048 8192 --compressors none none-kvcomp \
  freekv specache quant --decode-steps 32 --threads 2 --no-memory
bash experiments/ab_bench.sh /tmp/base runs/ab-s9c 2 -- --contexts 2048 8192 --compressors none none-kvcomp \
  freekv specache quant --decode-steps 24 --threads 1 --no-memory
python -m experiments.native_kernel_ab --base /tmp/base --contexts 2048 8192 --threads 2 --out runs/native-ab-2
python -m experiments.native_kernel_ab --base /tmp/base --contexts 2048 8192 --threads 1 --out runs/native-ab-1
