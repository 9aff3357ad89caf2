#!/bin/bash
# InertiaKV in-place eviction A/B, run from the repository root: after (this tree), before (a worktree of e2ee8f6,
# the commit before the fix), alternating twice. Results in runs/ab-inertia/<leg>-<time>/bench.csv.
set -eu
before=$(mktemp -d)/before
git worktree add -q "$before" e2ee8f6
trap 'git worktree remove --force "$before"' EXIT
for leg in after before after before; do
  if [ $leg = after ]; then root=$PWD; else root=$before; fi
  PYTHONPATH=$root .venv/bin/python -m experiments.cli bench --contexts 4096 --compressors snapkv inertiakv \
    --decode-steps 16 --threads 1 --no-memory --out runs/ab-inertia/$leg-$(date +%s) > /dev/null
done
