#!/bin/bash
# Prefill A/B of CriticalKV's blocked projected value norms (47bdb51) against f7ccae9
# (git worktree add /tmp/base f7ccae9), 2 threads, two interleaved rounds.
cd "$(dirname "$0")/../../.." && source .venv/bin/activate
bash experiments/ab_bench.sh /tmp/base runs/ab-criticalkv 2 -- --contexts 2048 8192 --compressors none snapkv \
  criticalkv --decode-steps 4 --threads 2 --no-memory
