#!/bin/bash
# A/B of H2O's one-pass prefill (54a4337) against edfef36 (git worktree add /tmp/base edfef36): kvcomp bench,
# 2 threads; SmolLM2 at 2K and 8K (two interleaved rounds), Gemma 3 270M at 16K (one round).
cd "$(dirname "$0")/../../.." && source .venv/bin/activate
bash experiments/ab_bench.sh /tmp/base runs/ab-h2o 2 -- --contexts 2048 8192 --compressors none h2o \
  --decode-steps 8 --threads 2 --no-memory
bash experiments/ab_bench.sh /tmp/base runs/ab-h2o-gemma 1 -- --model gemma3-270m --contexts 16384 \
  --compressors none h2o --decode-steps 4 --threads 2 --no-memory
