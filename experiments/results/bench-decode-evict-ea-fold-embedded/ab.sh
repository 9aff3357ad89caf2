#!/bin/bash
# A/B of this session's decode-time changes (4f16573) against f7ccae9 (git worktree add /tmp/base f7ccae9),
# 2 threads, two interleaved rounds. decode_evict runs at its default and at intervals 10 and 1 on both sides.
cd "$(dirname "$0")/../../.." && source .venv/bin/activate
bash experiments/ab_bench.sh /tmp/base runs/ab-session7 2 -- --contexts 2048 8192 --compressors none none-kvcomp \
  knorm decode_evict decode_evict:interval=10 decode_evict:interval=1 inertiakv --decode-steps 64 --threads 2 --no-memory
