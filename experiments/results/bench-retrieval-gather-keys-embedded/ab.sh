#!/bin/bash
# A/B of this session's retrieval changes (4062683, 730b21d, bbf7667) against be4a450
# (git worktree add /tmp/base be4a450), 2 threads, two interleaved rounds.
cd "$(dirname "$0")/../../.." && source .venv/bin/activate
bash experiments/ab_bench.sh /tmp/base runs/ab-session8 2 -- --contexts 2048 8192 --compressors none none-kvcomp \
  freekv specache --decode-steps 32 --threads 2 --no-memory
